"""A trace-driven KV-cache memory simulator: where did the memory go?

It replays a request trace (``minikv.traces``) against a fixed KV budget, one decode step
at a time, under a pluggable allocation policy, and accounts for every token of the budget
at every step. Each step:

1. arrivals join the waiting queue (a request that can never fit is rejected, with why);
2. every running sequence writes one token (oldest first); when a policy has no room for
   it, the youngest running sequence is preempted (freed, requeued at the front, its
   tokens recomputed on readmission, as vLLM does); a finished sequence frees its memory;
3. waiting requests are admitted first come, first served while the policy can place
   them; the first one that cannot be placed blocks the queue (no overtaking).

Policies (one small class each):

* ``ContiguousMax``: one ``max_seq_len`` slab per request, reserved up front, as early
  servers did (FasterTransformer; the paper's "Orca (Max)").
* ``ContiguousPow2``: a slab of the next power of two >= the current length, *doubled by
  reallocation* when full (``realloc``: extend in place if the next bytes are free, else
  move). A real server never knows the output length, so it cannot reserve "prompt +
  output rounded up" as the paper's oracle-informed "Orca (Pow2)" did; doubling is what
  a growable array does without that knowledge. It pays in copies and preemptions.
* ``ContiguousOracle``: a slab of exactly prompt + output, known in advance: the best a
  contiguous allocator could do, and something no real server has.
* ``Paged(block_size)``: fixed-size blocks taken on demand from a free list (vLLM).

Slabs are placed first-fit in one linear address space, so holes between slabs are real.

The accounting, in tokens (times ``bytes_per_token`` for bytes), at every step:

* live: tokens written in the cache;
* reserved: held space the sequence *will* still fill before it finishes;
* internal fragmentation: held space it will never fill (the slab or last-block tail);
* external fragmentation: free memory that cannot be used because of where it lies: at
  a step where the head of the queue is refused although the total free memory would
  hold it (compaction would have admitted it), all free memory counts as external;
* free: the rest (free memory too small in total for the next request, or no one waiting).

``live + reserved + internal + external + free == budget`` is asserted every step, with
free taken from the allocator's own books, so a leak or a double free trips it.

Reserved vs internal needs the final length, which a server does not know while it runs:
to ContiguousMax every unused slab token looks the same. The simulator knows each
request's output length, so it can split the waste honestly after the fact: the part of
the slab the sequence grows into before it ends is "reserved", the rest "internal".

Reports are averaged over the steps where the system is saturated (someone is waiting),
the regime where wasted memory costs throughput.

Steps are not all equally long. The memory books count steps; ``SimResult.timing(cost)``
turns them into seconds with a simple model of the GPU (``StepCost``): each decode step
reads the weights and every live token's K/V once (decode is bandwidth-bound); prefill
(a prompt at admission) and *recompute* (a preempted sequence's tokens, prompt and output
so far, computed again when it is readmitted) cost 2 x params FLOPs per token; a slab move
reads and writes the tokens it copies. The timeline records, per step, the tokens decoded,
prefilled, recomputed and copied, so every policy is charged for what it did.

Default setup, from the paper (Kwon et al. 2023, Table 1): OPT-13B on one A100-40GB,
26 GB of weights, 12 GB left for the KV cache at 800 KiB per token (2 x 40 layers x 5120
x fp16) = 15,728 token slots ("15.7K"), ``max_seq_len`` 2,048 (OPT's context).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
from tqdm.auto import tqdm

from minikv.blocks import BlockAllocator, BlockTable, blocks_for
from minikv.traces import Request

OPT13B_BYTES_PER_TOKEN = 2 * 40 * 5120 * 2  # K and V, 40 layers, hidden 5120, fp16: 800 KiB
DEFAULT_BUDGET_TOKENS = 12 * 2**30 // OPT13B_BYTES_PER_TOKEN  # 12 GiB of KV: 15,728 tokens
DEFAULT_MAX_SEQ_LEN = 2048
PARTS = ("live", "reserved", "internal", "external", "free")
# Tokens of work per step, for timing: output tokens decoded, the K/V tokens those decode steps
# read (each sequence attends over all its tokens), prompt tokens prefilled, tokens recomputed
# after a preemption, tokens copied when a slab moved.
WORK = ("decoded", "attended", "prefilled", "recomputed", "copied")


@dataclass(frozen=True)
class StepCost:
    """How long a step takes, for ``SimResult.timing``. The default is the paper's setup:
    OPT-13B (12.85 B parameters, 26 GB of fp16 weights) on an A100-40GB (1,555 GB/s, 312 fp16
    TFLOP/s, datasheet). Prefill is compute-bound and reaches ``prefill_efficiency`` of the
    peak (0.5: a round figure, not a measurement); decode and copies run at full bandwidth,
    so the model flatters decode and copies, and its ratios are what to read, not its seconds."""

    weight_bytes: int = 12_853_473_280 * 2
    num_params: int = 12_853_473_280
    bandwidth_gb_s: float = 1555
    fp16_tflops: float = 312
    prefill_efficiency: float = 0.5

    def seconds(self, decoded, attended_bytes, prefilled, recomputed, copied_bytes) -> dict[str, np.ndarray]:
        """Per-step seconds, split by what they pay for (arrays in, arrays out)."""
        bw, flops = self.bandwidth_gb_s * 1e9, self.fp16_tflops * 1e12 * self.prefill_efficiency
        busy = np.asarray(decoded) > 0
        return {"decode": busy * (self.weight_bytes + np.asarray(attended_bytes)) / bw,
                "prefill": 2 * self.num_params * np.asarray(prefilled) / flops,
                "recompute": 2 * self.num_params * np.asarray(recomputed) / flops,
                "copy": 2 * np.asarray(copied_bytes) / bw}


@dataclass(eq=False, slots=True)
class Seq:
    """A request while it is in the system: ``live`` tokens are in (or owed to) the cache."""

    req: Request
    live: int
    id: int = field(init=False)
    final: int = field(init=False)  # prompt + output: known to the simulator, not to a server
    cap: int = 0  # tokens the policy holds for it (cached: the per-step books read it a lot)
    running: bool = False
    since: int = 0  # step of its current admission
    live0: int = 0  # tokens it was admitted with (prompt, or prompt + output so far)
    preempted: int = 0  # times it was preempted: readmitting it recomputes its tokens

    def __post_init__(self) -> None:
        self.id, self.final = self.req.id, self.req.total_len


class Policy(Protocol):
    """How KV memory is handed out. A slot is ``(offset, size, first_token)``: ``size``
    tokens of the address space from ``offset`` holding the sequence's tokens from
    ``first_token`` on."""

    name: str
    counters: dict[str, int]

    def reset(self, budget: int, max_seq_len: int) -> None: ...
    def refuse(self, req: Request) -> str | None: ...  # why it can never fit, else None
    def need(self, seq: Seq) -> int: ...  # tokens admitting it now would take
    def admit(self, seq: Seq) -> bool: ...  # place seq.live tokens; False: no room
    def grow(self, seq: Seq) -> bool: ...  # room for token seq.live + 1; False: no room
    def release(self, seq: Seq) -> None: ...
    def capacity(self, seq: Seq) -> int: ...  # tokens it holds
    def slots(self, seq: Seq, start: int = 0) -> list[tuple[int, int, int]]: ...  # holding tokens >= start
    def free_tokens(self) -> int: ...  # free in the allocator's own books
    def usable_free(self) -> int: ...  # of which a new request could use


def first_fit(slabs: list[tuple[int, int]], size: int, budget: int) -> int | None:
    """The lowest offset in [0, budget) where ``size`` tokens fit between the ``(offset, size)``
    slabs (any order, not overlapping), or None when no hole is big enough."""
    end = 0  # end of the previous slab: the hole runs from here to the next slab
    for off, sz in sorted(slabs):
        if off - end >= size:
            return end
        end = off + sz
    return end if budget - end >= size else None


def slab_waste(size: int, live: int, final: int) -> tuple[int, int, int]:
    """Split a held slot of ``size`` tokens into (live, reserved, internal) tokens, for a
    sequence with ``live`` tokens in it now that will end with ``final``: reserved is what
    it will still fill, internal what it never will. For a block holding the sequence's tokens
    from ``first`` on, pass ``live - first`` and ``final - first``."""
    live, used = min(max(live, 0), size), min(max(final, 0), size)
    return live, used - live, size - used


def external_tokens(policy: Policy, blocked: Seq | None) -> int:
    """Free memory stranded by where it lies: all free memory when the head of the queue
    (``blocked``) was refused although the total free memory would hold it, else 0."""
    if blocked is not None and policy.need(blocked) <= policy.usable_free():
        return policy.free_tokens()
    return 0


class _Slabs:
    """One contiguous slab per sequence, placed first-fit in [0, budget)."""

    name = "contiguous"

    def reset(self, budget: int, max_seq_len: int) -> None:
        self.budget, self.max_seq_len = budget, max_seq_len
        self.slab: dict[int, tuple[int, int]] = {}  # seq id -> (offset, size)
        self.used = 0
        self.counters: dict[str, int] = {}

    def slab_size(self, seq: Seq) -> int:
        raise NotImplementedError

    def refuse(self, req: Request) -> str | None:
        if req.total_len > self.budget:
            return f"needs {req.total_len} tokens, more than the whole {self.budget}-token budget"
        return None

    def _first_fit(self, size: int, skip: int | None = None) -> int | None:
        return first_fit([s for sid, s in self.slab.items() if sid != skip], size, self.budget)

    def need(self, seq: Seq) -> int:
        return self.slab_size(seq)

    def admit(self, seq: Seq) -> bool:
        size = self.slab_size(seq)
        off = self._first_fit(size)
        if off is None:
            return False
        self.slab[seq.id] = (off, size)
        self.used += size
        return True

    def grow(self, seq: Seq) -> bool:
        return seq.live + 1 <= self.slab[seq.id][1]

    def release(self, seq: Seq) -> None:
        self.used -= self.slab.pop(seq.id)[1]

    def capacity(self, seq: Seq) -> int:
        return self.slab[seq.id][1]

    def slots(self, seq: Seq, start: int = 0) -> list[tuple[int, int, int]]:
        off, size = self.slab[seq.id]
        return [(off, size, 0)]

    def free_tokens(self) -> int:
        return self.budget - self.used

    usable_free = free_tokens


class ContiguousMax(_Slabs):
    name = "contiguous max"

    def slab_size(self, seq: Seq) -> int:
        return self.max_seq_len

    def refuse(self, req: Request) -> str | None:
        if self.max_seq_len > self.budget:
            return f"a max_seq_len slab ({self.max_seq_len}) is larger than the {self.budget}-token budget"
        return None


class ContiguousOracle(_Slabs):
    name = "contiguous oracle"

    def slab_size(self, seq: Seq) -> int:
        return seq.final


class ContiguousPow2(_Slabs):
    name = "contiguous pow2"

    def reset(self, budget: int, max_seq_len: int) -> None:
        super().reset(budget, max_seq_len)
        self.cap = min(max_seq_len, budget)  # never grow past what the model or memory allows
        self.counters = {"reallocations": 0, "copied_tokens": 0}

    def slab_size(self, seq: Seq) -> int:
        return min(1 << seq.live.bit_length(), self.cap)  # next power of two > live: room to grow

    def grow(self, seq: Seq) -> bool:
        off, size = self.slab[seq.id]
        if seq.live + 1 <= size:
            return True
        new = min(2 * size, self.cap)
        nxt = min((o for sid, (o, _) in self.slab.items() if o > off), default=self.budget)
        if nxt - off < new:  # cannot extend in place: move (the old slab counts as free)
            moved = self._first_fit(new, skip=seq.id)
            if moved is None:
                return False
            off = moved
            self.counters["copied_tokens"] += seq.live
        self.slab[seq.id] = (off, new)
        self.used += new - size
        self.counters["reallocations"] += 1
        return True


class Paged:
    """Fixed-size blocks on demand: stage 3's own BlockAllocator and BlockTable, one table per sequence."""

    def __init__(self, block_size: int = 16):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.name = f"paged (block {block_size})"

    def reset(self, budget: int, max_seq_len: int) -> None:
        self.budget, self.num_blocks = budget, budget // self.block_size
        # The allocator's FIFO free list reuses the block freed longest ago, so as sequences come
        # and go one sequence's blocks end up scattered, as in a real pool.
        # (A budget smaller than one block has no pool at all: refuse() turns every request away.)
        self.allocator = BlockAllocator(self.num_blocks) if self.num_blocks else None
        self.tables: dict[int, BlockTable] = {}
        self.counters: dict[str, int] = {}

    def refuse(self, req: Request) -> str | None:
        blocks = blocks_for(req.total_len, self.block_size)
        if blocks > self.num_blocks:
            return f"needs {blocks} blocks of {self.block_size}, the budget has {self.num_blocks}"
        return None

    def need(self, seq: Seq) -> int:
        return blocks_for(seq.live, self.block_size) * self.block_size

    def _append(self, table: BlockTable, tokens: int) -> bool:
        if table.blocks_needed(tokens) > self.allocator.num_free:
            return False
        table.append_tokens(tokens)
        return True

    def admit(self, seq: Seq) -> bool:
        table = BlockTable(self.block_size, self.allocator)
        if not self._append(table, seq.live):
            return False
        self.tables[seq.id] = table
        return True

    def grow(self, seq: Seq) -> bool:
        # The simulator asks only when the sequence's blocks are full, so the table first catches
        # up with the tokens written into its last block since, then takes room for one more.
        table = self.tables[seq.id]
        return self._append(table, seq.live + 1 - table.num_tokens)

    def release(self, seq: Seq) -> None:
        self.tables.pop(seq.id).free()

    def capacity(self, seq: Seq) -> int:
        return len(self.tables[seq.id]) * self.block_size

    def slots(self, seq: Seq, start: int = 0) -> list[tuple[int, int, int]]:
        bs, first = self.block_size, start // self.block_size
        return [(b * bs, bs, i * bs) for i, b in enumerate(self.tables[seq.id].blocks[first:], first)]

    def free_tokens(self) -> int:  # the budget's tail past the last whole block is never usable
        return self.usable_free() + self.budget % self.block_size

    def usable_free(self) -> int:
        return self.allocator.num_free * self.block_size if self.allocator else 0


