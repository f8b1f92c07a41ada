"""Grading many submissions: one after another or in worker processes, stopping where the grader changed.

Every submission is graded against the digest of the grader's files taken before the first one
(`minikv.grading.integrity`). When a submission's report says the files changed, no later
submission is graded with them: the ones not yet started are reported "not graded", with the
name of the submission during which the files changed, and the command exits non-zero.
"""

from __future__ import annotations

import sys
from pathlib import Path

import minikv.grading.integrity as integrity
from minikv.grading.grader import Report, grade_submission, not_graded


def grade_all(paths: list[Path], limits: dict, jobs: int = 1, progress: bool = False) -> list[Report]:
    """Grade each path (with jobs > 1 in worker processes, each grading several); reports in path order."""
    from tqdm.auto import tqdm

    integrity.compile_ours()
    reference = integrity.snapshot()
    bar = tqdm(total=len(paths), unit="nb", desc="grading", disable=not progress, file=sys.stderr)
    reports: dict[int, Report] = {}
    culprit = None
    if jobs <= 1:
        for i, p in enumerate(paths):
            if culprit is None:
                reports[i] = grade_submission(p, reference=reference, **limits)
                culprit = culprit or _culprit(reports[i])
            bar.update()
    else:
        import multiprocessing
        from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = {pool.submit(grade_submission, p, reference=reference, **limits): i for i, p in enumerate(paths)}
            pending = set(futures)
            while pending:
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                for f in done:
                    bar.update()
                    if not f.cancelled():
                        reports[futures[f]] = f.result()
                        culprit = culprit or _culprit(reports[futures[f]])
                if culprit is not None:
                    for f in pending:
                        f.cancel()  # those not started yet; the running ones finish and check for themselves
    bar.close()
    for i, p in enumerate(paths):
        if i not in reports:
            reports[i] = Report(str(p), reason=not_graded(culprit[1], f"while grading {culprit[0]}"),
                                tampered=list(culprit[1]))
    return [reports[i] for i in range(len(paths))]


def _culprit(report: Report) -> tuple[str, list[str]] | None:
    """(the submission during which the grader's files changed, the files), if they did."""
    if report.tampered and not report.reason.startswith("not graded"):
        return report.path, report.tampered
    return None
