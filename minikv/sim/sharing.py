"""Shared walls, simulated: replay traces with shared prefixes through the real ``BlockManager``.

Stage 2-3's simulator (``minikv.sim.memory``) asks where memory goes when nobody shares. This one asks
how much sharing saves, and runs the very block manager the engine uses (``minikv.prefix``), so
every hit, fork, copy-on-write and eviction below is the real one, on block ids, without tensors.

Traces (each a list of ``Job``; lengths and arrivals come from ``minikv.sim.traces``):

* ``system_prompt_trace``: conversations behind one long shared system prompt (~1,000 tokens),
  each with its own question (50-200 tokens);
* ``few_shot_trace``: prompts that start with one of a few few-shot blocks (a popular one
  most often), then a short question;
* ``multi_turn_trace``: chats where every turn resends the whole history (previous prompts and
  answers) plus a new user message, after a pause;
* ``parallel_trace(workload, n)``: each request's prompt sampled ``n`` times (vLLM's ``n``);
* ``beam_trace(workload, width)``: beam search of that width.

The replay (``replay``) is a step loop like ``minikv.sim.memory``: arrivals queue; every step each
running sequence writes one token; a job is admitted first come, first served when the pool
has ``blocks_for(prompt) + 1`` blocks per sequence free (a conservative check: cache hits on
blocks someone owns would need fewer); when a decode step runs out of blocks the youngest job
is preempted (all its blocks freed, restarted later: recompute), as in vLLM.

What it measures:

* **Memory saved by sharing**: at each step, the blocks the running sequences would take
  unshared (``sum blocks_for(len)``) against the blocks they own (refcount counted once). The
  reported fraction is sum(saved) / sum(unshared) over all steps: a *time average weighted by
  memory* (block-steps), because memory held for longer costs more. The PagedAttention paper
  (Kwon et al. 2023, §6.3, Fig. 15) reports "the number of blocks saved by sharing divided by
  the number of total blocks without sharing", averaged over its Alpaca run on OPT-13B:
  6.1-9.8% with parallel sampling and 37.6-55.2% with beam search, for n / width 2 to 6.
* **Prefill tokens skipped**: prompt tokens served from cached blocks / prompt tokens admitted
  (the block manager's own hit rate), counting each job's first admission only: a preempted
  job that comes back hits its own blocks, which says nothing about sharing.
* **Block hit rate**: of the full prompt blocks a lookup could have hit, the fraction it did.
  Against pool size this is the *eviction curve*: in a small pool LRU throws away cached blocks
  that a later prompt would have hit.

The beam-search model (``beam_parents``). Real beam search keeps the ``width`` best-scoring
sequences: every beam proposes its ``width`` best next tokens, the ``width`` best of the
``width**2`` candidates (score = beam's log-prob + token's log-prob) survive, and beams that no
candidate chose are dropped. So the survivors of a step descend from a few parents, and all
beams share a common history a few steps back. We draw the log-probs: a beam's best token costs
``Exp(1) * s`` nats and each next-best token ``Exp(1) * s`` more, with a confidence scale
``s ~ LogNormal(0, spread)`` drawn per beam and step (language models are sure of some tokens
and torn over others). With ``spread = 0`` the model has no parameter at all: a common scale
does not change which candidates win. Each step every survivor is forked from its parent, the
old beams are freed, and each new beam writes its token: a partial last block shared by sibling
beams is copied (copy-on-write) by all but the last sibling to write.

Parallel sampling: the prompt is prefilled once, then forked into ``n`` samples whose answer
lengths are drawn independently from the workload's answer lengths (samples stop at their own
end of text). The prompt's partial last block is copied by the first ``n - 1`` samples that write.

**Why the replay has its own admission and preemption** instead of driving the engine's scheduler
(``minikv.scheduler``, with the fake runner); the block manager, where the sharing happens, is
the engine's own:

* the engine has no beam search, and half of the paper's comparison (Fig. 15) is beams: each
  step forks the survivors from a few parents and drops the others, which is bookkeeping on
  block tables the scheduler never does;
* a job is preempted and readmitted as a whole (all its samples or beams), as vLLM does with a
  sequence group; the scheduler preempts single sequences, and would split a family;
* samples of one request stop at answer lengths drawn independently, while a request's
  ``SamplingParams.max_tokens`` is one number for all its ``n`` samples;
* admission here reserves ``blocks_for(prompt) + 1`` blocks per sequence and writes the whole
  prompt in the admission step; the scheduler admits under a token budget and a watermark and
  forks the ``n`` samples only after the prompt's prefill. Stage 5's printed figures (memory
  saved, prefill skipped, hit rates, the eviction curve) come from this replay, in the paper's
  setup, and would all move under the engine's rules.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from minikv.blocks import OutOfBlocks, blocks_for
from minikv.prefix import BlockManager
from minikv.sim.memory import DEFAULT_BUDGET_TOKENS, DEFAULT_MAX_SEQ_LEN
from minikv.sim.traces import WORKLOADS, make_trace

DEFAULT_BLOCK_SIZE = 16
DEFAULT_NUM_BLOCKS = DEFAULT_BUDGET_TOKENS // DEFAULT_BLOCK_SIZE  # the paper's OPT-13B budget: 983 blocks
PAPER = {"parallel": (0.061, 0.098), "beam": (0.376, 0.552)}  # Kwon et al. 2023 Fig. 15, n/width 2..6
VOCAB = 32_000


@dataclass
class Job:
    """One request of a sharing trace. ``prompt`` is token ids (prefix traces) or just a length
    (parallel sampling and beam search need no ids: they share by fork, not by lookup)."""

    id: int
    arrival: int
    prompt: tuple[int, ...] | int
    output_lens: tuple[int, ...]         # one per sample (n samples), or (steps,) for beam search
    answer: tuple[int, ...] = ()         # ids sample 0 writes (multi-turn resends them); else unknown
    beams: int = 0                       # > 0: beam search of this width
    next_turn: tuple[int, Job] | None = None  # multi-turn: (pause in steps, the next turn's job)

    @property
    def prompt_len(self) -> int:
        return self.prompt if isinstance(self.prompt, int) else len(self.prompt)

    @property
    def width(self) -> int:
        return self.beams or len(self.output_lens)


# ---- traces ---------------------------------------------------------------------------------

def _ids(rng: np.random.Generator, n: int) -> tuple[int, ...]:
    return tuple(int(t) for t in rng.integers(0, VOCAB, n))


def system_prompt_trace(n: int = 200, *, system_len: int = 1000, question: tuple[int, int] = (50, 200),
                        workload: str = "sharegpt", seed: int = 0) -> list[Job]:
    """``n`` conversations behind one shared system prompt; questions of ``question`` tokens
    (uniform), answers and arrivals shaped like ``workload``."""
    rng, base = np.random.default_rng(seed), make_trace(workload, n, seed=seed)
    system = _ids(rng, system_len)
    return [Job(r.id, r.arrival, system + _ids(rng, int(rng.integers(question[0], question[1] + 1))),
                (r.output_len,)) for r in base]


def few_shot_trace(n: int = 300, *, shots: int = 4, shot_len: tuple[int, int] = (300, 600),
                   question: tuple[int, int] = (20, 100), workload: str = "alpaca", seed: int = 0) -> list[Job]:
    """Prompts = one of ``shots`` few-shot blocks (block k chosen with weight 1/(k+1): a popular
    task and a tail) + a question; answers and arrivals shaped like ``workload``."""
    rng, base = np.random.default_rng(seed), make_trace(workload, n, seed=seed)
    blocks = [_ids(rng, int(rng.integers(shot_len[0], shot_len[1] + 1))) for _ in range(shots)]
    weights = 1 / np.arange(1, shots + 1)
    picks = rng.choice(shots, n, p=weights / weights.sum())
    return [Job(r.id, r.arrival, blocks[k] + _ids(rng, int(rng.integers(question[0], question[1] + 1))),
                (r.output_len,)) for r, k in zip(base, picks)]


def multi_turn_trace(conversations: int = 60, *, turns: tuple[int, int] = (2, 8), user: tuple[int, int] = (20, 150),
                     max_answer: int = 300, pause: tuple[int, int] = (20, 200), workload: str = "sharegpt",
                     max_seq_len: int = DEFAULT_MAX_SEQ_LEN, seed: int = 0) -> list[Job]:
    """Chats whose every turn resends the history. Returns the first turns; each job's
    ``next_turn`` holds (pause, next job), started ``pause`` steps after the previous answer."""
    rng = np.random.default_rng(seed)
    answers = iter(make_trace(workload, conversations * turns[1], seed=seed + 1))
    firsts, next_id = [], 0
    for conv in make_trace(workload, conversations, seed=seed):
        history: tuple[int, ...] = ()
        chain: list[Job] = []
        for _ in range(int(rng.integers(turns[0], turns[1] + 1))):
            prompt = history + _ids(rng, int(rng.integers(user[0], user[1] + 1)))
            answer = _ids(rng, min(next(answers).output_len, max_answer))
            if len(prompt) + len(answer) > max_seq_len:
                break  # the chat no longer fits the model's context: it ends here
            chain.append(Job(next_id, conv.arrival, prompt, (len(answer),), answer))
            next_id += 1
            history = prompt + answer
        for job, follow in zip(chain, chain[1:]):
            job.next_turn = (int(rng.integers(pause[0], pause[1] + 1)), follow)
        firsts.append(chain[0])
    return firsts


def parallel_trace(workload: str = "alpaca", n: int = 4, requests: int = 300, *, seed: int = 0,
                   rate: float | str | None = "default") -> list[Job]:
    """Each request's prompt sampled ``n`` times; every sample's answer length is drawn
    independently from the workload's answer lengths. ``rate``: as in ``make_trace``."""
    base = make_trace(workload, requests, seed=seed, rate=rate)
    others = iter(make_trace(workload, requests * n, seed=seed + 1))
    return [Job(r.id, r.arrival, r.prompt_len, (r.output_len,) + tuple(next(others).output_len for _ in range(n - 1)))
            for r in base]


