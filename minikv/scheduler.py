"""The scheduler: which sequences compute how many tokens this step, and who gives way when memory runs out.

Continuous (iteration-level) batching means the batch is re-decided at *every* step: finished
sequences leave, waiting ones join, and one forward pass computes a prefill chunk of one
sequence next to the single decode token of another. Each step, under a token budget
(``max_num_batched_tokens``) and a seat limit (``max_num_seqs``):

1. **decodes first**: every running sequence that has one token to compute gets it (a decode
   costs 1 token of budget and at most one new block, so latency of running requests comes first);
2. **prefill chunks** of running sequences whose prompt is not done yet fill the remaining budget
   (each chunk at most ``long_prefill_token_threshold`` tokens when that is set, vLLM V1's knob);
3. **swapped** sequences come back (swap mode), oldest first;
4. **waiting** requests are admitted, strictly first come first served (head of line: if the
   oldest waiting request does not fit, nobody behind it is admitted). A request is admitted
   only if, after taking the blocks its first chunk needs, ``watermark_blocks`` stay free: that
   headroom lets the running sequences grow into new blocks without an immediate preemption.

Steps 3 and 4 happen only in a step that preempted nobody: memory is short, and a victim let
back in at once would only be preempted again. Of vLLM's schedulers, V1 has this rule for both (it
schedules no waiting request, new or preempted, in a step that preempted); V0's chunked-prefill
scheduler held back only the swap-ins (step 3) after a preemption and admitted new prefills regardless.

**Preemption.** When a running sequence needs a block and none is free, the most recently
admitted running sequence that is not yet scheduled this step (and was admitted after the
one in need) is the victim; if there is none, the sequence in need is preempted itself.
``recompute`` frees the victim's blocks and sends it to the front of the waiting queue: it
will prefill prompt + generated tokens again (the prefix cache usually still holds most of
them). ``swap`` copies its blocks to a CPU pool (the `SwapSpace`) first and copies them back
later; when the CPU pool is full it falls back to recompute. Either way the tokens are the same as
without preemption; only time is lost.

**Block operations.** The scheduler never touches K/V: copy-on-write copies, swap-outs and swap-ins
go into the step's `SchedulerOutput.block_ops`, in the order they were decided, and the engine
applies them through the runner before the forward.

All bookkeeping is O(running sequences) per step: no scan of the block pool.

**The policy API.** Two public methods are the scheduling policy; everything else is mechanism
(queues, blocks, swapping) that a policy should not have to touch. A subclass overrides either:

* ``can_admit(seq, num_tokens, step) -> bool``: may waiting ``seq`` be admitted now with a first
  chunk of ``num_tokens`` tokens? (Its prefix-cache hits are already opened, so
  ``self.bm.blocks_needed(seq.seq_id, num_tokens)`` counts only the new blocks it takes.)
* ``choose_victim(seq, step) -> Sequence``: running ``seq`` needs a block and none is free: which
  sequence gives way? One of ``self.victim_candidates(seq, step)``, or ``seq`` itself.

Both get the step's own state, a `SchedulerStep` (the token budget left, the seats taken, which
sequences are already scheduled), and may read ``self.running``, ``self.bm`` and ``self.config``;
they decide, and the scheduler acts (admits, preempts). Exercise 06 plugs a learner's policy in
this way, and so can a server that wants another one.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from minikv.metrics import Preemption
from minikv.sequence import SeqStatus, Sequence


class SchedulerStalled(RuntimeError):
    """Requests are pending but the scheduler scheduled nothing: a policy that never admits anyone, or a
    bug. (A type, so a caller can tell it from other failures without reading its message.)"""


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler's read-only view of the engine's settings (`EngineConfig.scheduler_config` builds it,
    with the pool's size; the settings' defaults and checks live there, once)."""
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    preemption_mode: str                 # "recompute" or "swap"
    watermark_blocks: int                # free blocks kept back when admitting (0 = none)
    swap_blocks: int                     # capacity of the CPU swap pool, in blocks
    # vLLM V1's knob: the most tokens one request's prefill chunk may take in a step (None or 0: no
    # cap). The step's budget is unchanged, so a long prompt no longer takes a whole step to itself
    # while short prompts still prefill in one go. Needs chunked prefill.
    long_prefill_token_threshold: int | None


@dataclass
class Scheduled:
    """One sequence's share of a step: compute token_ids[start : start + num_tokens] into `slots`."""
    seq: Sequence
    start: int
    num_tokens: int
    slots: list[int]

    @property
    def wants_logits(self) -> bool:  # the chunk reaches the sequence's newest token: sample after it
        return self.start + self.num_tokens == len(self.seq.token_ids)


