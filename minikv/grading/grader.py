"""The exercise machinery: generate exercises from solutions, and grade submissions with the same checks.

Solutions are the single source of truth (nbgrader's convention): in a solution notebook,
code between ``### BEGIN SOLUTION`` and ``### END SOLUTION`` is the answer. `make_exercise`
replaces each such region with a stub that raises `NotImplementedError`, keeping the
indentation, so the exercise notebook still runs top to bottom and every check then says
"not implemented yet" instead of failing deep inside.

Checks live in ``minikv/grading/checks/exNN_*.py``, one module per exercise, and are plain functions
that take the learner's namespace and raise AssertionError with a short reason. There are two
ways to run them:

* ``python -m minikv grade PATH...`` (`grade_submission`), what graders use: the submission's
  cells run in a child process (`minikv.grading.sandbox`) with a time and a memory limit, the checks run
  here against proxies of the learner's functions and classes, and verdicts and score are
  computed and printed here alone. A static look at the cells (`minikv.grading.delegation`) and a
  runtime tripwire in the child fail a check whose graded code hands the work to minikv's own.
* the notebook's last cell, ``grade("NN", globals())``: a quick self-check in the learner's own
  process, which says so.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import re
import sys
import textwrap
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import nbformat

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
STUB = 'raise NotImplementedError("not implemented yet: {hint}")'
STUB_WIDTH = 100  # a generated stub stays on screen in JupyterLab beside the file browser (issue 19)
REPO = Path(__file__).resolve().parents[2]


class NotImplementedYet(AssertionError):
    """A check met a stub: the learner has not written this part yet."""


@dataclass
class CheckResult:
    """One check's verdict. `message`: why it failed, or, for a check that measures (a design's objective), what
    it measured, the target and the held-out set it measured on, passing or failing. `points` of `max_points`:
    the check's share of the exercise's score (its module's PARTS), 0 of 0 where none is given."""

    name: str
    passed: bool
    message: str = ""
    points: int = 0
    max_points: int = 0
    seconds: float = 0.0

    @property
    def tally(self) -> str:
        return f" [{self.points}/{self.max_points}]" if self.max_points else ""

    def __str__(self) -> str:
        if self.passed:
            return f"PASS  {self.name}{self.tally}" + (f": {self.message}" if self.message else "")
        return f"FAIL  {self.name}{self.tally}: {self.message}"


Check = Callable[[dict], None]


def learner(ns: dict, name: str) -> Callable:
    """Fetch the learner's function `name`, with a clear message if the cell was never run."""
    if name not in ns:
        notes = getattr(ns, "notes", None)  # the sandbox's: cells that raised
        raise AssertionError(f"`{name}` is not defined: run the cell that defines it first"
                             + (f" ({'; '.join(notes)})" if notes else ""))
    return ns[name]


def call(fn: Callable, *args, **kwargs):
    """Call learner code; a stub's NotImplementedError becomes a one-line verdict, not a traceback."""
    try:
        return fn(*args, **kwargs)
    except NotImplementedError as err:
        raise NotImplementedYet(str(err) or "not implemented yet") from None


def source_of(ns, name: str) -> str | None:
    """The source of the learner's top-level function or class `name`. Under the sandbox the
    grader reads it from the submission's cells (the last definition wins, as when they ran);
    in a notebook, `inspect` finds it (through a Triton kernel's `.fn`)."""
    import ast
    import inspect

    cells = getattr(ns, "cells", None)
    if cells is not None:
        for source in reversed(cells):
            try:
                tree = ast.parse(source)
            except SyntaxError:
                continue
            for node in reversed(tree.body):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
                    return ast.get_source_segment(source, node)
        return None
    obj = ns.get(name) if hasattr(ns, "get") else None
    try:
        return inspect.getsource(getattr(obj, "fn", obj))
    except (TypeError, OSError):
        return None


def peek(obj, items: list) -> list[tuple[str, object]]:
    """Read several attributes (a name) or call several methods (a tuple: name, *args) of a learner
    object: [("ok", value) or ("raised", exception)] in order. On a sandbox proxy this is one round
    trip instead of one per item; a stub's NotImplementedError stops it, as in `call`."""
    from minikv.grading.sandbox import Proxy

    if isinstance(obj, Proxy):
        out = obj._gather(items)
    else:
        out = []
        for item in items:
            try:
                out.append(("ok", getattr(obj, item) if isinstance(item, str) else getattr(obj, item[0])(*item[1:])))
            except Exception as err:  # noqa: BLE001 - the learner's code may raise anything
                out.append(("raised", err))
    for kind, value in out:
        if kind == "raised" and isinstance(value, NotImplementedError):
            raise NotImplementedYet(str(value) or "not implemented yet")
    return out


CHECK_SECONDS = 120  # a check's own time budget under the sandbox, unless its module's CHECK_SECONDS says more
# One notebook cell's time budget under the sandbox, unless the exercise's check module sets CELL_SECONDS: the
# slowest cell of any solution takes a few seconds (`Report.slowest_cell` says which), so a cell that never
# returns ends the submission here, named, and not at the wall clock.
CELL_SECONDS = 60


def run_checks(checks: list[Check], ns, budget: Callable | None = None,
               seconds: dict[str, float] | None = None, points: dict[str, int] | None = None) -> list[CheckResult]:
    """Run each check on the learner's namespace (a dict, or the sandbox's proxy of one). If the
    submission's process dies, the check in flight and every later one fail with the reason.
    `budget(name, seconds)`: a context manager that bounds one check (the sandbox's `check_budget`);
    `seconds`: the checks' budgets by function name (default CHECK_SECONDS); `points`: each check's points
    by function name (`points_of(module)`). A check that returns a string passes with it as its message
    (what it measured: a design check's figures, target and held-out set)."""
    from minikv.grading.sandbox import ChildDied, Delegation

    results, dead = [], None
    for check in checks:
        name = check.__name__.removeprefix("check_").replace("_", " ")
        worth = (points or {}).get(check.__name__, 0)
        if dead:
            results.append(CheckResult(name, False, f"not run: {dead}", 0, worth))
            continue
        limit = (seconds or {}).get(check.__name__, CHECK_SECONDS)
        start = time.monotonic()
        try:
            with budget(name, limit) if budget else contextlib.nullcontext():
                said = check(ns)
            results.append(CheckResult(name, True, _one_line(said) if isinstance(said, str) else "", worth, worth))
        except ChildDied as err:
            dead = err.reason
            results.append(CheckResult(name, False, dead, 0, worth))
        except Delegation as err:
            results.append(CheckResult(name, False, str(err), 0, worth))
        except NotImplementedYet as err:
            results.append(CheckResult(name, False, str(err), 0, worth))
        except AssertionError as err:
            results.append(CheckResult(name, False, _one_line(str(err)) or "assertion failed", 0, worth))
        except Exception as err:  # the learner's code crashed: say where, in one line
            where = getattr(err, "where", None)  # set on an exception that crossed from the sandbox
            if where is None:
                frame = _learner_frame(traceback.extract_tb(err.__traceback__))
                where = f"line {frame.lineno} of {Path(frame.filename).name}"
            results.append(CheckResult(name, False, _one_line(f"{type(err).__name__}: {err}")
                                       + (f" ({where})" if where else ""), 0, worth))
        results[-1].seconds = round(time.monotonic() - start, 2)
    return results


def points_of(module) -> dict[str, int]:
    """Each check's points, by function name, from the module's PARTS ({part: (points, [checks])}, the parts and
    points its exercise's markdown states): a part's points split evenly over its checks, the first ones taking
    what does not divide. A module without PARTS: no points (the score counts checks)."""
    out: dict[str, int] = {}
    for worth, checks in getattr(module, "PARTS", {}).values():
        share, extra = divmod(worth, len(checks))
        for i, check in enumerate(checks):
            out[check.__name__] = share + (1 if i < extra else 0)
    return out


def _one_line(text: str) -> str:
    """A verdict is one line: a message with newlines (hypothesis adds some) is joined."""
    return " ".join(line.strip() for line in str(text).splitlines() if line.strip())


def _learner_frame(frames: traceback.StackSummary) -> traceback.FrameSummary:
    """The frame to point a learner at: the last one in a notebook cell (their code), else the
    last one outside installed libraries (an error raised deep inside torch is not where to look)."""
    for test in (lambda f: f.filename.startswith("<"), lambda f: "site-packages" not in f.filename):
        mine = [f for f in frames if test(f)]
        if mine:
            return mine[-1]
    return frames[-1] if frames else traceback.FrameSummary("?", 0, "?")


def exercise_module(exercise: str):
    """The check module of exercise `exercise` ("01", "02", ...)."""
    from minikv.grading.checks import MODULES

    module_name = MODULES.get(exercise)
    if module_name is None:
        raise ValueError(f"no checks for exercise {exercise!r}; known: {', '.join(MODULES)}")
    return importlib.import_module(f"minikv.grading.checks.{module_name}")


SELF_CHECK = ("(self-check, run in this notebook's own process. Graders run\n"
              " `python -m minikv grade NOTEBOOK`, which runs your code in a separate process\n"
              " and also fails code that calls minikv's own answer.)")


def grade(exercise: str, ns: dict, quiet: bool = False) -> list[CheckResult]:
    """The notebook's self-check: run exercise `exercise`'s checks on the notebook's globals, here,
    and print a line per check and the score. Quick, and for the learner only: it runs in the
    learner's own process, so it is no verdict (see `grade_submission`)."""
    module = exercise_module(exercise)
    cells = [c for c in ns.get("In", []) if isinstance(c, str)] if isinstance(ns, dict) else []
    flagged = _delegation(module, cells)
    results = run_checks(list(module.CHECKS), _Flagged(ns, flagged) if flagged else ns, points=points_of(module))
    if not quiet:
        print(SELF_CHECK)
        for line in result_lines(results):
            print(line)
        print(score_line(results))
    return results


class _Flagged(dict):
    """A namespace where reading a name that delegates to minikv fails its checks."""

    def __init__(self, ns: dict, flagged: dict[str, str]):
        super().__init__(ns)
        self.flagged = flagged

    def __getitem__(self, name):
        from minikv.grading.sandbox import Delegation

        if name in self.flagged:
            raise Delegation(self.flagged[name])
        return super().__getitem__(name)

    def get(self, name, default=None):
        return self[name] if name in self else default


def _delegation(module, cells: list[str]) -> dict[str, str]:
    from minikv.grading.delegation import find_delegation

    return find_delegation(cells, list(getattr(module, "GRADED", ())), list(getattr(module, "FORBIDDEN", ())))


SCREEN_WIDTH = 88  # a verdict wraps at words before JupyterLab's output wraps it mid-word


def result_lines(results: list[CheckResult]) -> list[str]:
    """A line per check, as a learner reads them: a message already printed (several checks calling
    one unfinished function meet the same hint) is not repeated, and long lines wrap at words."""
    seen, lines = set(), []
    for r in results:
        text = f"FAIL  {r.name}{r.tally}: the same as above" if not r.passed and r.message in seen else str(r)
        seen.add(r.message)
        lines.append(textwrap.fill(text, SCREEN_WIDTH, subsequent_indent=" " * 6, break_long_words=False,
                                   break_on_hyphens=False))
    return lines


def score_line(results: list[CheckResult]) -> str:
    """The score: points (each check's, from its module's PARTS) where the checks have them, else checks passed."""
    passed = sum(r.passed for r in results)
    got, worth = sum(r.points for r in results), sum(r.max_points for r in results)
    if worth:
        return f"score: {got}/{worth} points ({100 * got // worth}%), {passed}/{len(results)} checks passed"
    return f"score: {passed}/{len(results)} ({100 * passed // max(len(results), 1)}%)"



# --- helpers for check modules -----------------------------------------------------------

def run_hypothesis(test: Callable[[], None],
                   hint: str = "does your code keep state between calls (a list at class level, a global)?") -> None:
    """Run a hypothesis test; a flaky failure (different on a rerun of the same input) becomes its
    first message plus ``hint``, instead of hypothesis' own report."""
    from hypothesis import errors

    try:
        test()
    except (errors.Flaky, errors.FlakyFailure) as err:  # FlakyFailure: an ExceptionGroup
        inner = getattr(err, "exceptions", None) or [err]
        raise AssertionError(f"{inner[0]} -- and a rerun of the same input behaved differently: {hint}") from None


@contextlib.contextmanager
def one_torch_thread():
    """Run torch on one thread, then restore. Checks' tensors (and a 135M model's decode steps) are
    too small to gain from more, and on a busy machine (graders run side by side) two threads
    contending for two cores made them 5-100x slower in our measurements."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)

# --- notebooks ---------------------------------------------------------------------------

def exercise_id(nb) -> str:
    try:
        return nb.metadata["minikv"]["exercise"]
    except KeyError:
        raise ValueError("this notebook has no metadata.minikv.exercise: it is not a graded exercise") from None


def is_grading_cell(cell) -> bool:
    return "grade" in cell.metadata.get("tags", [])


@dataclass
class Report:
    """One graded submission: a row of the gradebook."""

    path: str
    exercise: str = ""
    results: list[CheckResult] = field(default_factory=list)
    seconds: float = 0.0
    reason: str = ""      # why it is not full marks, in one line ("" when it is)
    notes: list[str] = field(default_factory=list)  # cells that raised, and the like
    round_trips: int = 0  # calls from the grader into the submission's process
    isolation: str = ""   # what kept the submission's process in, in words
    tampered: list[str] = field(default_factory=list)  # grader files that changed while it was graded
    integrity_seconds: float = 0.0  # the digests before and after
    slowest_cell: tuple[str, float] = ("", 0.0)  # the cell that took longest, and its seconds

    @property
    def graded(self) -> bool:
        return not self.tampered and not self.reason.startswith("not graded")

    @property
    def passed(self) -> int:
        return sum(r.passed for r in self.results)

    @property
    def full_marks(self) -> bool:
        """Every check passed, and there was at least one: the only case that exits 0."""
        return bool(self.results) and self.passed == len(self.results) and not self.reason

    @property
    def points(self) -> tuple[int, int]:
        """(points earned, points possible): each check's points from its module's PARTS (0, 0 without)."""
        return sum(r.points for r in self.results), sum(r.max_points for r in self.results)

    def row(self) -> dict:
        """A gradebook row. `score` and `percent` are in points where the exercise gives them (every graded
        exercise does: its markdown states each part's points), else in checks; `passed` and `total` count checks."""
        total = len(self.results)
        got, worth = self.points
        score, percent = (f"{got}/{worth}", 100 * got // worth) if worth else (
            f"{self.passed}/{total}", 100 * self.passed // max(total, 1))
        return {"path": self.path, "exercise": self.exercise, "passed": self.passed, "total": total,
                "points": got, "max_points": worth, "score": score, "percent": percent,
                "seconds": round(self.seconds, 1), "round_trips": self.round_trips, "reason": self.reason,
                "isolation": self.isolation, "tampered": self.tampered,
                "integrity_seconds": round(self.integrity_seconds, 3),
                "slowest_cell": [self.slowest_cell[0], round(self.slowest_cell[1], 1)],
                "checks": {r.name: ("PASS" if r.passed else "FAIL") for r in self.results}}


def notebook_cells(nb, name: str) -> list[tuple[str, str]]:
    """(source, filename) of the code cells to run, the grading cell left out."""
    return [(cell.source, f"<{name} cell {i}>") for i, cell in enumerate(nb.cells)
            if cell.cell_type == "code" and not is_grading_cell(cell)]


def grade_submission(path: str | Path, timeout: float = 300, memory_gb: float | None = 4,
                     reference: dict[str, str] | None = None) -> Report:
    """Grade one submission in a sandbox: its cells run in a child process (`minikv.grading.sandbox`),
    isolated as far as this machine allows, limited to `timeout` seconds of wall clock and to
    `memory_gb` of address space beyond what the interpreter needs after importing torch and minikv;
    the checks run here, on proxies of its functions and classes. Never raises: a broken submission
    is a report with a reason.

    The grader's files (`minikv.grading.integrity`) are digested before the submission runs and
    checked after its process and everything it started are gone: if anything changed, the report
    has no score and names the changed files (`Report.tampered`). `reference`: a batch's digest from
    before its first submission; if the files differ from it already, the submission is not graded."""
    import minikv.grading.integrity as integrity
    from minikv.grading.sandbox import ChildDied, Sandbox

    start = time.monotonic()
    report = Report(str(path))
    try:
        nb = nbformat.read(str(path), as_version=4)
        report.exercise = exercise_id(nb)
        module = exercise_module(report.exercise)
    except Exception as err:  # noqa: BLE001 - unreadable, not a notebook, not an exercise
        report.reason = _one_line(f"not gradable: {err}")
        report.seconds = time.monotonic() - start
        return report
    cells = notebook_cells(nb, Path(path).name)
    flagged = _delegation(module, [source for source, _ in cells])
    budget = int(memory_gb * 2**30) if memory_gb else None
    writes_bytecode, sys.dont_write_bytecode = sys.dont_write_bytecode, True  # the digest sees no .pyc of ours appear
    try:
        tick = time.monotonic()
        integrity.compile_ours()
        before = integrity.snapshot()
        report.integrity_seconds = time.monotonic() - tick
        if reference is not None and integrity.changed(reference, before):
            report.reason = not_graded(integrity.changed(reference, before), "before this submission")
            report.tampered = integrity.changed(reference, before)
            return report
        _run_in_sandbox(report, module, cells, flagged, timeout, budget, Sandbox, ChildDied)
        tick = time.monotonic()
        report.tampered = integrity.changed(before)
        report.integrity_seconds += time.monotonic() - tick
    finally:
        sys.dont_write_bytecode = writes_bytecode
        report.seconds = time.monotonic() - start
    if report.tampered:
        report.results = []  # no score: the checks may have run with changed code
        report.reason = ("the grader's files changed while this submission was graded: "
                         f"{_files(report.tampered)}; restore them (git checkout / reinstall) and grade again")
        return report
    if not report.results and not report.reason:
        report.reason = "no checks ran"
    if not report.reason:
        failed = [r for r in report.results if not r.passed]
        report.reason = f"{failed[0].name}: {failed[0].message}" if failed else ""
    return report


def _run_in_sandbox(report: Report, module, cells, flagged, timeout, budget, Sandbox, ChildDied) -> None:
    try:
        with Sandbox(cells, timeout=timeout, memory_budget=budget, flagged=flagged,
                     tripwires=tuple(getattr(module, "FORBIDDEN", ())),
                     cell_seconds=getattr(module, "CELL_SECONDS", CELL_SECONDS)) as box:
            report.notes = box.notes
            if box.death:
                report.results = run_checks(list(module.CHECKS), _Dead(box.death), points=points_of(module))
            else:
                report.results = run_checks(list(module.CHECKS), box.namespace, box.check_budget,
                                            getattr(module, "CHECK_SECONDS", None), points_of(module))
            report.round_trips = box.channel.next_request
    except ChildDied as err:  # while shutting down: the verdicts stand, the reason is recorded
        report.reason = err.reason
    except Exception as err:  # noqa: BLE001 - the grader itself failed on this submission
        report.reason = _one_line(f"grader error: {type(err).__name__}: {err}")
    if "box" in locals():
        report.isolation = box.isolation
        report.slowest_cell = max(box.cell_times.items(), key=lambda kv: kv[1], default=("", 0.0))
        if box.leftovers:
            report.notes.append(f"the submission left {box.leftovers} process(es) running: killed")


def _files(paths: list[str]) -> str:
    return ", ".join(paths[:5]) + (f" and {len(paths) - 5} more" if len(paths) > 5 else "")


def not_graded(paths: list[str], when: str) -> str:
    """The reason given to a submission graded with (possibly) changed grader files."""
    return (f"not graded: the grader's files changed {when} ({_files(paths)}); restore them "
            "(git checkout / reinstall) and grade again")


class _Dead:
    """The namespace of a submission whose process died before the checks: every read says why."""

    def __init__(self, reason: str):
        self.reason = reason

    def __contains__(self, *args):
        from minikv.grading.sandbox import ChildDied

        raise ChildDied(self.reason)

    __getitem__ = get = __contains__


def grade_notebook(path: str | Path, quiet: bool = False, timeout: float = 300,
                   memory_gb: float | None = 4) -> list[CheckResult]:
    """`grade_submission`, printed: notes, a line per check and the score."""
    report = grade_submission(path, timeout=timeout, memory_gb=memory_gb)
    if not quiet:
        print_report(report)
    return report.results


def print_report(report: Report) -> None:
    if report.isolation:
        print(report.isolation)
    for note in report.notes:
        print(f"note: {note}")
    if not report.results:
        print(f"FAIL  {report.path}: {report.reason}")
    for line in result_lines(report.results):
        print(line)
    print("score: none (the grader's files changed)" if report.tampered else score_line(report.results))


def strip_solutions(source: str) -> str:
    """Replace each BEGIN/END SOLUTION region with a NotImplementedError stub at the same indent.

    The comment lines right after BEGIN SOLUTION that start with "hint:" are not part of the
    answer: joined, they become the stub's message (a long hint is written over several
    `# hint:` lines, so that neither the solution nor the exercise has a line off the screen).
    """
    out, lines, i = [], source.splitlines(), 0
    while i < len(lines):
        line = lines[i]
        if line.strip() != BEGIN:
            if line.strip() == END:
                raise ValueError(f"{END} without {BEGIN}")
            out.append(line)
            i += 1
            continue
        indent = line[: len(line) - len(line.lstrip())]
        j = i + 1
        while j < len(lines) and lines[j].strip() != END:
            j += 1
        if j == len(lines):
            raise ValueError(f"{BEGIN} without {END}")
        hints = []
        for body_line in lines[i + 1:j]:
            hinted = re.match(r"\s*#\s*hint:\s*(.*)", body_line)
            if not hinted:
                break
            hints.append(hinted.group(1).strip())
        out += stub(indent, " ".join(hints) or "your code here")
        i = j + 1
    return "\n".join(out)


def stub(indent: str, hint: str) -> list[str]:
    """`raise NotImplementedError("not implemented yet: <hint>")` at `indent`, on one line if it fits
    in STUB_WIDTH characters, else as adjacent string literals, one per line (the same message)."""
    hint = hint.replace("\\", "\\\\").replace('"', "'")
    one_line = indent + STUB.format(hint=hint)
    if len(one_line) <= STUB_WIDTH:
        return [one_line]
    inner = indent + "    "
    pieces = textwrap.wrap(f"not implemented yet: {hint}", width=STUB_WIDTH - len(inner) - 3,
                           break_long_words=False, break_on_hyphens=False, drop_whitespace=False)
    return ([indent + "raise NotImplementedError("] + [f'{inner}"{piece}"' for piece in pieces]
            + [indent + ")"])


def strip_notebook(nb, markdown, generated_from: str):
    """`nb` with answers stripped, outputs cleared, Markdown through `markdown` (exercises' and lessons' own)."""
    nb = copy.deepcopy(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.source = strip_solutions(cell.source)
            cell.outputs, cell.execution_count = [], None
        else:
            cell.source = markdown(strip_solutions(cell.source))
    nb.metadata.setdefault("minikv", {})["generated_from"] = generated_from
    return nb


def make_exercise(solution_nb):
    """The exercise generated from a solution notebook; its Colab badge opens the exercise, not the answer."""
    return strip_notebook(solution_nb, lambda md: md.replace("/blob/main/solutions/", "/blob/main/exercises/"),
                          "solutions/ (run `make exercises` to regenerate)")


def generate_exercises(root: Path = REPO, check: bool = False) -> list[Path]:
    """Write exercises/ from solutions/. With check=True write nothing and return the stale files."""
    stale = []
    for solution in sorted((root / "solutions").glob("*.ipynb")):
        target = solution.parent.parent / "exercises" / solution.name
        text = nbformat.writes(make_exercise(nbformat.read(str(solution), as_version=4))) + "\n"
        if not target.exists() or target.read_text() != text:
            stale.append(target)
            if not check:
                target.parent.mkdir(exist_ok=True)
                target.write_text(text)
    return stale


__all__ = ["grade", "grade_notebook", "grade_submission", "Report", "learner", "call", "make_exercise",
           "generate_exercises", "strip_solutions", "CheckResult", "NotImplementedYet", "points_of"]
