"""What exercise 02's design part uses besides the learner's own code: the seam that plugs a learner's
contiguous allocator (``MySlabs``) into stage 2's memory simulator, the traces the objective draws, and
``objective`` to measure a design against the lecture's policies.

Public on purpose: the notebook imports these (``from minikv.grading.public.ex02_contiguous import
objective, serve``), and a submission's process may read this module. It holds no target: exercise 02's
design part is graded against an objective whose passing rule lives in
``minikv/grading/checks/ex02_contiguous.py``.

The learner's allocator does not know how long a request will run (the simulator does, and never tells
it). It sees only request ids and token counts, and owns the layout: ``slabs``, a dict of request id ->
``(offset, size)`` in ``[0, budget)``, which the seam reads after every call and checks (the hard limits):

* slabs inside the budget, none overlapping another;
* every running request has a slab holding all its tokens (after ``grow`` returns True: one more);
  a finished or preempted request has none (memory is never leaked);
* a call may move any slab (each move copies that request's tokens: counted), but may resize only the
  slab of the request it is about;
* an empty budget admits the request at the head of the queue, and a request running alone gets room
  to grow (else nothing would ever run);
* the run ends: every request of the trace finishes, within ``CALL_LIMIT`` calls per request.
"""

from __future__ import annotations

import functools
import random

from minikv.grading.grader import call
from minikv.sim.memory import DEFAULT_BUDGET_TOKENS, DEFAULT_MAX_SEQ_LEN, SimResult, simulate
from minikv.sim.policies import ContiguousMax, ContiguousPow2, Seq
from minikv.sim.traces import TraceRequest, make_trace

NUM_TRACES = 2        # ShareGPT-shaped traces drawn for one measurement
TRACE_REQUESTS = 200  # requests per drawn trace
CALL_LIMIT = 100      # calls into the allocator per request of a trace (the solution makes about 9)
BASELINES = (ContiguousMax, ContiguousPow2)  # the lecture's policies that do not know the future


class SlabsBroken(AssertionError):
    """The learner's allocator broke a hard limit (the message says which, and where)."""


