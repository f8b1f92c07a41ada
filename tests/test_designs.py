"""GRADING.md's tables, asserted: every design of `tests/designs.py` (each design exercise's solution, the lecture's
policies and the cheap designs of issue 46), measured on the grader's held-out sets with the check modules' own code,
gets the verdict GRADING.md's pass/fail column gives it, and no design's mean sits within two standard errors (over
the set's seeds) of a target. And the same notebook gets the same grade at every run: a borderline design, handed in
as a notebook, graded three times by the grader, gets identical verdicts (issue 46).

    .venv/bin/python tests/designs.py     # prints the tables
"""

import designs
import pytest

pytestmark = pytest.mark.design

CASES = [(exercise, design) for exercise, table in designs.DESIGNS.items() for design in table]


@pytest.mark.parametrize("exercise, design", CASES, ids=[f"{e}: {d[:60]}" for e, d in CASES])
def test_the_grader_agrees_with_grading_md(exercise, design):
    row = designs.measure(exercise, design)
    print(row.line())
    assert row.passed == row.should_pass, f"GRADING.md says it should {'pass' if row.should_pass else 'fail'}: " \
                                          + row.line()
    for m in row.measured:
        for c in m.criteria:
            assert c.standard_errors_away >= 2, f"within two standard errors of a target: {m.summary()}"


def test_the_same_notebook_gets_the_same_grade_three_times(tmp_path):
    from minikv.grading import grade_submission

    path = designs.borderline_notebook("03", tmp_path / "03_best_fit.ipynb")
    reports = [grade_submission(path) for _ in range(3)]
    verdicts = [[(r.name, r.passed, r.message, r.points, r.max_points) for r in report.results] for report in reports]
    assert reports[0].results and not reports[0].tampered, reports[0].row()
    assert verdicts[0] == verdicts[1] == verdicts[2], verdicts
    design = {r.name: r for r in reports[0].results}["run allocator few runs on held out traces"]
    assert design.passed and "held-out set ex03-v1" in design.message and "the target is <= 0.70x" in design.message
    print(f"{reports[0].row()['score']}: {design.message}")
