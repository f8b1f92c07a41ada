"""How much a submission's process can reach: decided by the grader, per machine, and said in words.

Three layers, each used where the machine offers it (GRADING.md lists the guarantees per mode):

* **a uid of its own** (the grader runs as root and the interpreter is readable by any user): the
  child runs as an unused numeric uid with no groups, so file permissions keep it from writing the
  repository; when it is done, every process of that uid is killed (none can hide by forking or
  by leaving its process group). Where the interpreter is not readable by others (a pyenv Python
  under ``/root``), the child stays uid 0 but drops every capability.
* **Landlock** (Linux 5.13+, any user, `minikv.grading.landlock`): the child may read only
  Python, its libraries and minikv's public modules (not ``minikv/grading/checks/``, not
  ``solutions/``, not ``.git``), write only its private folder, and reach no TCP port.
* **always**: a separate process in its own session, a private temporary folder as its working
  folder, ``HOME`` and ``TMPDIR``, time and memory limits, and, when it exits, its process group
  and every process it left behind killed (the grader is their subreaper, so orphans come back
  to it instead of to init); the grader is not dumpable, so no child can ptrace it.

The digest of the grader's own files (`minikv.grading.integrity`) checks the result either way.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import site
import stat
import sys
import tempfile
from dataclasses import dataclass, field

import minikv.grading.landlock as landlock

SANDBOX_UID_BASE = 1_900_000_000  # far above any uid a system hands out; no passwd entry needed
PRIVATE = ("checks",)             # folders of minikv/grading/ a submission may not read
SYSTEM_READ = ("/usr", "/lib", "/lib32", "/lib64", "/libx32", "/bin", "/sbin", "/etc", "/proc", "/sys",
               "/dev/null", "/dev/zero", "/dev/urandom", "/dev/random")
_counter = itertools.count()


@dataclass
class Plan:
    """The isolation of one child: passed to Popen (uid) and to the child's set-up message."""

    repo: str
    workdir: str
    uid: int | None = None            # run as this uid (root only)
    drop_capabilities: bool = False   # root that cannot leave uid 0: drop capabilities instead
    landlock: bool = False
    read: list[str] = field(default_factory=list)
    write: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # why a layer is missing

    def setup(self, memory_budget: int | None) -> dict:
        return {"repo": self.repo, "workdir": self.workdir, "landlock": self.landlock, "read": self.read,
                "write": self.write, "drop_capabilities": self.drop_capabilities,
                "max_processes": 512 if self.uid is not None else None, "max_file_bytes": 2 << 30,
                "memory_budget": memory_budget or 0}

    def describe(self, said: list[str], timeout: float, address_space: tuple[int, int]) -> str:
        """One line for the verdict's header: what was in force for this submission."""
        who = (f"uid {self.uid}, not root" if self.uid is not None else
               "uid 0 without capabilities" if self.drop_capabilities else f"uid {os.geteuid()}, the grader's")
        baseline, limit = address_space
        memory = (f"address space {baseline / 2**30:.1f} GB for Python, torch and minikv + "
                  f"{(limit - baseline) / 2**30:.1f} GB" if limit else
                  "no memory limit" if baseline else "memory limit not set (the process ended before)")
        parts = [f"a separate process ({'; '.join([who, *self.notes])}), private folder and HOME, "
                 f"time limit {timeout:g} s, {memory}", *said]
        if not any(s.startswith("Landlock") for s in said):
            parts.append("files: read-only by file permissions, the checks readable" if self.uid is not None else
                         "files: read-write, the checks readable — run as root or in a container for read-only")
        return "isolation: " + "; ".join(parts)


def make_plan(repo: str) -> Plan:
    """The strongest isolation this machine allows the grader, for one child."""
    workdir = tempfile.mkdtemp(prefix="minikv-submission-")
    plan = Plan(repo=repo, workdir=workdir)
    if os.geteuid() == 0:
        needed = [os.path.realpath(sys.executable), *_python_paths(), os.path.join(repo, "minikv", "__init__.py")]
        unreadable = next((p for p in needed if not _others_can_read(p)), None)
        if unreadable is None:
            plan.uid = SANDBOX_UID_BASE + (os.getpid() % 100_000) * 1000 + next(_counter) % 1000
            os.chown(workdir, plan.uid, plan.uid)
        else:
            plan.drop_capabilities = True
            plan.notes.append(f"{unreadable} is not readable by other users")
    if os.environ.get("MINIKV_GRADER_LANDLOCK", "1") == "0":
        plan.notes.append("Landlock off: MINIKV_GRADER_LANDLOCK=0")
    elif landlock.abi() >= 1:
        plan.landlock = True
        plan.read = [*SYSTEM_READ, *_python_paths(), *_public_paths(repo)]
        plan.write = [workdir, "/dev/null"]
    else:
        plan.notes.append("no Landlock in this kernel")
    return plan


