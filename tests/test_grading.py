"""The exercise machinery: stripping, sync of exercises/ with solutions/, and the grader on both."""

import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

from minikv.grading import generate_exercises, grade, make_exercise, run_checks, strip_solutions

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


def test_a_long_hint_spans_hint_lines_and_its_stub_fits_the_screen():
    hint = "first the bytes one token costs in ONE layer; then, layer by layer, how many tokens it keeps"
    src = ("def f(x):\n"
           "    ### BEGIN SOLUTION\n"
           "    # hint: first the bytes one token costs in ONE layer;\n"
           "    # hint: then, layer by layer, how many tokens it keeps\n"
           "    # the solution's own comment is not part of the hint\n"
           "    return 2 * x\n"
           "    ### END SOLUTION\n")
    out = strip_solutions(src)
    assert "own comment" not in out and "return" not in out
    assert max(len(line) for line in out.splitlines()) <= 100, out
    assert len(out.splitlines()) > 2, out  # too long for one line: wrapped
    ns = {}
    exec(out, ns)
    with pytest.raises(NotImplementedError) as raised:
        ns["f"](3)
    assert str(raised.value) == f"not implemented yet: {hint}"


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


# The documented path, as a grader runs it: `python -m minikv grade FOLDER --jobs 2` in a fresh process, once
# for all solutions (a CSV gradebook) and once for all generated exercises (JSON, to read every message).
# One batch each instead of a process per notebook: the same coverage at CI's cost of the slowest notebooks.
def _grade_cli(*args: str, timeout: float = 1500) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "minikv", "grade", *args, "--jobs", "2", "--quiet"],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


@pytest.fixture(scope="module")
def solutions_gradebook(tmp_path_factory):
    book = tmp_path_factory.mktemp("gradebook") / "solutions.csv"
    done = _grade_cli("solutions/", "--csv", str(book))
    rows = {Path(r["path"]).name: r for r in csv.DictReader(book.open())} if book.exists() else {}
    return done, rows


@pytest.fixture(scope="module")
def exercises_gradebook():
    done = _grade_cli("exercises/", "--json")
    try:
        rows = {Path(r["path"]).name: r for r in json.loads(done.stdout)}
    except json.JSONDecodeError:
        rows = {}
    return done, rows


@pytest.mark.design
@pytest.mark.parametrize("solution", SOLUTIONS, ids=[p.stem for p in SOLUTIONS])
def test_solution_scores_full_marks_from_the_command_line(solution, solutions_gradebook):
    done, rows = solutions_gradebook
    assert solution.name in rows, f"no gradebook row for {solution.name}:\n{done.stdout}\n{done.stderr[-3000:]}"
    row = rows[solution.name]
    assert row["percent"] == "100" and row["reason"] == "", row
    assert row["notes"] == "", f"a cell of {solution.name} raised under the grader: {row['notes']}"


@pytest.mark.design
def test_the_solutions_batch_exits_zero(solutions_gradebook):
    done, rows = solutions_gradebook
    assert done.returncode == 0 and len(rows) == len(SOLUTIONS), done.stdout + done.stderr[-3000:]
    assert f"{len(SOLUTIONS)}/{len(SOLUTIONS)} submissions with full marks" in done.stdout


@pytest.mark.design
@pytest.mark.parametrize("solution", SOLUTIONS, ids=[p.stem for p in SOLUTIONS])
def test_generated_exercise_scores_zero_from_the_command_line(solution, exercises_gradebook):
    done, rows = exercises_gradebook
    assert solution.name in rows, f"no gradebook row for exercises/{solution.name}:\n{done.stderr[-3000:]}"
    row = rows[solution.name]
    assert row["results"] and row["passed"] == 0 and not row["tampered"], row
    unclear = [f"{r['name']}: {r['message']}" for r in row["results"] if "not implemented yet" not in r["message"]]
    assert not unclear, "each check of an untouched exercise should say 'not implemented yet':\n" + "\n".join(unclear)
    assert done.returncode != 0


