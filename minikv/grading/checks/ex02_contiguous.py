"""Checks for exercise 02 (contiguous): the learner's `first_fit`, `slab_waste` and
`external_fragmentation`, against minikv.sim.memory's own placement and books.

Hand-picked edge cases first (each names what it is about), then hypothesis-drawn slab layouts
(any order, holes anywhere, request sizes that fit exactly, miss by one or exceed the budget),
then the simulator itself: a short ShareGPT-shaped trace replayed with the learner's first fit
in place of minikv's, and the simulator's per-step books recomputed with the learner's
`slab_waste`. Every failure message shows the input that disagrees.

Delegation: the graded functions are plain Python over tuples and ints; minikv's own `first_fit`,
`slab_waste`, `external_tokens` and the simulator's slab policies are forbidden in them (`FORBIDDEN`).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from minikv.grading import call, learner
from minikv.sim.memory import simulate
from minikv.sim.policies import (
    ContiguousMax,
    ContiguousOracle,
    ContiguousPow2,
    Seq,
    external_tokens,
    first_fit,
    slab_waste,
)
from minikv.sim.traces import TraceRequest, make_trace

GRADED = ["first_fit", "slab_waste", "external_fragmentation"]
FORBIDDEN = ["minikv.sim.policies.first_fit", "minikv.sim.policies.slab_waste", "minikv.sim.policies.external_tokens",
             "minikv.sim.policies._Slabs", "minikv.sim.policies.ContiguousMax", "minikv.sim.policies.ContiguousOracle",
             "minikv.sim.policies.ContiguousPow2"]

MANY = settings(max_examples=300, deadline=None, database=None, derandomize=True)


def _slabs(slabs) -> str:
    slabs = sorted(slabs)
    shown = ", ".join(f"({o}, {s})" for o, s in slabs[:10])
    return f"[{shown}{', ...' if len(slabs) > 10 else ''}]" + (f" ({len(slabs)} slabs)" if len(slabs) > 10 else "")


def _holes(slabs, budget) -> list[int]:
    """Lengths of the gaps between the slabs, in address order (empty gaps included)."""
    out, end = [], 0
    for off, size in sorted(slabs):
        out.append(off - end)
        end = off + size
    return out + [budget - end]


@st.composite
def layouts(draw, max_slabs: int = 8):
    """(slabs, budget): non-overlapping (offset, size) slabs in [0, budget), in a random order."""
    pieces = draw(st.lists(st.tuples(st.integers(0, 12), st.integers(1, 12)), max_size=max_slabs))
    slabs, end = [], 0
    for gap, size in pieces:
        slabs.append((end + gap, size))
        end += gap + size
    budget = max(end + draw(st.integers(0, 12)), 1)
    return list(draw(st.permutations(slabs))), budget


@st.composite
def layouts_and_sizes(draw):
    """A layout and a request size: any size up to past the budget, or exactly a hole, or one more."""
    slabs, budget = draw(layouts())
    hole = draw(st.sampled_from(_holes(slabs, budget)))
    size = draw(st.one_of(st.integers(1, budget + 2), st.just(max(hole, 1)), st.just(hole + 1)))
    return slabs, budget, size


# ---- first fit -----------------------------------------------------------------------------

FIRST_FIT_CASES = [  # (what it is about, slabs, size, budget)
    ("empty layout", [], 5, 10),
    ("empty layout, the whole budget exactly", [], 10, 10),
    ("empty layout, larger than the budget", [], 11, 10),
    ("hole at the start", [(3, 4)], 3, 10),
    ("exact fit between two slabs", [(0, 2), (5, 3)], 3, 10),
    ("hole at the end", [(0, 4)], 6, 10),
    ("no room at all", [(0, 5), (5, 5)], 1, 10),
    ("holes too small everywhere", [(2, 3), (7, 2)], 3, 10),
    ("the FIRST hole that fits, not the tightest", [(0, 1), (6, 1), (9, 1)], 2, 10),
    ("slabs not in address order", [(6, 1), (0, 1), (9, 1)], 2, 10),
]


def _compare_first_fit(ns, slabs, size, budget, what=""):
    want = first_fit(list(slabs), size, budget)
    got = call(learner(ns, "first_fit"), list(slabs), size, budget)
    assert got == want, (f"{what + ': ' if what else ''}first_fit(slabs={list(slabs)}, size={size}, "
                         f"budget={budget}) returned {got!r}, expected {want!r}")


def check_first_fit_edge_cases(ns):
    for what, slabs, size, budget in FIRST_FIT_CASES:
        _compare_first_fit(ns, slabs, size, budget, what)


def check_first_fit_on_many_layouts(ns):
    MANY(given(layouts_and_sizes())(lambda case: _compare_first_fit(ns, case[0], case[2], case[1])))()


# ---- the waste of one slab -------------------------------------------------------------------

SLAB_WASTE_CASES = [  # (what, size, live, final)
    ("max-length slab, short request", 2048, 300, 500),
    ("slab sized exactly (oracle): nothing internal", 500, 300, 500),
    ("slab the sequence will outgrow (pow2): nothing internal", 512, 300, 1000),
    ("sequence at its last token", 64, 64, 64),
    ("just admitted, one token", 16, 1, 9),
]


def _compare_waste(ns, size, live, final, what=""):
    want = slab_waste(size, live, final)
    got = call(learner(ns, "slab_waste"), size, live, final)
    got = tuple(got) if isinstance(got, (list, tuple)) else got
    assert got == want, (f"{what + ': ' if what else ''}slab_waste(size={size}, live={live}, final={final}) "
                         f"returned {got!r}, expected (live, reserved, internal) = {want}")


def check_slab_waste_cases(ns):
    for what, size, live, final in SLAB_WASTE_CASES:
        _compare_waste(ns, size, live, final, what)


@st.composite
def slab_states(draw):
    size = draw(st.integers(1, 4096))
    live = draw(st.integers(1, size))
    final = draw(st.one_of(st.integers(live, size), st.integers(live, 3 * size), st.just(size)))
    return size, live, final


def check_slab_waste_on_many_slabs(ns):
    MANY(given(slab_states())(lambda s: _compare_waste(ns, *s)))()


@lru_cache(maxsize=1)
def _short_trace() -> tuple[TraceRequest, ...]:
    return tuple(make_trace("sharegpt", 200, seed=2))


@lru_cache(maxsize=None)
def _reference_run(policy: str):
    cls = {"max": ContiguousMax, "pow2": ContiguousPow2, "oracle": ContiguousOracle}[policy]
    return simulate(list(_short_trace()), cls())


def check_slab_waste_matches_the_simulator(ns):
    fn = learner(ns, "slab_waste")
    for policy in ("max", "pow2"):
        r = _reference_run(policy)
        final = dict(zip(r.extents["seq"].tolist(), r.extents["final"].tolist()))
        for step in np.linspace(0, r.steps - 1, 25).astype(int).tolist():
            totals = np.zeros(3, dtype=np.int64)
            for seg in r.snapshot(step):
                got = call(fn, seg.size, seg.live, final[seg.seq_id])
                want = (seg.live, seg.reserved, seg.internal)
                got = tuple(got) if isinstance(got, (list, tuple)) else got
                assert got == want, (f"at step {step} of a {r.policy} run, slab_waste(size={seg.size}, "
                                     f"live={seg.live}, final={final[seg.seq_id]}) returned {got!r}; "
                                     f"the simulator's books say {want}")
                totals += got
            books = [int(r.timeline[p][step]) for p in ("live", "reserved", "internal")]
            assert totals.tolist() == books, (f"step {step} of {r.policy}: your parts add up to {totals.tolist()}, "
                                              f"the books to {books}")


# ---- external fragmentation --------------------------------------------------------------------

EXTERNAL_CASES = [  # (what, slabs, budget, request_size)
    ("two holes of 3, a request of 4: all 6 free tokens are stranded", [(3, 4)], 10, 4),
    ("a request that fits a hole: nothing stranded", [(3, 4)], 10, 3),
    ("a request larger than all free memory: not fragmentation, just full", [(3, 4)], 10, 7),
    ("empty layout", [], 10, 4),
    ("no free memory at all", [(0, 10)], 10, 1),
    ("free memory that would hold it exactly, split in three", [(1, 2), (4, 2), (7, 2)], 10, 4),
]


def _reference_external(slabs, budget, size) -> int:
    """minikv.sim.memory's books for a request of `size` tokens at the head of the queue."""
    policy = ContiguousOracle()  # slab = the request's final length: here exactly `size`
    policy.reset(budget, max_seq_len=budget)
    for i, slab in enumerate(slabs):
        policy.slab[i] = slab
    policy.used = sum(s for _, s in slabs)
    head = Seq(TraceRequest(len(slabs), 0, size, 0), size)
    return external_tokens(policy, None if policy.admit(head) else head)