def beam_trace(workload: str = "alpaca", width: int = 4, requests: int = 300, *, seed: int = 0,
               rate: float | str | None = "default") -> list[Job]:
    """Beam search of ``width`` beams over the workload's prompts, for its answer lengths."""
    return [Job(r.id, r.arrival, r.prompt_len, (r.output_len,), beams=width)
            for r in make_trace(workload, requests, seed=seed, rate=rate)]


# ---- the beam model -------------------------------------------------------------------------

def beam_parents(scores: np.ndarray, width: int, rng: np.random.Generator, spread: float = 1.0):
    """One step of beam search: each beam proposes its ``width`` best next tokens with drawn
    log-probs (see module doc); returns (parent of each survivor, survivors' scores), best first."""
    beams = len(scores)
    scale = rng.lognormal(0.0, spread, (beams, 1)) if spread else 1.0
    logp = -np.cumsum(rng.exponential(1.0, (beams, width)), axis=1) * scale
    cand = (scores[:, None] + logp).ravel()
    best = np.argsort(-cand, kind="stable")[:width]
    return best // width, cand[best]


def _turns(job: Job):
    while job is not None:
        yield job
        job = job.next_turn[1] if job.next_turn else None


# ---- the replay -----------------------------------------------------------------------------

@dataclass
class _Running:
    job: Job
    start: int
    seqs: dict = field(default_factory=dict)    # seq id -> tokens still to write (samples) / None (beams)
    outs: dict = field(default_factory=dict)    # sample's seq id -> its answer length
    first: int = 0                              # sample 0's seq id: it writes the known answer ids
    written: int = 0                            # decode steps done
    scores: np.ndarray | None = None


