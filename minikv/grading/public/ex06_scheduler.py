"""What exercise 06's notebook uses besides its own code: the seam that plugs a policy into minikv's
scheduler, a fake-runner driver that measures a policy, the two families of workloads the objective
draws, and the scripted scenarios it shows.

Public on purpose: the notebook imports these (``from minikv.grading.public.ex06_scheduler import
SCENARIOS, objective, run_fake, policy_scheduler``), and a submission's process may read this module. There
is no reference answer to copy: exercise 06 is a design exercise, graded by invariants and by an
objective measured against the lecture's baseline (minikv's default policy) on held-out sets of seeds
(the same at every grading); the checks live in ``minikv/grading/checks/ex06_scheduler.py``.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass, field

from minikv.blocks import blocks_for
from minikv.grading.grader import call
from minikv.scheduler import Scheduler, SchedulerStalled

# ---- the seam: a policy as two plain functions ----------------------------------------------

class PolicyScheduler(Scheduler):
    """minikv's scheduler with its policy replaced by ``admit(...) -> bool`` and ``victim(...) -> seq_id``,
    plugged in through the scheduler's public policy hooks (``can_admit``, ``choose_victim``). A hook
    given as None keeps minikv's own rule (the lecture's baseline).

    Records each step's decisions in its `Record` (request names, not global seq ids, so two engines can
    be compared) and counts the tokens computed there: the caller keeps the record, so nothing reads the
    engine's scheduler from outside."""

    admit_fn = victim_fn = None   # set on the subclass that `policy_scheduler` makes
    record: Record                # the same

    def __init__(self, config, block_manager, swap=None):
        super().__init__(config, block_manager, swap)

    def can_admit(self, seq, num_tokens: int, step) -> bool:
        if self.admit_fn is None:
            return super().can_admit(seq, num_tokens, step)
        bm = self.bm
        args = (num_tokens, step.budget, bm.blocks_needed(seq.seq_id, num_tokens), bm.num_free_blocks,
                [bm.num_tokens(s.seq_id) for s in self.running], bm.block_size)
        ok = call(self.admit_fn, *args)
        if not isinstance(ok, bool):
            raise AssertionError(f"my_admit{args} returned {ok!r}; it must return True or False")
        return ok

    def choose_victim(self, seq, step):
        if self.victim_fn is None:
            return super().choose_victim(seq, step)
        cands = self.victim_candidates(seq, step)
        pairs = [(s.seq_id, len(self.bm.block_table(s.seq_id)), s.num_computed) for s in cands]
        pick = call(self.victim_fn, seq.seq_id, pairs)
        by_id = {s.seq_id: s for s in cands} | {seq.seq_id: seq}
        if not isinstance(pick, int) or pick not in by_id:
            raise AssertionError(f"my_victim({seq.seq_id}, {pairs}) returned {pick!r}; it must return "
                                 f"{seq.seq_id} (needy) or a seq_id from the candidates")
        return by_id[pick]

    def schedule(self):
        out = super().schedule()
        n, budget = sum(x.num_tokens for x in out.scheduled), self.config.max_num_batched_tokens
        if n > budget:
            raise AssertionError(f"a step computed {n} tokens, over the budget of {budget}: my_admit admitted a "
                                 "chunk larger than budget_left")
        self.record.computed += n
        name = lambda s: f"{s.request.request_id}"  # noqa: E731
        self.record.trace.append((tuple((name(x.seq), x.start, x.num_tokens) for x in out.scheduled),
                           tuple(name(s) for s in out.preempted)))
        return out


@dataclass
class Record:
    """What a `PolicyScheduler` decided, step by step, and the tokens it had computed."""
    trace: list[tuple] = field(default_factory=list)   # per step: ((request, start, tokens), ...), (preempted, ...)
    computed: int = 0


def policy_scheduler(admit, victim, record: Record | None = None) -> type[PolicyScheduler]:
    """A scheduler class with this policy, for ``LLMEngine(..., scheduler_cls=policy_scheduler(admit, victim))``:
    the one way a policy is plugged in. Its decisions go into `record` (a fresh one if None)."""
    return type("PolicyScheduler", (PolicyScheduler,), {"admit_fn": staticmethod(admit) if admit else None,
                                                        "victim_fn": staticmethod(victim) if victim else None,
                                                        "record": record if record is not None else Record()})


@functools.lru_cache(maxsize=1)
def _tiny_model():
    from minikv.models import tiny_random_llama

    return tiny_random_llama()


@dataclass
class Run:
    """One workload served under one policy, measured."""
    trace: list[tuple]            # per step: ((request, start, tokens), ...), (preempted requests, ...)
    tokens: dict[str, list[int]]  # request id -> the generated token ids
    preemptions: int
    steps: int                    # forward passes (engine steps) until every request finished
    recomputed: int               # tokens computed beyond each request's prompt + output - 1: preemption's waste