def _compare_external(ns, slabs, budget, size, what=""):
    want = _reference_external(slabs, budget, size)
    got = call(learner(ns, "external_fragmentation"), list(slabs), budget, size)
    assert got == want, (f"{what + ': ' if what else ''}external_fragmentation(slabs={list(slabs)}, budget={budget}, "
                         f"request_size={size}) returned {got!r}, expected {want!r}")


def check_external_fragmentation_cases(ns):
    for what, slabs, budget, size in EXTERNAL_CASES:
        _compare_external(ns, slabs, budget, size, what)


def check_external_fragmentation_on_many_layouts(ns):
    MANY(given(layouts_and_sizes())(lambda case: _compare_external(ns, *case)))()


# ---- the simulator, with the learner's first fit -------------------------------------------------

def _invalid(slabs, offset, size, budget) -> str:
    """A note when a placement is not a free stretch of memory at all."""
    if offset is None or not isinstance(offset, int):
        return ""
    if offset < 0 or offset + size > budget:
        return f" (slots {offset}..{offset + size - 1} are not all inside the budget)"
    hit = [s for s in sorted(slabs) if s[0] < offset + size and offset < s[0] + s[1]]
    return f" (that overlaps the slab {hit[0]}: two requests in the same memory)" if hit else ""


def _with_first_fit(base, fn, log: dict):
    """A `base` policy whose slab placement calls `fn`; `log` records calls and the first disagreement."""

    class LearnersFirstFit(base):
        def _first_fit(self, size, skip=None):
            slabs = [s for sid, s in self.slab.items() if sid != skip]
            log["calls"] += 1
            if log["calls"] > log["limit"]:
                raise AssertionError(
                    f"with your first_fit the {self.name} run did not finish: {log['calls'] - 1:,} placements "
                    f"and requests still waiting (minikv's first fit needs {log['reference']:,} for the whole "
                    f"trace). First placement that differs: {log.get('first', 'none')}")
            got = call(fn, list(slabs), size, self.budget)
            want = first_fit(slabs, size, self.budget)
            if got != want and "first" not in log:
                log["first"] = (f"first_fit(slabs={_slabs(slabs)}, size={size}, budget={self.budget}) "
                                f"returned {got!r}, minikv's first fit {want!r}"
                                + _invalid(slabs, got, size, self.budget))
            return got

    return LearnersFirstFit()


