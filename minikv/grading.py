"""The exercise machinery: generate exercises from solutions, and grade either with the same checks.

Solutions are the single source of truth (nbgrader's convention): in a solution notebook,
code between ``### BEGIN SOLUTION`` and ``### END SOLUTION`` is the answer. `make_exercise`
replaces each such region with a stub that raises `NotImplementedError`, keeping the
indentation, so the exercise notebook still runs top to bottom and every check then says
"not implemented yet" instead of failing deep inside.

Checks live in ``minikv/checks/exNN_*.py``, one module per exercise, and are plain functions
that take the learner's namespace (the notebook's globals) and raise AssertionError with a
short reason. `grade` runs them and prints one line per check and a score; the notebook's
last cell calls it, and ``python -m minikv grade NOTEBOOK`` runs the notebook's code in this
process and then calls it too, so learners and graders see the same verdicts.
"""

from __future__ import annotations

import copy
import importlib
import linecache
import os
import re
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import nbformat

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
STUB = 'raise NotImplementedError("not implemented yet: {hint}")'
REPO = Path(__file__).resolve().parent.parent


class NotImplementedYet(AssertionError):
    """A check met a stub: the learner has not written this part yet."""


@dataclass
class CheckResult:
    name: str
    passed: bool
    message: str = ""

    def __str__(self) -> str:
        return f"PASS  {self.name}" if self.passed else f"FAIL  {self.name}: {self.message}"


Check = Callable[[dict], None]


def learner(ns: dict, name: str) -> Callable:
    """Fetch the learner's function `name`, with a clear message if the cell was never run."""
    if name not in ns:
        raise AssertionError(f"`{name}` is not defined: run the cell that defines it first")
    return ns[name]


def call(fn: Callable, *args, **kwargs):
    """Call learner code; a stub's NotImplementedError becomes a one-line verdict, not a traceback."""
    try:
        return fn(*args, **kwargs)
    except NotImplementedError as err:
        raise NotImplementedYet(str(err) or "not implemented yet") from None


def run_checks(checks: list[Check], ns: dict) -> list[CheckResult]:
    results = []
    for check in checks:
        name = check.__name__.removeprefix("check_").replace("_", " ")
        try:
            check(ns)
            results.append(CheckResult(name, True))
        except NotImplementedYet as err:
            results.append(CheckResult(name, False, str(err)))
        except AssertionError as err:
            results.append(CheckResult(name, False, str(err) or "assertion failed"))
        except Exception as err:  # the learner's code crashed: say where, in one line
            where = _learner_frame(traceback.extract_tb(err.__traceback__))
            results.append(CheckResult(name, False, f"{type(err).__name__}: {err} "
                                                    f"(line {where.lineno} of {Path(where.filename).name})"))
    return results


def _learner_frame(frames: traceback.StackSummary) -> traceback.FrameSummary:
    """The frame to point a learner at: the last one in a notebook cell (their code), else the
    last one outside installed libraries (an error raised deep inside torch is not where to look)."""
    for test in (lambda f: f.filename.startswith("<"), lambda f: "site-packages" not in f.filename):
        mine = [f for f in frames if test(f)]
        if mine:
            return mine[-1]
    return frames[-1]


def exercise_checks(exercise: str) -> list[Check]:
    """The checks of exercise `exercise` ("01", "02", ...), in the order they are defined."""
    from minikv import checks

    module_name = checks.MODULES.get(exercise)
    if module_name is None:
        raise ValueError(f"no checks for exercise {exercise!r}; known: {', '.join(checks.MODULES)}")
    module = importlib.import_module(f"minikv.checks.{module_name}")
    return list(module.CHECKS)


def grade(exercise: str, ns: dict, quiet: bool = False) -> list[CheckResult]:
    """Run exercise `exercise`'s checks against a namespace; print a line per check and the score."""
    results = run_checks(exercise_checks(exercise), ns)
    if not quiet:
        for r in results:
            print(r)
        print(score_line(results))
    return results