def _parts_table(markdown: str) -> dict[str, int]:
    """The "| part | points |" table of an exercise's first cell, as {part: points}."""
    lines = markdown.split("| part | points |", 1)[1].strip().splitlines()[1:]
    rows = [line.strip().strip("|").rsplit("|", 1) for line in lines if line.startswith("|")]
    return {name.strip(): int(points) for name, points in rows}


@pytest.mark.parametrize("solution", SOLUTIONS, ids=[p.stem for p in SOLUTIONS])
def test_each_exercise_states_its_time_and_the_points_the_grader_gives(solution):
    """Issue 46: the first cell states the expected time and each part's points; the grader's PARTS are the same
    parts and points, add up to 100, and give every check exactly one part."""
    from minikv.grading.grader import exercise_id, exercise_module, points_of

    nb = nbformat.read(solution, as_version=4)
    module = exercise_module(exercise_id(nb))
    intro = nb.cells[0].source
    assert "**Time and points.** Plan about" in intro and "out of 100 points" in intro, intro[-400:]
    assert _parts_table(intro) == {part: points for part, (points, _) in module.PARTS.items()}
    assert sum(points_of(module).values()) == 100
    in_parts = [check for _, checks in module.PARTS.values() for check in checks]
    assert sorted(c.__name__ for c in in_parts) == sorted(c.__name__ for c in module.CHECKS)


def _design_targets() -> dict[str, list[str]]:
    """What each design exercise's markdown must say: every target, and every held-out set's name and size."""
    from minikv.grading.checks import ex02_contiguous as ex02_
    from minikv.grading.checks import ex06_scheduler as ex06
    from minikv.grading.checks import ex07_admission as ex07
    from minikv.grading.checks import run_allocator as ex03

    def sets(*held):
        return [f for h in held for f in (h.name, f"{len(h.seeds)} seeds")]

    return {"02": [f"{ex02_.TARGET:.2f}x", f"{ex02_.MAX_COPIED_PER_TOKEN:g} tokens", *sets(ex02_.HELD_OUT)],
            "03": [f"{ex03.MAX_RUNS:.2f}x", *sets(ex03.HELD_OUT)],
            "06": [f"{ex06.MAX_RECOMPUTED['short']:.2f}×", f"{ex06.MAX_RECOMPUTED['mixed']:.2f}×",
                   f"{ex06.MAX_STEPS:.2f}×", *sets(*ex06.HELD_OUT.values())],
            "07": [f"{ex07.MARGIN['scripted']:.2f}x", f"{ex07.MIN_GAIN:g} more good requests per 100 offered",
                   *sets(ex07.HELD_OUT)]}


@pytest.mark.parametrize("exercise", ["02", "03", "06", "07"])
def test_each_design_exercise_states_its_targets_and_held_out_sets(exercise):
    """Issue 46: no hidden target. The exercise's markdown states every target the grader holds it to, and the held-out
    sets it grades on (their names and sizes; the seeds themselves are in no notebook)."""
    solution = next(p for p in SOLUTIONS if p.name.startswith(exercise))
    markdown = " ".join(" ".join(c.source.split()) for c in nbformat.read(solution, as_version=4).cells
                        if c.cell_type == "markdown")
    missing = [said for said in _design_targets()[exercise] if said not in markdown]
    assert not missing, f"{solution.name} does not state {missing}"


def test_a_check_that_measures_says_so_when_it_passes_and_the_score_is_in_points():
    """A check that returns a string passes with it as its message; the points come from PARTS."""
    def check_measures(ns):
        return "measured 0.5x on set s-v1; the target is <= 0.7x"

    def check_fails(ns):
        raise AssertionError("measured 0.9x on set s-v1; the target is <= 0.7x")

    results = run_checks([check_measures, check_fails], {}, points={"check_measures": 30, "check_fails": 70})
    assert [(r.passed, r.points, r.max_points) for r in results] == [(True, 30, 30), (False, 0, 70)]
    assert str(results[0]) == "PASS  measures [30/30]: measured 0.5x on set s-v1; the target is <= 0.7x"
    assert str(results[1]).startswith("FAIL  fails [0/70]: measured 0.9x")
    from minikv.grading.grader import score_line

    assert score_line(results) == "score: 30/100 points (30%), 1/2 checks passed"


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