def run_fake(workload, admit, victim, max_steps: int = 3000) -> Run:
    """Serve `workload` with the fake runner under a policy (admit and victim None: minikv's own, the
    lecture's baseline, with its watermark of one block), check every request's tokens, and measure."""
    from minikv.engine import LLMEngine
    from minikv.sampling import SamplingParams
    from minikv.sim.fake_runner import FakeRunner, reference_tokens

    model = _tiny_model()
    w = workload
    eng = LLMEngine(model, None, block_size=w["block_size"], num_blocks=w["num_blocks"], verbose=False,
                    max_num_batched_tokens=w["budget"], enable_chunked_prefill=w["chunked"],
                    enable_prefix_caching=w["caching"], preemption_mode=w["mode"],
                    watermark=0.01 if admit is None else 0, max_num_seqs=w["max_num_seqs"],
                    runner=FakeRunner(w["num_blocks"], w["block_size"], model.config.vocab_size),
                    scheduler_cls=policy_scheduler(admit, victim, record := Record()))
    for i, (prompt, k) in enumerate(w["requests"]):
        eng.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=k, ignore_eos=True))
    tokens, steps = {}, 0
    while eng.has_unfinished_requests():
        if steps == max_steps:
            raise AssertionError(f"the engine did not finish within {max_steps} steps: does your policy ever admit "
                                 f"anyone? ({_describe(w)})")
        try:
            outputs = eng.step()
        except AssertionError:
            raise
        except Exception as err:  # noqa: BLE001 - the block manager refusing an allocation, a stall...
            if isinstance(err, SchedulerStalled):
                raise AssertionError(f"the engine stalled at step {steps}: nothing could run and my_admit refused "
                                     f"the head of the waiting queue ({_describe(w)})") from None
            raise AssertionError(f"the engine failed at step {steps} under your policy: {type(err).__name__}: "
                                 f"{err} (did my_admit admit a chunk whose blocks are not free? {_describe(w)})"
                                 ) from None
        steps += 1
        for o in outputs:
            if o.finished:
                tokens[o.request_id] = list(o.outputs[0].token_ids)
    vocab = model.config.vocab_size
    for i, (prompt, k) in enumerate(w["requests"]):
        gold = reference_tokens(prompt, k, vocab)
        if tokens.get(f"r{i}") != gold:
            raise AssertionError(f"{_describe(w)}: request r{i} got {tokens.get(f'r{i}')}, the model's tokens are "
                                 f"{gold}: a block was lost or overwritten")
    least = sum(len(p) + k - 1 for p, k in w["requests"])
    return Run(record.trace, tokens, eng.stats(history=0).preemptions, steps, record.computed - least)


# ---- the objective: your policy against the lecture's baseline on tight workloads ----------

# Workloads one seed draws, by family (the mixed ones vary more). The grader measures a policy on a held-out set of
# seeds, each drawing this many, and grades the mean over the seeds of the two ratios below against the targets.
NUM_DRAWN = {"short": 10, "mixed": 20}
MAX_RECOMPUTED = {"short": 0.90, "mixed": 0.85}  # the targets: recomputed tokens, yours / the baseline's
MAX_STEPS = 1.10        # and forward passes, yours / the baseline's (no winning by admitting nobody)


