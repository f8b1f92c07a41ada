"""The attack suite: hostile submissions graded through the real command line, each in its own
`python -m minikv grade` process, as a grader would run them.

Every attack starts from the honest solution of exercise 01 (the cheapest to grade), breaks its
answer (so that only the attack could earn marks) and adds the attack to the first graded cell.
Each must end with a non-zero exit status, within its time limit, without full marks, and with
a one-line reason. Then a batch: a folder mixing honest, hostile and broken submissions, graded
with --jobs 2 into a CSV gradebook, each row checked.
"""

from __future__ import annotations

import csv
import json
import os
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

# name -> (code added to the first graded cell, extra CLI options, a fragment every FAIL line or the reason shows)
ATTACKS = {
    "patch the grader": (WRONG + (
        "import minikv.grading as g\n"
        "g.run_checks = lambda checks, ns: [g.CheckResult(c.__name__, True) for c in checks]\n"
        "g.score_line = lambda results: 'score: 6/6 (100%)'\n"), [], "returned 1"),
    "empty the checks": (WRONG + "import minikv.checks.ex01_bytes as m\nm.CHECKS.clear()\n", [], "returned 1"),
    "edit the checks": (WRONG + (
        "import minikv.checks.ex01_bytes as m\n"
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
    "delegation by import": (
        "\nfrom minikv.sizing import kv_bytes_per_token, ModelShape\n"
        "def kv_cache_bytes(config, context_len, dtype_bytes):\n"
        "    shape = ModelShape.from_config(config)\n"
        "    per_layer = kv_bytes_per_token(shape, {1: 'fp8', 2: 'float16', 4: 'float32'}[dtype_bytes]) // shape.num_layers\n"
        "    w = config.get('sliding_window')\n"
        "    types = config.get('layer_types') or ['sliding_attention' if w else 'full_attention'] * shape.num_layers\n"
        "    return per_layer * sum(min(context_len, w) if t == 'sliding_attention' and w else context_len for t in types)\n",
        [], "minikv.sizing.kv_bytes_per_token"),
    "delegation hidden from a static look": (
        "\nimport minikv.sizing as s\n"
        "per_token = getattr(s, 'kv_bytes_' + 'per_token')\n"
        "def kv_cache_bytes(config, context_len, dtype_bytes):\n"
        "    shape = s.ModelShape.from_config(config)\n"
        "    per_layer = per_token(shape, {1: 'fp8', 2: 'float16', 4: 'float32'}[dtype_bytes]) // shape.num_layers\n"
        "    w = config.get('sliding_window')\n"
        "    types = config.get('layer_types') or ['sliding_attention' if w else 'full_attention'] * shape.num_layers\n"
        "    return per_layer * sum(min(context_len, w) if t == 'sliding_attention' and w else context_len for t in types)\n",
        [], "calls minikv's minikv.sizing.kv_bytes_per_token"),
    "syntax error": ("\ndef kv_cache_bytes(config, context_len dtype_bytes):\n    return 1\n", [], "SyntaxError"),
}


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


def grade_cli(*args, timeout: float = 300) -> tuple[subprocess.CompletedProcess, float]:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "minikv", "grade", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)
    return done, time.monotonic() - start


@pytest.fixture(scope="module")
def attack_runs(request, tmp_path_factory):
    """Every selected attack graded, two CLI processes at a time (the machine may have two cores)."""
    folder = tmp_path_factory.mktemp("attacks")
    selected = [item.callspec.params["name"] for item in request.session.items
                if getattr(item, "originalname", "") == "test_attack_is_refused" and hasattr(item, "callspec")]

    def run(name):
        code, options, _ = ATTACKS[name]
        path = attack_notebook(code, folder, name)
        return name, grade_cli(path, *LIMITS, *options)

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
    assert reason in out, f"{name}: expected {reason!r} in the verdicts\n{out}\n{done.stderr[-2000:]}"
    assert "Traceback" not in out + done.stderr, out + done.stderr
    limit = float(options[options.index("--timeout") + 1]) if "--timeout" in options else 60
    assert seconds < limit + 60, f"{name} took {seconds:.0f} s"  # start-up and the checks come on top


def test_not_an_exercise_is_refused(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells.append(nbformat.v4.new_code_cell("print('PASS  everything')"))
    path = tmp_path / "lecture.ipynb"
    nbformat.write(nb, path)
    done, _ = grade_cli(path, *LIMITS)
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
    done, _ = grade_cli(folder, "--jobs", "2", "--csv", book, "--quiet", *LIMITS)
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
    done, _ = grade_cli(SOLUTION, "--json", *LIMITS)
    assert done.returncode == 0, done.stdout + done.stderr
    (row,) = json.loads(done.stdout)
    assert row["score"] == "6/6" and row["percent"] == 100 and set(row["checks"].values()) == {"PASS"}
