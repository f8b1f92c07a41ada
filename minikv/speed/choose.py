"""Speed levers chosen by measurement, on the host they run on, and remembered.

A lever that wins on one CPU can lose on another: MKL's packed sgemm was 6-10% faster than oneDNN's on one
AMD EPYC host and made decode steps twice as slow on another of the same kind (MKL is known to pick slower
code on non-Intel CPUs). So no path is a constant here. Each candidate is timed on this machine, on the
shapes the engine will meet, and the fastest kept (:func:`fastest`). A choice is remembered for the process
and on disk (:class:`Choices`), keyed by the CPU's model, PyTorch's version, the thread count and the shape,
so a second start pays nothing; another CPU, PyTorch or thread count measures afresh.

``MINIKV_LINEAR=eager|onednn|mkl`` (or ``--linears`` on the command line) forces one path, for a control
or where measuring is not wanted; ``measure`` measures again, replacing what was remembered (a choice made
while the machine was busy with something else is worth making again on a quiet one).
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch

ENV = "MINIKV_LINEAR"
PATHS = ("eager", "onednn", "mkl")


def cpu_model() -> str:
    """The CPU's model name as the kernel reports it ("AMD EPYC", "Intel(R) Xeon(R) ..."), else the machine."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def host_key() -> str:
    """What a measured choice depends on besides the shape: the CPU, PyTorch, the threads it runs on."""
    return f"{cpu_model()} | torch {torch.__version__} | {torch.get_num_threads()} threads"


def requested(path: str | None = None) -> str | None:
    """What the argument asks for, else $MINIKV_LINEAR: None (what is remembered, else measure), "measure"
    (measure now) or one of PATHS (forced)."""
    path = path if path is not None else os.environ.get(ENV) or None
    if path not in (None, "measure", *PATHS):
        raise ValueError(f"{ENV} / --linears must be one of {', '.join(('measure', *PATHS))}, not {path!r}")
    return path


def forced_path(path: str | None = None) -> str | None:
    """The path forced by the argument, else by $MINIKV_LINEAR; None (measure) if neither or "measure"."""
    asked = requested(path)
    return None if asked == "measure" else asked


def fastest(candidates: dict[str, Callable[[], object]], repeats: int = 5, warmup: int = 1) -> tuple[str, dict]:
    """The name of the fastest candidate and each one's best time, in milliseconds.

    The candidates run in turn, round after round, each round in a rotated order, so all see the same load on a
    shared machine and none always runs first (on a cache still warm from the one before it). Each is judged by
    its fastest round: other load on the machine only ever adds time, so the minimum is the least disturbed
    estimate of what a path costs (a median would rank a path by how often it was interrupted)."""
    names = list(candidates)
    times: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(warmup):
        for name in names:
            candidates[name]()
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start = time.perf_counter()
            candidates[name]()
            times[name].append(time.perf_counter() - start)
    ms = {name: 1e3 * min(t) for name, t in times.items()}
    return min(ms, key=ms.get), ms


class Choices:
    """Measured choices, in this process and in a JSON file (``$MINIKV_CACHE/speed-choices.json``).

    An entry is ``key -> {"path": name, "ms": {candidate: ms}}``; the key is :func:`host_key` and the question
    ("linear 1536x576 at 8 rows"). A file that cannot be read or written is not an error: the choice is then
    measured again next time."""

    def __init__(self, path: Path | None = None):
        if path is None:
            try:
                from minikv.models import cache_dir
            except ImportError:   # loaded by path where minikv is not installed (bench ops in vLLM's venv)
                cache_dir = None
            path = cache_dir() / "speed-choices.json" if cache_dir is not None else None
        self.path = path
        self.memory: dict[str, dict] = {}

    def _read(self) -> dict:
        if self.path is None:
            return {}
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}

    def get(self, question: str) -> dict | None:
        key = f"{host_key()} | {question}"
        if key not in self.memory:
            found = self._read().get(key)
            if found is None:
                return None
            self.memory[key] = found
        return self.memory[key]

    def put(self, answers: dict[str, dict]) -> None:
        """Remember several answers at once (one read and one write of the file)."""
        keyed = {f"{host_key()} | {q}": a for q, a in answers.items()}
        self.memory.update(keyed)
        if self.path is None:
            return
        try:
            write_atomic(self.path, json.dumps(self._read() | keyed, indent=1, sort_keys=True).encode())
        except OSError:
            pass


def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` whole or not at all: two processes writing at once each leave a whole file, the
    last one's (a temporary file beside it, then renamed over it). Raises OSError as a write would."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


_CHOICES: Choices | None = None


def choices() -> Choices:
    """The process's choices, made on first use (so that $MINIKV_CACHE is read when it matters)."""
    global _CHOICES
    if _CHOICES is None:
        _CHOICES = Choices()
    return _CHOICES