class LearnersSlabs:
    """A ``minikv.sim.policies.Policy`` that asks the learner's allocator (``make(budget, max_seq_len)``,
    e.g. the class ``MySlabs``) where every request's tokens go, checks its layout after every call, and
    counts the tokens its moves copy (``counters["copied_tokens"]``, charged by ``SimResult.timing``)."""

    name = "your slabs"

    def __init__(self, make, call_limit: int | None = None):
        self.make, self.call_limit = make, call_limit

    def reset(self, budget: int, max_seq_len: int) -> None:
        self.budget, self.max_seq_len = budget, max_seq_len
        self.mine = call(self.make, budget, max_seq_len)
        self.layout: dict[int, tuple[int, int]] = {}  # the last checked layout: request id -> (offset, size)
        self.seqs: dict[int, Seq] = {}                # running requests
        self.counters = {"copied_tokens": 0, "moves": 0}
        self.calls = 0
        self.changes = 0                              # successful calls so far: the allocator's state moved on
        self.refused: tuple | None = None             # (request, tokens, changes) of the last refused admission

    # -- the learner's calls, checked --------------------------------------------------------------

    def _ask(self, method: str, *args):
        self.calls += 1
        if self.call_limit is not None and self.calls > self.call_limit:
            raise SlabsBroken(f"the run did not finish within {self.call_limit:,} calls into your allocator "
                              f"({CALL_LIMIT} per request of the trace), {len(self.seqs)} requests still running: "
                              "does grow add a token at a time, or admit or grow keep refusing what they could give?")
        return call(getattr(self.mine, method), *args)

    def _read(self, what: str) -> dict[int, tuple[int, int]]:
        slabs = self.mine.slabs
        if not isinstance(slabs, dict):
            raise SlabsBroken(f"after {what}, `slabs` is a {type(slabs).__name__}; it must be a dict of request "
                              "id -> (offset, size)")
        out = {}
        for k, v in slabs.items():
            if not (isinstance(v, (tuple, list)) and len(v) == 2 and all(isinstance(x, int) for x in v)):
                raise SlabsBroken(f"after {what}, slabs[{k!r}] = {v!r}; each slab must be (offset, size), two ints")
            out[k] = (int(v[0]), int(v[1]))
        return out

    def _check(self, what: str, about: int, new: dict[int, tuple[int, int]]) -> None:
        """Check the layout after a call about request `about`; count what it moved."""
        running = set(self.seqs)
        if set(new) != running:
            lost, extra = sorted(running - set(new)), sorted(set(new) - running)
            raise SlabsBroken(f"after {what}, " + (f"running request(s) {lost} have no slab (their tokens are lost)"
                              if lost else f"slabs are held for {extra}, which are not running (a leak)"))
        end, last = 0, None
        for rid, (off, size) in sorted(new.items(), key=lambda kv: kv[1]):
            if size < 1 or off < 0 or off + size > self.budget:
                raise SlabsBroken(f"after {what}, request {rid}'s slab (offset {off}, size {size}) is not inside "
                                  f"the budget [0, {self.budget})")
            if off < end:
                raise SlabsBroken(f"after {what}, request {rid}'s slab (offset {off}, size {size}) overlaps request "
                                  f"{last}'s {new[last]}: two requests in the same memory")
            end, last = off + size, rid
        for rid, (off, size) in new.items():
            live = self.seqs[rid].live + (1 if what.startswith("grow") and rid == about else 0)
            if size < live:
                raise SlabsBroken(f"after {what}, request {rid} has {live} tokens to hold in a slab of {size}")
            if rid in self.layout and rid != about and self.layout[rid][1] != size:
                raise SlabsBroken(f"after {what}, request {rid}'s slab changed size ({self.layout[rid][1]} -> "
                                  f"{size}): a call may move other requests' slabs, not resize them")
            if rid in self.layout and self.layout[rid][0] != off:
                self.counters["copied_tokens"] += self.seqs[rid].live  # a move copies the tokens written so far
                self.counters["moves"] += 1
        self.layout = new
        self.changes += 1

    # -- the simulator's Policy ----------------------------------------------------------------------

    def refuse(self, req: TraceRequest) -> str | None:
        return None if req.total_len <= self.budget else f"needs {req.total_len} tokens, the budget is {self.budget}"

    def need(self, seq: Seq) -> int:
        return seq.live  # the least any allocator must give it (the books' external fragmentation)

    def admit(self, seq: Seq) -> bool:
        key = (seq.id, seq.live, self.changes)
        if key == self.refused:  # nothing happened since it said no: it would say no again
            return False
        ok = self._ask("admit", seq.id, seq.live)
        if not isinstance(ok, bool):
            raise SlabsBroken(f"admit({seq.id}, {seq.live}) returned {ok!r}; it must return True or False")
        if not ok:
            if not self.seqs:
                raise SlabsBroken(f"admit({seq.id}, {seq.live}) returned False with nothing running: the whole "
                                  f"budget ({self.budget} tokens) is free, and nothing would ever run")
            self.refused = key
            return False
        self.seqs[seq.id] = seq
        self._check(f"admit({seq.id}, {seq.live})", seq.id, self._read(f"admit({seq.id}, {seq.live})"))
        return True

    def grow(self, seq: Seq) -> bool:
        what = f"grow({seq.id}, {seq.live})"
        ok = self._ask("grow", seq.id, seq.live)
        if not isinstance(ok, bool):
            raise SlabsBroken(f"{what} returned {ok!r}; it must return True or False")
        if not ok:
            self.changes += 1  # it may have changed its own state while it tried
            if len(self.seqs) == 1:
                raise SlabsBroken(f"{what} returned False while request {seq.id} runs alone: the budget has "
                                  f"{self.budget - seq.live} free tokens, and preempting it would not help")
            return False
        self._check(what, seq.id, self._read(what))
        return True

    def release(self, seq: Seq) -> None:
        self._ask("release", seq.id)
        del self.seqs[seq.id]
        self._check(f"release({seq.id})", seq.id, self._read(f"release({seq.id})"))

    def capacity(self, seq: Seq) -> int:
        return self.layout[seq.id][1]

    def slots(self, seq: Seq, start: int = 0) -> list[tuple[int, int, int]]:
        off, size = self.layout[seq.id]
        return [(off, size, 0)]

    def free_tokens(self) -> int:
        return self.budget - sum(size for _, size in self.layout.values())

    usable_free = free_tokens