# ---- the sandbox: proxies, exceptions, delegation ------------------------------------------------

from minikv.grading import peek  # noqa: E402
from minikv.grading.delegation import find_delegation  # noqa: E402
from minikv.grading.sandbox import ChildDied, Delegation, Sandbox  # noqa: E402

LEARNER = '''
class OutOfRoom(RuntimeError):
    pass

class Pool:
    def __init__(self, n):
        self.free = list(range(n))
    def take(self):
        if not self.free:
            raise OutOfRoom("empty")
        return self.free.pop()
    def pair(self):
        return (self.take(), [self.take()])

class User:
    def __init__(self, pool):
        self.pool = pool          # a proxy, when the grader hands over one of its own objects
    def grab(self, k):
        return [self.pool.allocate() for _ in range(k)]

def make(n):
    return Pool(n)

def stub():
    raise NotImplementedError("not implemented yet: stub")
'''


def test_sandbox_proxies_classes_instances_and_the_graders_objects():
    from minikv.blocks import BlockAllocator

    with Sandbox([(LEARNER, "<t cell 0>")], timeout=60, memory_budget=None) as box:
        ns = box.namespace
        assert not box.death and "Pool" in ns and "nothing" not in ns
        pool = ns["Pool"](3)                    # a class proxy makes an instance in the child
        assert pool.take() == 2 and pool.pair() == (1, [0])  # values come back as plain data
        with pytest.raises(RuntimeError) as err:
            pool.take()
        assert type(err.value).__name__ == "OutOfRoom" and str(err.value) == "empty"
        assert err.value.where.startswith("line ")
        assert ns["make"](3) is not None and ns["make"](3).free == [0, 1, 2]
        mine = BlockAllocator(4)                # a grader object handed to learner code stays here
        user = ns["User"](mine)
        assert user.grab(3) == [0, 1, 2] and mine.num_free == 1
        assert peek(pool, ["free", ("take",)])[0] == ("ok", [])
        with pytest.raises(NotImplementedError):
            ns["stub"]()


def test_sandbox_child_death_and_time_limit():
    with Sandbox([("import os\nos._exit(3)\n", "<t cell 0>")], timeout=60, memory_budget=None) as box:
        assert "exited with status 3" in box.death and "<t cell 0>" in box.death
    # the time limit counts from the start: the child's imports (torch, minikv) come first
    with Sandbox([("def spin():\n    while True:\n        pass\n", "<t cell 0>")], timeout=20,
                 memory_budget=None) as box:
        with pytest.raises(ChildDied, match="time limit"):
            box.namespace["spin"]()


def test_a_check_that_never_returns_fails_at_its_own_budget_not_the_wall():
    """A learner function that never returns: its check fails after that check's budget, named, with the
    reason; the checks after it say "not run" with the same reason; the one before it passed."""
    def check_first(ns):
        assert ns["make"](2).free == [0, 1]

    def check_spins(ns):
        ns["spin"]()

    def check_after(ns):
        ns["make"](1)

    cells = [(LEARNER + "\ndef spin():\n    while True:\n        pass\n", "<t cell 0>")]
    with Sandbox(cells, timeout=280, memory_budget=None) as box:
        results = run_checks([check_first, check_spins, check_after], box.namespace, box.check_budget,
                             {"check_spins": 3})
    assert [r.passed for r in results] == [True, False, False]
    assert "the check 'spins' ran past its 3 s budget" in results[1].message, results[1]
    assert results[2].message.startswith("not run: time limit: the check 'spins'"), results[2]


def test_a_cell_that_never_returns_ends_the_submission_at_its_cell_budget_not_the_wall():
    """A notebook cell that never returns (a demo calling a learner function that loops): the sandbox ends the
    submission after the cell's budget, naming the cell, long before the wall clock; cells before it were timed."""
    cells = [(LEARNER, "<t cell 0>"), ("while True:\n    pass\n", "<t cell 1>"), ("x = 1\n", "<t cell 2>")]
    start = time.monotonic()
    with Sandbox(cells, timeout=280, memory_budget=None, cell_seconds=3) as box:
        assert box.death and "<t cell 1> ran past its 3 s budget for one cell" in box.death, box.death
    assert time.monotonic() - start < 60, "the cell's budget, not the wall clock, should have ended it"
    assert list(box.cell_times) == ["<t cell 0>"]