@dataclass(frozen=True)
class Segment:
    """A held piece of the address space at one step, split by what its tokens are."""

    seq_id: int
    offset: int
    size: int
    live: int
    reserved: int
    internal: int


@dataclass
class SimResult:
    policy: str
    budget: int
    max_seq_len: int
    bytes_per_token: int
    timeline: dict[str, np.ndarray]  # per step: PARTS, running, waiting, finished
    extents: dict[str, np.ndarray]  # every slot ever held: seq, offset, size, first, start, end, live0, final
    rejected: list[tuple[int, str]]
    preemptions: int
    counters: dict[str, int] = field(default_factory=dict)

    @property
    def steps(self) -> int:
        return len(self.timeline["live"])

    @property
    def window(self) -> np.ndarray:
        """Steps that are reported on: saturated ones (someone waits), else busy ones."""
        sat = self.timeline["waiting"] > 0
        return sat if sat.any() else self.timeline["running"] > 0

    def shares(self) -> dict[str, float]:
        w = self.window
        n = max(int(w.sum()), 1)
        return {p: float(self.timeline[p][w].sum()) / (n * self.budget) for p in PARTS}

    @property
    def utilization(self) -> float:
        return self.shares()["live"]

    def timing(self, cost: StepCost | None = None) -> dict[str, float]:
        """Seconds and throughput over the reported window under ``cost`` (default: the paper's
        OPT-13B on an A100-40GB): each part of the time (``decode_s``, ``prefill_s``,
        ``recompute_s``, ``copy_s``), output tokens per second with everything charged
        (``tokens_per_s``) and with recompute and copies free (``uncharged_tokens_per_s``, what
        counting steps alone would suggest), and the shares of the time spent recomputing
        preempted sequences and copying slabs."""
        cost = cost or StepCost()
        t = self.timeline
        # The saturated steps, as everywhere; in a run that never saturates, every step that worked.
        w = self.window if (t["waiting"] > 0).any() else (t["decoded"] + t["prefilled"] + t["recomputed"]) > 0
        secs = cost.seconds(t["decoded"], self.in_bytes("attended"), t["prefilled"], t["recomputed"],
                            self.in_bytes("copied"))
        parts = {k: float(v[w].sum()) for k, v in secs.items()}
        total = sum(parts.values())
        tokens = int(t["decoded"][w].sum())
        return {**{f"{k}_s": v for k, v in parts.items()}, "seconds": total, "tokens": tokens,
                "tokens_per_s": tokens / total if total else 0.0,
                "uncharged_tokens_per_s": tokens / (parts["decode"] + parts["prefill"]) if total else 0.0,
                "recompute_share": parts["recompute"] / total if total else 0.0,
                "copy_share": parts["copy"] / total if total else 0.0,
                "recomputed_tokens": int(t["recomputed"][w].sum()), "copied_tokens": int(t["copied"][w].sum())}

    def in_bytes(self, part: str) -> np.ndarray:
        """A timeline series (``live``, ``free``, ...) in bytes instead of tokens."""
        return self.timeline[part] * self.bytes_per_token

    def summary(self) -> dict:
        w, t = self.window, self.timeline
        shares = self.shares()
        return {
            "policy": self.policy, "utilization": shares["live"], **shares,
            "peak_concurrent": int(t["running"].max(initial=0)),
            "mean_concurrent": float(t["running"][w].mean()) if w.any() else 0.0,
            "finished_per_step": float(t["finished"][w].sum() / max(int(w.sum()), 1)),
            "saturated_steps": int((t["waiting"] > 0).sum()), "steps": self.steps,
            "finished": int(t["finished"].sum()), "rejected": len(self.rejected),
            "preemptions": self.preemptions, **self.counters,
            "mean_live_bytes": shares["live"] * self.budget * self.bytes_per_token,
        }

    def snapshot(self, step: int) -> list[Segment]:
        """The address space at the end of ``step``: every held slot, by offset."""
        e = self.extents
        idx = np.flatnonzero((e["start"] <= step) & (step < e["end"]))
        segs = []
        for i in idx:
            size, first = int(e["size"][i]), int(e["first"][i])
            live_seq = int(e["live0"][i] + step - e["res_start"][i])
            parts = slab_waste(size, live_seq - first, int(e["final"][i]) - first)
            segs.append(Segment(int(e["seq"][i]), int(e["offset"][i]), size, *parts))
        return sorted(segs, key=lambda s: s.offset)