def serve(make, trace: list[TraceRequest], budget: int = DEFAULT_BUDGET_TOKENS,
          max_seq_len: int = DEFAULT_MAX_SEQ_LEN) -> SimResult:
    """Replay `trace` through stage 2's simulator with the learner's allocator (``serve(MySlabs, trace)``);
    raises ``SlabsBroken`` where a hard limit breaks."""
    policy = LearnersSlabs(make, call_limit=CALL_LIMIT * len(trace))
    result = simulate(list(trace), policy, budget, max_seq_len=max_seq_len)
    unfinished = len(trace) - int(result.timeline["finished"].sum()) - len(result.rejected)
    if unfinished:
        raise SlabsBroken(f"{unfinished} requests of the trace never finished")
    return result


def measure(result: SimResult) -> dict:
    """What the objective reads from one run: output tokens per second with recompute and copies charged
    (``SimResult.timing``, the lecture's cost model), the tokens its moves copied, and what explains them."""
    t = result.timing()
    return {"tokens_per_s": t["tokens_per_s"], "tokens": t["tokens"], "copied_tokens": t["copied_tokens"],
            "recompute_share": t["recompute_share"], "copy_share": t["copy_share"],
            "preemptions": result.preemptions, "mean_concurrent": result.summary()["mean_concurrent"]}


def draw_traces(seed: int, n: int = NUM_TRACES, requests: int = TRACE_REQUESTS) -> list[list[TraceRequest]]:
    """`n` ShareGPT-shaped traces (the lecture's workload, its arrival rate) drawn from `seed`."""
    rng = random.Random(seed)
    return [make_trace("sharegpt", requests, seed=rng.randrange(2 ** 32)) for _ in range(n)]


def baseline(trace: list[TraceRequest], budget: int = DEFAULT_BUDGET_TOKENS) -> dict:
    """The best of the lecture's policies that do not know the future (``BASELINES``) on `trace`."""
    runs = {cls.name: measure(simulate(list(trace), cls(), budget)) for cls in BASELINES}
    best = max(runs, key=lambda name: runs[name]["tokens_per_s"])
    return {"policy": best, **runs[best]}


@functools.lru_cache(maxsize=64)
def _seed_baselines(seed: int, budget: int) -> tuple[dict, ...]:
    """The baseline on each trace `seed` draws: the same whatever is measured against it, so computed once per
    process (the grader measures every design on the same seeds; a notebook measures one seed again and again)."""
    return tuple(baseline(trace, budget) for trace in draw_traces(seed))


def objective(make, seed: int = 0, traces: list[list[TraceRequest]] | None = None,
              budget: int = DEFAULT_BUDGET_TOKENS) -> dict:
    """Serve `traces` (default: ``NUM_TRACES`` drawn from `seed`) with the learner's allocator (``make``: pass the
    class, ``objective(MySlabs, seed=0)``) and with the best of the lecture's policies that do not know the future.
    Returns per trace, and over all of them: ``ratio``, the mean over the traces of your output tokens per second
    (charged) over the baseline's, and ``copied_per_token``, the tokens your moves copied per output token.
    Raises ``SlabsBroken`` where a hard limit breaks."""
    bases = _seed_baselines(seed, budget) if traces is None else [baseline(t, budget) for t in traces]
    traces = draw_traces(seed) if traces is None else traces
    rows = []
    for i, trace in enumerate(traces):
        base, mine = bases[i], measure(serve(make, trace, budget))
        rows.append({"trace": i, "requests": len(trace), "baseline": base["policy"],
                     "ratio": mine["tokens_per_s"] / base["tokens_per_s"], "yours": mine, "base": base})
    tokens = sum(r["yours"]["tokens"] for r in rows)
    return {"seed": seed, "budget": budget, "traces": rows, "ratio": sum(r["ratio"] for r in rows) / len(rows),
            "copied_per_token": sum(r["yours"]["copied_tokens"] for r in rows) / max(1, tokens)}