def _python_paths() -> list[str]:
    """Where this interpreter and its libraries live. Other sys.path entries (the working folder, which
    may hold the submissions; PYTHONPATH; another checkout with its own checks) are left out."""
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(os.path.dirname(os.path.realpath(
        sys.executable)))}
    paths.update(site.getsitepackages() if hasattr(site, "getsitepackages") else [])
    for entry in sys.path:
        if entry and ("site-packages" in entry or "dist-packages" in entry) and os.path.isdir(entry) \
                and not os.path.isdir(os.path.join(entry, "minikv")):
            paths.add(os.path.abspath(entry))
    return sorted(p for p in paths if os.path.exists(p))


def _public_paths(repo: str) -> list[str]:
    """minikv/ and kernels/ without minikv/grading/checks: each entry beside a private one, one by one
    (Landlock grants access beneath a path; it cannot take a subfolder back). And the package's own
    metadata (an editable install's ``minikv.egg-info``): ``transformers`` probes for a PyPI package
    called ``kernels``, finds our folder, maps it to the distribution ``minikv`` and reads its version;
    unreadable, that version is None and every import of a model raised ``InvalidVersion`` in here."""
    out = [os.path.join(repo, "kernels")]
    out += [os.path.join(repo, n) for n in os.listdir(repo) if n.endswith((".egg-info", ".dist-info"))]
    package = os.path.join(repo, "minikv")
    for name in os.listdir(package):
        if name != "grading":
            out.append(os.path.join(package, name))
    grading = os.path.join(package, "grading")
    out += [os.path.join(grading, n) for n in os.listdir(grading) if n not in PRIVATE]
    return out


def _others_can_read(path: str) -> bool:
    """Whether a user with no relation to the owner can reach and read `path`."""
    path = os.path.realpath(path)
    parts = path.split(os.sep)
    for i in range(1, len(parts)):
        folder = os.sep.join(parts[:i]) or os.sep
        if not os.stat(folder).st_mode & stat.S_IXOTH:
            return False
    mode = os.stat(path).st_mode
    return bool(mode & stat.S_IROTH) and (not stat.S_ISDIR(mode) or bool(mode & stat.S_IXOTH))


# ---- afterwards ---------------------------------------------------------------------------------

def guard_grader() -> None:
    """Before the first child starts: orphans of our descendants come back to this process (not to
    init), so they can be found and killed; and this process is not dumpable, so a child with the
    same uid (no Landlock, or root without capabilities) cannot ptrace it or read its memory through
    /proc and rewrite a verdict."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
        libc.prctl(4, 0, 0, 0, 0)   # PR_SET_DUMPABLE 0
    except (OSError, AttributeError):
        pass


def _processes() -> list[tuple[int, int, int, int]]:
    """(pid, ppid, uid, start time) of every process."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            uid = os.stat(f"/proc/{name}").st_uid
        except (OSError, IndexError):
            continue
        out.append((int(name), int(fields[1]), uid, int(fields[19])))
    return out


def start_time(pid: int) -> int:
    """When `pid` started, in clock ticks since boot (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return 0


def kill_leftovers(plan: Plan, child_started: int) -> int:
    """Kill what the submission left running: every process of its uid, and every orphan that came
    back to us and started after the child did. Returns how many were killed."""
    me, killed = os.getpid(), 0
    for _ in range(50):  # a process may fork while we look: look again until nothing is left
        victims = [pid for pid, ppid, uid, started in _processes()
                   if pid != me and ((plan.uid is not None and uid == plan.uid)
                                     or (ppid == me and started >= child_started))]
        if not victims:
            break
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except (ProcessLookupError, PermissionError):
                pass
        for pid in victims:  # orphans that came back to us are our children now: reap them
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
    return killed


def remove(plan: Plan) -> None:
    shutil.rmtree(plan.workdir, ignore_errors=True)
