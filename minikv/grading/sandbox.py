"""The grader's sandbox: run a submission's code in a child process, and call into it from the parent.

`python -m minikv grade` must not let a submission decide its own verdict, change the grader for
the submissions after it, or read the checks' answers. So the submission's cells run in a fresh
interpreter (`minikv.grading.child`, run as a script), isolated as far as this machine allows
(`minikv.grading.isolation`: another uid, Landlock, a private folder), under a wall-clock limit
and an address-space limit relative to what the interpreter needs; the checks, the reference
and the drawing of inputs stay in the parent, which sees the child's objects through proxies
(`minikv.grading.wire`): ``Sandbox.namespace`` is a read-only mapping of the child's globals.

If the child dies (any exit, a crash, the time limit, the memory limit), the call in flight raises
`ChildDied` with the reason, a `BaseException` so that no check's ``except Exception`` hides it.
When the sandbox closes, the child's process group and every process it left behind are killed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import minikv.grading.isolation as isolation
from minikv.grading.wire import Channel, ChildDied, Delegation, ProtocolError, Proxy

__all__ = ["ChildDied", "Delegation", "ProtocolError", "Proxy", "RemoteNamespace", "Sandbox"]


class RemoteNamespace:
    """The child's globals, read-only: `name in ns`, `ns[name]`, `ns.get(name)`.

    `flagged` maps names to a delegation message: reading such a name raises `Delegation`."""

    def __init__(self, channel: Channel, flagged: dict[str, str] | None = None):
        self._channel, self.flagged = channel, dict(flagged or {})
        self.notes: list[str] = []  # cells that raised, for "`f` is not defined" messages

    def __contains__(self, name) -> bool:
        return bool(self._channel.request("has", None, (name,)))

    def __getitem__(self, name):
        if name in self.flagged:
            raise Delegation(self.flagged[name])
        if name not in self:
            raise KeyError(name)
        return self._channel.request("get", None, (name,))

    def get(self, name, default=None):
        return self[name] if name in self else default

    def keys(self):
        return list(self._channel.request("keys", None, ()))


class Sandbox:
    """A child process holding one submission's namespace. Use as a context manager.

    `memory_budget`: bytes of address space the submission may add to what the interpreter needs
    after importing torch and minikv (measured in the child; None: no limit). `cell_seconds`: one
    cell's time budget (within the wall clock): a cell that never returns (a demo calling a learner
    function that loops) ends the submission after it, named, not at the wall. `cell_times` records
    each cell's seconds."""

    def __init__(self, cells: list[tuple[str, str]], *, timeout: float = 300, memory_budget: int | None = 4 << 30,
                 tripwires: tuple[str, ...] = (), flagged: dict[str, str] | None = None, repo: str | None = None,
                 cell_seconds: float | None = None):
        self.cells, self.timeout, self.memory_budget = cells, timeout, memory_budget
        self.cell_seconds = cell_seconds
        self.cell_times: dict[str, float] = {}
        self.tripwires, self.flagged = tripwires, flagged
        self.repo = repo or os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        self.proc = None
        self.notes: list[str] = []
        self.cell_running: str | None = None
        self.death: str | None = None
        self.isolation = ""          # what was in force, in words (the verdict's header)
        self.address_space = (0, 0)  # the child's after importing torch and minikv, and its limit
        self.leftovers = 0           # processes the submission left running, killed at the end

    def __enter__(self) -> "Sandbox":
        parent_sock, child_sock = socket.socketpair()
        self.log = tempfile.TemporaryFile()
        self.plan = isolation.make_plan(self.repo)
        isolation.guard_grader()
        user = {} if self.plan.uid is None else {"user": self.plan.uid, "group": self.plan.uid, "extra_groups": []}
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "child.py"),
             str(child_sock.fileno())],
            pass_fds=(child_sock.fileno(),), stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT,
            env=_child_env(self.plan.workdir), cwd=self.plan.workdir, start_new_session=True, **user)
        self.started = isolation.start_time(self.proc.pid)
        child_sock.close()
        self.channel = Channel(parent_sock, trusting=False)
        self.wall = self.channel.deadline = time.monotonic() + self.timeout
        self.check_limit: tuple[str, float, float] | None = None
        self.channel.on_timeout = self._timed_out
        self.channel.on_eof = self._died
        self.channel.on_broken = self._broken
        self.namespace = RemoteNamespace(self.channel, self.flagged)
        self.namespace.cells = [source for source, _ in self.cells]  # the submission's code, as the grader read it
        try:
            self.channel.send(("start", list(self.cells), tuple(self.tripwires),
                               self.plan.setup(self.memory_budget)))
            while True:  # the child runs the cells, saying which one it starts
                msg = self.channel.recv()
                if not (isinstance(msg, tuple) and msg and msg[0] in ("cell", "note", "ready", "isolation")):
                    raise ProtocolError("unexpected message while the cells ran")
                if msg[0] == "isolation" and not self.isolation and len(msg) == 4:
                    said = [_one_line(s)[:200] for s in msg[1]] if isinstance(msg[1], list) else []
                    self.address_space = (int(msg[2]), int(msg[3]))
                    self.isolation = self.plan.describe(said, self.timeout, self.address_space)
                elif msg[0] == "cell":
                    self._cell_started(str(msg[1])[:100])
                elif msg[0] == "note":
                    self.notes.append(_one_line(msg[1]))
                    self.namespace.notes = self.notes
                else:
                    self._cell_started(None)
                    break
        except ProtocolError as err:
            self._kill()
            self.death = f"the submission broke the grader's protocol ({err})"
        except ChildDied as err:
            self.death = err.reason
        return self

    def _cell_started(self, name: str | None) -> None:
        """The child started cell `name` (None: all cells ran): time the last one, bound the next."""
        now = time.monotonic()
        if self.cell_running is not None:
            self.cell_times[self.cell_running] = now - self.cell_started
        self.cell_running, self.cell_started = name, now
        cell_end = now + self.cell_seconds if name is not None and self.cell_seconds else self.wall
        self.channel.deadline = min(self.wall, cell_end)

    def _status(self) -> str:
        try:
            rc = self.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            self._kill()
            rc = self.proc.wait()
        if rc < 0:
            name = signal.Signals(-rc).name
            why = " (out of memory?)" if name == "SIGKILL" else ""
            return f"was killed by {name}{why}"
        return f"exited with status {rc}"

    def _where(self) -> str:
        return f" while running {self.cell_running}" if self.cell_running else ""

    def _last_output(self) -> str:
        try:
            self.log.seek(0, os.SEEK_END)
            size = self.log.tell()
            self.log.seek(max(0, size - 400))
            lines = [ln for ln in self.log.read().decode(errors="replace").splitlines() if ln.strip()]
            return f"; its last output: {_one_line(lines[-1])[:150]}" if lines else ""
        except OSError:
            return ""

    def _died(self):
        if self.death:  # we killed it already (time limit, protocol): that is the reason
            raise ChildDied(self.death)
        where = self._where()
        self.death = f"the submission's process {self._status()}{where}{self._last_output()}"
        raise ChildDied(self.death)

    def _broken(self, why: str):
        self._kill()
        self.death = f"the submission broke the grader's protocol ({_one_line(why)[:100]})"
        raise ChildDied(self.death)

    def _timed_out(self):
        self._kill()
        if self.check_limit is not None and self.check_limit[2] < self.wall:
            name, seconds, _ = self.check_limit
            self.death = (f"time limit: the check '{name}' ran past its {seconds:g} s budget (a call into your code "
                          "that never returns?)")
        elif self.cell_running is not None and self.channel.deadline < self.wall:
            self.death = (f"time limit: {self.cell_running} ran past its {self.cell_seconds:g} s budget for one cell "
                          "(a loop that never ends, or a call into your code that never returns?)")
        else:
            self.death = f"time limit: the submission ran past {self.timeout:g} s{self._where()}"
        raise ChildDied(self.death)

    @contextlib.contextmanager
    def check_budget(self, name: str, seconds: float):
        """Run one check under its own time budget (and the submission's wall clock, whichever ends first):
        a call that never returns fails that check after `seconds`, with its name, not the whole
        submission at the wall. The submission's process is then gone: later checks say "not run"."""
        self.check_limit = (name, seconds, time.monotonic() + seconds)
        self.channel.deadline = min(self.wall, self.check_limit[2])
        try:
            yield
        finally:
            self.check_limit, self.channel.deadline = None, self.wall

    def _kill(self):
        if self.proc and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                self.proc.kill()
        if self.proc:
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass

    def __exit__(self, *exc):
        self._kill()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # anything the submission started, too
        except (ProcessLookupError, PermissionError, TypeError):
            pass
        # ... and what left the group (setsid, a double fork): its uid's processes, and orphans
        self.leftovers = isolation.kill_leftovers(self.plan, self.started)
        if not self.isolation:
            self.isolation = self.plan.describe(["(the submission's process ended before it said more)"],
                                                self.timeout, (0, 0))
        isolation.remove(self.plan)
        self.channel.sock.close()
        self.log.close()
        return False


# Variables a submission's process inherits (no tokens or keys of the grader's environment).
KEEP_ENV = ("PATH", "LANG", "LANGUAGE", "PYTHONPATH", "PYTHONHASHSEED", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
            "TOKENIZERS_PARALLELISM", "TRITON_INTERPRET")


def _child_env(workdir: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k in KEEP_ENV or k.startswith("LC_")}
    env.update(HOME=workdir, TMPDIR=workdir, PYTHONDONTWRITEBYTECODE="1", PYTHONNOUSERSITE="1",
               MPLCONFIGDIR=workdir, MALLOC_ARENA_MAX="2")  # few malloc arenas: an address space that varies less
    env.setdefault("OMP_NUM_THREADS", "1")  # graders run jobs side by side; the child's tensors are small
    # The checks hand the child CPU tensors only, and CUDA's start-up reserves far more address space
    # than a memory limit allows: the child sees no GPU.
    env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def _one_line(text) -> str:
    return " ".join(str(text).split())[:300]