def test_runtime_tripwire_catches_hidden_delegation():
    src = ("import minikv.sizing as s\nf = getattr(s, 'kv_bytes_' + 'per_token')\n"
           "def mine(cfg):\n    return f(cfg)\n")
    with Sandbox([(src, "<t cell 0>")], timeout=60, memory_budget=None,
                 tripwires=("minikv.sizing.kv_bytes_per_token",)) as box:
        with pytest.raises(Delegation, match="minikv.sizing.kv_bytes_per_token"):
            box.namespace["mine"]({"num_hidden_layers": 1, "num_attention_heads": 1, "hidden_size": 8})


@pytest.mark.parametrize("cells, flagged", [
    (["from minikv.sizing import kv_bytes_per_token\n"], "imported"),
    (["import minikv.sizing as s\ndef kv_bytes_per_token(c, b):\n    return s.kv_bytes_per_token(c)\n"], "uses"),
    (["from minikv.blocks import BlockAllocator\nclass kv_bytes_per_token(BlockAllocator):\n    pass\n"], "uses"),
    (["import minikv.sizing as s\ndef helper(c):\n    return getattr(s, 'kv_bytes_per_token')(c)\n",
      "def kv_bytes_per_token(c, b):\n    return helper(c)\n"], "through `helper`"),
    (["def kv_bytes_per_token(c, b):\n    return __import__('minikv').sizing\n"], "dynamically"),
])
def test_static_delegation(cells, flagged):
    found = find_delegation(cells, ["kv_bytes_per_token"], ["minikv.sizing.kv_bytes_per_token",
                                                             "minikv.blocks.BlockAllocator"])
    assert flagged in found["kv_bytes_per_token"]


def test_static_delegation_allows_other_helpers():
    cells = ["from minikv.sizing import ModelShape\nfrom minikv.attention import paged_attention_ref\n",
             "def kv_bytes_per_token(c, b):\n    s = ModelShape.from_config(c)\n    return 2 * s.num_layers * b\n",
             "def try_it():\n    return paged_attention_ref\n"]
    assert find_delegation(cells, ["kv_bytes_per_token"], ["minikv.sizing.kv_bytes_per_token",
                                                           "minikv.attention.paged_attention_ref"]) == {}


def test_notebook_self_check_says_so(capsys):
    grade("01", {"In": ["from minikv.sizing import kv_cache_bytes\n"], "kv_cache_bytes": lambda *a: 0})
    out = capsys.readouterr().out
    assert "self-check" in out and "python -m minikv grade" in out
    assert "is minikv's minikv.sizing.kv_cache_bytes" in " ".join(out.split())  # verdicts wrap at words


