"""The attack suite: hostile submissions graded through the real command line, each in its own
`python -m minikv grade` process, as a grader would run them, on a copy of the repository (so a
defence that fails damages only the copy).

Every attack starts from the honest solution of exercise 01 (the cheapest to grade), breaks its
answer (so that only the attack could earn marks) and adds the attack to the first graded cell.
Each must end with a non-zero exit status, within its time limit, without full marks, and with
a one-line reason. Then a batch: a folder mixing honest, hostile and broken submissions, graded
with --jobs 2 into a CSV gradebook, each row checked.

The attacks on the grader's files (`test_tampering_has_no_effect_on_the_next_submission`) grade
the attacker and then another submission in one batch: the attacker never gets full marks, and the
next one gets its right verdict or, if the files did change, "not graded" with the reason. They run
with Landlock and without it (``MINIKV_GRADER_LANDLOCK=0``, the fallback of a kernel without it),
where only file permissions and the digest of the grader's files stand in the way.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
SOLUTION = ROOT / "solutions" / "01_bytes.ipynb"
# A wrong answer for both functions: every check fails with it (unless the attack worked).
WRONG = ("\ndef kv_cache_bytes(config, context_len, dtype_bytes):\n    return 1\n"
         "\ndef conversations_that_fit(*args, **kwargs):\n    return -1\n")
LIMITS = ["--timeout", "60", "--memory", "3"]
# For batches whose honest submissions must finish: on a busy machine exercise 01 takes a minute.
BATCH_LIMITS = ["--timeout", "240", "--memory", "3"]

# name -> (code added to the first graded cell, extra CLI options, a fragment every FAIL line or the reason shows)
ATTACKS = {
    "patch the grader": (WRONG + (
        "import minikv.grading as g\n"
        "g.run_checks = lambda checks, ns: [g.CheckResult(c.__name__, True) for c in checks]\n"
        "g.score_line = lambda results: 'score: 6/6 (100%)'\n"), [], "returned 1"),
    "empty the checks": (WRONG + "import minikv.grading.checks.ex01_bytes as m\nm.CHECKS.clear()\n", [], "returned 1"),
    "edit the checks": (WRONG + (
        "import minikv.grading.checks.ex01_bytes as m\n"
        "m.CHECKS[:] = [lambda ns: None] * 6\n"
        "m.reference_cache_bytes = lambda *a: 1\n"), [], "returned 1"),
    "os._exit(0)": (WRONG + "import os\nos._exit(0)\n", [], "exited with status 0"),
    "sys.exit(0)": (WRONG + "import sys\nsys.exit(0)\n", [], "returned 1"),
    "raise SystemExit in graded code": (
        "\ndef kv_cache_bytes(config, context_len, dtype_bytes):\n    raise SystemExit(0)\n", [], "SystemExit"),
    "raise KeyboardInterrupt in graded code": (
        "\ndef kv_cache_bytes(config, context_len, dtype_bytes):\n    raise KeyboardInterrupt\n", [],
        "KeyboardInterrupt"),
    "print fake PASS lines and score": (WRONG + (
        "for name in ['cache bytes without a window', 'cache bytes every layer sliding']:\n"
        "    print('PASS  ' + name)\n"
        "print('score: 6/6 (100%)')\n"), [], "returned 1"),
    "an __eq__ that says yes": (
        "\nclass Yes(int):\n    def __eq__(self, other):\n        return True\n    __hash__ = int.__hash__\n"
        "def kv_cache_bytes(config, context_len, dtype_bytes):\n    return Yes(1)\n", [], "expected"),
    "infinite loop": ("\ndef kv_cache_bytes(config, context_len, dtype_bytes):\n    while True:\n        pass\n",
                      ["--timeout", "20"], "time limit"),
    "unbounded memory": (
        "\ndef kv_cache_bytes(config, context_len, dtype_bytes):\n    hoard = []\n    while True:\n"
        "        hoard.append(bytearray(50 * 2**20))\n", ["--memory", "2"], "MemoryError"),
    "delegation by import": (WRONG +  # if the import failed (a memory limit), only WRONG would be left
        "\nfrom minikv.sizing import kv_bytes_per_token, ModelShape\n"
        "def kv_cache_bytes(config, context_len, dtype_bytes):\n"
        "    shape = ModelShape.from_config(config)\n"
        "    dtype = {1: 'fp8', 2: 'float16', 4: 'float32'}[dtype_bytes]\n"
        "    per_layer = kv_bytes_per_token(shape, dtype) // shape.num_layers\n"
        "    w = config.get('sliding_window')\n"
        "    types = config.get('layer_types') or ['sliding_attention' if w else 'full_attention'] * shape.num_layers\n"
        "    kept = [min(context_len, w) if t == 'sliding_attention' and w else context_len for t in types]\n"
        "    return per_layer * sum(kept)\n",
        [], "minikv.sizing.kv_bytes_per_token"),
    "delegation hidden from a static look": (WRONG +
        "\nimport minikv.sizing as s\n"
        "per_token = getattr(s, 'kv_bytes_' + 'per_token')\n"
        "def kv_cache_bytes(config, context_len, dtype_bytes):\n"
        "    shape = s.ModelShape.from_config(config)\n"
        "    dtype = {1: 'fp8', 2: 'float16', 4: 'float32'}[dtype_bytes]\n"
        "    per_layer = per_token(shape, dtype) // shape.num_layers\n"
        "    w = config.get('sliding_window')\n"
        "    types = config.get('layer_types') or ['sliding_attention' if w else 'full_attention'] * shape.num_layers\n"
        "    kept = [min(context_len, w) if t == 'sliding_attention' and w else context_len for t in types]\n"
        "    return per_layer * sum(kept)\n",
        [], "calls minikv's minikv.sizing.kv_bytes_per_token"),
    # No defence may depend on a limit being hit: with a budget of a quarter GB the verdict is the same.
    "delegation hidden, a small memory budget": None,
    "syntax error": ("\ndef kv_cache_bytes(config, context_len dtype_bytes):\n    return 1\n", [], "SyntaxError"),
}


_hidden = ATTACKS["delegation hidden from a static look"]
ATTACKS["delegation hidden, a small memory budget"] = (_hidden[0], ["--memory", "0.25"], _hidden[2])


def attack_notebook(code: str, folder: Path, name: str) -> Path:
    """Exercise 01's solution with `code` appended to the cell that defines kv_cache_bytes."""
    nb = nbformat.read(SOLUTION, as_version=4)
    cell = next(c for c in nb.cells if c.cell_type == "code" and "def kv_cache_bytes" in c.source)
    if "syntax" in name:
        cell.source = code  # a cell that does not parse replaces the answer
    else:
        cell.source += "\n" + code
    path = folder / (name.replace(" ", "_").replace("(", "").replace(")", "").replace("'", "") + ".ipynb")
    nbformat.write(nb, path)
    return path


