"""Checks for exercise 03 (paged): the learner's `MyBlockAllocator` (LIFO), `MyBlockTable` (with a
sliding window) and `my_paged_attention` (over a head-major pool), each compared with minikv's own on
many inputs, then the allocator and the table together inside `PagedKVCache` driving a real model;
and a design, `MyRunAllocator`, graded against an objective that minikv's own allocator misses.

The first eight checks teach the mechanics, and a paste of minikv's `blocks.py` and `attention.py`
with small adapters passes them (their answers are variants of minikv's, so they must). Full marks take
the design part (d), graded in `minikv.grading.checks.run_allocator` (why this design, the gate, the
objective and its target are in its docstring), where nothing of minikv's passes.

Notebook 03 prints minikv's FIFO allocator and plain block table, so the exercise asks for variants
that need the same understanding but not the same code:

* The allocator replays random operation sequences (hypothesis draws them and shrinks a failure
  to the shortest one) on the learner's class and on `minikv.blocks.BlockAllocator`, and compares
  after every operation: return values, errors, `num_free`, `num_used` and every refcount (blocks
  paired by the moment they were allocated). On top, the order: `allocate` must hand out the block
  freed *most recently* (last in, first out), and a fresh pool hands out 0, 1, 2, ...
* The block table is replayed against `WindowTable`, minikv's `BlockTable` plus a sliding window
  (below): several tables sharing one pool, block sizes 1, 2, 3, 5, 7 and 16, no window or windows of
  1 to 4 blocks; once with a roomy pool and once with a small one that runs out, where a failed
  append must leave the table and the pool as they were.
* Paged attention is compared with `paged_attention_ref` on random batches from
  `random_paged_inputs`, handed to the learner with the pool laid out
  `[num_blocks, num_kv_heads, block_size, head_dim]`: GQA ratios 1, 3 and 4 (and MQA), block sizes
  1, 7 and 16, lengths that are and are not block multiples, garbage block ids past every row's end.
* The real-model check runs SmolLM2-135M (the tiny random Llama if SmolLM2 is not installed)
  with `PagedKVCache(..., block_size=7, allocator=MyBlockAllocator(n), table_cls=MyBlockTable)`
  and wants DynamicCache's greedy tokens, then every block back after `cache.reset()`.

Every failure message names the failing input: the operation sequence, the shapes, the row.

Delegation: the graded classes and function may use `minikv.blocks.OutOfBlocks` and `blocks_for`
(and torch); minikv's `BlockAllocator`, `BlockTable` and `minikv.attention.paged_attention_ref` (and
the kernel, and the objective's baseline `FreeListBaseline`) are forbidden in them (`FORBIDDEN`).
Checks hand the learner's table a minikv `BlockAllocator` that lives in the grader: that one it may,
and must, use.
"""

from __future__ import annotations

import functools
import random

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minikv.attention import paged_attention_ref, random_paged_inputs
from minikv.blocks import BlockAllocator, BlockTable, blocks_for
from minikv.grading import NotImplementedYet, call, learner, one_torch_thread, peek, run_hypothesis
from minikv.grading.checks.run_allocator import (  # part (d), and the helpers the checks share
    CLASS_STATE,
    OUT_OF_BLOCKS_ERRORS,
    _describe,
    _outcome,
    check_run_allocator_few_runs_on_held_out_traces,
    check_run_allocator_keeps_the_hard_limits,
)

GRADED = ["MyBlockAllocator", "MyBlockTable", "my_paged_attention", "MyRunAllocator"]
FORBIDDEN = ["minikv.blocks.BlockAllocator", "minikv.blocks.BlockTable", "minikv.attention.paged_attention_ref",
             "minikv.paged.PagedKVCache", "minikv_kernels.paged_attention.paged_attention",
             "minikv.grading.public.ex03_paged.FreeListBaseline"]

MANY = settings(max_examples=100, deadline=None, database=None, derandomize=True, report_multiple_bugs=False)
TABLE_BLOCK_SIZES = (1, 2, 3, 5, 7, 16)


def _ints(values) -> list[int]:
    return [int(v) for v in values]


# ---- (a) the allocator ----------------------------------------------------------------------