def tight_workload(rng: random.Random) -> dict:
    """Short requests at once: 4-8 requests (prompts of 4-24 tokens) in a pool of at most half of what
    they need together (but enough for the largest alone), chunked prefill, recompute, no prefix cache
    (so every recomputed token is preemption's waste). Here admission decides: the most recently
    admitted sequence is almost always also the one that has computed least, so the victim rule
    hardly matters, while admitting into a pool the running sequences are about to grow into does."""
    bs = rng.choice([2, 4, 8])
    reqs = [([rng.randint(1, 90) for _ in range(rng.randint(4, 24))], rng.randint(4, 24))
            for _ in range(rng.randint(4, 8))]
    need = max(blocks_for(len(p) + k - 1, bs) for p, k in reqs)
    total = sum(blocks_for(len(p) + k - 1, bs) for p, k in reqs)
    return dict(block_size=bs, num_blocks=rng.randint(need + 1, max(need + 2, total // 2)),
                budget=rng.choice([16, 32, 64]), chunked=True, caching=False, mode="recompute", max_num_seqs=8,
                requests=reqs)


def mixed_workload(rng: random.Random) -> dict:
    """A few long prompts among short ones: 6-8 requests at once, two of them (anywhere in the queue) with a
    prompt of 150-300 tokens and 8-32 to generate, the others 4-16 prompt tokens and 32-96 to generate. The
    pool holds every prompt with a block to spare for each, plus at most a quarter of what the outputs add:
    any sane admission lets every request in at once, and the outputs' growth forces the preemptions. Here
    the victim decides: the candidates differ tenfold in what they have computed, and the most recently
    admitted one is as likely a long prompt as a short one."""
    bs = rng.choice([2, 4, 8])
    n = rng.randint(6, 8)
    long = rng.sample(range(n), 2)
    reqs = []
    for i in range(n):
        if i in long:
            length, k = rng.randint(150, 300), rng.randint(8, 32)
        else:
            length, k = rng.randint(4, 16), rng.randint(32, 96)
        reqs.append(([rng.randint(1, 90) for _ in range(length)], k))
    prompts = sum(blocks_for(len(p), bs) for p, _ in reqs) + n + 1
    total = sum(blocks_for(len(p) + k - 1, bs) for p, k in reqs)
    need = max(blocks_for(len(p) + k - 1, bs) for p, k in reqs)
    pool = prompts + int(rng.uniform(0, 0.25) * max(0, total - prompts))
    # A budget of 512 tokens a step prefills any prompt in one step: no long prompt is caught half-prefilled
    # with no block left and no candidate to evict (it would give way itself, whatever the victim rule).
    return dict(block_size=bs, num_blocks=max(need + 1, pool), budget=512, chunked=True, caching=False,
                mode="recompute", max_num_seqs=8, requests=reqs)


# The objective's families of workloads, each graded on its own (a policy must beat the baseline on both).
FAMILIES = {"short": tight_workload, "mixed": mixed_workload}


def draw_workloads(seed: int, n: int | None = None, family: str = "short") -> list[dict]:
    """The `n` (default ``NUM_DRAWN[family]``) workloads of `family` that `seed` draws, as `objective` serves them."""
    rng = random.Random(seed)
    return [FAMILIES[family](rng) for _ in range(n or NUM_DRAWN[family])]


@functools.lru_cache(maxsize=64)
def _baseline(seed: int, n: int, family: str) -> tuple[Run, ...]:
    """The baseline's runs of the workloads `seed` draws: the same whatever is measured against them, so served once
    per process (the grader measures every policy on the same seeds)."""
    return tuple(run_fake(w, None, None) for w in draw_workloads(seed, n, family))


def objective(admit, victim, seed: int, n: int | None = None, family: str = "short") -> dict:
    """Serve `n` (default ``NUM_DRAWN[family]``) workloads of `family` ("short": `tight_workload`, "mixed":
    `mixed_workload`), drawn from `seed`, under the lecture's baseline (minikv's default policy) and under
    (admit, victim): recomputed tokens, forward passes and preemptions, summed. The grader calls this on each seed
    of its held-out set of the family, and grades the means of ``recomputed / base_recomputed`` and
    ``steps / base_steps`` over the seeds."""
    n = n or NUM_DRAWN[family]
    base = _baseline(seed, n, family)
    mine = [run_fake(w, admit, victim) for w in draw_workloads(seed, n, family)]
    return dict(seed=seed, n=n, family=family,
                base_recomputed=sum(r.recomputed for r in base), recomputed=sum(r.recomputed for r in mine),
                base_steps=sum(r.steps for r in base), steps=sum(r.steps for r in mine),
                base_preemptions=sum(r.preemptions for r in base), preemptions=sum(r.preemptions for r in mine))


def _describe(w) -> str:
    reqs = ", ".join(f"{len(p)}+{k}" for p, k in w["requests"])
    return (f"pool {w['num_blocks']} blocks of {w['block_size']}, budget {w['budget']} tokens/step, "
            f"chunked prefill {'on' if w['chunked'] else 'off'}, prefix caching {'on' if w['caching'] else 'off'}, "
            f"{w['mode']}, max_num_seqs {w['max_num_seqs']}, requests (prompt+output tokens) {reqs}")


# Scripted scenarios the notebook shows and the checks serve: recompute and swap, chunked prefill on and
# off, pools small enough that minikv's default policy preempts in each.
def _scenario(block_size, num_blocks, budget, requests, chunked=True, caching=False, mode="recompute",
              max_num_seqs=8):
    return dict(block_size=block_size, num_blocks=num_blocks, budget=budget, chunked=chunked, caching=caching,
                mode=mode, max_num_seqs=max_num_seqs, requests=requests)


def _prompt(seed: int, n: int) -> list[int]:
    return [1 + (seed * 131 + i * 17) % 97 for i in range(n)]


def _requests(shape):
    return [(_prompt(i, n), k) for i, (n, k) in enumerate(shape)]


SCENARIOS = [
    _scenario(4, 11, 8, _requests([(13, 7), (12, 11), (11, 12), (8, 4)])),
    _scenario(2, 11, 8, _requests([(11, 6), (4, 6), (6, 10), (8, 6), (3, 7)]), mode="swap"),
    _scenario(4, 8, 64, _requests([(9, 9), (8, 6), (4, 8), (4, 8)]), chunked=False, mode="swap"),
    _scenario(2, 14, 64, _requests([(5, 7), (10, 12), (8, 12)]), chunked=False),
]
