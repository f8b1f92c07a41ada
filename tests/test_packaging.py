"""A normal install works: one dependency list, and a wheel that carries every module and data file.

The editable install the course uses (`pip install -e .`) reads the source tree, so it cannot see a
package left out of the wheel or a data file that is not declared: once, `minikv.grading.public` and
`minikv/bench/recorded.json` were both missing from the wheel, and `pip install .` broke exercises 06
and 07 and `python -m minikv claims`. These tests build the wheel, install it (not editable) into a
fresh virtual environment, and use it from a folder outside the repository.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import venv
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]


def _key(req: Requirement) -> tuple[str, str, str]:
    return req.name.lower().replace("_", "-"), str(req.specifier), str(req.marker or "")


def test_requirements_txt_is_pyprojects_list():
    """requirements.txt = pyproject's dependencies (less torch, which `make` installs first) + its extras."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = [Requirement(r) for r in project["dependencies"]]
    declared += [Requirement(r) for extra in project["optional-dependencies"].values() for r in extra]
    declared = {_key(r) for r in declared if r.name != "torch"}
    lines = [line.split("#")[0].strip() for line in (ROOT / "requirements.txt").read_text().splitlines()]
    listed = {_key(Requirement(line)) for line in lines if line}
    assert listed == declared, (f"only in requirements.txt: {sorted(listed - declared)}; "
                                f"only in pyproject.toml: {sorted(declared - listed)}")


def test_every_package_is_listed():
    """pyproject lists its packages by hand (kernels/ is mapped to minikv_kernels, which packages.find cannot
    see): a folder of minikv/ with an __init__.py that the list misses is left out of the wheel."""
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(tool["packages"])
    folders = {".".join(init.parent.relative_to(ROOT).parts) for init in (ROOT / "minikv").rglob("__init__.py")}
    assert folders <= listed, f"packages in minikv/ that pyproject.toml does not list: {sorted(folders - listed)}"
    assert tool["package-dir"] == {"minikv_kernels": "kernels"} and "minikv_kernels" in listed
    assert "kernels" not in listed, "a top-level `kernels` would collide with PyPI's package of that name"


def _exercise_imports() -> set[str]:
    """Every minikv/minikv_kernels module a solution or an exercise imports."""
    found = set()
    for nb in [*ROOT.glob("solutions/*.ipynb"), *ROOT.glob("exercises/*.ipynb")]:
        for cell in json.loads(nb.read_text())["cells"]:
            if cell["cell_type"] == "code":
                found |= set(re.findall(r"^\s*(?:from|import)\s+(minikv[\w.]*)",
                                        "".join(cell["source"]), re.M))
    return found


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path]:
    """(python, folder): a fresh venv holding minikv from its wheel; the other packages come from this one."""
    tmp = tmp_path_factory.mktemp("wheel")
    # Built from a copy: setuptools reuses an in-tree build/ folder, which would hide a file the
    # declaration leaves out behind one a previous build copied there.
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__", ".hypothesis", "artifacts", "out"))
    # This venv's setuptools if it has one (Python 3.11's venvs do, 3.12's do not): then pip builds in an
    # isolated environment of its own, fetching setuptools from the package index.
    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *isolation,
                    "-w", str(tmp / "dist"), str(src)], check=True, timeout=300)
    (wheel,) = (tmp / "dist").glob("minikv-*.whl")
    env_dir = tmp / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    # This venv's packages (torch, transformers, ...) without reinstalling them: a plain path line, so the
    # editable install's own .pth hook in that folder is not run and cannot hand out the source tree.
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, timeout=300)
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    for data in ("minikv/bench/recorded.json", "minikv_kernels/paged_attention_cpu.cpp",
                 "minikv_kernels/resources_before.json", "minikv_kernels/paged_attention.py",
                 "minikv/grading/public/ex06_scheduler.py"):
        assert data in names, f"the wheel lacks {data}"
    assert not any(name.startswith("kernels/") for name in names), "kernels/ must be installed as minikv_kernels"
    work = tmp / "elsewhere"   # not the repository: nothing may be found through the current folder
    work.mkdir()
    return python, work


def _run(python: Path, work: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    return subprocess.run([str(python), *args], cwd=work, env=env, capture_output=True, text=True, timeout=timeout)


def test_wheel_imports_what_the_exercises_import(installed):
    python, work = installed
    modules = sorted(_exercise_imports() | {"minikv", "minikv.grading.checks.ex06_scheduler",
                                            "minikv.grading.checks.ex07_admission", "minikv.server.app"})
    code = ("import importlib, minikv, sys\n"
            "assert 'site-packages' in minikv.__file__, minikv.__file__\n"
            f"for m in {modules!r}: importlib.import_module(m)\n"
            "print(minikv.__file__)")
    r = _run(python, work, "-c", code)
    assert r.returncode == 0, r.stderr[-3000:]
    assert str(ROOT) not in r.stdout, f"minikv came from the source tree, not the wheel: {r.stdout}"


def test_wheel_runs_claims(installed):
    python, work = installed
    r = _run(python, work, "-m", "minikv", "claims")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "recorded" in r.stdout, r.stdout[-2000:]
