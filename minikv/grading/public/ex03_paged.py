"""What exercise 03's design part uses besides the learner's own code: a serving trace of sequences
that arrive, grow token by token and finish (or are preempted) in a pool of KV blocks, a driver that
replays it on a per-sequence allocator and measures how many physically contiguous *runs* each
sequence's blocks form, and minikv's own free list as the baseline.

Why runs: a sequence whose blocks lie in few runs is cheap to move. Swapping it out to CPU memory,
offloading it to a prefix store, or sending it to another machine (disaggregated prefill) copies
its blocks, and a copy costs one call (one DMA descriptor, one ``cudaMemcpyAsync``) per run, not per
block; a kernel reading one run can issue longer loads. minikv's FIFO free list, after some churn,
hands a sequence blocks scattered all over the pool: nearly a run per block.

Public on purpose: the notebook imports these (``from minikv.grading.public.ex03_paged import
TRACES, objective, simulate``), and a submission's process may read this module. It holds no answer
and no passing rule: the target and the held-out seeds live in ``minikv/grading/checks/run_allocator.py``.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

from minikv.blocks import BlockAllocator, OutOfBlocks, blocks_for
from minikv.grading.grader import NotImplementedYet, call

BLOCK_SIZE = 16    # tokens per block (vLLM's default)
NUM_TRACES = 6     # traces per measurement: one trace's figure moves with its luck, six summed much less


@dataclass
class Trace:
    """A serving trace: requests (prompt tokens, output tokens) arriving at once, served by continuous
    batching in a pool of `num_blocks` blocks with at most `max_running` sequences at a time."""
    num_blocks: int
    max_running: int
    requests: list[tuple[int, int]]
    block_size: int = BLOCK_SIZE

    def describe(self) -> str:
        return (f"pool of {self.num_blocks} blocks of {self.block_size}, at most {self.max_running} running, "
                f"{len(self.requests)} requests")


def runs(blocks: list[int]) -> int:
    """How many physically contiguous runs `blocks` (a sequence's table, in token order) forms: one,
    plus one wherever the next block is not the one right after the previous. [4, 5, 6, 9, 10] -> 2."""
    return (1 if blocks else 0) + sum(1 for a, b in zip(blocks, blocks[1:]) if b != a + 1)


def draw_trace(rng: random.Random) -> Trace:
    """30-50 chat requests (prompts and outputs log-normal around 120 tokens, up to 1,024 each) in a
    pool of 12-30% of what they need together (but room for the largest), 8, 16 or 32 at a time."""
    requests = [(min(1024, int(rng.lognormvariate(4.8, 0.9))) + 1, min(1024, int(rng.lognormvariate(4.8, 0.8))) + 1)
                for _ in range(rng.randint(30, 50))]
    total = sum(blocks_for(p + o, BLOCK_SIZE) for p, o in requests)
    largest = max(blocks_for(p + o, BLOCK_SIZE) for p, o in requests)
    num_blocks = max(largest + 8, int(total * rng.uniform(0.12, 0.3)))
    return Trace(num_blocks, rng.choice([8, 16, 32]), requests)


def draw_traces(seed: int, n: int = NUM_TRACES) -> list[Trace]:
    rng = random.Random(seed)
    return [draw_trace(rng) for _ in range(n)]


# Small traces the notebook shows first: a few sequences, a pool small enough to churn.
TRACES = [
    Trace(40, 4, [(40, 60), (20, 90), (70, 30), (10, 120), (50, 50), (30, 80)]),
    Trace(64, 8, [(100, 40), (16, 100), (33, 64), (48, 48), (5, 150), (80, 20), (64, 64), (20, 20), (90, 90)]),
]


class FreeListBaseline:
    """The lecture's allocator as a per-sequence allocator: minikv's `BlockAllocator` (a FIFO free list)
    hands out blocks, whichever sequence asks. The baseline of the objective."""

    def __init__(self, num_blocks: int):
        self._pool = BlockAllocator(num_blocks)
        self._tables: dict[int, list[int]] = {}

    @property
    def num_free(self) -> int:
        return self._pool.num_free

    def allocate(self, seq_id: int, n: int) -> list[int]:
        if n > self._pool.num_free:
            raise OutOfBlocks(n, self._pool.num_free)
        blocks = [self._pool.allocate() for _ in range(n)]
        self._tables.setdefault(seq_id, []).extend(blocks)
        return blocks

    def free(self, seq_id: int) -> None:
        for block in self._tables.pop(seq_id):
            self._pool.free(block)


@dataclass
class Run:
    """One trace served with one allocator, measured."""
    runs: int = 0          # summed over every sequence moved (finished or preempted): its table's runs
    blocks: int = 0        # the blocks of those tables (runs can be no more than this, no fewer than moves)
    moves: int = 0         # sequences moved: each finish and each preemption
    preemptions: int = 0
    calls: int = 0         # allocate and free calls made on the allocator
    per_move: list[int] = field(default_factory=list)  # each move's runs, in order


class HardLimit(AssertionError):
    """The allocator broke a rule no objective can excuse: a block handed out twice, a block lost, a
    refusal while enough blocks were free."""


def simulate(allocator_cls, trace: Trace) -> Run:
    """Serve `trace` with `allocator_cls(trace.num_blocks)` and measure its runs.

    The engine is continuous batching in miniature: it admits waiting requests in order while their
    prompt's blocks plus a block of headroom per running sequence are free; each step every running
    sequence adds one token and asks for a block when its last one is full; when none is free it
    preempts the most recently admitted sequence (recompute: that request waits again, its tokens so
    far as its new prompt). A finished or preempted sequence is *moved*: its table's runs are counted
    (swapping it out, or offloading its K/V, copies one segment per run), then it is freed.
    Which blocks a sequence gets never changes when anything happens, only where its blocks are: every
    allocator that keeps the hard limits sees the same events.

    Raises `HardLimit` at the first broken rule, naming the step: the allocator must hand out exactly `n`
    blocks that are free (ids in range, none twice), refuse with OutOfBlocks (a RuntimeError) only when
    fewer than `n` are free and then change nothing, report `num_free` exactly, and get every block back
    when a sequence is freed."""
    n_blocks, bs = trace.num_blocks, trace.block_size
    mine = call(allocator_cls, n_blocks)
    owner: dict[int, int] = {}               # block -> the sequence holding it (the truth, kept here)
    tables: dict[int, list[int]] = {}        # sequence -> its blocks, in the order they were handed out
    out = Run()
    log: deque[str] = deque(maxlen=4)        # the last operations, for a failure message

    def fail(problem: str):
        raise HardLimit(f"{trace.describe()}; after {' '.join(log) or 'nothing'}: {problem}")

    def allocate(seq: int, n: int) -> None:
        out.calls += 1
        log.append(f"allocate({seq}, {n});")
        try:
            got = call(mine.allocate, seq, n)
        except NotImplementedYet:
            raise
        except Exception as err:  # noqa: BLE001 - the learner's code may raise anything; we describe it
            fail(f"allocate({seq}, {n}) raised {type(err).__name__}: {err}, with {n_blocks - len(owner)} blocks free")
        if not isinstance(got, list) or len(got) != n or not all(isinstance(b, int) for b in got):
            fail(f"allocate({seq}, {n}) returned {got!r}: expected a list of {n} block ids (ints)")
        for b in got:
            if not 0 <= b < n_blocks:
                fail(f"allocate({seq}, {n}) returned block {b}: valid ids are 0..{n_blocks - 1}")
            if b in owner:
                fail(f"allocate({seq}, {n}) returned {got}: block {b} is already held by sequence {owner[b]} "
                     "(handed out twice)")
            owner[b] = seq
        tables.setdefault(seq, []).extend(got)

    def move_and_free(seq: int) -> None:
        blocks = tables.pop(seq)
        r = runs(blocks)
        out.runs, out.blocks, out.moves = out.runs + r, out.blocks + len(blocks), out.moves + 1
        out.per_move.append(r)
        out.calls += 1
        log.append(f"free({seq});")
        try:
            call(mine.free, seq)
        except NotImplementedYet:
            raise
        except Exception as err:  # noqa: BLE001
            fail(f"free({seq}) raised {type(err).__name__}: {err}")
        for b in blocks:
            del owner[b]
        free = call(lambda: mine.num_free)
        if free != n_blocks - len(owner):
            fail(f"num_free is {free!r}, but {len(owner)} of {n_blocks} blocks are held: expected "
                 f"{n_blocks - len(owner)} (a block lost, or counted twice?)")

    waiting = deque((p, o) for p, o in trace.requests)
    running: list[list[int]] = []            # [seq, tokens, tokens still to generate, prompt]
    next_seq = 0
    while waiting or running:
        while waiting and len(running) < trace.max_running:
            p, o = waiting[0]
            need = blocks_for(p, bs)
            if need + len(running) > n_blocks - len(owner):
                break
            waiting.popleft()
            allocate(next_seq, need)
            running.append([next_seq, p, o, p])
            next_seq += 1
        if not running:
            fail("nothing could be admitted into an empty pool")   # the trace fits: cannot happen honestly
        k = 0
        while k < len(running):
            seq, tokens, left, _prompt = entry = running[k]
            if tokens % bs == 0:                 # its last block is full: one more
                while len(owner) == n_blocks and running[-1] is not entry:
                    victim = running.pop()
                    out.preemptions += 1
                    move_and_free(victim[0])
                    waiting.appendleft((victim[1], victim[2]))   # recompute: all it holds is its new prompt
                if len(owner) == n_blocks:           # it is the last admitted itself: it gives way
                    running.pop(k)
                    out.preemptions += 1
                    move_and_free(seq)
                    waiting.appendleft((tokens, left))
                    continue
                allocate(seq, 1)
            entry[1], entry[2] = tokens + 1, left - 1
            if entry[2] == 0:
                running.pop(k)
                move_and_free(seq)
                continue
            k += 1
    if call(lambda: mine.num_free) != n_blocks:
        fail(f"every sequence finished, but num_free is {call(lambda: mine.num_free)!r}, expected {n_blocks}")
    return out


def objective(allocator_cls, seed: int, n: int = NUM_TRACES) -> dict:
    """Serve the `n` traces drawn from `seed` with minikv's free list (the baseline) and with
    `allocator_cls`: runs of the sequences moved, summed, and the ratio yours / the baseline's (lower is
    better). The grader calls this on every seed of its held-out set and grades the mean of the ratio."""
    traces = draw_traces(seed, n)
    base = [simulate(FreeListBaseline, t) for t in traces]
    mine = [simulate(allocator_cls, t) for t in traces]
    base_runs, my_runs = sum(r.runs for r in base), sum(r.runs for r in mine)
    return dict(seed=seed, n=n, base_runs=base_runs, runs=my_runs, ratio=my_runs / base_runs,
                blocks=sum(r.blocks for r in mine), moves=sum(r.moves for r in mine),
                preemptions=sum(r.preemptions for r in mine), calls=sum(r.calls for r in mine),
                per_trace=[(b.runs, m.runs) for b, m in zip(base, mine)])
