"""What the engine measures: per request (latency) and per step (occupancy), and the usual summaries.

Per request, `RequestMetrics` records wall-clock times (``time.perf_counter()`` seconds):
arrival, first scheduled, each generated token, finish; plus how often it was preempted and
how many prompt tokens the prefix cache served. From those:

* **TTFT**, time to first token: ``first_token_time - arrival_time`` (queueing + prefill);
* **TPOT**, time per output token: the mean gap between consecutive tokens after the first
  (what a reader of a streamed answer feels; a preemption shows up as one long gap, the
  "latency wobble");
* **latency**: ``finished_time - arrival_time``.

Per step, `StepStats` is one row of the occupancy timeline: how many sequences ran, waited or
sat swapped out, how many blocks were used / cached-evictable / free, how many tokens were
scheduled (prefill vs decode), how many preemptions happened. The engine keeps a bounded history
of them (`STEP_HISTORY`): a server runs for days.

`EngineStats` is the one read-only view of a live engine (``LLMEngine.stats()``): its queues, its
pool, its prefix-cache counters and its last steps, copied at one moment. The server's gauges and
admission policies, the demo and the pictures read that, never the scheduler's queues or the
block manager's cache.
"""

from __future__ import annotations

import functools
import statistics
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # when each of sample 0's tokens arrived
    finished_time: float | None = None
    preemptions: int = 0             # times any of its sequences was preempted
    cached_prompt_tokens: int = 0    # prompt tokens served by the prefix cache at first admission

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)

    @property
    def latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    @property
    def max_gap(self) -> float | None:
        """The longest wait between two consecutive tokens: where a preemption shows."""
        gaps = [b - a for a, b in zip(self.token_times, self.token_times[1:])]
        return max(gaps) if gaps else None


# The named parts of an engine step, as torch.profiler spans (``bench engine --profile`` reads them by name).
SPAN_STEP, SPAN_EXECUTE, SPAN_PLAN, SPAN_ATTENTION, SPAN_SAMPLE = (
    "minikv.step", "minikv.execute", "minikv.plan", "minikv.attention", "minikv.sample")


def span(name: str):
    """A ``torch.profiler.record_function`` span while a profiler records, else nothing: the hot path
    (thirty attention calls a step) pays one attribute read when nobody is looking."""
    return torch.profiler.record_function(name) if torch.autograd.profiler._is_profiler_enabled else nullcontext()