@dataclass
class SharingResult:
    """What one replay measured; see the module doc for each number's meaning."""

    name: str
    num_blocks: int
    block_size: int
    used: np.ndarray          # blocks owned per step (each shared block once)
    unshared: np.ndarray      # blocks the same sequences would own without sharing, per step
    prompt_tokens: int = 0
    hit_tokens: int = 0
    lookup_blocks: int = 0    # full prompt blocks a lookup could have hit
    evictions: int = 0
    cow_copies: int = 0
    preemptions: int = 0
    finished: int = 0

    @property
    def memory_saved(self) -> float:
        total = self.unshared.sum()
        return float((self.unshared - self.used).sum() / total) if total else 0.0

    @property
    def peak_saved(self) -> float:
        frac = (self.unshared - self.used) / np.maximum(self.unshared, 1)
        return float(frac.max()) if len(frac) else 0.0

    @property
    def prefill_skipped(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.block_size / self.lookup_blocks if self.lookup_blocks else 0.0

    def summary(self) -> dict:
        return {"trace": self.name, "memory_saved": self.memory_saved, "peak_saved": self.peak_saved,
                "prefill_skipped": self.prefill_skipped, "hit_rate": self.hit_rate,
                "prompt_tokens": self.prompt_tokens, "hit_tokens": self.hit_tokens, "evictions": self.evictions,
                "cow_copies": self.cow_copies, "preemptions": self.preemptions, "finished": self.finished,
                "steps": len(self.used), "num_blocks": self.num_blocks, "block_size": self.block_size}


def replay(jobs: Sequence[Job], name: str = "", *, num_blocks: int = DEFAULT_NUM_BLOCKS,
           block_size: int = DEFAULT_BLOCK_SIZE, enable_prefix_caching: bool = True, spread: float = 1.0,
           seed: int = 0, max_steps: int = 1_000_000) -> SharingResult:
    """Serve ``jobs`` step by step through one ``BlockManager`` (see module doc)."""
    for job in (j for first in jobs for j in _turns(first)):
        if job.width < 1 or min(job.output_lens, default=0) < 1 or job.prompt_len < 1:
            raise ValueError(f"job {job.id}: needs a prompt, at least one sequence and answers >= 1 token")
        if job.width * (blocks_for(job.prompt_len + max(job.output_lens), block_size) + 1) > num_blocks:
            raise ValueError(f"job {job.id} ({job.width} x {job.prompt_len}+{max(job.output_lens)} tokens) cannot "
                             f"fit in {num_blocks} blocks of {block_size}: give the replay more blocks")
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching)
    rng = np.random.default_rng(seed)
    pending = sorted(jobs, key=lambda j: (j.arrival, j.id))  # not yet arrived
    waiting: deque[Job] = deque()
    running: list[_Running] = []
    res = SharingResult(name, num_blocks, block_size, np.zeros(0), np.zeros(0))
    used, unshared = [], []
    next_seq = 0
    step = 0
    admitted: set[int] = set()

    def new_seq() -> int:
        nonlocal next_seq
        next_seq += 1
        return next_seq

    def release(run: _Running) -> None:
        for sid in run.seqs:
            bm.free(sid)
        run.seqs.clear()

    def admit(job: Job) -> _Running | None:
        width = job.width
        if bm.num_free_blocks < width * (blocks_for(job.prompt_len, block_size) + 1):
            return None
        sid = new_seq()
        ids = job.prompt if not isinstance(job.prompt, int) else [None] * job.prompt
        hit = bm.open(sid, ids) if not isinstance(job.prompt, int) else bm.open(sid, ())
        bm.append(sid, ids[hit:] if not isinstance(job.prompt, int) else job.prompt - hit)
        if job.id not in admitted:  # a preempted job's re-admission hits its own blocks: not counted
            admitted.add(job.id)
            res.prompt_tokens += job.prompt_len
            res.hit_tokens += hit
            res.lookup_blocks += (job.prompt_len - 1) // block_size
        run = _Running(job, step, {sid: job.output_lens[0]}, {sid: job.output_lens[0]}, sid)
        if job.beams:
            run.seqs[sid], run.scores = None, np.zeros(1)
        else:  # parallel samples share the whole prompt
            for extra in job.output_lens[1:]:
                child = new_seq()
                bm.fork(sid, child)
                run.seqs[child] = run.outs[child] = extra
        return run

    def decode(run: _Running) -> None:
        """One token per sequence, all or nothing: raises OutOfBlocks and changes nothing."""
        job, bs = run.job, block_size
        length = job.prompt_len + run.written  # every beam, and every sample still writing, is this long
        if job.beams:
            parents, scores = beam_parents(run.scores, job.beams, rng, spread)
            children: dict[int, int] = {}
            for p in parents.tolist():
                children[p] = children.get(p, 0) + 1
            # a full tail: every beam takes a new block; a partial one: all siblings but the last copy it
            needed = job.beams if length % bs == 0 else job.beams - len(children)
            if needed > bm.num_free_blocks:
                raise OutOfBlocks(needed, bm.num_free_blocks, f"beam step of job {job.id}")
            old, new = list(run.seqs), []
            for p, count in children.items():  # the first child continues its parent's sequence (as vLLM)
                new.append(old[p])
                for _ in range(count - 1):
                    child = new_seq()
                    bm.fork(old[p], child)
                    new.append(child)
            for p, sid in enumerate(old):
                if p not in children:
                    bm.free(sid)  # a beam no candidate chose: dropped
            run.seqs = dict.fromkeys(new)
            for sid in new:
                bm.append(sid, 1)
            run.scores = scores
            run.written += 1
            return
        writing = list(run.seqs)  # samples still writing (a finished one is freed at once, as in vLLM)
        if run.written == 0:  # the samples' first tokens: all but the last writer copy the prompt's tail
            needed = len(writing) - (length % bs != 0)
        else:
            needed = len(writing) if length % bs == 0 else 0
        if needed > bm.num_free_blocks:
            raise OutOfBlocks(needed, bm.num_free_blocks, f"decode step of job {job.id}")
        for sid in writing:
            bm.append(sid, [job.answer[run.written]] if sid == run.first and job.answer else 1)
            run.seqs[sid] -= 1
            if run.seqs[sid] == 0:
                bm.free(sid)
                del run.seqs[sid]
        run.written += 1

    def unshared_blocks(run: _Running) -> int:
        """Blocks the run's sequences would own without sharing (arithmetic: no table reads)."""
        job = run.job
        if job.beams:
            return len(run.seqs) * blocks_for(job.prompt_len + run.written, block_size)
        return sum(blocks_for(job.prompt_len + run.outs[sid] - left, block_size) for sid, left in run.seqs.items())

    def done(run: _Running) -> bool:
        if run.job.beams:
            return run.written >= run.job.output_lens[0]
        return not run.seqs

    while (pending or waiting or running) and step < max_steps:
        while pending and pending[0].arrival <= step:
            waiting.append(pending.pop(0))
        # decode: oldest first; out of blocks -> preempt the youngest job (maybe this one)
        i = 0
        while i < len(running):
            run = running[i]
            try:
                decode(run)
            except OutOfBlocks:
                victim = running.pop()
                release(victim)
                waiting.appendleft(victim.job)
                res.preemptions += 1
                continue  # retry this run (unless it was the victim: then i == len(running))
            if done(run):
                release(run)
                running.pop(i)
                res.finished += 1
                if run.job.next_turn:
                    pause, follow = run.job.next_turn
                    follow.arrival = step + pause
                    pending.append(follow)
                    pending.sort(key=lambda j: (j.arrival, j.id))
                continue
            i += 1
        while waiting:
            run = admit(waiting[0])
            if run is None:
                break
            waiting.popleft()
            running.append(run)
        if running:
            used.append(bm.allocator.num_used)
            unshared.append(sum(unshared_blocks(r) for r in running))
        step += 1
    res.used, res.unshared = np.array(used), np.array(unshared)
    res.evictions, res.cow_copies = bm.stats.evictions, bm.stats.cow_copies
    return res