def copy_repo(dest: Path) -> Path:
    """What grading needs of the repository (the package, the kernels, exercise 01), copied to `dest`."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("minikv", "kernels"):
        shutil.copytree(ROOT / name, dest / name, ignore=ignore)
    for name in ("solutions", "exercises"):
        (dest / name).mkdir()
        shutil.copy(ROOT / name / "01_bytes.ipynb", dest / name)
    return dest


def grade_cli(*args, repo: Path = ROOT, env: dict | None = None, timeout: float = 300):
    """`python -m minikv grade ARGS` with `repo`'s minikv: (the finished process, seconds)."""
    env = dict(os.environ, **(env or {}))
    env["PYTHONPATH"] = str(repo) + os.pathsep + env.get("PYTHONPATH", "")
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "minikv", "grade", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=repo, env=env)
    return done, time.monotonic() - start


@pytest.fixture(scope="module")
def attack_runs(request, tmp_path_factory):
    """Every selected attack graded, two CLI processes at a time (the machine may have two cores)."""
    folder = tmp_path_factory.mktemp("attacks")
    repo = copy_repo(tmp_path_factory.mktemp("repo"))
    selected = [item.callspec.params["name"] for item in request.session.items
                if getattr(item, "originalname", "") == "test_attack_is_refused" and hasattr(item, "callspec")]

    def run(name):
        code, options, _ = ATTACKS[name]
        path = attack_notebook(code, folder, name)
        return name, grade_cli(path, *LIMITS, *options, repo=repo)

    with ThreadPoolExecutor(2) as pool:
        return dict(pool.map(run, selected or ATTACKS))


@pytest.mark.parametrize("name", list(ATTACKS))
def test_attack_is_refused(name, attack_runs):
    (done, seconds), (_, options, reason) = attack_runs[name], ATTACKS[name]
    out = done.stdout
    assert done.returncode != 0, f"{name}: exit status 0\n{out}"
    assert "(100%)" not in out.splitlines()[-1], out
    assert "score: 6/6" not in out.splitlines()[-1], out
    verdicts = [line for line in out.splitlines() if line.startswith(("PASS", "FAIL"))]
    assert len(verdicts) == 6, out  # one verdict line per check, none forged
    # (with the honest conversations_that_fit, "weights that do not fit" may pass: its answer is 0)
    assert sum(line.startswith("FAIL") for line in verdicts) >= 5, out
    # verdicts wrap at words (88 columns): compare with the lines joined
    assert reason in " ".join(out.split()), f"{name}: expected {reason!r} in the verdicts\n{out}\n{done.stderr[-2000:]}"
    assert "Traceback" not in out + done.stderr, out + done.stderr
    limit = float(options[options.index("--timeout") + 1]) if "--timeout" in options else 60
    # The limit stopped it: start-up (a CUDA torch imports slowly) and the checks come on top, and a busy
    # 2-core machine stretches both; a submission that ran on unchecked would take the call's 300 s.
    assert seconds < limit + 150, f"{name} took {seconds:.0f} s"
    # What the grader said, for a person reading `pytest -rP` (the closing notes quote it per mode).
    said = next((line for line in verdicts if line.startswith("FAIL") and reason.split()[0] in line), verdicts[0])
    print(f"{name}: {out.splitlines()[-1]}; {said[:150]} ({seconds:.0f} s)")