@lru_cache(maxsize=None)
def _reference_placements(base) -> tuple[float, int]:
    """minikv's own run of the short trace under `base`: utilization and first-fit calls made."""
    calls = []

    class Counted(base):
        def _first_fit(self, size, skip=None):
            calls.append(size)
            return super()._first_fit(size, skip)

    return simulate(list(_short_trace()), Counted()).utilization, len(calls)


def check_first_fit_in_the_simulator(ns):
    fn = learner(ns, "first_fit")
    for base in (ContiguousOracle, ContiguousPow2):
        want, calls = _reference_placements(base)
        log = {"calls": 0, "limit": 3 * calls + 1000, "reference": calls}
        got = simulate(list(_short_trace()), _with_first_fit(base, fn, log)).utilization
        assert "first" not in log, (f"replaying a {len(_short_trace())}-request ShareGPT-shaped trace under "
                                    f"{base.name} with your first_fit: {got:.2%} of KV memory live, with minikv's "
                                    f"{want:.2%}. First placement that differs: {log['first']}")


CHECKS = [check_first_fit_edge_cases, check_first_fit_on_many_layouts,
          check_slab_waste_cases, check_slab_waste_on_many_slabs,
          check_slab_waste_matches_the_simulator,
          check_external_fragmentation_cases, check_external_fragmentation_on_many_layouts,
          check_first_fit_in_the_simulator]
