"""The submission's side of the sandbox: run as a script (``python child.py FD``) by `minikv.grading.sandbox`.

It runs the submission's cells in its own namespace and then serves the grader's requests on the
socket `FD` (`minikv.grading.wire`). Before any cell runs, and in this order, it

1. takes this folder off ``sys.path`` and loads its two helpers, ``wire.py`` and ``landlock.py``, by
   their file paths: it imports no minikv module yet, because the tripwires below wrap minikv's
   forbidden functions when their modules are *first* imported (``import minikv`` first would
   import them unwrapped);
2. reads the grader's set-up message (the cells, the tripwires, the limits and the isolation);
3. sets its limits (no core files, a file size cap, a process cap when it has a uid of its own),
   drops every capability if it still runs as root, and enters a Landlock domain where one is
   asked for (what it may read and write, see `minikv.grading.landlock`);
4. installs the tripwires, then imports torch and minikv (the tripwires wrap them now), measures
   its address space and sets ``RLIMIT_AS`` to that plus the submission's budget: the limit is
   relative to what this interpreter and torch need, so it starves no honest submission on one
   Python and lets no import fail on another (a failed import would hide a delegation).
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import socket
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if sys.path and os.path.abspath(sys.path[0] or ".") == HERE:
    sys.path.pop(0)  # this file's folder is minikv/grading/; its modules are not top-level names


def _load(name: str):
    """A sibling module by its path, under a private name (nothing crossing the socket names it)."""
    spec = importlib.util.spec_from_file_location(f"_minikv_sandbox_{name}", os.path.join(HERE, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


wire = _load("wire")


class _ChildChannel(wire.Channel):
    def __init__(self, sock, ns: dict):
        super().__init__(sock, trusting=True)
        self.ns = ns

    def serve(self, msg) -> None:
        # Namespace requests are ("req", rid, "has"|"get"|"keys", None, (name,), {}).
        if len(msg) == 6 and msg[3] is None and msg[2] in ("has", "get", "keys"):
            _, rid, op, _, args, _ = msg
            if op == "has":
                value = isinstance(args[0], str) and args[0] in self.ns
            elif op == "get":
                value = self.ns[args[0]]
            else:
                value = [k for k in self.ns if isinstance(k, str) and not k.startswith("__")]
            try:
                self.send(("rep", rid, "ok", value, ()))
            except Exception as err:  # noqa: BLE001
                self.send(("rep", rid, "err", self.describe_error(err), ()))
            return
        super().serve(msg)


def _install_tripwires(channel, names: tuple[str, ...]) -> None:
    """Record every call of minikv's own implementations while a graded call runs: wrap each named
    function (or each method of a named class) when its module is first imported."""
    import functools
    import importlib.abc
    import importlib.machinery

    by_module: dict[str, list[str]] = {}
    for dotted in names:
        module, _, attr = dotted.rpartition(".")
        by_module.setdefault(module, []).append(attr)

    def wrap_module(module) -> None:
        for attr in by_module.get(module.__name__, []):
            obj = getattr(module, attr, None)
            if obj is None:
                continue
            label = f"{module.__name__}.{attr}"
            if isinstance(obj, type):
                for key, member in list(vars(obj).items()):
                    if callable(member) and not isinstance(member, type):
                        setattr(obj, key, _tripwire(member, f"{label}.{key}"))
                    elif isinstance(member, property) and member.fget:
                        setattr(obj, key, property(_tripwire(member.fget, f"{label}.{key}"), member.fset))
            elif callable(obj):
                setattr(module, attr, _tripwire(obj, label))

    def _tripwire(fn, label):
        if isinstance(fn, (staticmethod, classmethod)):
            return type(fn)(_tripwire(fn.__func__, label))

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if channel.depth:
                channel.hits.append(label)
            return fn(*args, **kwargs)
        return wrapper

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname not in by_module:
                return None
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
            if spec is None or spec.loader is None:
                return spec
            exec_module = spec.loader.exec_module

            def exec_and_wire(module):
                exec_module(module)
                wrap_module(module)
            spec.loader.exec_module = exec_and_wire
            return spec

    sys.meta_path.insert(0, Finder())


def _python_only(source: str) -> str:
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines())


def _drop_capabilities() -> None:
    """Still root (the interpreter is not readable by an unprivileged user): give up every capability
    for this process and whatever it runs, so uid 0 is only a number (Landlock still applies)."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in range(64):  # the bounding set: nothing executed later can regain them
        libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP; EINVAL past the last capability

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    if libc.capset(ctypes.byref(Header(0x20080522, 0)), (Data * 2)()) != 0:
        raise OSError(ctypes.get_errno(), "capset: " + os.strerror(ctypes.get_errno()))


def _address_space() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def _isolate(setup: dict) -> list[str]:
    """Step 3 of the module docstring; returns what is in force, in words."""
    import resource

    said = []
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_FSIZE, (setup["max_file_bytes"], setup["max_file_bytes"]))
    if setup.get("max_processes"):  # counted per uid: only meaningful with a uid of its own
        resource.setrlimit(resource.RLIMIT_NPROC, (setup["max_processes"], setup["max_processes"]))
    os.umask(0o077)
    if setup.get("drop_capabilities"):
        _drop_capabilities()
    ctypes.CDLL(None, use_errno=True).prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS: no setuid program helps
    if setup.get("landlock"):
        try:
            said.append(_load("landlock").restrict(setup["read"], setup["write"]))
        except OSError as err:
            said.append(f"no Landlock ({err})")
    return said


def _preimport_and_limit(setup: dict, channel) -> tuple[int, int]:
    """Step 4: import what an honest submission imports, then limit the address space relative to it."""
    import resource

    for name in ("torch", "minikv"):
        try:
            __import__(name)
        except BaseException as err:  # noqa: BLE001 - a grader without torch still grades what needs none
            channel.send(("note", f"the sandbox could not import {name}: {type(err).__name__}: {err}"[:300]))
    baseline = _address_space()
    limit = baseline + setup["memory_budget"] if setup.get("memory_budget") else 0
    if limit:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    return baseline, limit


def child_main(fd: int) -> None:
    sock = socket.socket(fileno=fd)
    ns: dict = {"__name__": "__main__"}
    channel = _ChildChannel(sock, ns)
    _, cells, tripwires, setup = channel.recv()
    sys.path.insert(0, setup["repo"])
    if setup.get("workdir"):
        os.chdir(setup["workdir"])
    said = _isolate(setup)
    _install_tripwires(channel, tripwires)
    baseline, limit = _preimport_and_limit(setup, channel)
    channel.send(("isolation", said, baseline, limit))
    import linecache

    os.environ.setdefault("MPLBACKEND", "Agg")  # no windows
    for source, filename in cells:
        channel.send(("cell", filename))
        source = _python_only(source)
        # Registered as IPython does, so inspect (and Triton's interpreter, which re-reads a
        # kernel's source) and tracebacks find the code that actually ran.
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        try:
            exec(compile(source, filename, "exec"), ns)
        except BaseException as err:  # noqa: BLE001 - SystemExit, KeyboardInterrupt: a note, not an exit
            first = (str(err).splitlines() or [""])[0][:200]
            channel.send(("note", f"{filename} raised {type(err).__name__}: {first}"))
    channel.send(("ready",))
    while True:
        msg = channel.recv()
        if msg == ("bye",):
            return
        channel.serve(msg)


if __name__ == "__main__":
    child_main(int(sys.argv[1]))
