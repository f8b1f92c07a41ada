"""A trace-driven KV-cache memory simulator: where did the memory go?

It replays a request trace (``minikv.sim.traces``) against a fixed KV budget, one decode step
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

**Why this loop does not drive the engine's scheduler** (``minikv.scheduler``, with the fake
runner), although both admit first come first served and preempt the youngest by recompute:

* three of the four policies are contiguous slabs placed first-fit in one address space (and
  ``ContiguousPow2`` moves a slab when it doubles). The scheduler knows only a block manager
  (``minikv.prefix.BlockManagerProtocol``): equal blocks, a table per sequence, no addresses, so
  it has no notion of a slab, a hole or a move, and external fragmentation cannot arise in it;
* a step here is one decode token per running sequence, and an admitted prompt is in the cache
  at once, whatever its length. The engine's step is a *token budget* (``max_num_batched_tokens``,
  chunked prefill), a seat limit and a free-block watermark, and it samples the first output
  token in the prompt's own step, so the same trace takes a different number of steps and
  ``max_concurrent_*``, the utilizations and the timeline would all move (stage 2 and 3's
  printed figures are these, and they follow the paper's setup, which has none of those knobs);
* the trace gives lengths, not token ids, and the simulator knows each output length in advance
  (that is how it splits waste into reserved and internal); the engine learns a sequence's end
  only by generating it, and the fake runner would hash every sequence's whole history at every
  one of the trace's hundreds of thousands of token steps.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np
from tqdm.auto import tqdm

from minikv.sim.policies import Paged, Policy, Seq, default_policies, external_tokens, slab_waste
from minikv.sim.traces import TraceRequest

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


def simulate(trace: list[TraceRequest], policy: Policy, budget_tokens: int | None = None, *,
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


def compare(trace: list[TraceRequest], policies: list[Policy] | None = None, **kw) -> dict[str, SimResult]:
    """Run the same trace under each policy (default: all four); keyword args go to simulate."""
    return {p.name: simulate(trace, p, **kw) for p in (policies or default_policies())}


def sweep_block_sizes(trace: list[TraceRequest], sizes=(1, 2, 4, 8, 16, 32, 64, 128, 256),
                      **kw) -> dict[int, SimResult]:
    """Paged allocation at each block size, same trace and budget."""
    return {b: simulate(trace, Paged(b), **kw) for b in sizes}