def spanned(name: str):
    """Decorate a function so that each call is one `span` of that name."""
    def decorate(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            with span(name):
                return fn(*args, **kwargs)
        return inner
    return decorate


STEP_HISTORY = 1 << 16   # the most StepStats an engine keeps (a few MiB); older ones are dropped


@dataclass(frozen=True)
class StepStats:
    step: int
    time: float              # perf_counter at the end of the step
    duration: float          # seconds the step took (schedule + forward + sample + bookkeeping)
    num_running: int
    num_waiting: int
    num_swapped: int
    blocks_used: int         # held by some sequence
    blocks_cached: int       # free but still holding a cached prefix (evictable)
    blocks_free: int         # an allocation could take them now (never-used + cached-evictable)
    prefill_tokens: int
    decode_tokens: int
    preemptions: int
    forward: float = 0.0     # seconds of it in the runner (block operations + the forward; on a GPU, until sampled)

    @property
    def tokens_scheduled(self) -> int:
        return self.prefill_tokens + self.decode_tokens


class StepOutputs(list):
    """What one ``LLMEngine.step()`` did: the `RequestOutput`s that changed (a list, as vLLM's step returns),
    and the step's own record: ``stats`` (its `StepStats`, None when nothing was scheduled: an idle call,
    or one that only returned aborts) and ``preemptions`` (the `Preemption`s it decided, usually none)."""

    def __init__(self, outputs=(), stats: StepStats | None = None, preemptions: tuple = ()):
        super().__init__(outputs)
        self.stats, self.preemptions = stats, tuple(preemptions)

    @property
    def ran(self) -> bool:
        """Whether the step computed anything (a forward ran)."""
        return self.stats is not None


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of an engine (``LLMEngine.stats()``): plain numbers, taken between steps."""
    running: int                 # sequences in the batch
    waiting: int                 # sequences waiting to be admitted (recompute-preempted ones included)
    swapped: int                 # sequences swapped out to the CPU
    num_blocks: int              # the pool
    block_size: int
    blocks_used: int             # held by some sequence
    blocks_cached: int           # free but still holding a cached prefix (evictable)
    blocks_free: int             # an allocation could take them now (never-used + cached-evictable)
    reserved_blocks: int         # what the unfinished requests may hold at most (prompt + max_tokens, x n)
    max_num_seqs: int
    preemptions: int             # so far
    prefix_tokens_queried: int   # prompt tokens looked up in the prefix cache, so far
    prefix_tokens_hit: int       # of them, served from cached blocks
    prefix_evictions: int        # cached blocks thrown away to make room, so far
    steps: tuple[StepStats, ...] = ()   # the last steps, oldest first

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_tokens_hit / self.prefix_tokens_queried if self.prefix_tokens_queried else 0.0

    @property
    def last_step(self) -> StepStats | None:
        return self.steps[-1] if self.steps else None


def summarize(outputs, steps: list[StepStats] | None = None, prefix_stats=None) -> dict:
    """The headline numbers of a run: tokens/s, mean/p50/p99 TTFT and TPOT, preemptions, prefix hit rate.

    `outputs`: finished `RequestOutput`s. `steps`: the engine's `step_stats` (for the wall time and
    occupancy). `prefix_stats`: the block manager's `stats` (for the hit rate), if any.
    """
    outputs = list(outputs)
    ms = [o.metrics for o in outputs]
    gen = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    start = min(m.arrival_time for m in ms) if ms else 0.0
    end = max((m.finished_time or start) for m in ms) if ms else 0.0
    ttft = [m.ttft for m in ms if m.ttft is not None]
    tpot = [m.tpot for m in ms if m.tpot is not None]

    def pct(xs, q):
        return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if len(xs) > 1 else (xs[0] if xs else None)

    out = {
        "requests": len(outputs),
        "generated_tokens": gen,
        "seconds": end - start,
        "tokens_per_s": gen / (end - start) if end > start else None,
        "ttft_mean": statistics.fmean(ttft) if ttft else None,
        "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99),
        "tpot_mean": statistics.fmean(tpot) if tpot else None,
        "tpot_p50": pct(tpot, 50), "tpot_p99": pct(tpot, 99),
        "preemptions": sum(m.preemptions for m in ms),
    }
    if steps:
        out["steps"] = len(steps)
        out["max_running"] = max(s.num_running for s in steps)
        out["max_blocks_used"] = max(s.blocks_used for s in steps)
    if prefix_stats is not None:
        out["prefix_hit_rate"] = getattr(prefix_stats, "hit_rate", None)
    return out


def occupancy(steps: list[StepStats]) -> dict[str, list]:
    """The occupancy timeline as columns (ready for matplotlib): step, running, waiting, swapped, blocks."""
    cols = ("step", "num_running", "num_waiting", "num_swapped", "blocks_used", "blocks_cached",
            "blocks_free", "prefill_tokens", "decode_tokens", "preemptions")
    return {c: [getattr(s, c) for s in steps] for c in cols}


# -- the landlord's view: who holds which block (stage 7's live page reads only this) ---------------
@dataclass(frozen=True)
class Preemption:
    """One preemption, as the scheduler decided it: whose, how many blocks it gave back, and how."""
    time: float          # perf_counter when it was decided
    request_id: str
    seq_id: int
    blocks: int          # blocks returned to the pool
    mode: str            # "recompute" (K/V dropped, prompt+output computed again) or "swap" (copied to CPU)


@dataclass(frozen=True)
class Tenant:
    """One sequence in the building (running or swapped), or at the door (waiting)."""
    request_id: str
    seq_id: int
    state: str                   # "running" | "waiting" | "swapped"
    blocks: int                  # blocks it holds now (shared ones counted for each owner)
    tokens: int                  # tokens whose K/V it holds
    prompt_tokens: int
    output_tokens: int
    preemptions: int
    ttft: float | None           # seconds, once its first token came
    last_gap: float | None       # seconds between its last two tokens

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        for k in ("ttft", "last_gap"):
            d[k] = None if d[k] is None else round(d[k], 4)
        return d


@dataclass(frozen=True)
class PoolView:
    """The pool block by block, at the end of a step. ``owner[b]``: the seq_id of one sequence holding
    block b (-1: none); ``refcount[b]``: how many hold it; ``cached[b]``: free but still holding a cached
    prefix (evictable). ``counts`` are the numbers /metrics reports."""
    step: int
    num_blocks: int
    block_size: int
    owner: list[int]
    refcount: list[int]
    cached: list[bool]
    tenants: list[Tenant]
    waiting: list[str]           # request ids at the door, in the order they will be let in
    counts: dict
    kv_bytes: int | None = None  # the pool's K and V tensors as allocated (None: a runner that holds none)