# ---- the studies the bench and the notebook print -----------------------------------------

def fork_savings(workload: str = "alpaca", widths: Sequence[int] = (2, 4, 6), requests: int = 300, *,
                 seed: int = 0, spread: float = 1.0, **kw) -> dict[str, dict[int, SharingResult]]:
    """Memory saved by parallel sampling and beam search at each width (sharing by fork only)."""
    out: dict[str, dict[int, SharingResult]] = {"parallel": {}, "beam": {}}
    for w in widths:
        out["parallel"][w] = replay(parallel_trace(workload, w, requests, seed=seed), f"{workload} n={w}",
                                    enable_prefix_caching=False, seed=seed, **kw)
        out["beam"][w] = replay(beam_trace(workload, w, requests, seed=seed), f"{workload} beam={w}",
                                enable_prefix_caching=False, seed=seed, spread=spread, **kw)
    return out


def eviction_curve(jobs_fn, pool_sizes: Sequence[int], **kw) -> dict[int, SharingResult]:
    """Replay a fresh copy of the same trace (``jobs_fn()``) at each pool size."""
    return {n: replay(jobs_fn(), f"{n} blocks", num_blocks=n, **kw) for n in pool_sizes}


def expected_system_prompt_skip(system_len: int, question_mean: float, block_size: int = DEFAULT_BLOCK_SIZE) -> float:
    """What a warm cache should skip: the system prompt's full blocks, of the whole prompt."""
    return (system_len // block_size) * block_size / (system_len + question_mean)


__all__ = ["Job", "SharingResult", "replay", "beam_parents", "system_prompt_trace", "few_shot_trace",
           "multi_turn_trace", "parallel_trace", "beam_trace", "fork_savings", "eviction_curve",
           "expected_system_prompt_skip", "PAPER", "WORKLOADS"]