# The operations on the K/V pool a step needs before its forward. The scheduler only decides them (it
# never sees the runner); the engine applies them through the runner, in the order they were decided:
# a block freed by a swap-out may be the destination of a copy decided after it, so order matters.
@dataclass(frozen=True)
class CopyBlocks:
    """Copy-on-write: copy each (source, destination) block, in every layer."""
    pairs: list[tuple[int, int]]


@dataclass(frozen=True)
class SwapOut:
    """Copy these blocks of `seq_id` into the swap space (they are free once this op has run)."""
    seq_id: int
    blocks: list[int]


@dataclass(frozen=True)
class SwapIn:
    """Copy `seq_id`'s K/V from the swap space back into these (fresh) blocks."""
    seq_id: int
    blocks: list[int]


BlockOp = CopyBlocks | SwapOut | SwapIn


class SwapSpace:
    """The CPU pool that swapped-out sequences wait in, beside the block manager: capacity in blocks.

    The scheduler decides who goes there (`reserve`) and who comes back; the engine moves the K/V,
    in the order the scheduler decided it: it stores what ``runner.swap_out`` returned with `put`, and
    `take`s it back (which frees the room) for ``runner.swap_in``. An aborted swapped sequence's room
    is `release`d. So the scheduler counts blocks and never touches a tensor."""

    def __init__(self, num_blocks: int):
        if num_blocks < 0:
            raise ValueError(f"a swap space of {num_blocks} blocks: give 0 (no swapping) or more")
        self.num_blocks = num_blocks
        self.held: dict[int, int] = {}       # seq_id -> blocks reserved for it
        self.data: dict[int, object] = {}    # seq_id -> its K/V, as the runner's swap_out returned it

    @property
    def num_used_blocks(self) -> int:
        return sum(self.held.values())

    def reserve(self, seq_id: int, num_blocks: int) -> bool:
        """Room for `num_blocks` of `seq_id`'s blocks? Then they are its until `release`."""
        if self.num_used_blocks + num_blocks > self.num_blocks:
            return False
        self.held[seq_id] = num_blocks
        return True

    def num_held(self, seq_id: int) -> int:
        return self.held[seq_id]

    def release(self, seq_id: int) -> None:
        """Give `seq_id`'s room back and forget its data (it was aborted while swapped out)."""
        self.held.pop(seq_id, None)
        self.data.pop(seq_id, None)

    def put(self, seq_id: int, data: object) -> None:
        self.data[seq_id] = data

    def take(self, seq_id: int) -> object:
        """`seq_id`'s data, for the swap-in; its room is free again."""
        del self.held[seq_id]
        return self.data.pop(seq_id)


@dataclass
class SchedulerOutput:
    """What one step hands the engine: plain data, no reference back to the scheduler."""
    scheduled: list[Scheduled] = field(default_factory=list)
    block_ops: list[BlockOp] = field(default_factory=list)   # to apply, in this order, before the forward
    preempted: list[Sequence] = field(default_factory=list)
    preemptions: list[Preemption] = field(default_factory=list)  # the same preemptions, as records for the page
    prefill_tokens: int = 0
    decode_tokens: int = 0


@dataclass
class SchedulerStep:
    """One call of `Scheduler.schedule` as it goes: what the policy hooks may read.

    A fresh one per step, so nothing of a step outlives it on the scheduler."""
    budget: int                                          # tokens still free this step (max_num_batched_tokens - used)
    seats_used: int = 0                                  # running slots taken (set once the running ones are scheduled)
    scheduled_ids: set[int] = field(default_factory=set)  # seq_ids scheduled this step: never chosen as victims
    out: SchedulerOutput = field(default_factory=SchedulerOutput)  # the step's result so far