@st.composite
def allocator_programs(draw):
    """A pool size and a sequence of operations; block ids are the learner's, some invalid."""
    n = draw(st.integers(1, 8))
    block = st.integers(-2, n + 1)
    op = st.one_of(st.tuples(st.just("allocate")), st.tuples(st.just("allocate")),
                   st.tuples(st.just("free"), block), st.tuples(st.just("free"), block),
                   st.tuples(st.just("incref"), block), st.tuples(st.just("refcount"), block))
    return n, draw(st.lists(op, max_size=40))


def _op_str(op) -> str:
    return f"{op[0]}({', '.join(map(str, op[1:]))})"


def replay_allocator(cls, n: int, ops) -> None:
    """Run `ops` on cls(n) and on minikv's BlockAllocator(n); raise AssertionError at the first difference."""
    ref = BlockAllocator(n)
    mine = call(cls, n)
    to_ref = list(range(n))  # learner block id -> reference block id (a permutation of the pool)
    history = [f"a = MyBlockAllocator({n})"]

    def fail(problem: str):
        raise AssertionError(f"{'; '.join(history)}: {problem}")

    def learner_value(name: str):
        attr = _outcome(lambda: call(getattr, mine, name))
        if attr[0] == "raised":
            fail(f"reading a.{name} raised {type(attr[1]).__name__}: {attr[1]}")
        return attr[1]

    def compare_state(after: str):
        names = ("num_blocks", "num_free", "num_used")
        got_all = peek(mine, [*names, *[("refcount", b) for b in range(n)]])  # one round trip
        for name, got in zip(names, got_all):
            want = getattr(ref, name)
            if got[0] == "raised":
                fail(f"{after}reading a.{name} raised {type(got[1]).__name__}: {got[1]}")
            if got[1] != want:
                fail(f"{after}a.{name} is {got[1]!r}, expected {want}")
        for b, got in enumerate(got_all[len(names):]):
            want = ref.refcount(to_ref[b])
            if got != ("ok", want):
                fail(f"{after}a.refcount({b}) {_describe(got)}, expected {want}")

    stack = list(range(n - 1, -1, -1))  # the learner's free blocks, the next to hand out last (LIFO)
    fresh = learner_value("num_free")
    if fresh != n:
        fail(f"a fresh allocator has num_free = {fresh!r}, expected {n}"
             + (" (is some state shared between instances, e.g. a list defined at class level?)" if
                isinstance(fresh, int) and fresh > n else ""))
    compare_state("")
    for op in ops:
        name, args = op[0], op[1:]
        shown = f"a.{_op_str(op)}"
        free_before = {b for b in range(n) if ref.refcount(to_ref[b]) == 0}
        ref_args = [to_ref[b] if 0 <= b < n else b for b in args]
        want = _outcome(lambda: getattr(ref, name)(*ref_args))
        got = _outcome(lambda: call(getattr(mine, name), *args))
        if want[0] == "raised":
            if name == "allocate":
                if got[0] == "raised" and isinstance(got[1], OUT_OF_BLOCKS_ERRORS):
                    pass
                elif got[0] == "raised" and isinstance(got[1], IndexError):
                    fail(f"{shown} on an empty pool raised IndexError ({got[1]}): popping an empty list? Raise "
                         "OutOfBlocks(1, 0) (from minikv.blocks; a RuntimeError) with a clear message instead")
                else:
                    fail(f"{shown} on an empty pool {_describe(got)}; expected it to raise OutOfBlocks "
                         "(any RuntimeError or MemoryError)")
            elif not (got[0] == "raised" and isinstance(got[1], ValueError)):
                fail(f"{shown} {_describe(got)}; expected ValueError ({want[1]})")
        else:
            if got[0] == "raised":
                fail(f"{shown} raised {type(got[1]).__name__}: {got[1]}; minikv's BlockAllocator {_describe(want)}")
            if name == "allocate":
                m = got[1]
                if not isinstance(m, int) or not 0 <= m < n:
                    fail(f"{shown} returned {m!r}; expected a free block id, an int in 0..{n - 1}")
                if m not in free_before:
                    fail(f"{shown} returned block {m}, which is already allocated (refcount "
                         f"{ref.refcount(to_ref[m])}): a block must leave the free list when it is handed out")
                if m != stack[-1]:
                    fail(f"{shown} returned block {m}, expected block {stack[-1]}: last in, first out, the block "
                         f"freed most recently goes first, and a fresh pool hands out 0, 1, 2, ... (the free "
                         f"blocks, next out last: {stack})")
                stack.pop()
                # Pair the learner's block m with the reference's new block: swap them in the permutation.
                x = to_ref.index(want[1])
                to_ref[m], to_ref[x] = want[1], to_ref[m]
                shown = f"{shown} -> {m}"
            elif name == "free" and want[1] is True and got[1] is True:
                stack.append(args[0])
            if name in ("free", "refcount") and got[1] != want[1]:
                what = {True: " (its last owner let go: it is free again)",
                        False: " (another owner still holds it)"}.get(want[1], "") if name == "free" else ""
                fail(f"{shown} returned {got[1]!r}, expected {want[1]!r}{what}")
        history.append(shown)
        compare_state("then ")


