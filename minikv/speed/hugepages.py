"""Packed weights on huge pages, where that is measured faster, once it has paid for itself.

A CPU translates each virtual address through its TLB, a cache of page-table entries. A decode step reads
half a gigabyte of weights (SmolLM2 in fp32): on 4 KiB pages some 130,000 pages a step, each a translation to
fetch; on 2 MiB pages, 256. Linux backs ordinary memory with 4 KiB pages unless a range asks for huge ones
(``/sys/kernel/mm/transparent_hugepage/enabled`` is ``madvise`` on most distributions), and PyTorch asks only
under ``THP_MEM_ALLOC_ENABLE=1`` set before it starts. So this module asks the kernel to rebuild the packed
weights' memory on 2 MiB pages in place (``madvise(MADV_COLLAPSE)``, Linux 6.1 on): the same bytes at the same
addresses, nothing for the matmuls to know.

Measured on this course's 2-core AMD EPYC machine by ``python -m minikv bench hugepages --engine`` (one process,
huge-page copies and 4 KiB ones taking turns, medians of the per-turn ratios): oneDNN's packed matmuls took 0.87-0.95
of the time at 1 row, 0.93-0.95 at 8, 0.94-0.97 at 32 (gate/up, down, the lm_head); a whole engine, a batch of
200-token prompts and 48 tokens each (its prefill included, which gains less), 0.97 at batch 1 and 0.96-0.99 at 8,
its tokens identical.

**Chosen by measurement** (:func:`decide`): scratch copies of one of the model's weights on each kind of page,
timed in turns at a decode step's 8 rows by ``minikv.speed.choose.fastest``, remembered on disk like the linears'
paths. ``MINIKV_HUGEPAGES=on`` moves at once, ``off`` never, ``measure`` measures again.

**Moved once it pays** (:class:`HugePages`). The move costs time once: the kernel copies each 2 MiB into a huge
page, 0.6-6 ms each here, 1.0-1.5 s for SmolLM2's 513 MiB; each later step saves a few per cent. ``make demo``'s
fifty steps would never earn that back; a server does within a minute; the engine cannot know which it is in.
So it rents before it buys: each step adds what 4 KiB pages cost it (its seconds times the measured saving), and
once that adds up to what the move will cost, it moves, between two steps. Whatever the run's length, it then pays
at most twice what the better choice in hindsight would have (the ski-rental argument), as far as the move costs
what it is estimated to: the last move's seconds per MiB on this host, remembered (the first start's estimate, from
the scratch copies, can be several times low: here the first 14 MiB of a move went at 0.3 ms a MiB, the rest at
2.3-2.8). A caller that knows it
will run long (``minikv serve``, the benchmarks) moves at start instead (``LLMEngine.long_run``), rather than
stall one step for a second later. Moving on a thread of its own, beside running steps, was tried: on two cores it
halved the steps' speed while it lasted.
"""

from __future__ import annotations

import ctypes
import os
import platform
import time
from dataclasses import dataclass

import torch

from minikv.speed.choose import choices, fastest

ENV = "MINIKV_HUGEPAGES"
HUGE = 2 << 20          # x86-64's (and most arm64 kernels') transparent huge page
MADV_COLLAPSE = 25      # linux/mman.h (6.1): make this range's pages huge now, in place
SCRATCH_COPIES = 16     # copies of one weight measured on each kind of page: far more than an L3 cache holds

_libc: list = []


def _madvise():
    if not _libc:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            _libc.append(libc.madvise)
        except (OSError, AttributeError):
            _libc.append(None)
    return _libc[0]


def span(t: torch.Tensor) -> tuple[int, int]:
    """(address, bytes) of a tensor's memory: a dense one's, or the buffer of a oneDNN-packed (mkldnn) one."""
    if t.layout == torch._mkldnn:
        return torch.ops.mkldnn.data_ptr(t), torch.ops.mkldnn._nbytes(t)
    return t.data_ptr(), t.untyped_storage().nbytes()