class Scheduler:
    """Iteration-level scheduling over one block manager (see the module's docstring). Override
    `can_admit` and `choose_victim` to change the policy."""

    def __init__(self, config: SchedulerConfig, block_manager, swap: SwapSpace | None = None):
        """`swap`: where swapped-out sequences wait (the engine moves their K/V); by default a swap
        space of ``config.swap_blocks`` blocks."""
        if swap is not None and not isinstance(swap, SwapSpace):
            raise TypeError(f"swap must be a minikv.scheduler.SwapSpace or None, not {type(swap).__name__}")
        self.config, self.bm = config, block_manager
        self.swap = swap if swap is not None else SwapSpace(config.swap_blocks)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []     # admission order: the last one is the next victim
        self.swapped: deque[Sequence] = deque()
        self.num_preemptions = 0

    # -- queues ------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark `seq` finished and return its blocks (it leaves `running` at the end of the step)."""
        if seq.status is SeqStatus.RUNNING:
            self.bm.free(seq.seq_id)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SeqStatus.SWAPPED:
            self.swapped.remove(seq)
            self.swap.release(seq.seq_id)
        seq.status, seq.finish_reason = SeqStatus.FINISHED, reason

    def fork(self, seq: Sequence, child: Sequence) -> None:
        """`child` (a new sample of `seq`'s request) shares every block of `seq` and runs beside it."""
        self.bm.fork(seq.seq_id, child.seq_id)
        child.status, child.num_computed = SeqStatus.RUNNING, seq.num_computed
        self.running.append(child)

    def remove_finished(self) -> None:
        self.running = [s for s in self.running if s.status is SeqStatus.RUNNING]

    # -- one step ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        cfg, bm = self.config, self.bm
        step = SchedulerStep(budget=cfg.max_num_batched_tokens)
        out = step.out

        # 1 + 2: running sequences, decodes then prefill chunks, in admission order.
        for want_prefill in (False, True):
            for seq in list(self.running):
                if step.budget == 0:
                    break
                if seq.status is not SeqStatus.RUNNING or seq.is_prefill != want_prefill:
                    continue
                n = seq.num_to_compute
                if cfg.enable_chunked_prefill:
                    n = min(self._cap(n), step.budget)
                if n > step.budget:
                    continue
                n = self._make_room(seq, n, step)
                if n:
                    self._schedule(seq, n, step)

        # Seats: a request that has not forked yet holds n (its samples appear when its prompt is done).
        step.seats_used = sum(self._seats(s) for s in self.running)

        # 3 + 4 only in a step that preempted nobody: memory is short, and a victim let back in at
        # once would only be preempted again (vLLM's rule too).
        admit = not out.preempted

        # 3: swapped sequences come back, oldest first, while they fit with the watermark kept.
        while admit and self.swapped and step.budget > 0:
            seq = self.swapped[0]
            if step.seats_used + self._seats(seq) > cfg.max_num_seqs:
                break
            headroom = cfg.watermark_blocks if self.running else 0
            if self.swap.num_held(seq.seq_id) + 1 > bm.num_free_blocks - headroom:
                break
            self.swapped.popleft()
            self._swap_in(seq, step)
            step.seats_used += self._seats(seq)
            n = min(self._cap(seq.num_to_compute), step.budget)
            if n == seq.num_to_compute or cfg.enable_chunked_prefill:
                n = self._fit(seq, n)
                if n:
                    self._schedule(seq, n, step)

        # 4: waiting requests, strictly first come first served (none while any is swapped out).
        while admit and self.waiting and not self.swapped and step.budget > 0:
            seq = self.waiting[0]
            if step.seats_used + self._seats(seq) > cfg.max_num_seqs:
                break
            # A hit may be a block another sequence fills in this very step (the block manager
            # caches blocks when they are appended, before the forward computes them). That is
            # safe because the runner writes every layer's new K/V before any token attends.
            cached = bm.open(seq.seq_id, seq.token_ids)
            n = seq.num_to_compute - cached
            if cfg.enable_chunked_prefill:
                n = min(self._cap(n), step.budget)
            if not self.can_admit(seq, n, step):
                bm.free(seq.seq_id)   # give the cache hits back: full cached blocks stay cached
                break
            self.waiting.popleft()
            seq.status, seq.num_computed = SeqStatus.RUNNING, cached
            self.running.append(seq)
            step.seats_used += self._seats(seq)
            seq.request.on_admitted(cached)
            self._schedule(seq, n, step)

        self._flush_copies(step)
        return out

    # -- the policy (override these) ---------------------------------------------------------
    def can_admit(self, seq: Sequence, num_tokens: int, step: SchedulerStep) -> bool:
        """Admit waiting `seq` now, with a first chunk of `num_tokens` tokens?

        Its cache hits are already opened, so ``self.bm.blocks_needed(seq.seq_id, num_tokens)``
        counts only new blocks. minikv's rule: the chunk fits in the step's budget, and after
        taking its blocks ``watermark_blocks`` stay free."""
        # The watermark is headroom for sequences already running; an empty engine needs none
        # (without that exception, a request needing the whole pool would wait forever).
        headroom = self.config.watermark_blocks if self.running else 0
        return (num_tokens <= step.budget
                and self.bm.blocks_needed(seq.seq_id, num_tokens) <= self.bm.num_free_blocks - headroom)

    def choose_victim(self, seq: Sequence, step: SchedulerStep) -> Sequence:
        """Running `seq` needs a block and none is free: who gives way? One of
        ``victim_candidates(seq, step)``, or `seq` itself. minikv's rule: the most recently admitted
        candidate that was admitted after `seq`; if there is none, `seq`."""
        for other in reversed(self.running):
            if other is seq:
                break
            if other.status is SeqStatus.RUNNING and other.seq_id not in step.scheduled_ids:
                return other
        return seq

    def victim_candidates(self, seq: Sequence, step: SchedulerStep) -> list[Sequence]:
        """Sequences that may give way for `seq`, in admission order: running, not `seq`, and not
        yet scheduled this step (their tokens are already in the batch)."""
        return [s for s in self.running
                if s is not seq and s.status is SeqStatus.RUNNING and s.seq_id not in step.scheduled_ids]

    # -- helpers -----------------------------------------------------------------------------
    @staticmethod
    def _seats(seq: Sequence) -> int:
        """Running slots `seq` will take: its request's n until its prompt is done and it forks."""
        return 1 if seq.request.forked else seq.request.params.n

    def _cap(self, n: int) -> int:
        """`n` tokens to compute, cut to ``long_prefill_token_threshold`` if set (a decode's 1 never is)."""
        cap = self.config.long_prefill_token_threshold
        return min(n, cap) if cap else n

    def _fit(self, seq: Sequence, n: int) -> int:
        """The most tokens (<= n) of `seq` that the free blocks can hold now, preempting nobody."""
        bm = self.bm
        if bm.blocks_needed(seq.seq_id, n) <= bm.num_free_blocks:
            return n
        if not (self.config.enable_chunked_prefill and seq.is_prefill):
            return 0
        # A prefilling sequence's last block is its own (the prefix cache shares only full
        # blocks), so it can take the room left in that block plus whole free blocks.
        fit = min(n, (-seq.num_computed) % bm.block_size + bm.num_free_blocks * bm.block_size)
        return fit if fit > 0 and bm.blocks_needed(seq.seq_id, fit) <= bm.num_free_blocks else 0

    def _schedule(self, seq: Sequence, n: int, step: SchedulerStep) -> None:
        start = seq.num_computed
        slots = self.bm.append(seq.seq_id, seq.token_ids[start:start + n])
        seq.num_computed += n
        step.budget -= n
        step.scheduled_ids.add(seq.seq_id)
        step.out.scheduled.append(Scheduled(seq, start, n, slots))
        if n == 1 and start >= seq.num_prompt_tokens:   # the token is a generated one: a decode
            step.out.decode_tokens += 1
        else:
            step.out.prefill_tokens += n

    def _make_room(self, seq: Sequence, n: int, step: SchedulerStep) -> int:
        """Tokens of `seq` that can be scheduled now (<= n), preempting others (`choose_victim`) if needed."""
        while True:
            fit = self._fit(seq, n)   # a prefill chunk shrinks to what fits rather than preempt anyone
            if fit:
                return fit
            victim = self.choose_victim(seq, step)
            if victim is not seq and victim not in self.victim_candidates(seq, step):
                raise ValueError(f"choose_victim returned sequence {victim.seq_id}, which is not {seq.seq_id} (the "
                                 "one in need) nor one of victim_candidates(): it is not running, or its tokens "
                                 "are already in this step's batch")
            self._preempt(victim, step)
            if victim is seq:
                return 0

    def _flush_copies(self, step: SchedulerStep) -> None:
        """The copy-on-write copies the block manager recorded so far, as the step's next operation."""
        copies = self.bm.take_copies()
        if copies:
            step.out.block_ops.append(CopyBlocks(copies))

    def _preempt(self, seq: Sequence, step: SchedulerStep) -> None:
        self.num_preemptions += 1
        seq.request.metrics.preemptions += 1
        step.out.preempted.append(seq)
        self.running.remove(seq)
        table = list(self.bm.block_table(seq.seq_id))
        swap = self.config.preemption_mode == "swap" and self.swap.reserve(seq.seq_id, len(table))
        step.out.preemptions.append(Preemption(time.perf_counter(), seq.request.request_id, seq.seq_id, len(table),
                                               "swap" if swap else "recompute"))
        if swap:
            # Its blocks are read before anything decided after this point may reuse them.
            self._flush_copies(step)
            step.out.block_ops.append(SwapOut(seq.seq_id, table))
            self.bm.free(seq.seq_id)
            seq.status = SeqStatus.SWAPPED
            self.swapped.appendleft(seq)   # it was admitted before everything already swapped
        else:
            self.bm.free(seq.seq_id)
            seq.num_computed = 0
            seq.status = SeqStatus.WAITING
            self.waiting.appendleft(seq)   # it arrived before everything still waiting

    def _swap_in(self, seq: Sequence, step: SchedulerStep) -> None:
        # Pending copy-on-write copies read their source blocks before the forward; they go first,
        # so a block freed this step and reused by the swap-in is not overwritten before it is read.
        self._flush_copies(step)
        # Fresh blocks for everything it had computed (open with no tokens: no prefix lookup).
        self.bm.open(seq.seq_id, [])
        self.bm.append(seq.seq_id, seq.token_ids[:seq.num_computed])
        step.out.block_ops.append(SwapIn(seq.seq_id, list(self.bm.block_table(seq.seq_id))))
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
