"""The exercise machinery: stripping, sync of exercises/ with solutions/, and the grader on both."""

from pathlib import Path

import nbformat
import pytest

from minikv.grading import (generate_exercises, grade, grade_notebook, make_exercise, run_checks,
                            strip_solutions)

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))


def test_strip_keeps_indent_and_hint():
    src = ("def f(x):\n"
           "    ### BEGIN SOLUTION\n"
           "    # hint: double it\n"
           "    return 2 * x\n"
           "    ### END SOLUTION\n"
           "\n"
           "y = 1\n")
    out = strip_solutions(src)
    assert out == 'def f(x):\n    raise NotImplementedError("not implemented yet: double it")\n\ny = 1'
    ns = {}
    exec(out, ns)
    with pytest.raises(NotImplementedError, match="not implemented yet"):
        ns["f"](3)


@pytest.mark.parametrize("bad", ["### BEGIN SOLUTION\nx = 1\n", "x = 1\n### END SOLUTION\n"])
def test_unbalanced_markers_are_errors(bad):
    with pytest.raises(ValueError, match="without"):
        strip_solutions(bad)


def test_make_exercise_clears_outputs():
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("### BEGIN SOLUTION\nx = 1\n### END SOLUTION")
    cell.outputs = [nbformat.v4.new_output("stream", text="1")]
    nb.cells.append(cell)
    ex = make_exercise(nb)
    assert ex.cells[0].outputs == [] and "NotImplementedError" in ex.cells[0].source
    assert nb.cells[0].outputs  # the solution is not modified


def test_exercises_are_in_sync_with_solutions():
    stale = generate_exercises(ROOT, check=True)
    assert not stale, f"run `make exercises`: out of date: {[str(p) for p in stale]}"


def test_checks_report_one_line_without_tracebacks():
    def check_crashes(ns):
        ns["f"]()

    def check_stub(ns):
        from minikv.grading import call
        call(ns["g"])

    results = run_checks([check_crashes, check_stub], {"f": lambda: 1 / 0, "g": lambda: (_ for _ in ()).throw(
        NotImplementedError("not implemented yet: g"))})
    assert [r.passed for r in results] == [False, False]
    assert results[0].message.startswith("ZeroDivisionError: division by zero (line")
    assert results[1].message == "not implemented yet: g"


def test_unknown_exercise():
    with pytest.raises(ValueError, match="no checks for exercise '99'"):
        grade("99", {})


@pytest.mark.parametrize("solution", SOLUTIONS, ids=[p.stem for p in SOLUTIONS])
def test_solution_scores_full_marks(solution, capsys):
    results = grade_notebook(solution)
    assert results and all(r.passed for r in results), "\n".join(map(str, results))
    assert "(100%)" in capsys.readouterr().out


@pytest.mark.parametrize("solution", SOLUTIONS, ids=[p.stem for p in SOLUTIONS])
def test_generated_exercise_scores_zero_with_clear_messages(solution):
    results = grade_notebook(ROOT / "exercises" / solution.name)
    assert results and not any(r.passed for r in results)
    unclear = [str(r) for r in results if "not implemented yet" not in r.message]
    assert not unclear, "each check of an untouched exercise should say 'not implemented yet':\n" + "\n".join(unclear)


def test_exercise_badge_opens_the_exercise():
    nb = nbformat.v4.new_notebook()
    nb.cells.append(nbformat.v4.new_markdown_cell(
        "[![Open In Colab](b.svg)](https://colab.research.google.com/github/o/r/blob/main/solutions/01_x.ipynb)"))
    assert "/blob/main/exercises/01_x.ipynb" in make_exercise(nb).cells[0].source


def test_a_crash_inside_a_library_points_at_the_learners_cell():
    ns = {}
    exec(compile("import torch\ndef f():\n    return torch.einsum('ij,jk->ik', torch.ones(2, 3), torch.ones(2, 3))\n",
                 "<03_paged.ipynb cell 7>", "exec"), ns)

    def check_calls_f(ns):
        ns["f"]()

    (result,) = run_checks([check_calls_f], ns)
    assert result.message.endswith("(line 3 of <03_paged.ipynb cell 7>)"), result.message