def collapse(tensors: list[torch.Tensor]) -> int:
    """Back these tensors' memory with huge pages; returns the bytes of theirs now on huge pages (0 where the
    kernel cannot). Neighbours less than a huge page apart are collapsed as one range, so the page that
    straddles two weights is huge too (it costs at most the gap between them in memory)."""
    madvise = _madvise()
    if madvise is None or platform.system() != "Linux" or not tensors:
        return 0
    spans = sorted(span(t) for t in tensors)
    merged = [list(spans[0])]
    for addr, size in spans[1:]:
        last = merged[-1]
        if addr <= last[0] + last[1] + HUGE:
            last[1] = max(last[1], addr + size - last[0])
        else:
            merged.append([addr, size])
    done = 0
    for addr, size in merged:
        lo, hi = -(-addr // HUGE) * HUGE, (addr + size) // HUGE * HUGE  # only whole huge pages inside the range
        if hi > lo and madvise(lo, hi - lo, MADV_COLLAPSE) == 0:
            done += sum(max(0, min(a + n, hi) - max(a, lo)) for a, n in spans)
    return done


@dataclass
class Verdict:
    """What :func:`decide` found: the fraction of a step's time huge pages save here (None: stay on 4 KiB pages),
    what moving a MiB costs, in words how it was decided, and where it is remembered (None: forced)."""

    saving: float | None
    move_s_per_mib: float
    how: str
    question: str | None = None
    now: bool = False   # MINIKV_HUGEPAGES=on: move at once


def empty_on_huge_pages(nbytes: int) -> torch.Tensor | None:
    """A fresh uint8 tensor of `nbytes` on 2 MiB pages from its first touch (an anonymous mapping, aligned, asked
    for huge pages before anything is written), or None where the kernel will not say it can."""
    import mmap

    if platform.system() != "Linux" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    region = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(region, dtype=torch.uint8)   # keeps the mapping alive as long as the tensor
    start = -whole.data_ptr() % HUGE
    return whole[start:start + nbytes]


class HugePages:
    """Packed copies to move onto huge pages once 4 KiB pages have cost the steps as much as the move will.

    The move's cost is the verdict's seconds per MiB: the last move's on this host, remembered (at the first start,
    the scratch copies' move that :func:`decide` timed). ``now=True`` moves at once."""

    def __init__(self, tensors: list[torch.Tensor], verdict: Verdict, now: bool = False):
        self.tensors, self.verdict = tensors, verdict
        self.ids = [id(t) for t in tensors]   # which tensors: another set of copies is another move
        self.total = sum(span(t)[1] for t in tensors)
        self.saving, self.cost = verdict.saving or 0.0, verdict.move_s_per_mib * self.total / 2**20
        self.lost = 0.0                  # what 4 KiB pages have cost the steps so far
        self.done: int | None = None     # bytes moved; None: not yet
        if now:
            self.move()

    def after_step(self, seconds: float) -> None:
        if self.done is None:
            self.lost += seconds * self.saving
            if self.lost >= self.cost:
                self.move()

    def move(self) -> None:
        """Move now, unless that is done."""
        if self.done is not None:
            return
        start = time.perf_counter()
        self.done, self.tensors = collapse(self.tensors), []
        question = self.verdict.question
        if self.done and question is not None:   # what this move cost is the next start's estimate
            rate = (time.perf_counter() - start) / (self.done / 2**20)
            choices().put({question: (choices().get(question) or {}) | {"move_s_per_mib": rate}})

    def __str__(self) -> str:
        if self.done is None:
            return (f"not yet: {self.total / 2**20:.0f} MiB, once 4 KiB pages have cost the steps what moving them "
                    f"will, about {self.cost:.1f} s (at {self.saving:.0%} of a step's time)")
        return f"{self.done / 2**20:.0f} of {self.total / 2**20:.0f} MiB"


def requested() -> str | None:
    """$MINIKV_HUGEPAGES: None (what is remembered, else measure), "measure", "on" (move now) or "off" (never)."""
    asked = os.environ.get(ENV) or None
    if asked not in (None, "measure", "on", "off"):
        raise ValueError(f"{ENV} must be one of on, off, measure, not {asked!r}")
    return asked


def decide(weight: torch.Tensor, pack) -> Verdict:
    """Whether huge pages save time on this host, and what moving onto them costs. `weight` is one of the model's,
    `pack` what turns it into the packed copy a step reads (oneDNN's reorder): scratch copies of it are moved and
    timed on each kind of page, at a decode step's 8 rows."""
    asked = requested()
    if asked in ("on", "off"):
        return Verdict(0.0 if asked == "on" else None, 0.0, f"{asked} ({ENV})", now=asked == "on")
    if weight.numel() * weight.element_size() < 2 * HUGE:   # a toy model's: a few pages in all, nothing to gain
        return Verdict(None, 0.0, "weights smaller than a huge page")
    question = f"huge pages for packed {weight.shape[0]}x{weight.shape[1]} fp32"
    known = None if asked == "measure" else choices().get(question)
    how = "remembered"
    if known is None or "move_s_per_mib" not in known:
        with torch.inference_mode():
            small, huge = ([pack(weight) for _ in range(SCRATCH_COPIES)] for _ in range(2))
            start = time.perf_counter()
            moved = collapse(huge)
            if moved == 0:   # the kernel cannot: nothing to measure, nothing to choose
                return Verdict(None, 0.0, "this kernel makes no huge pages on request")
            per_mib = (time.perf_counter() - start) / (moved / 2**20)
            x = torch.randn(1, 8, weight.shape[1])
            run = torch.ops.mkldnn._linear_pointwise.default
            best, ms = fastest({"4k": lambda: [run(x, w, None, "none", [], "") for w in small],
                                "huge": lambda: [run(x, w, None, "none", [], "") for w in huge]}, repeats=9)
        known = {"path": best, "ms": ms, "move_s_per_mib": per_mib}
        choices().put({question: known})
        how = "measured"
    ms = known["ms"]
    saving = 1 - ms["huge"] / ms["4k"] if known["path"] == "huge" else None
    return Verdict(saving, known["move_s_per_mib"], f"{how}: {ms['huge']:.2f} against {ms['4k']:.2f} ms on 4 KiB pages",
                   question)