def score_line(results: list[CheckResult]) -> str:
    passed = sum(r.passed for r in results)
    return f"score: {passed}/{len(results)} ({100 * passed // max(len(results), 1)}%)"


# --- notebooks ---------------------------------------------------------------------------

def exercise_id(nb) -> str:
    try:
        return nb.metadata["minikv"]["exercise"]
    except KeyError:
        raise ValueError("this notebook has no metadata.minikv.exercise: it is not a graded exercise") from None


def is_grading_cell(cell) -> bool:
    return "grade" in cell.metadata.get("tags", [])


def _python_only(source: str) -> str:
    """Drop IPython magics and shell lines so a cell runs under plain exec()."""
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines())


def grade_notebook(path: str | Path, quiet: bool = False) -> list[CheckResult]:
    """Run a notebook's code cells in a fresh namespace (a failing cell is reported, not fatal),
    then its exercise's checks. Environment variables the notebook sets (exercise 04 sets
    TRITON_INTERPRET) are restored afterwards, so grading leaves this process as it found it."""
    import matplotlib

    matplotlib.use("Agg")  # no windows when grading from a terminal
    nb = nbformat.read(str(path), as_version=4)
    exercise = exercise_id(nb)
    ns: dict = {"__name__": "__main__"}
    saved_env = dict(os.environ)
    try:
        for i, cell in enumerate(nb.cells):
            if cell.cell_type != "code" or is_grading_cell(cell):
                continue
            source, filename = _python_only(cell.source), f"<{Path(path).name} cell {i}>"
            # Register the cell's source as IPython does, so `inspect` (and Triton's interpreter,
            # which re-reads a kernel's source) and tracebacks find the code that actually ran.
            linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
            try:
                exec(compile(source, filename, "exec"), ns)
            except Exception as err:
                if not quiet:
                    print(f"note: cell {i} raised {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
        return grade(exercise, ns, quiet=quiet)
    finally:
        os.environ.clear()
        os.environ.update(saved_env)


def strip_solutions(source: str) -> str:
    """Replace each BEGIN/END SOLUTION region with a NotImplementedError stub at the same indent.

    A comment line right after BEGIN SOLUTION whose text starts with "hint:" is not part of
    the answer: it becomes the stub's message.
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
        body = lines[i + 1:j]
        hint = re.match(r"\s*#\s*hint:\s*(.*)", body[0]).group(1) if body and re.match(r"\s*#\s*hint:", body[0]) else "your code here"
        out.append(indent + STUB.format(hint=hint.replace('"', "'")))
        i = j + 1
    return "\n".join(out)


def make_exercise(solution_nb):
    """The exercise notebook generated from a solution notebook: solutions stripped, outputs cleared."""
    nb = copy.deepcopy(solution_nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.source = strip_solutions(cell.source)
            cell.outputs, cell.execution_count = [], None
        else:  # markdown: the Colab badge opens the exercise, not the answer
            cell.source = strip_solutions(cell.source).replace("/blob/main/solutions/", "/blob/main/exercises/")
    nb.metadata.setdefault("minikv", {})["generated_from"] = "solutions/ (run `make exercises` to regenerate)"
    return nb


def exercise_path(solution: Path) -> Path:
    return solution.parent.parent / "exercises" / solution.name


def generate_exercises(root: Path = REPO, check: bool = False) -> list[Path]:
    """Write exercises/ from solutions/. With check=True write nothing and return the stale files."""
    stale = []
    for solution in sorted((root / "solutions").glob("*.ipynb")):
        target = exercise_path(solution)
        text = nbformat.writes(make_exercise(nbformat.read(str(solution), as_version=4))) + "\n"
        if not target.exists() or target.read_text() != text:
            stale.append(target)
            if not check:
                target.parent.mkdir(exist_ok=True)
                target.write_text(text)
    return stale


__all__ = ["grade", "grade_notebook", "learner", "call", "make_exercise", "generate_exercises",
           "strip_solutions", "CheckResult", "NotImplementedYet"]