def test_digest_names_what_changed(tmp_path, monkeypatch):
    """The digest of the grader's files sees an edit, a new file (a planted .pyc) and a removal."""
    import shutil

    from minikv.grading import integrity

    for name in ("minikv", "kernels"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(integrity, "PACKAGE", tmp_path / "minikv")
    monkeypatch.setattr(integrity, "REPO", tmp_path)
    before = integrity.snapshot()
    assert integrity.changed(before) == []
    with open(tmp_path / "minikv/grading/checks/ex01_bytes.py", "a") as f:
        f.write("\n")
    (tmp_path / "minikv/__pycache__").mkdir()
    (tmp_path / "minikv/__pycache__/sizing.cpython-311.pyc").write_bytes(b"planted")
    # A cache file another grader is writing right now (its temporary name; import never loads it): not a change.
    (tmp_path / "minikv/__pycache__/blocks.cpython-311.pyc.140211").write_bytes(b"half-written")
    (tmp_path / "kernels/__init__.py").unlink()
    assert integrity.changed(before) == ["kernels/__init__.py", "minikv/__pycache__/sizing.cpython-311.pyc",
                                         "minikv/grading/checks/ex01_bytes.py"]


def test_digest_does_not_flag_what_a_check_imports():
    """Importing kernels/ (as the checks of 06 and 07 do) after the digest is no change: our own files are
    compared by content, not also by stat as loaded modules. In a fresh process, whatever ran before."""
    code = ("import minikv.grading.integrity as i\n"
            "before = i.snapshot()\n"
            "import minikv_kernels.paged_attention_cpu, minikv.engine\n"
            "print(i.changed(before))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout


# ---- exercise 02's design part: MySlabs against the lecture's policies ------------------------------------

from minikv.grading.checks import ex02_contiguous as ex02  # noqa: E402
from minikv.grading.public.ex02_contiguous import SlabsBroken, serve  # noqa: E402
from minikv.sim.traces import make_trace  # noqa: E402


def _solution_02() -> dict:
    """The solution's graded cells, run here: `first_fit` and `MySlabs`."""
    nb = nbformat.read(ROOT / "solutions" / "02_contiguous.ipynb", as_version=4)
    ns: dict = {}
    for cell in nb.cells:
        if cell.cell_type == "code" and cell.source.startswith(("def first_fit", "class MySlabs")):
            exec(compile(cell.source, "<solution 02>", "exec"), ns)  # noqa: S102 - the course's own notebook
    return ns


@pytest.mark.design
def test_02_the_solution_meets_the_objective_with_room_and_says_so():
    """On the held-out set: both means with room, and a passing verdict that says what was measured, the targets and
    the set (name and version)."""
    m = ex02.held_out_measurement(_solution_02()["MySlabs"])
    ratio, copied = m.criteria
    assert m.passed and ratio.mean >= ex02.TARGET + 0.05 and copied.mean <= ex02.MAX_COPIED_PER_TOKEN / 2, m.summary()
    passed, said = ex02.objective_verdict(m)
    assert passed and "held-out set ex02-v1 (4 seeds" in said, said
    assert "the target is >= 1.25x" in said and "the target is <= 8.00 tokens" in said, said


class _Pow2Slabs:
    """The best shipped policy behind MySlabs' calls (minikv's ContiguousPow2, as the pastes use it)."""

    def __init__(self, budget, max_seq_len):
        from minikv.sim.policies import ContiguousPow2

        self.pow2 = ContiguousPow2()
        self.pow2.reset(budget, max_seq_len)
        self.slabs = self.pow2.slab

    def admit(self, seq_id, live):
        return self.pow2.admit(type("S", (), {"id": seq_id, "live": live})())

    def grow(self, seq_id, live):
        return self.pow2.grow(type("S", (), {"id": seq_id, "live": live})())

    def release(self, seq_id):
        self.pow2.release(type("S", (), {"id": seq_id})())


@pytest.mark.design
def test_02_the_best_shipped_policy_is_exactly_the_baseline_and_fails():
    """Through the seam, minikv's Pow2 makes the same decisions as in the lecture: 1.00x, the same copies. Its verdict
    names the set, the targets, the worst seed and the line that reproduces it, and advises on the throughput only
    (its copies are within the bound)."""
    m = ex02.objective(_Pow2Slabs, 3)
    assert all(r["baseline"] == "contiguous pow2" and r["ratio"] == 1.0 for r in m["traces"]), m["traces"]
    assert all(r["yours"]["copied_tokens"] == r["base"]["copied_tokens"] for r in m["traces"])
    passed, said = ex02.objective_verdict(ex02.held_out_measurement(_Pow2Slabs))
    assert not passed and "1.000x the charged output tokens per second" in said and "the target is >= 1.25x" in said
    assert "held-out set ex02-v1" in said and "objective(MySlabs, seed=" in said, said
    assert "for the throughput" in said and "for the copies" not in said, said


class _Compacting:
    """Max-length slabs, packed back to the start of the budget after every release: slow and copy-heavy."""

    def __init__(self, budget, max_seq_len):
        self.budget, self.max_seq_len, self.slabs = budget, max_seq_len, {}

    def admit(self, seq_id, live):
        end = sum(size for _, size in self.slabs.values())
        if end + self.max_seq_len > self.budget:
            return False
        self.slabs[seq_id] = (end, self.max_seq_len)
        return True

    def grow(self, seq_id, live):
        return live + 1 <= self.slabs[seq_id][1]

    def release(self, seq_id):
        del self.slabs[seq_id]
        at = 0
        for rid, (_, size) in sorted(self.slabs.items(), key=lambda kv: kv[1][0]):
            self.slabs[rid] = (at, size)
            at += size


@pytest.mark.design
def test_02_a_verdict_that_misses_both_figures_advises_on_both(monkeypatch):
    """Issue 46's 02b: a design that misses the throughput and the copy bound is told about both."""
    from minikv.grading.checks.held_out import HeldOutSet

    monkeypatch.setattr(ex02, "HELD_OUT", HeldOutSet("ex02-test", (0,), "2 traces"))
    monkeypatch.setattr(ex02, "MAX_COPIED_PER_TOKEN", 0.01)
    passed, said = ex02.objective_verdict(ex02.held_out_measurement(_Compacting))
    assert not passed and "for the throughput" in said and "for the copies" in said, said


def _broken(**changes):
    """The solution's allocator with one method replaced by a rule breaker."""
    return type("Broken", (_solution_02()["MySlabs"],), changes)


def _overlap(self, seq_id, live):
    self.slabs[seq_id] = (0, live + 1)
    return True


def _leak(self, seq_id):
    pass


def _beyond(self, seq_id, live):
    self.slabs[seq_id] = (self.budget - live, live + 1)
    return True


def _resize_others(self, seq_id, live):
    ok = _solution_02()["MySlabs"].grow(self, seq_id, live)
    other = next((k for k in self.slabs if k != seq_id), None)
    if other is not None:
        self.slabs[other] = (self.slabs[other][0], self.slabs[other][1] - 1)
    return ok


def _never(self, seq_id, live):
    return False


@pytest.mark.design
@pytest.mark.parametrize("changes, said", [
    ({"admit": _overlap}, "overlaps"),
    ({"release": _leak}, "not running (a leak)"),
    ({"grow": _beyond}, "not inside the budget"),
    ({"grow": _resize_others}, "not resize them"),
    ({"admit": _never}, "with nothing running"),
    ({"grow": _never}, "runs alone"),
], ids=["overlap", "leak", "beyond", "resize", "never-admit", "never-grow"])
def test_02_each_hard_limit_is_named(changes, said):
    with pytest.raises(SlabsBroken, match=said.replace("(", r"\(").replace(")", r"\)")):
        for trace, budget in ex02.HARD_SCENARIOS.values():
            serve(_broken(**changes), trace(), budget)


@pytest.mark.design
def test_02_a_call_that_changes_nothing_is_not_asked_again():
    """The seam skips re-asking a refused head when no call happened since (a deterministic allocator would
    refuse again): the measurement is the same as asking every step, in fewer round trips."""
    calls = {"admit": 0}
    base = _solution_02()["MySlabs"]

    class Counted(base):
        def admit(self, seq_id, live):
            calls["admit"] += 1
            return base.admit(self, seq_id, live)

    result = serve(Counted, make_trace("sharegpt", 60, seed=5))
    assert int(result.timeline["finished"].sum()) == 60
    assert calls["admit"] < result.steps, (calls, result.steps)

# ---- exercise 03's design part: few runs per sequence, against minikv's free list -----------------------

def _ex03_run_allocator(folder: str = "solutions"):
    """The notebook's `MyRunAllocator`, defined by running its imports and its cell."""
    nb = json.loads((ROOT / folder / "03_paged.ipynb").read_text())
    ns: dict = {}
    for cell in nb["cells"]:
        src = "".join(cell["source"])
        if cell["cell_type"] == "code" and src.startswith("class MyRunAllocator"):
            exec(compile("from minikv.blocks import OutOfBlocks\n" + src, f"<{folder} 03>", "exec"), ns)  # noqa: S102
    return ns["MyRunAllocator"]


class _Ex03Breaks:
    """minikv's free list as a per-sequence allocator, with one rule broken (chosen by `how`)."""

    how = ""

    def __init__(self, num_blocks):
        self.n, self.free_ids, self.tables = num_blocks, list(range(num_blocks)), {}

    @property
    def num_free(self):
        return len(self.free_ids) + (1 if self.how == "miscount" else 0)

    def allocate(self, seq_id, n):
        from minikv.blocks import OutOfBlocks

        if n > len(self.free_ids) or (self.how == "refuse" and n > 1 and len(self.free_ids) < self.n // 2):
            raise OutOfBlocks(n, len(self.free_ids))
        got = [self.free_ids.pop(0) for _ in range(n)]
        if self.how == "twice" and self.tables and n:
            got[-1] = next(iter(self.tables.values()))[0]  # a block another sequence holds
        self.tables.setdefault(seq_id, []).extend(got)
        return got

    def free(self, seq_id):
        blocks = self.tables.pop(seq_id)
        self.free_ids += blocks[:-1] if self.how == "lose" and len(blocks) > 1 else blocks


@pytest.mark.design
def test_ex03_solution_meets_the_objective_with_room_and_the_free_list_does_not():
    from minikv.grading.checks import run_allocator as ex

    passed, said = ex.objective_verdict(m := ex.held_out_measurement(_ex03_run_allocator()))
    assert passed and m.criteria[0].mean <= ex.MAX_RUNS - 0.1, m.summary()
    assert said.startswith("on held-out set ex03-v1 (16 seeds, 6 serving traces each): 0.") and \
        said.endswith("the target is <= 0.70x"), said
    passed, said = ex.objective_verdict(ex.held_out_measurement(ex.FreeListBaseline))
    assert not passed and "1.000x of minikv's free list's runs" in said, said
    seed = int(said.split("objective(MyRunAllocator, seed=")[1].split(")")[0])
    assert seed in ex.HELD_OUT.seeds and f"draw_traces({seed})[" in said, said


@pytest.mark.design
def test_ex03_the_objective_sees_the_same_events_whatever_the_allocator():
    """Placement never changes what happens (admissions, preemptions, finishes): only where blocks lie."""
    from minikv.grading.public.ex03_paged import FreeListBaseline, draw_traces, simulate

    for trace in draw_traces(7, 3):
        a, b = simulate(FreeListBaseline, trace), simulate(_ex03_run_allocator(), trace)
        assert (a.moves, a.blocks, a.preemptions) == (b.moves, b.blocks, b.preemptions)
        assert b.runs < a.runs and all(1 <= r for r in b.per_move)


@pytest.mark.design
@pytest.mark.parametrize("how, message", [
    ("twice", "handed out twice"), ("lose", "num_free"), ("miscount", "num_free"),
    ("refuse", "must hand them out"),
])
def test_ex03_hard_limits_are_a_gate(how, message):
    from minikv.grading.checks import run_allocator as ex

    broken = type(f"Breaks_{how}", (_Ex03Breaks,), {"how": how})
    with pytest.raises(AssertionError, match=message):
        ex.check_run_allocator_keeps_the_hard_limits({"MyRunAllocator": broken})
    with pytest.raises(AssertionError):  # and the objective is not measured past a broken rule
        ex.check_run_allocator_few_runs_on_held_out_traces({"MyRunAllocator": broken})


class _Ex04KernelLookAlike:
    """Not a Triton kernel: `[grid](...)` writes the right answer (the reference) into `out` with PyTorch."""

    def __init__(self, case):
        self.case = case

    def __getitem__(self, grid):
        def launch(out, *args, **meta):
            out.copy_(self.case.reference())
        return launch


def test_ex04_window_check_launches_a_triton_kernel_and_no_look_alike():
    """The window check launches `paged_attention_kernel` itself (not the learner's wrapper), and only a kernel that
    `@triton.jit` made: a Python object that answers `[grid](...)` with the right numbers is refused, by name."""
    from minikv.grading.checks import ex04_kernel as ex

    case = ex.Case([13, 7], 2, 1, 16, 4, window=6)
    ns = {"paged_attention_kernel": _Ex04KernelLookAlike(case),
          "exercise_paged_attention": lambda *args, **kwargs: pytest.fail("the window check called the wrapper")}
    with pytest.raises(AssertionError, match="_Ex04KernelLookAlike, not a @triton.jit kernel"):
        ex.check_sliding_window(ns)