def simulate(trace: list[Request], policy: Policy, budget_tokens: int | None = None, *,
             budget_bytes: int | None = None, max_seq_len: int = DEFAULT_MAX_SEQ_LEN,
             bytes_per_token: int = OPT13B_BYTES_PER_TOKEN, progress: bool = False) -> SimResult:
    """Replay ``trace`` under ``policy`` (see the module docstring for the rules)."""
    if budget_tokens is None:
        budget_tokens = DEFAULT_BUDGET_TOKENS if budget_bytes is None else budget_bytes // bytes_per_token
    if budget_tokens < 1:
        raise ValueError(f"the KV budget must hold at least one token, got {budget_tokens}")
    budget = budget_tokens
    policy.reset(budget, max_seq_len)
    pending = deque(sorted(trace, key=lambda r: (r.arrival, r.id)))
    waiting: deque[Seq] = deque()
    running: list[Seq] = []  # in admission order: the last one is preempted first
    rejected: list[tuple[int, str]] = []
    tl: dict[str, list[int]] = {k: [] for k in (*PARTS, "running", "waiting", "finished", *WORK)}
    ext: list[list[int]] = []  # [seq, offset, size, first, start, end, live0, res_start, final]
    open_slots: dict[int, list[tuple[int, int]]] = {}  # seq id -> [(first_token, extent index)]
    preemptions, t = 0, 0
    bar = tqdm(total=len(pending), unit="req", desc=policy.name, disable=not progress, leave=False)

    def open_(seq: Seq, slots) -> None:
        for slot in slots:
            open_slots[seq.id].append((slot[2], len(ext)))
            ext.append([seq.id, *slot, t, -1, seq.live0, seq.since, seq.final])

    def close(seq: Seq) -> None:
        for _, i in open_slots.pop(seq.id):
            ext[i][5] = t
        policy.release(seq)
        seq.running = False
        running.remove(seq)

    while pending or waiting or running:
        # 1. Arrivals join the queue, unless they could never fit.
        while pending and pending[0].arrival <= t:
            req = pending.popleft()
            why = (f"{req.total_len} tokens is longer than max_seq_len {max_seq_len}"
                   if req.total_len > max_seq_len else policy.refuse(req))
            if why:
                rejected.append((req.id, why))
                bar.update()
            else:
                waiting.append(Seq(req, req.prompt_len))
        # 2. Decode: one token per running sequence; preempt the youngest when there is no room.
        finished = decoded = attended = prefilled = recomputed = 0
        copied_before = policy.counters.get("copied_tokens", 0)
        for seq in list(running):  # oldest first, so the oldest always makes progress
            if not seq.running:
                continue  # preempted earlier this step
            before = seq.cap
            while seq.live == seq.cap and not policy.grow(seq):  # full: ask the policy for room
                victim = running[-1]
                close(victim)  # recompute later: its tokens so far become its new "prompt"
                victim.preempted += 1
                waiting.appendleft(victim)
                preemptions += 1
                if victim is seq:
                    break
            if not seq.running:
                continue
            seq.live += 1
            decoded, attended = decoded + 1, attended + seq.live
            seq.cap = policy.capacity(seq) if seq.live > before else before
            if seq.live == seq.final:
                close(seq)
                finished += 1
                bar.update()
            elif seq.cap != before:  # a new block, or a grown or moved slab
                fresh, held = policy.slots(seq, before), open_slots[seq.id]
                lo = min(slot[2] for slot in fresh)
                while held and held[-1][0] >= lo:  # slots the fresh ones replace (a slab's old self)
                    ext[held.pop()[1]][5] = t
                open_(seq, fresh)
        # 3. Admission, first come first served: the first request that cannot be placed blocks.
        blocked = None
        while waiting:
            head = waiting[0]
            if not policy.admit(head):
                blocked = head
                break
            waiting.popleft()
            if head.preempted:
                recomputed += head.live  # prompt and output so far, computed again from scratch
            else:
                prefilled += head.live
            head.running, head.since, head.live0, head.cap = True, t, head.live, policy.capacity(head)
            running.append(head)
            open_slots[head.id] = []
            open_(head, policy.slots(head))

        # 4. The books: every token of the budget in exactly one of PARTS.
        live = held = will_use = 0
        for s in running:
            live, held = live + s.live, held + s.cap
            will_use += s.cap if s.cap < s.final else s.final
        free = policy.free_tokens()  # from the allocator's books, not from `held`
        external = external_tokens(policy, blocked)
        parts = (live, will_use - live, held - will_use, external, free - external)
        assert sum(parts) == budget, f"step {t}: {dict(zip(PARTS, parts))} != budget {budget}"
        assert all(0 < s.live <= s.cap for s in running), f"step {t}: a sequence overflows its memory"
        for k, v in zip(PARTS, parts):
            tl[k].append(v)
        tl["running"].append(len(running))
        tl["waiting"].append(len(waiting))
        tl["finished"].append(finished)
        for k, v in zip(WORK, (decoded, attended, prefilled, recomputed,
                               policy.counters.get("copied_tokens", 0) - copied_before)):
            tl[k].append(v)
        t += 1
    bar.close()
    cols = ("seq", "offset", "size", "first", "start", "end", "live0", "res_start", "final")
    arr = np.array(ext, dtype=np.int64).reshape(-1, len(cols))
    return SimResult(policy.name, budget, max_seq_len, bytes_per_token,
                     {k: np.asarray(v, dtype=np.int64) for k, v in tl.items()},
                     {c: arr[:, i] for i, c in enumerate(cols)}, rejected, preemptions,
                     dict(policy.counters))


def default_policies(block_size: int = 16) -> list[Policy]:
    return [ContiguousMax(), ContiguousPow2(), ContiguousOracle(), Paged(block_size)]


def compare(trace: list[Request], policies: list[Policy] | None = None, **kw) -> dict[str, SimResult]:
    """Run the same trace under each policy (default: all four); keyword args go to simulate."""
    return {p.name: simulate(trace, p, **kw) for p in (policies or default_policies())}


def sweep_block_sizes(trace: list[Request], sizes=(1, 2, 4, 8, 16, 32, 64, 128, 256), **kw) -> dict[int, SimResult]:
    """Paged allocation at each block size, same trace and budget."""
    return {b: simulate(trace, Paged(b), **kw) for b in sizes}
