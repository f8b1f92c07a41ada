"""Keep the memory a CPU step frees, so that the next step does not fault it back in page by page.

A CPU step of a few thousand tokens allocates activations of megabytes to tens of megabytes each (one
MLP activation of a 2,048-token step of SmolLM2 is 2,048 x 1,536 floats, 12.6 MB), and frees them
before the next layer. glibc's malloc serves an allocation above its mmap threshold (128 KiB at first,
raised by what is freed, up to 32 MiB) with a fresh ``mmap`` that ``free`` unmaps, and it gives the top
of its heap back to the kernel once more than its trim threshold is free there. Either way the next
buffer of that size is new pages: the kernel zero-fills each 4 KiB page at its first touch, inside the
elementwise op or matmul that writes it. Measured on this course's 2-core machine, the engine's first
step of `bench engine`'s workload (2,048 prompt tokens) took 2.0-3.6 s with glibc's defaults and
1.8-2.1 s with both thresholds fixed (each alone: 2.1-3.6 s and 2.7-4.1 s), and the whole workload
10.8-11.3 s instead of 12.0-12.7 s; decode steps (small buffers) did not move.

So the runner, on the CPU, fixes both once per process: allocations up to 32 MiB come from the heap,
and up to 1 GiB of freed heap stays mapped (the process keeps its largest step's activations, a few
hundred MB at most here). vLLM's CPU build gets the same effect by preloading tcmalloc. The setting is
the process's, not one engine's: ``MINIKV_MALLOC=default`` leaves glibc's defaults, the control for the
figures above (``MINIKV_MALLOC=default python -m minikv bench engine``). Elsewhere than glibc (macOS,
musl) nothing changes.
"""

from __future__ import annotations

import ctypes
import os
import platform

M_TRIM_THRESHOLD = -1    # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest mmap threshold on 64-bit: a step's buffers all come from the heap
TRIM_THRESHOLD = 1 << 30   # far above a step's activations: freed heap stays mapped from step to step

_state: dict[str, bool] = {}


def keep_freed_memory() -> bool:
    """Fix glibc's mmap and trim thresholds for this process (once); True if they are now fixed."""
    if "kept" not in _state:
        _state["kept"] = _set_thresholds()
    return _state["kept"]


def _set_thresholds() -> bool:
    if os.environ.get("MINIKV_MALLOC") == "default" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    # mallopt answers 1 on success; both are set, in this order, so that neither is left half done.
    return mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