def _allocator_cls(ns):
    return learner(ns, "MyBlockAllocator")


def check_allocator_matches_minikv_on_random_operations(ns):
    cls = _allocator_cls(ns)
    replay_allocator(cls, 2, [("allocate",), ("incref", 0), ("free", 0)])  # a stub stops here, quickly
    run_hypothesis(MANY(given(allocator_programs())(lambda prog: replay_allocator(cls, *prog))), CLASS_STATE)


def _expect_raises(setup: str, fn, types, what: str) -> None:
    got = _outcome(lambda: call(fn))
    if not (got[0] == "raised" and isinstance(got[1], types)):
        names = " or ".join(t.__name__ for t in types) if isinstance(types, tuple) else types.__name__
        raise AssertionError(f"{setup}: {_describe(got)}; expected {names} ({what})")


def check_allocator_errors(ns):
    cls = _allocator_cls(ns)
    a = call(cls, 2)
    b = call(a.allocate)
    call(a.free, b)
    setup = f"a = MyBlockAllocator(2); b = a.allocate() -> {b}; a.free(b); a.free(b)"
    _expect_raises(setup, lambda: a.free(b), ValueError, "double free: the block is already free")
    got = (call(lambda: a.num_free), call(a.refcount, b))
    if got != (2, 0):
        raise AssertionError(f"{setup}: afterwards (num_free, refcount(b)) = {got}, expected (2, 0): "
                             "a refused free must change nothing")
    blocks = [call(a.allocate), call(a.allocate)]
    if sorted(blocks) != [0, 1]:
        raise AssertionError(f"{setup}; a.allocate(); a.allocate() returned {blocks}, expected blocks 0 and 1 once "
                             f"each: did the double free put block {b} on the free list twice?")

    for bad in (-1, 3, 100):
        for method in ("free", "incref", "refcount"):
            a = call(cls, 3)
            _expect_raises(f"a = MyBlockAllocator(3); a.{method}({bad})", lambda: getattr(a, method)(bad), ValueError,
                           f"block {bad} does not exist: valid ids are 0..2")

    a = call(cls, 3)
    _expect_raises("a = MyBlockAllocator(3); a.incref(1)", lambda: a.incref(1), ValueError,
                   "block 1 is free: only an allocated block can get another owner")

    a = call(cls, 1)
    b = call(a.allocate)
    setup = f"a = MyBlockAllocator(1); a.allocate() -> {b}; a.allocate()"
    got = _outcome(lambda: call(a.allocate))
    if got[0] == "raised" and isinstance(got[1], IndexError):
        raise AssertionError(f"{setup}: raised IndexError ({got[1]}): popping an empty list? Raise "
                             "OutOfBlocks(1, 0) (from minikv.blocks; a RuntimeError) with a clear message instead")
    if not (got[0] == "raised" and isinstance(got[1], OUT_OF_BLOCKS_ERRORS)):
        raise AssertionError(f"{setup}: {_describe(got)}; the pool is empty: expected OutOfBlocks "
                             "(any RuntimeError or MemoryError)")
    if call(lambda: a.num_free) != 0 or call(a.refcount, b) != 1:
        raise AssertionError(f"{setup}: after the refused allocate, num_free = {a.num_free} and refcount({b}) = "
                             f"{a.refcount(b)}; expected 0 and 1: a refused allocate must change nothing")

    a = call(cls, 2)
    b = call(a.allocate)
    call(a.incref, b)
    steps = f"a = MyBlockAllocator(2); b = a.allocate() -> {b}; a.incref(b)"
    for expected in (False, True):
        got = call(a.free, b)
        steps += f"; a.free(b) -> {got!r}"
        if got is not expected:
            raise AssertionError(f"{steps}: expected {expected} (True only when the last owner lets go)")
    _expect_raises(steps + "; a.free(b)", lambda: a.free(b), ValueError, "its reference count is already 0")