def test_not_an_exercise_is_refused(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells.append(nbformat.v4.new_code_cell("print('PASS  everything')"))
    path = tmp_path / "lecture.ipynb"
    nbformat.write(nb, path)
    done, _ = grade_cli(path, *LIMITS, repo=copy_repo(tmp_path / "repo"))
    assert done.returncode != 0
    assert "not gradable" in done.stdout and "not a graded exercise" in done.stdout, done.stdout
    assert "score: 0/0 (0%)" in done.stdout


def test_a_batch_of_honest_hostile_and_broken_submissions(tmp_path):
    """One folder, one command: each row right, and one broken submission does not stop the batch."""
    folder = tmp_path / "class"
    folder.mkdir()
    honest = folder / "alice.ipynb"
    honest.write_text(SOLUTION.read_text())
    untouched = folder / "bob.ipynb"
    untouched.write_text((ROOT / "exercises" / "01_bytes.ipynb").read_text())
    attack_notebook(ATTACKS["os._exit(0)"][0], folder, "carol exits")
    attack_notebook(ATTACKS["syntax error"][0], folder, "dave syntax")
    (folder / "erin.ipynb").write_text("this is not a notebook")
    book = tmp_path / "book.csv"
    done, _ = grade_cli(folder, "--jobs", "2", "--csv", book, "--quiet", *BATCH_LIMITS,
                        repo=copy_repo(tmp_path / "repo"))
    assert done.returncode == 1, done.stdout + done.stderr
    rows = {Path(r["path"]).stem: r for r in csv.DictReader(book.open())}
    assert set(rows) == {"alice", "bob", "carol_exits", "dave_syntax", "erin"}
    assert rows["alice"]["score"] == "6/6" and rows["alice"]["reason"] == ""
    assert all(v == "PASS" for k, v in rows["alice"].items() if k.startswith("01: "))
    assert rows["bob"]["score"] == "0/6" and "not implemented yet" in rows["bob"]["reason"]
    assert rows["carol_exits"]["score"] == "0/6" and "exited with status 0" in rows["carol_exits"]["reason"]
    assert rows["dave_syntax"]["score"] != "6/6" and "SyntaxError" in rows["dave_syntax"]["reason"]
    assert rows["erin"]["score"] == "0/0" and "not gradable" in rows["erin"]["reason"]
    assert "1/5 submissions with full marks" in done.stdout


def test_json_gradebook(tmp_path):
    done, _ = grade_cli(SOLUTION, "--json", *BATCH_LIMITS, repo=copy_repo(tmp_path / "repo"))
    assert done.returncode == 0, done.stdout + done.stderr
    (row,) = json.loads(done.stdout)
    assert row["score"] == "6/6" and row["percent"] == 100 and set(row["checks"].values()) == {"PASS"}


# ---- attacks on the grader's files and on the submissions after it ---------------------------------

# The repository as the submission finds it: through the installed package.
FIND = "import os, sys, minikv\nREPO = os.path.dirname(os.path.dirname(minikv.__file__))\n"
CHECK_FILE = "minikv/grading/checks/ex01_bytes.py"
PASS_ALL = "\nCHECKS[:] = [lambda ns: None] * 6\n"  # appended to the check module: every check passes
DAEMON = "minikv-attack-daemon"  # in the command line of the process the last attack leaves behind
# It leaves the process group (a double fork, a new session), waits for the submission's process to
# end (after the grader's digest), then appends PASS_ALL to the check module: the next submission's.
DAEMON_CODE = f"""
import os, sys, time
if os.fork():
    os._exit(0)
os.setsid()
while True:
    try:
        os.kill(int(sys.argv[2]), 0)
    except OSError:
        break
    time.sleep(0.1)
time.sleep(1)
for _ in range(100):
    try:
        with open(sys.argv[1], 'a') as f:
            f.write({PASS_ALL!r})
        break
    except OSError:
        time.sleep(0.2)
"""

TAMPERING = {  # name -> (code added to the attacker's graded cell, the submission graded next)
    "append to a check module on disk": (WRONG + FIND + (
        "try:\n"
        f"    with open(os.path.join(REPO, {CHECK_FILE!r}), 'a') as f:\n"
        f"        f.write({PASS_ALL!r})\n"
        "except OSError as err:\n"
        "    print('refused:', err)\n"), "exercise"),
    "rewrite a minikv module the checks import": (WRONG + FIND + (
        "try:\n"  # the reference then says 1 byte per token: the honest solution after it would fail
        "    with open(os.path.join(REPO, 'minikv', 'sizing.py'), 'a') as f:\n"
        "        f.write('\\ndef kv_bytes_per_token(*args, **kwargs):\\n    return 1\\n')\n"
        "except OSError as err:\n"
        "    print('refused:', err)\n"), "solution"),
    "write into the gradebook's output path": (WRONG + FIND + (
        "try:\n"
        "    with open(os.path.join(REPO, 'book.csv'), 'w') as f:\n"
        "        f.write('path,exercise,score\\nattacker,01,6/6\\n')\n"
        "except OSError as err:\n"
        "    print('refused:', err)\n"), "solution"),
    "leave a process behind that rewrites a check module": (WRONG + FIND + (
        "import subprocess\n"
        f"subprocess.Popen([sys.executable, '-c', {DAEMON_CODE!r}, os.path.join(REPO, {CHECK_FILE!r}), "
        f"str(os.getpid()), {DAEMON!r}], start_new_session=True)\n"), "exercise"),
}


def _untouched_exercise(folder: Path) -> Path:
    path = folder / "b_next.ipynb"
    path.write_text((ROOT / "exercises" / "01_bytes.ipynb").read_text())
    return path


def _daemons() -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if DAEMON.encode() in f.read():
                    pids.append(int(entry))
        except (OSError, ValueError):
            pass
    return pids


MODES = {"landlock": {}, "no landlock": {"MINIKV_GRADER_LANDLOCK": "0"}}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", list(TAMPERING))
def test_tampering_has_no_effect_on_the_next_submission(name, mode, tmp_path):
    code, following = TAMPERING[name]
    repo = copy_repo(tmp_path / "repo")
    pristine = {p: p.read_bytes() for p in (repo / "minikv").rglob("*.py")}
    folder = tmp_path / "class"
    folder.mkdir()
    attack_notebook(code, folder, "a attacker")
    nxt = _untouched_exercise(folder) if following == "exercise" else folder / "b_next.ipynb"
    if following == "solution":
        nxt.write_text(SOLUTION.read_text())
    done, _ = grade_cli(folder, "--csv", "book.csv", "--quiet", *BATCH_LIMITS, repo=repo, env=MODES[mode])
    time.sleep(1.5)  # a process left behind would have written by now
    assert not _daemons(), "a process the submission started is still running"
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert "Traceback" not in out, out
    rows = {Path(r["path"]).stem: r for r in csv.DictReader((repo / "book.csv").open())}
    assert set(rows) == {"a_attacker", "b_next"}, rows
    assert rows["a_attacker"]["score"] != "6/6", out
    changed = sorted(str(p.relative_to(repo)) for p, data in pristine.items() if p.read_bytes() != data)
    if changed:  # the defence that stood: the digest; the attacker has no score, the next is not graded
        assert "grader's files changed" in rows["a_attacker"]["reason"], out
        assert rows["a_attacker"]["score"] == "0/0", out
        assert rows["b_next"]["reason"].startswith("not graded") and "a_attacker" in rows["b_next"]["reason"], out
        assert all(c in rows["a_attacker"]["reason"] for c in changed), (changed, out)
    elif following == "exercise":
        assert rows["b_next"]["score"] == "0/6" and "not implemented yet" in rows["b_next"]["reason"], out
    else:
        assert rows["b_next"]["score"] == "6/6" and rows["b_next"]["reason"] == "", out
    if mode == "landlock" and _has_landlock(done.stdout + out):
        assert not changed, f"Landlock let the submission write {changed}"
    # Which defence held, for a person reading `pytest -rP` (the closing notes quote it per mode).
    header = next((line for line in out.splitlines() if "isolation" in line), "")
    print(f"{name} [{mode}]: " + (f"files changed {changed}: the digest stopped the batch" if changed else
                                  f"no grader file changed; the next notebook got {rows['b_next']['score']}")
          + f"; attacker {rows['a_attacker']['score']}; {header.strip()}")


def _has_landlock(out: str) -> bool:
    return "Landlock ABI" in out


def test_a_check_module_cannot_be_read(tmp_path):
    """The answer is right only if the submission could read the check module's source."""
    code = FIND + (
        "try:\n"
        f"    SOURCE = open(os.path.join(REPO, {CHECK_FILE!r})).read()\n"
        "except OSError as err:\n"
        "    SOURCE = ''\n"
        "    print('refused:', err)\n"
        "honest = kv_cache_bytes\n"
        "def kv_cache_bytes(config, context_len, dtype_bytes):\n"
        "    return honest(config, context_len, dtype_bytes) if 'def reference_cache_bytes' in SOURCE else 1\n")
    path = attack_notebook(code, tmp_path, "reader")
    done, _ = grade_cli(path, *LIMITS, repo=copy_repo(tmp_path / "repo"))
    if "the checks readable" in done.stdout:  # the header of a grader without Landlock
        pytest.skip("this grader has no Landlock: a submission can read the checks (INSTRUCTORS.md)")
    assert done.returncode != 0 and "(100%)" not in done.stdout, done.stdout
    assert "Landlock" in done.stdout.splitlines()[0], done.stdout  # the header says what kept it out


def test_a_batch_of_honest_tampering_honest(tmp_path):
    """Without Landlock (file permissions and the digest only): the right rows, or a stop after the tamperer."""
    repo = copy_repo(tmp_path / "repo")
    folder = tmp_path / "class"
    folder.mkdir()
    (folder / "a_honest.ipynb").write_text(SOLUTION.read_text())
    attack_notebook(TAMPERING["append to a check module on disk"][0], folder, "b tamperer")
    (folder / "c_honest.ipynb").write_text(SOLUTION.read_text())
    done, _ = grade_cli(folder, "--csv", "book.csv", "--quiet", *BATCH_LIMITS, repo=repo, env=MODES["no landlock"])
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    rows = {Path(r["path"]).stem: r for r in csv.DictReader((repo / "book.csv").open())}
    assert rows["a_honest"]["score"] == "6/6" and rows["a_honest"]["reason"] == "", out
    assert rows["b_tamperer"]["score"] != "6/6", out
    if "grader's files changed" in rows["b_tamperer"]["reason"]:
        assert rows["c_honest"]["reason"].startswith("not graded: the grader's files changed while grading"), out
        assert "b_tamperer" in rows["c_honest"]["reason"] and "restore them" in rows["c_honest"]["reason"], out
    else:
        assert rows["c_honest"]["score"] == "6/6", out


# ---- copying instead of designing -------------------------------------------------------------------------
# What a learner could paste instead of writing: minikv's own module, the lecture's code. Each is graded like
# any submission, all in one batch (the slow exercises grade side by side); none may score 100%.

PASTED_PREFIX = (ROOT / "minikv" / "prefix.py").read_text()
PASTES = {
    # minikv/prefix.py as `inspect.getsource` prints it, plus an all-or-nothing admit around it.
    "05 minikv's module pasted": ("05_prefix_sharing.ipynb", {
        "def chain_hash": PASTED_PREFIX + (
            "\n\ndef chain_hash(parent_hash, tokens, salt=None):\n"
            "    return block_hash(parent_hash, tokens, salt)\n"),
        "class MyBlockManager": (
            "import copy\n\n\nclass MyBlockManager:\n"
            "    def __init__(self, num_blocks, block_size):\n"
            "        self.bm, self.block_size = BlockManager(num_blocks, block_size), block_size\n\n"
            "    @property\n    def num_free_blocks(self):\n        return self.bm.num_free_blocks\n\n"
            "    def admit(self, seq_id, prompt, salt=None):\n"
            "        if seq_id in self.bm.tables:\n"
            "            raise ValueError(f'sequence {seq_id!r} is already admitted')\n"
            "        trial = copy.deepcopy(self.bm)\n"
            "        hit = trial.open(seq_id, prompt, extra_key=salt)\n"
            "        trial.append(seq_id, prompt[hit:])\n"
            "        self.bm = trial\n        return hit\n\n"
            "    def append(self, seq_id, token):\n        return self.bm.append(seq_id, [token])[0]\n\n"
            "    def fork(self, parent_id, child_id):\n        self.bm.fork(parent_id, child_id)\n\n"
            "    def free(self, seq_id):\n        self.bm.free(seq_id)\n\n"
            "    def take_copies(self):\n        return self.bm.take_copies()\n\n"
            "    def block_table(self, seq_id):\n        return self.bm.block_table(seq_id)\n\n"
            "    def num_tokens(self, seq_id):\n        return self.bm.num_tokens(seq_id)\n\n"
            "    def refcount(self, block):\n        return self.bm.allocator.refcount(block)\n"),
    }),
    # The lecture's policy (minikv's default Scheduler.can_admit and choose_victim), as plain functions.
    "06 the lecture's policy pasted": ("06_continuous_batching.ipynb", {
        "def my_admit": (
            "def my_admit(chunk_tokens, budget_left, blocks_needed, free_blocks, running_tokens, block_size):\n"
            "    watermark = 1 if running_tokens else 0\n"
            "    return chunk_tokens <= budget_left and blocks_needed <= free_blocks - watermark\n"),
        "def my_victim": (
            "def my_victim(needy, candidates):\n"
            "    return candidates[-1][0] if candidates else needy\n"),
    }),
    # The old stub's hint ("keep one free block per running sequence, plus a spare"), with the lecture's victim: it
    # passes on short requests at once, where admission decides, and misses where a long prompt is the last admitted.
    "06 the old hint with the lecture's victim": ("06_continuous_batching.ipynb", {
        "def my_admit": (
            "def my_admit(chunk_tokens, budget_left, blocks_needed, free_blocks, running_tokens, block_size):\n"
            "    headroom = len(running_tokens) + 1 if running_tokens else 0\n"
            "    return chunk_tokens <= budget_left and blocks_needed + headroom <= free_blocks\n"),
        "def my_victim": (
            "def my_victim(needy, candidates):\n"
            "    return candidates[-1][0] if candidates else needy\n"),
    }),
    # Today's hints and design questions taken literally: "every running sequence grows by a block every block_size
    # tokens ... how much headroom is worth keeping, and for whom?" (a free block for each running sequence) and
    # "who gave way, and what did the needy sequence get?" (give it the most: the candidate holding the most blocks).
    "06 the hint transcribed": ("06_continuous_batching.ipynb", {
        "def my_admit": (
            "def my_admit(chunk_tokens, budget_left, blocks_needed, free_blocks, running_tokens, block_size):\n"
            "    return chunk_tokens <= budget_left and blocks_needed + len(running_tokens) <= free_blocks\n"),
        "def my_victim": (
            "def my_victim(needy, candidates):\n"
            "    return max(candidates, key=lambda c: c[1])[0] if candidates else needy\n"),
    }),
    # The lecture's baseline (notebook 07 serves minikv.server.admission.BoundedFIFO), copied.
    "07 the lecture's policy pasted": ("07_landlord.ipynb", {
        "class MyPolicy": (
            "class MyPolicy:\n"
            "    def __init__(self, max_waiting=BASELINE_MAX_WAITING):\n"
            "        self.max_waiting = max_waiting\n\n"
            "    def decide(self, request, state):\n"
            "        if request['held'] or state['queued'] < self.max_waiting:\n"
            "            return 'admit'\n"
            "        return 'refuse', f\"{state['queued']} waiting\"\n"),
    }),
    # What notebook 07 prints and runs: `minikv serve ... --max-waiting 64`, i.e. the server's BoundedFIFO(64).
    "07 the lecture's max_waiting 64 transcribed": ("07_landlord.ipynb", {
        "class MyPolicy": (
            "from minikv.server.admission import BoundedFIFO\n\n\n"
            "class MyPolicy(BoundedFIFO):\n"
            "    def __init__(self):\n"
            "        super().__init__(max_waiting=64)\n"),
    }),
    # The laziest answer: let the engine's scheduler sort it out.
    "07 return admit": ("07_landlord.ipynb", {
        "class MyPolicy": (
            "class MyPolicy:\n"
            "    def decide(self, request, state):\n"
            "        return 'admit'\n"),
    }),
}

# Exercise 02 (the bookkeeping has one right answer each; the design, MySlabs, decides 100%) and exercise 01.
# minikv/sim/policies.py with the names the static look knows renamed (a paste that keeps them is flagged at once).
PASTED_POLICIES = (ROOT / "minikv" / "sim" / "policies.py").read_text()
for _old, _new in (("ContiguousPow2", "GrowingSlabs"), ("ContiguousOracle", "ExactSlabs"),
                   ("ContiguousMax", "WorstCaseSlabs"), ("_Slabs", "SlabsBase"), ("external_tokens", "stranded")):
    PASTED_POLICIES = PASTED_POLICIES.replace(_old, _new)


def _solution_cell(notebook: str, start: str) -> str:
    """A graded cell of the solution, as a learner who solved that part would have it."""
    nb = nbformat.read(ROOT / "solutions" / notebook, as_version=4)
    return next(c.source for c in nb.cells if c.cell_type == "code" and c.source.startswith(start))


_BOOKKEEPING_02 = {start: _solution_cell("02_contiguous.ipynb", start)
                   for start in ("def first_fit", "def slab_waste", "def external_fragmentation")}
PASTES.update({
    # minikv/sim/policies.py as `inspect.getsource` prints it (first_fit, slab_waste, external_tokens, the slab
    # policies; renamed), external_fragmentation as the simulator's books compute it, and the best shipped policy
    # that does not know the future (ContiguousPow2) behind MySlabs' calls: the bookkeeping passes, the design is
    # 1.00x. (The module goes into the last graded cell: paste_notebook finds each cell by a name the module has.)
    "02 minikv's module pasted": ("02_contiguous.ipynb", {
        "def first_fit": "# first_fit: pasted below\n",
        "def slab_waste": "# slab_waste: pasted below\n",
        "def external_fragmentation": (
            "def external_fragmentation(slabs, budget, request_size):\n"
            "    policy = ExactSlabs()\n"
            "    policy.reset(budget, max_seq_len=budget)\n"
            "    for i, slab in enumerate(slabs):\n"
            "        policy.slab[i] = slab\n"
            "    policy.used = sum(s for _, s in slabs)\n"
            "    head = Seq(TraceRequest(len(slabs), 0, request_size, 0), request_size)\n"
            "    return stranded(policy, None if policy.admit(head) else head)\n"),
        "class MySlabs": PASTED_POLICIES + (
            "\n\nfrom types import SimpleNamespace\n\n\n"
            "class MySlabs:\n"
            "    def __init__(self, budget, max_seq_len):\n"
            "        self.pow2 = GrowingSlabs()\n"
            "        self.pow2.reset(budget, max_seq_len)\n"
            "        self.slabs = self.pow2.slab\n\n"
            "    def admit(self, seq_id, live):\n"
            "        return self.pow2.admit(SimpleNamespace(id=seq_id, live=live))\n\n"
            "    def grow(self, seq_id, live):\n"
            "        return self.pow2.grow(SimpleNamespace(id=seq_id, live=live))\n\n"
            "    def release(self, seq_id):\n"
            "        self.pow2.release(SimpleNamespace(id=seq_id))\n"),
    }),
    # The lecture's slab (notebook 02, section 1: reserve max_seq_len for every request at admission, placed first
    # fit) as the design, with the bookkeeping solved.
    "02 the lecture's policy pasted": ("02_contiguous.ipynb", {
        **_BOOKKEEPING_02,
        "class MySlabs": (
            "class MySlabs:\n"
            "    def __init__(self, budget, max_seq_len):\n"
            "        self.budget, self.max_seq_len = budget, max_seq_len\n"
            "        self.slabs = {}\n\n"
            "    def admit(self, seq_id, live):\n"
            "        offset = first_fit(list(self.slabs.values()), self.max_seq_len, self.budget)\n"
            "        if offset is None:\n"
            "            return False\n"
            "        self.slabs[seq_id] = (offset, self.max_seq_len)\n"
            "        return True\n\n"
            "    def grow(self, seq_id, live):\n"
            "        return live + 1 <= self.slabs[seq_id][1]\n\n"
            "    def release(self, seq_id):\n"
            "        del self.slabs[seq_id]\n"),
    }),
    # Every hint of the exercise taken literally: the bookkeeping's hints give its answers; the design's hints give
    # the API: "a slab of at least `live` tokens (your first_fit helps)", "at least live + 1 tokens (in place, or
    # moved)", "take its slab out of `slabs`", and nothing else kept.
    "02 the hint transcribed": ("02_contiguous.ipynb", {
        "def first_fit": (
            "def first_fit(slabs, size, budget):\n"
            "    end = 0\n"
            "    for offset, length in sorted(slabs):\n"
            "        if offset - end >= size:\n"
            "            return end\n"
            "        end = offset + length\n"
            "    return end if budget - end >= size else None\n"),
        "def slab_waste": (
            "def slab_waste(size, live, final):\n"
            "    filled = min(final, size)\n"
            "    return live, filled - live, size - filled\n"),
        "def external_fragmentation": (
            "def external_fragmentation(slabs, budget, request_size):\n"
            "    free = budget - sum(size for _, size in slabs)\n"
            "    if request_size <= free and first_fit(slabs, request_size, budget) is None:\n"
            "        return free\n"
            "    return 0\n"),
        "class MySlabs": (
            "class MySlabs:\n"
            "    def __init__(self, budget, max_seq_len):\n"
            "        self.budget, self.max_seq_len = budget, max_seq_len\n"
            "        self.slabs = {}\n\n"
            "    def admit(self, seq_id, live):\n"
            "        offset = first_fit(list(self.slabs.values()), live, self.budget)\n"
            "        if offset is None:\n"
            "            return False\n"
            "        self.slabs[seq_id] = (offset, live)\n"
            "        return True\n\n"
            "    def grow(self, seq_id, live):\n"
            "        offset, size = self.slabs.pop(seq_id)\n"
            "        others = list(self.slabs.values())\n"
            "        room = min([o for o, _ in others if o > offset], default=self.budget) - offset\n"
            "        if live + 1 <= room:\n"
            "            self.slabs[seq_id] = (offset, live + 1)\n"
            "            return True\n"
            "        moved = first_fit(others, live + 1, self.budget)\n"
            "        if moved is not None:\n"
            "            self.slabs[seq_id] = (moved, live + 1)\n"
            "            return True\n"
            "        self.slabs[seq_id] = (offset, size)\n"
            "        return False\n\n"
            "    def release(self, seq_id):\n"
            "        del self.slabs[seq_id]\n"),
    }),
    # Exercise 01's hints taken literally: "first the bytes one token costs in ONE layer; then, layer by layer, how
    # many tokens that layer keeps" and "the budget is what the reserve and the weights leave of the card; 0 if the
    # weights alone do not fit", with the config's fields read as notebook 01 names them.
    "01 the hint transcribed": ("01_bytes.ipynb", {
        "def kv_cache_bytes": (
            "def kv_cache_bytes(config, context_len, dtype_bytes):\n"
            "    head_dim = config['hidden_size'] // config['num_attention_heads']\n"
            "    one_layer = 2 * config['num_key_value_heads'] * head_dim * dtype_bytes\n"
            "    window = config.get('sliding_window')\n"
            "    kinds = config.get('layer_types', ['sliding_attention' if window else 'full_attention']\n"
            "                       * config['num_hidden_layers'])\n"
            "    total = 0\n"
            "    for kind in kinds:\n"
            "        total += one_layer * (min(context_len, window) if kind == 'sliding_attention' else context_len)\n"
            "    return total\n"),
        "def conversations_that_fit": (
            "def conversations_that_fit(config, num_params, gpu_memory_bytes, context_len, dtype_bytes=2,\n"
            "                           reserve_fraction=0.10):\n"
            "    budget = gpu_memory_bytes * (1 - reserve_fraction) - num_params * dtype_bytes\n"
            "    if budget <= 0:\n"
            "        return 0\n"
            "    return int(budget // kv_cache_bytes(config, context_len, dtype_bytes))\n"),
    }),
})


def paste_notebook(name: str, folder: Path) -> Path:
    """The untouched exercise with each graded cell (the first code cell that starts with the key, else the first
    that holds it) replaced by the paste."""
    notebook, cells = ALL_PASTES[name]
    nb = nbformat.read(ROOT / "exercises" / notebook, as_version=4)
    code_cells = [c for c in nb.cells if c.cell_type == "code"]
    for start, code in cells.items():
        cell = next((c for c in code_cells if c.source.startswith(start)), None) or next(
            c for c in code_cells if start in c.source)
        cell.source = code
    path = folder / (name.split()[0] + "_" + "_".join(name.split()[1:]).replace("'", "") + ".ipynb")
    nbformat.write(nb, path)
    return path


@pytest.fixture(scope="module")
def paste_runs(tmp_path_factory):
    """Every paste of this module (PASTES, then exercises 03 and 04's below) graded in one batch."""
    folder = tmp_path_factory.mktemp("pastes")
    paths = {name: paste_notebook(name, folder) for name in ALL_PASTES}
    done, _ = grade_cli(folder, "--jobs", "2", "--json", "--quiet", timeout=1500)
    rows = {Path(r["path"]).name: r for r in json.loads(done.stdout)} if done.stdout.strip() else {}
    return done, {name: rows.get(path.name) for name, path in paths.items()}


def below_full_marks(name: str, paste_runs) -> dict:
    """The paste's gradebook row, once it is shown graded (not refused) and below 100% (its score printed)."""
    done, rows = paste_runs
    row = rows[name]
    assert row is not None, done.stdout + done.stderr[-3000:]
    assert row["results"] and not row["tampered"], row
    print(f"{name}: {row['score']}; {row['reason'][:300]}")
    assert row["passed"] < row["total"], f"{name} scored {row['score']}: {row['checks']}"
    return row


@pytest.mark.design
@pytest.mark.parametrize("name", list(PASTES))
def test_a_paste_does_not_score_full_marks(name, paste_runs):
    below_full_marks(name, paste_runs)


@pytest.mark.design
def test_07_return_admit_breaks_a_hard_limit_and_scores_nothing(paste_runs):
    """The hard limits are a gate, not half the score: admitting everything floods the queue on the burst."""
    row = paste_runs[1]["07 return admit"]
    assert row is not None and row["passed"] == 0, row
    assert "not bounded back-pressure" in row["reason"], row


# ---- exercises 03 and 04: minikv's modules, the lecture's code and the hints, pasted --------------------------
# Exercise 03's first eight checks ask for variants of minikv's blocks and attention, so a paste with small adapters
# passes them; its design part (MyRunAllocator: few contiguous runs per sequence, against minikv's free list on
# traces drawn at grading time) is what none of these pastes meets. Exercise 04: the course's kernel pasted.

def _source_between(path: str, start: str, stop: str) -> str:
    text = (ROOT / path).read_text()
    i = text.index(start)
    return text[i:text.index(stop, i)]


def _renamed(source: str, names: dict[str, str]) -> str:
    import re

    for old, new in names.items():
        source = re.sub(rf"\b{old}\b", new, source)
    return source


# minikv/blocks.py and attention.py's reference, pasted with every class and function renamed, as a copier would.
RENAMES = {"BlockAllocator": "KVPool", "BlockTable": "KVTable", "gather_kv": "gather_seq",
           "paged_attention_ref": "attend"}
PASTED_BLOCKS = _renamed((ROOT / "minikv" / "blocks.py").read_text(), RENAMES)
PASTED_ATTENTION = _renamed("from minikv.attention import check_paged_attention_inputs\nfrom minikv.blocks import "
                            "blocks_for\n\n\n" + _source_between("minikv/attention.py", "def gather_kv(",
                                                                  "class PagedInputs"), RENAMES)
# minikv's table plus the sliding window (what the checks' reference, WindowTable, adds), on the pasted table.
WINDOW_ADAPTER = (
    "class MyBlockTable(KVTable):\n"
    "    def __init__(self, block_size, allocator, window=None):\n"
    "        super().__init__(block_size, allocator)\n"
    "        self.window = window\n\n"
    "    def append_tokens(self, n):\n"
    "        slots = super().append_tokens(n)\n"
    "        if self.window is not None:\n"
    "            for i in range(max(0, (self.num_tokens - self.window) // self.block_size)):\n"
    "                if self.blocks[i] != -1:\n"
    "                    self.allocator.free(self.blocks[i])\n"
    "                    self.blocks[i] = -1\n"
    "        return slots\n\n"
    "    def slots_for(self, positions):\n"
    "        positions = list(positions)\n"
    "        for t in positions:\n"
    "            if 0 <= t < self.num_tokens and self.blocks[t // self.block_size] == -1:\n"
    "                raise IndexError(f'token {t} fell out of the window')\n"
    "        return super().slots_for(positions)\n\n"
    "    def free(self):\n"
    "        for block in self.blocks:\n"
    "            if block != -1:\n"
    "                self.allocator.free(block)\n"
    "        self.blocks, self.num_tokens = [], 0\n")
HEAD_MAJOR_ADAPTER = (
    "\n\ndef my_paged_attention(query, key_cache, value_cache, block_tables, seq_lens, scale):\n"
    "    return attend(query, key_cache.transpose(1, 2), value_cache.transpose(1, 2), block_tables, seq_lens, scale)\n")
# The lecture's free list as a per-sequence allocator (the objective's baseline, written out).
FREE_LIST_RUNS = (
    "class MyRunAllocator:\n"
    "    def __init__(self, num_blocks):\n"
    "        self.pool, self.tables = {pool}(num_blocks), {{}}\n\n"
    "    @property\n    def num_free(self):\n        return self.pool.num_free\n\n"
    "    def allocate(self, seq_id, n):\n"
    "        if n > self.pool.num_free:\n"
    "            raise OutOfBlocks(n, self.pool.num_free)\n"
    "        blocks = [self.pool.allocate() for _ in range(n)]\n"
    "        self.tables.setdefault(seq_id, []).extend(blocks)\n"
    "        return blocks\n\n"
    "    def free(self, seq_id):\n"
    "        for block in self.tables.pop(seq_id, []):\n"
    "            self.pool.free(block)\n")


def _lecture_03() -> dict[str, str]:
    """What notebook 03 prints (BlockAllocator.allocate and free, BlockTable.blocks_needed, append_tokens and
    slots_for, gather_kv and paged_attention_ref), pasted into the exercise's classes with the least glue."""
    import inspect

    from minikv import attention, blocks

    def method(fn) -> str:
        return "\n" + inspect.getsource(fn)

    allocator = ("from collections import deque\n\nfrom minikv.blocks import BlockError\n\n\n"
                 "class MyBlockAllocator:\n"
                 "    def __init__(self, num_blocks):\n"
                 "        self.num_blocks = num_blocks\n"
                 "        self._free = deque(range(num_blocks))\n"
                 "        self._refcount = [0] * num_blocks\n"
                 "        self._kept = set()\n\n"
                 "    @property\n    def num_free(self):\n        return len(self._free)\n\n"
                 "    @property\n    def num_used(self):\n        return self.num_blocks - len(self._free)\n\n"
                 "    def _check(self, block):\n"
                 "        if not 0 <= block < self.num_blocks:\n"
                 "            raise BlockError(f'block {block} does not exist')\n"
                 "        return block\n\n"
                 "    def incref(self, block):\n"
                 "        if self._refcount[self._check(block)] == 0:\n"
                 "            raise BlockError(f'block {block} is free')\n"
                 "        self._refcount[block] += 1\n\n"
                 "    def refcount(self, block):\n        return self._refcount[self._check(block)]\n"
                 + method(blocks.BlockAllocator.allocate) + method(blocks.BlockAllocator.free))
    table = ("from collections.abc import Iterable\n\nfrom minikv.blocks import blocks_for\n\n\n"
             "class KVTable:\n"
             "    def __init__(self, block_size, allocator):\n"
             "        self.block_size, self.allocator, self.blocks, self.num_tokens = block_size, allocator, [], 0\n\n"
             "    def __len__(self):\n        return len(self.blocks)\n"
             + method(blocks.BlockTable.blocks_needed) + method(blocks.BlockTable.append_tokens)
             + method(blocks.BlockTable.slots_for) + "\n\n" + WINDOW_ADAPTER)
    attend = _renamed("from minikv.attention import check_paged_attention_inputs\n\n\n"
                      + inspect.getsource(attention.gather_kv) + "\n\n"
                      + inspect.getsource(attention.paged_attention_ref), RENAMES) + HEAD_MAJOR_ADAPTER
    return {"class MyBlockAllocator": allocator, "class MyBlockTable": table, "def my_paged_attention": attend,
            "class MyRunAllocator": FREE_LIST_RUNS.format(pool="MyBlockAllocator")}


# The course's Triton kernel (kernels/paged_attention.py, which notebook 04 prints whole, part by part), renamed into
# the exercise's kernel, and the course's launch (num_splits=1): it has no sliding window.
PASTED_KERNEL = ("import triton.language as tl  # noqa\n\n" + _renamed(
    _source_between("kernels/paged_attention.py", "@triton.jit\ndef _paged_attention_kernel(",
                    "@triton.jit\ndef _combine_splits_kernel("), {"_paged_attention_kernel": "paged_attention_kernel"})
    + _source_between("kernels/paged_attention.py", "def launch_meta(", "def combine_warps("))
KERNEL_LAUNCH = (
    "    num_seqs, num_heads, head_dim = query.shape\n"
    "    _, block_size, num_kv_heads, _ = key_cache.shape\n"
    "    out = torch.empty_like(query)\n"
    "    meta = launch_meta(num_heads // num_kv_heads, head_dim, block_size, query.dtype == torch.float32)\n"
    "    paged_attention_kernel[(num_seqs, num_kv_heads * meta['HEAD_TILES'], 1)](\n"
    "        out, out, out, out, query, key_cache, value_cache, block_tables, seq_lens,\n"
    "        scale * LOG2E, 1, block_tables.shape[1],\n"
    "        *query.stride(), *key_cache.stride(), *value_cache.stride(), *block_tables.stride(), *out.stride(),\n"
    "        SPLIT_KV=False, **meta)\n"
    "    return out\n")
KERNEL_WRAPPER = ("def exercise_paged_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, "
                  "window=None):\n"
                  "    check_paged_attention_inputs(query, key_cache, value_cache, block_tables, seq_lens)\n"
                  + KERNEL_LAUNCH)
# The same kernel, with the window done by the wrapper in PyTorch: each sequence's last `window` tokens copied into
# a fresh pool of its own blocks, then the windowless kernel on that. It scored 8/8 while the window check graded the
# wrapper's output; that check now launches the learner's kernel itself, so the wrapper's copy never runs there (7/8).
KERNEL_WRAPPER_GATHERING = (
    "def exercise_paged_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, window=None):\n"
    "    check_paged_attention_inputs(query, key_cache, value_cache, block_tables, seq_lens)\n"
    "    if window is not None:\n"
    "        bs = key_cache.shape[1]\n"
    "        ks, vs, rows, lens, used = [], [], [], [], 0\n"
    "        for i, n in enumerate(seq_lens.tolist()):\n"
    "            pos = torch.arange(max(0, n - window), n)\n"
    "            phys = block_tables[i, pos // bs].long()\n"
    "            m = -(-len(pos) // bs)\n"
    "            for cache, out_list in ((key_cache, ks), (value_cache, vs)):\n"
    "                kv = cache[phys, pos % bs]\n"
    "                kv = torch.cat([kv, kv.new_zeros(m * bs - len(pos), *kv.shape[1:])])\n"
    "                out_list.append(kv.view(m, bs, *kv.shape[1:]))\n"
    "            rows.append(list(range(used, used + m)))\n"
    "            lens.append(len(pos))\n"
    "            used += m\n"
    "        width = max(len(r) for r in rows)\n"
    "        key_cache, value_cache = torch.cat(ks), torch.cat(vs)\n"
    "        block_tables = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32)\n"
    "        seq_lens = torch.tensor(lens, dtype=torch.int32)\n"
    + KERNEL_LAUNCH)

PASTES_03_04 = {
    "03 minikv's module pasted": ("03_paged.ipynb", {
        "class MyBlockAllocator": PASTED_BLOCKS + (
            "\n\nclass MyBlockAllocator(KVPool):\n"
            "    def __init__(self, num_blocks):\n"
            "        super().__init__(num_blocks)\n"
            "        self._free = deque(range(num_blocks - 1, -1, -1))  # a stack: the next out is the last\n\n"
            "    def allocate(self):\n"
            "        if not self._free:\n"
            "            raise OutOfBlocks(1, 0)\n"
            "        block = self._free.pop()\n"
            "        self._refcount[block] = 1\n"
            "        return block\n"),
        "class MyBlockTable": WINDOW_ADAPTER,
        "def my_paged_attention": PASTED_ATTENTION + HEAD_MAJOR_ADAPTER,
        "class MyRunAllocator": FREE_LIST_RUNS.format(pool="KVPool"),
    }),
    "03 the lecture's code pasted": ("03_paged.ipynb", _lecture_03()),
    # The hints of parts 1-3 state nearly the code: transcribed, they are the solution's cells. Part 4's text taken
    # literally: a sequence keeps one run while it grows into the block right after its last one; else any free block.
    "03 the hints transcribed": ("03_paged.ipynb", {
        "class MyBlockAllocator": _solution_cell("03_paged.ipynb", "class MyBlockAllocator"),
        "class MyBlockTable": _solution_cell("03_paged.ipynb", "class MyBlockTable"),
        "def my_paged_attention": _solution_cell("03_paged.ipynb", "def my_paged_attention"),
        "class MyRunAllocator": (
            "from collections import deque\n\n\n"
            "class MyRunAllocator:\n"
            "    def __init__(self, num_blocks):\n"
            "        self.n, self.is_free, self.queue, self.free_count = num_blocks, [True] * num_blocks, "
            "deque(range(num_blocks)), num_blocks\n"
            "        self.tables = {}\n\n"
            "    @property\n    def num_free(self):\n        return self.free_count\n\n"
            "    def allocate(self, seq_id, n):\n"
            "        if n > self.free_count:\n"
            "            raise OutOfBlocks(n, self.free_count)\n"
            "        table, out = self.tables.setdefault(seq_id, []), []\n"
            "        for _ in range(n):\n"
            "            after = table[-1] + 1 if table else self.n\n"
            "            if after < self.n and self.is_free[after]:\n"
            "                block = after\n"
            "            else:\n"
            "                while not self.is_free[self.queue[0]]:\n"
            "                    self.queue.popleft()\n"
            "                block = self.queue.popleft()\n"
            "            self.is_free[block] = False\n"
            "            self.free_count -= 1\n"
            "            table.append(block)\n"
            "            out.append(block)\n"
            "        return out\n\n"
            "    def free(self, seq_id):\n"
            "        for block in self.tables.pop(seq_id, []):\n"
            "            self.is_free[block] = True\n"
            "            self.free_count += 1\n"
            "            self.queue.append(block)\n"),
    }),
    "04 the course's kernel pasted": ("04_triton_kernel.ipynb", {
        "@triton.jit\ndef paged_attention_kernel": PASTED_KERNEL,
        "def exercise_paged_attention": KERNEL_WRAPPER,
    }),
    "04 the course's kernel pasted, the window gathered by the wrapper": ("04_triton_kernel.ipynb", {
        "@triton.jit\ndef paged_attention_kernel": PASTED_KERNEL,
        "def exercise_paged_attention": KERNEL_WRAPPER_GATHERING,
    }),
    # The lecture's loop written into the exercise's kernel: every block from the first, no mask before the window.
    "04 the lecture's windowless loop in the exercise's kernel": ("04_triton_kernel.ipynb", {
        "@triton.jit\ndef paged_attention_kernel": _solution_cell("04_triton_kernel.ipynb", "@triton.jit").replace(
            "first_block = tl.maximum(seq_len - window, 0) // BLOCK_SIZE", "first_block = 0").replace(
            " & (pos >= seq_len - window)", ""),
    }),
}
ALL_PASTES = PASTES | PASTES_03_04


@pytest.mark.design
@pytest.mark.parametrize("name", list(PASTES_03_04))
def test_a_paste_into_03_or_04_does_not_score_full_marks(name, paste_runs):
    row = below_full_marks(name, paste_runs)
    if name.startswith("03"):  # the mechanics may pass (variants of minikv's own); the design part may not
        design = {r["name"]: r for r in row["results"]}["run allocator few runs on drawn traces"]
        assert not design["passed"] and "drawn with seed" in design["message"], design
    if name.startswith("04"):  # the window check launches the kernel itself: a windowless kernel fails, any wrapper
        window = {r["name"]: r for r in row["results"]}["sliding window"]
        assert not window["passed"], window
        assert ("paged_attention_kernel()" if "course's kernel" in name else "NaN in the output") in window["message"]
        assert row["passed"] == row["total"] - 1, row  # the window is all these pastes miss
