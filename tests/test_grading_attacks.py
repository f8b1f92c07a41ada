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
    assert "score: 100/100" not in out.splitlines()[-1], out
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
    assert rows["alice"]["score"] == "100/100" and rows["alice"]["reason"] == ""
    assert all(v == "PASS" for k, v in rows["alice"].items() if k.startswith("01: "))
    assert rows["bob"]["score"] == "0/100" and "not implemented yet" in rows["bob"]["reason"]
    assert rows["carol_exits"]["score"] == "0/100" and "exited with status 0" in rows["carol_exits"]["reason"]
    assert rows["dave_syntax"]["score"] != "100/100" and "SyntaxError" in rows["dave_syntax"]["reason"]
    assert rows["erin"]["score"] == "0/0" and "not gradable" in rows["erin"]["reason"]
    assert "1/5 submissions with full marks" in done.stdout


def test_json_gradebook(tmp_path):
    done, _ = grade_cli(SOLUTION, "--json", *BATCH_LIMITS, repo=copy_repo(tmp_path / "repo"))
    assert done.returncode == 0, done.stdout + done.stderr
    (row,) = json.loads(done.stdout)
    assert row["score"] == "100/100" and row["percent"] == 100 and set(row["checks"].values()) == {"PASS"}


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
    assert rows["a_attacker"]["score"] != "100/100", out
    changed = sorted(str(p.relative_to(repo)) for p, data in pristine.items() if p.read_bytes() != data)
    if changed:  # the defence that stood: the digest; the attacker has no score, the next is not graded
        assert "grader's files changed" in rows["a_attacker"]["reason"], out
        assert rows["a_attacker"]["score"] == "0/0", out
        assert rows["b_next"]["reason"].startswith("not graded") and "a_attacker" in rows["b_next"]["reason"], out
        assert all(c in rows["a_attacker"]["reason"] for c in changed), (changed, out)
    elif following == "exercise":
        assert rows["b_next"]["score"] == "0/100" and "not implemented yet" in rows["b_next"]["reason"], out
    else:
        assert rows["b_next"]["score"] == "100/100" and rows["b_next"]["reason"] == "", out
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
        pytest.skip("this grader has no Landlock: a submission can read the checks (GRADING.md)")
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
    assert rows["a_honest"]["score"] == "100/100" and rows["a_honest"]["reason"] == "", out
    assert rows["b_tamperer"]["score"] != "100/100", out
    if "grader's files changed" in rows["b_tamperer"]["reason"]:
        assert rows["c_honest"]["reason"].startswith("not graded: the grader's files changed while grading"), out
        assert "b_tamperer" in rows["c_honest"]["reason"] and "restore them" in rows["c_honest"]["reason"], out
    else:
        assert rows["c_honest"]["score"] == "100/100", out
