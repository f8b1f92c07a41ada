"""A digest of everything grading depends on, taken before a submission runs and checked after.

Isolation (`minikv.grading.isolation`) keeps a submission from writing the grader's files where
the machine allows it; this digest proves, for every submission and in every mode, that it did
not: if anything changed while a submission was graded, that submission gets no score and a
batch grades nothing more with the changed code (`minikv.grading.batch`).

What it covers:

* the content (SHA-256) of every file under ``minikv/`` (the checks included, and ``__pycache__``:
  a planted ``.pyc`` runs like source) and ``kernels/``;
* the ``stat`` (inode, size, modification and change times; the change time cannot be set back
  by a user) of every file of a module this grader has loaded (torch, hypothesis, ...), and of
  every site-packages folder (a new ``.pth`` file runs code in every interpreter that starts).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import site
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]  # minikv/
REPO = PACKAGE.parent


def _ours(path: str) -> bool:
    """Is `path` under minikv/ or kernels/ (``minikv_x/`` is not under ``minikv/``)?"""
    return any(path == root or path.startswith(root + os.sep) for root in (str(PACKAGE), str(REPO / "kernels")))


def _content(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError as err:
        return f"unreadable: {err.strerror}"


def _stat(path: str) -> str:
    try:
        s = os.stat(path)
    except OSError:
        return "missing"
    return f"{s.st_ino}:{s.st_size}:{s.st_mtime_ns}:{s.st_ctime_ns}"


def _own_files() -> list[str]:
    """Every file under minikv/ and kernels/, except a .pyc being written: Python writes a cache file
    under a temporary name (``x.cpython-312.pyc.<number>``) and renames it, and another grader on the
    same tree may be doing so right now. Import never loads such a name; once renamed, it is a .pyc
    and is covered."""
    out = []
    for root in (PACKAGE, REPO / "kernels"):
        for folder, _, files in os.walk(root):
            in_cache = os.path.basename(folder) == "__pycache__"
            out += [os.path.join(folder, f) for f in files if not (in_cache and ".pyc." in f)]
    return out


def _library_paths() -> list[str]:
    """The files of the modules loaded here, and the site-packages folders. Our own trees are left
    out: `_own_files` covers them in full, by content, whether loaded or not; listing a file of
    theirs a second time, by stat, only once a check has imported it (the checks of 06 and 07 import
    kernels/), made that import itself look like a change."""
    out = set()
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if isinstance(path, str) and not _ours(path):
            out.add(path)
    folders = site.getsitepackages() if hasattr(site, "getsitepackages") else []
    out.update(folders + [site.getusersitepackages()])
    return sorted(out)


def compile_ours() -> None:
    """Write the .pyc files of minikv/ and kernels/ now (where the folder is writable), so that none
    appears while a submission is graded, where it would look like tampering."""
    import compileall

    for root in (PACKAGE, REPO / "kernels"):
        with contextlib.redirect_stdout(io.StringIO()):
            compileall.compile_dir(str(root), quiet=2)


def snapshot() -> dict[str, str]:
    """{path: fingerprint}: content hashes of minikv/ and kernels/, stats of the libraries."""
    digest = {path: _content(path) for path in _own_files()}
    digest.update((path, "stat " + _stat(path)) for path in _library_paths())
    return digest


def changed(before: dict[str, str], after: dict[str, str] | None = None) -> list[str]:
    """Paths that differ (new, gone or changed) between two snapshots, relative to the repository where
    they are in it. Library paths are compared where both snapshots have them (a module first loaded
    in between was not in `before`); minikv's and kernels' files are compared in full."""
    after = snapshot() if after is None else after
    out = []
    for path in sorted(set(before) | set(after)):
        mine = _ours(path)
        if (mine or (path in before and path in after)) and before.get(path) != after.get(path):
            out.append(os.path.relpath(path, REPO) if path.startswith(str(REPO)) else path)
    return out