# ---- (b) the block table ----------------------------------------------------------------

class WindowTable(BlockTable):
    """The reference: minikv's BlockTable, plus a sliding window. After each append, every block
    whose tokens all lie before the last `window` tokens goes back to the allocator, and its entry
    in `blocks` becomes -1 (so logical block i stays at index i). slots_for refuses those tokens."""

    def __init__(self, block_size: int, allocator, window: int | None = None):
        super().__init__(block_size, allocator)
        self.window = window

    def append_tokens(self, n: int) -> list[int]:
        slots = super().append_tokens(n)
        if self.window is not None:
            for i in range(max(0, (self.num_tokens - self.window) // self.block_size)):
                if self.blocks[i] != -1:
                    self.allocator.free(self.blocks[i])
                    self.blocks[i] = -1
        return slots

    def slots_for(self, positions):
        positions = list(positions)
        for t in positions:
            if 0 <= t < self.num_tokens and self.blocks[t // self.block_size] == -1:
                raise IndexError(f"token {t} fell out of the window: its block was given back")
        return super().slots_for(positions)

    def free(self) -> None:
        for block in self.blocks:
            if block != -1:
                self.allocator.free(block)
        self.blocks, self.num_tokens = [], 0


@st.composite
def table_programs(draw, small_pool: bool, windows: bool = False):
    bs = draw(st.sampled_from(TABLE_BLOCK_SIZES))
    num_tables = draw(st.integers(1, 3))
    num_blocks = draw(st.integers(1, 10)) if small_pool else 2000
    window = draw(st.integers(1, 4 * bs)) if windows else None
    table = st.integers(0, num_tables - 1)
    tokens = st.integers(0, 3 * bs + 2)
    op = st.one_of(*[st.tuples(st.just("append_tokens"), table, tokens)] * 3,
                   st.tuples(st.just("free"), table),
                   st.tuples(st.just("slots_for"), table, st.lists(st.integers(-1, 40), max_size=4)),
                   st.tuples(st.just("blocks_needed"), table, tokens))
    return bs, num_blocks, num_tables, draw(st.lists(op, max_size=30)), window


def replay_tables(cls, bs: int, num_blocks: int, num_tables: int, ops, window: int | None = None) -> None:
    """Run `ops` on `num_tables` of the learner's tables and of the reference's, each side on its own
    minikv BlockAllocator(num_blocks); raise AssertionError at the first difference.

    Block ids may differ from the reference's (a table that frees its blocks in another order changes
    which blocks the pool hands out next); what must hold is the structure: as many blocks (and -1
    entries, at the same places) and tokens as the reference, each block taken from the pool and
    owned once, old blocks kept in place until the window drops them, and every slot =
    blocks[t // block_size] * block_size + t % block_size."""
    ref_pool, my_pool = BlockAllocator(num_blocks), BlockAllocator(num_blocks)
    refs = [WindowTable(bs, ref_pool, window) for _ in range(num_tables)]
    extra = () if window is None else (window,)
    mine = [call(cls, bs, my_pool, *extra) for _ in range(num_tables)]
    names = "abc"[:num_tables]
    made = f"MyBlockTable({bs}, pool{', ' + str(window) if window is not None else ''})"
    history = [f"pool = BlockAllocator({num_blocks}); " + ", ".join(names) + " = " + ", ".join(made for _ in names)]

    def fail(problem: str):
        raise AssertionError(f"{'; '.join(history)}: {problem}")

    def read(t) -> tuple[list, int, int]:
        got = peek(t, ["blocks", "num_tokens", ("__len__",)])  # one round trip
        for what, g in zip((".blocks", ".num_tokens", "len()"), got):
            if g[0] == "raised":
                fail(f"reading {what} raised {type(g[1]).__name__}: {g[1]}")
        try:
            blocks = list(got[0][1])
        except TypeError:
            fail(f".blocks is {got[0][1]!r}, expected a list of block ids")
        return blocks, got[1][1], got[2][1]

    def compare_state(before_blocks, states):
        for i, (r, (blocks, tokens, length)) in enumerate(zip(refs, states)):
            if tokens != r.num_tokens:
                fail(f"then {names[i]}.num_tokens is {tokens!r}, expected {r.num_tokens}")
            if len(blocks) != len(r.blocks):
                fail(f"then {names[i]}.blocks is {blocks} ({len(blocks)} entries), expected {len(r.blocks)} "
                     f"for {r.num_tokens} token(s) of block_size {bs}")
            if length != len(r):
                fail(f"then len({names[i]}) is {length!r}, expected {len(r)} (its number of block entries)")
            dropped = [j for j, b in enumerate(r.blocks) if b == -1]
            if [j for j, b in enumerate(blocks) if b == -1] != dropped:
                fail(f"then {names[i]}.blocks = {blocks}; expected -1 exactly at {dropped or 'no entry'}: with a "
                     f"window of {window} tokens, a block is given back once all its tokens are older than the "
                     f"last {window} of the {r.num_tokens}" if window is not None else
                     f"then {names[i]}.blocks = {blocks}: without a window no block is given back before free()")
            old = before_blocks[i]
            if any(o != b and b != -1 for o, b in zip(old, blocks)):
                fail(f"then {names[i]}.blocks changed from {old} to {blocks}: a table only appends new blocks "
                     "at the end (or gives old ones back, as -1, or all of them in free())")
            if any(not isinstance(b, int) or not 0 <= b < num_blocks or my_pool.refcount(b) != 1
                   for b in blocks if b != -1):
                fail(f"then {names[i]}.blocks = {blocks} holds a block the pool has not handed out (or gave "
                     "back): take each block with allocator.allocate()")
        owners = [b for blocks, _, _ in states for b in blocks if b != -1]
        if len(set(owners)) != len(owners):
            fail("then a block is in two tables, or twice in one: "
                 + ", ".join(f"{n}.blocks = {st_[0]}" for n, st_ in zip(names, states)))
        if my_pool.num_free != ref_pool.num_free:
            fail(f"then the pool has {my_pool.num_free} free blocks, expected {ref_pool.num_free}"
                 + (": did the table give back the blocks that fell out of the window?" if window else ""))

    before = [read(t)[0] for t in mine]
    for op in ops:  # (no comparison before the first op: a fresh table's state is the given __init__)
        name, i, args = op[0], op[1], op[2:]
        r, m = refs[i], mine[i]
        free_before = my_pool.num_free
        want = _outcome(lambda: getattr(r, name)(*args))
        got = _outcome(lambda: call(getattr(m, name), *args))
        history.append(f"{names[i]}.{name}({', '.join(map(repr, args))})")
        states = [read(t) for t in mine]
        if want[0] == "raised":
            if name == "append_tokens" and isinstance(want[1], OUT_OF_BLOCKS_ERRORS):
                if not (got[0] == "raised" and isinstance(got[1], OUT_OF_BLOCKS_ERRORS)):
                    fail(f"it needs {want[1].needed} new block(s) but the pool has {want[1].free} free: it "
                         f"{_describe(got)}; expected OutOfBlocks (any RuntimeError or MemoryError)")
                after, tokens, _ = states[i]
                if after != before[i] or tokens != r.num_tokens or my_pool.num_free != free_before:
                    fail(f"it rightly failed ({want[1].needed} block(s) needed, {want[1].free} free), but not "
                         f"all-or-nothing: {names[i]}.blocks went from {before[i]} to {after}, num_tokens to "
                         f"{tokens} (expected {r.num_tokens}), the pool's free blocks from {free_before} to "
                         f"{my_pool.num_free}. Compare blocks_needed(n) with allocator.num_free "
                         "before taking any block")
            elif not (got[0] == "raised" and isinstance(got[1], next(
                    t for t in (IndexError, ValueError, type(want[1])) if isinstance(want[1], t)))):
                fail(f"it {_describe(got)}; expected {type(want[1]).__name__} ({want[1]})")
            compare_state(before, states)
            before = [s_[0] for s_ in states]
            continue
        if got[0] == "raised":
            fail(f"it raised {type(got[1]).__name__}: {got[1]}; the reference {_describe(want)}")
        compare_state(before, states)
        before = [s_[0] for s_ in states]
        if name in ("append_tokens", "slots_for"):
            positions = list(range(r.num_tokens - args[0], r.num_tokens)) if name == "append_tokens" else args[0]
            blocks = states[i][0]  # the learner's own blocks (-1: given back, its slots no longer checkable)
            try:
                slots = _ints(got[1])
            except (TypeError, ValueError):
                fail(f"it returned {got[1]!r}; expected a list of ints (slots)")
            expected = [blocks[t // bs] * bs + t % bs for t in positions]
            held = [k for k, t in enumerate(positions) if blocks[t // bs] != -1]
            if len(slots) != len(positions) or [slots[k] for k in held] != [expected[k] for k in held]:
                which = f" of tokens {positions[0]}..{positions[-1]}" if name == "append_tokens" and positions else ""
                fail(f"it returned slots {slots}, expected {expected}{which}: token t lives at slot "
                     f"blocks[t // {bs}] * {bs} + t % {bs}, and {names[i]}.blocks = {blocks}")
        elif got[1] != want[1]:
            fail(f"it returned {got[1]!r}, expected {want[1]!r} ({names[i]} holds {r.num_tokens} tokens in "
                 f"{len(r)} blocks of {bs})")


def _table_cls(ns):
    return learner(ns, "MyBlockTable")


def check_block_table_slots(ns):
    cls = _table_cls(ns)
    replay_tables(cls, 7, 16, 2, [("append_tokens", 0, 9), ("append_tokens", 1, 3), ("blocks_needed", 0, 6),
                                  ("append_tokens", 0, 6), ("slots_for", 0, [0, 8, 14]), ("free", 1)])
    for bs in TABLE_BLOCK_SIZES:  # one token at a time, across several block boundaries
        replay_tables(cls, bs, 64, 2, [("append_tokens", t % 2, 1) for t in range(4 * bs + 3)] + [("free", 0)])
    run_hypothesis(MANY(given(table_programs(small_pool=False))(lambda prog: replay_tables(cls, *prog))), CLASS_STATE)


def check_block_table_all_or_nothing(ns):
    cls = _table_cls(ns)
    # 3 blocks of 4; the first append takes 2, the second needs 2 but only 1 is free: it must take none.
    replay_tables(cls, 4, 3, 2, [("append_tokens", 0, 5), ("append_tokens", 1, 6), ("append_tokens", 1, 4)])
    run_hypothesis(MANY(given(table_programs(small_pool=True))(lambda prog: replay_tables(cls, *prog))), CLASS_STATE)


def check_block_table_sliding_window(ns):
    cls = _table_cls(ns)
    # blocks of 4, a window of 6 tokens: after 10 tokens, tokens 0..3 (block 0) are all out of it.
    replay_tables(cls, 4, 16, 1, [("append_tokens", 0, 9), ("append_tokens", 0, 1), ("slots_for", 0, [4, 9]),
                                  ("slots_for", 0, [3]), ("append_tokens", 0, 7), ("free", 0)], window=6)
    for bs in (1, 3, 16):  # one token at a time, as decoding does
        replay_tables(cls, bs, 64, 1, [("append_tokens", 0, 1)] * (3 * bs + 2), window=bs + 1)
    for small_pool in (False, True):
        programs = given(table_programs(small_pool=small_pool, windows=True))
        run_hypothesis(MANY(programs(lambda prog: replay_tables(cls, *prog))), CLASS_STATE)


# ---- (c) paged attention ------------------------------------------------------------------

def attention_cases(groups, count: int, seed: int):
    """(seq_lens, num_heads, num_kv_heads, head_dim, block_size) for random decode batches."""
    rng = random.Random(seed)
    cases = []
    for k in range(count):
        group = groups[k % len(groups)]
        block_size = (1, 7, 16)[k % 3]
        kv_heads = rng.choice([1, 2, 3]) if k % 4 else 1
        head_dim = rng.choice([8, 16, 64])
        num_seqs = rng.randint(1, 4)
        # lengths that are, and are not, block multiples; at least one token (the new one)
        lens = [rng.choice([1, block_size, 2 * block_size, rng.randint(1, 50)]) for _ in range(num_seqs)]
        cases.append((lens, group * kv_heads, kv_heads, head_dim, block_size))
    return cases


def compare_attention(fn, lens, num_heads, num_kv_heads, head_dim, block_size, seed=0) -> None:
    inputs = random_paged_inputs(lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                 block_size=block_size, spare_table_entries=2, seed=seed)
    scale = head_dim ** -0.5
    want = paged_attention_ref(*inputs, scale)
    shape = (f"seq_lens={lens}, num_heads={num_heads}, num_kv_heads={num_kv_heads}, head_dim={head_dim}, "
             f"block_size={block_size}, block_tables={inputs.block_tables.tolist()}")
    # The learner's pool is head-major: [num_blocks, num_kv_heads, block_size, head_dim].
    inputs = inputs._replace(key_cache=inputs.key_cache.transpose(1, 2).contiguous(),
                             value_cache=inputs.value_cache.transpose(1, 2).contiguous())
    args = [t.clone() for t in inputs]
    try:
        got = call(fn, *args, scale)
    except NotImplementedYet:
        raise
    except Exception as err:  # noqa: BLE001
        indexing = isinstance(err, IndexError) or "index" in str(err)
        hint = (" (entries past a sequence's last block are garbage, like -1 or 2**31-1: read only the first "
                "ceil(seq_len / block_size) entries of its row)") if indexing else ""
        raise AssertionError(f"my_paged_attention raised {type(err).__name__}: {err}{hint}, for {shape}") from None
    if not isinstance(got, torch.Tensor):
        raise AssertionError(f"my_paged_attention returned {type(got).__name__}, expected a tensor, for {shape}")
    if tuple(got.shape) != tuple(want.shape):
        raise AssertionError(f"my_paged_attention returned shape {tuple(got.shape)}, expected {tuple(want.shape)} "
                             f"= [num_seqs, num_heads, head_dim], for {shape}")
    if not torch.allclose(got.float(), want.float(), rtol=1e-4, atol=1e-5):
        err = (got.float() - want.float()).abs()
        seq, head = divmod(int(err.amax(-1).argmax()), num_heads)
        raise AssertionError(
            f"my_paged_attention differs from paged_attention_ref by up to {float(err.max()):.3g} (sequence {seq}, "
            f"query head {head}, which reads KV head {head // (num_heads // num_kv_heads)}) for {shape}")
    for before, after, name in zip(inputs, args, ("query", "key_cache", "value_cache", "block_tables", "seq_lens")):
        if not torch.equal(before, after):
            raise AssertionError(f"my_paged_attention changed its input {name} in place, for {shape}")


@one_torch_thread()
def check_paged_attention_multi_head(ns):
    fn = learner(ns, "my_paged_attention")
    compare_attention(fn, [5, 1, 9], 2, 2, 8, 4)
    for seed, case in enumerate(attention_cases([1], 30, seed=1)):
        compare_attention(fn, *case, seed=seed)


@one_torch_thread()
def check_paged_attention_grouped_query(ns):
    fn = learner(ns, "my_paged_attention")
    compare_attention(fn, [5, 1, 9], 6, 2, 8, 4)  # 3 query heads per KV head
    for seed, case in enumerate(attention_cases([3, 4], 40, seed=2)):
        compare_attention(fn, *case, seed=seed)


# ---- all together: a real model ----------------------------------------------------------

CHATS = ["What is the capital of France?", "Write a haiku about memory.",
         "In one sentence, what does a KV cache do?"]
NEW_TOKENS = 8
BLOCK_SIZE = 7


@functools.lru_cache(maxsize=1)
def _real_model():
    """(model, name, input_ids, attention_mask, DynamicCache's greedy tokens) in float32, once per process."""
    from transformers import DynamicCache

    from minikv.models import ModelNotAvailable, load_model, tiny_random_llama

    try:  # float32 on any machine or $MINIKV_DTYPE: equality is asserted, which only float32 promises
        model, tokenizer = load_model("smollm2-135m", device="cpu", dtype=torch.float32)
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                               add_generation_prompt=True) for q in CHATS]
        enc = tokenizer(texts, padding=True, padding_side="left", return_tensors="pt")
        ids, mask, name = enc["input_ids"], enc["attention_mask"], "SmolLM2-135M"
    except ModelNotAvailable as err:
        print(f"note: {err} Checking on the tiny random Llama instead.")
        model, name = tiny_random_llama(), "the tiny random Llama"
        ids = torch.randint(3, 256, (3, 11), generator=torch.Generator().manual_seed(0))
        mask = torch.ones_like(ids)
        mask[1, :4] = mask[2, :7] = 0  # left padding
    with torch.inference_mode():
        expected = model.generate(ids, attention_mask=mask, past_key_values=DynamicCache(config=model.config),
                                  do_sample=False, max_new_tokens=NEW_TOKENS)
    return model, name, ids, mask, expected


@one_torch_thread()
def check_real_model_with_your_allocator_and_table(ns):
    from minikv.paged import PagedKVCache

    alloc_cls, table_cls = _allocator_cls(ns), _table_cls(ns)
    call(alloc_cls, 4)  # stubs: say so before loading a model
    call(lambda: table_cls(BLOCK_SIZE, BlockAllocator(4)).append_tokens(1))
    model, name, ids, mask, expected = _real_model()
    seq = expected.shape[1] - 1  # tokens cached per row at the end
    per_row = blocks_for(seq, BLOCK_SIZE)
    num_blocks = len(CHATS) * per_row + 2  # a tight pool: two blocks to spare
    allocator = call(alloc_cls, num_blocks)
    built = f"PagedKVCache(model.config, num_blocks={num_blocks}, block_size={BLOCK_SIZE}, " \
            f"allocator=MyBlockAllocator({num_blocks}), table_cls=MyBlockTable)"
    cache = PagedKVCache(model.config, num_blocks=num_blocks, block_size=BLOCK_SIZE, allocator=allocator,
                         table_cls=table_cls)
    try:
        with torch.inference_mode():
            out = call(model.generate, ids, attention_mask=mask, past_key_values=cache, do_sample=False,
                       max_new_tokens=NEW_TOKENS)
    except AssertionError:
        raise
    except Exception as err:  # noqa: BLE001
        raise AssertionError(f"{name}.generate with {built} raised {type(err).__name__}: {err}") from None
    prompt = ids.shape[1]
    for row in range(len(CHATS)):
        if not torch.equal(out[row], expected[row]):
            got, want = out[row, prompt:].tolist(), expected[row, prompt:].tolist()
            first = next((i for i, (g, w) in enumerate(zip(got, want)) if g != w), min(len(got), len(want)))
            raise AssertionError(
                f"{name} with {built}: row {row}'s greedy tokens {got} differ from DynamicCache's {want} from new "
                f"token {first} on: K/V are read from the wrong slots (slot = block * block_size + offset?)")
    tables = cache.block_tables.tolist()
    if cache.seq_lens.tolist() != [seq] * len(CHATS) or any(len(t) != per_row for t in tables):
        raise AssertionError(f"after generate, {built} holds seq_lens {cache.seq_lens.tolist()} in block tables "
                             f"{tables}; expected {seq} tokens in {per_row} blocks per row")
    used = call(lambda: allocator.num_used)
    if used != len(CHATS) * per_row:
        raise AssertionError(f"after generate the block tables hold {len(CHATS) * per_row} blocks, but your "
                             f"allocator says num_used = {used}")
    cache.reset()  # every table's free(): all blocks back
    free = call(lambda: allocator.num_free)
    if free != num_blocks:
        raise AssertionError(f"after cache.reset() (every table's free()) your allocator has {free} free blocks, "
                             f"expected all {num_blocks}: some block was not given back")


# ---- (d) the design: few runs per sequence, in minikv/grading/checks/run_allocator.py -------------------
CHECKS = [check_allocator_matches_minikv_on_random_operations, check_allocator_errors, check_block_table_slots,
          check_block_table_all_or_nothing, check_block_table_sliding_window, check_paged_attention_multi_head,
          check_paged_attention_grouped_query, check_real_model_with_your_allocator_and_table,
          check_run_allocator_keeps_the_hard_limits, check_run_allocator_few_runs_on_held_out_traces]

# The exercise's parts and their points, out of 100 (its first cell states the same): the design decides full marks.
PARTS = {"1. `MyBlockAllocator`": (15, [check_allocator_matches_minikv_on_random_operations, check_allocator_errors]),
         "2. `MyBlockTable`": (15, [check_block_table_slots, check_block_table_all_or_nothing,
                                    check_block_table_sliding_window]),
         "3. `my_paged_attention`": (10, [check_paged_attention_multi_head, check_paged_attention_grouped_query]),
         "1-2 together: SmolLM2 on your allocator and table": (10, [check_real_model_with_your_allocator_and_table]),
         "4. `MyRunAllocator`: the hard limits": (15, [check_run_allocator_keeps_the_hard_limits]),
         "4. `MyRunAllocator`: the objective": (35, [check_run_allocator_few_runs_on_held_out_traces])}
