"""Checks for exercise 06 (design a scheduling policy): the learner's `my_admit` and `my_victim`.

A design exercise: no rule is asked for, so there is no reference answer to transcribe. Any policy
passes that

* **keeps the invariants**: admission never takes a chunk over the step's budget or blocks that are
  not free, and admits into an empty engine whatever fits (else the engine stalls); the victim is the
  needy sequence or one of the candidates; every request of every workload finishes, within a step
  limit, with the fake model's tokens (`minikv.sim.fake_runner`: any bookkeeping slip is a wrong
  token), and SmolLM2-135M served with the policy gives `transformers`' greedy tokens;
* **beats the lecture's baseline** (minikv's default `Scheduler`: FCFS admission keeping a watermark
  of one free block, the most recently admitted sequence as victim) on two families of memory-tight
  workloads, each graded by its own check on its own held-out set of seeds (`HELD_OUT`, the same at every
  grading; each seed draws `NUM_DRAWN[family]` workloads with the public `objective`): short requests at once
  (`tight_workload`: admission decides) and two long prompts among short ones (`mixed_workload`: the victim
  decides). On each, the mean over the seeds of its recomputed tokens over the baseline's (preemption's waste) must
  be at most `MAX_RECOMPUTED[family]`, and of its forward passes over the baseline's at most `MAX_STEPS` (so
  "admit one request at a time" does not pass). The verdict, passing or failing, gives both means, the targets and
  the set; a failing one names the worst seed and the public line that reproduces it.

Measured on the held-out sets with `tests/designs.py` (GRADING.md prints the table and says why each design passes
or fails): the solution and "a block per running sequence, the fewest computed as victim" (the insight the solution
rests on) pass both families; the lecture's policy (exactly 1.00x) and its admission with a good victim fail short
requests at once; headroom with the lecture's victim, the earliest admitted or the biggest one fail long prompts among
short ones (the earliest admitted about 1.0x there, with a spread over the seeds twice the other designs': that
family's set has 16 seeds of 20 workloads so that its target sits two standard errors from both it and the fewest
computed); admitting only into an empty engine (twice the forward passes) and the old exercise's answer fail both.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minikv.blocks import blocks_for
from minikv.grading import call, learner, one_torch_thread, run_hypothesis
from minikv.grading.checks.held_out import Criterion, HeldOutSet, Measurement
from minikv.grading.public.ex06_scheduler import (  # noqa: F401 - the notebook's helpers, re-exported for tests
    FAMILIES,
    MAX_RECOMPUTED,
    MAX_STEPS,
    NUM_DRAWN,
    SCENARIOS,
    PolicyScheduler,
    _describe,
    _tiny_model,
    mixed_workload,
    objective,
    policy_scheduler,
    run_fake,
    tight_workload,
)

MANY = settings(max_examples=200, deadline=None, database=None, derandomize=True, report_multiple_bugs=False)
WORKLOADS = settings(max_examples=40, deadline=None, database=None, derandomize=True, report_multiple_bugs=False)

# The graded functions take plain ints and lists: there is no minikv function they could hand the work to.
GRADED = ["my_admit", "my_victim"]
FORBIDDEN: list[str] = []
FUNCTION_STATE = "does your function keep state between calls?"  # the likely cause of a flaky failure



# ---- workloads ------------------------------------------------------------------------------

@st.composite
def workloads(draw):
    """Any workload: pool and block sizes, budgets, chunked prefill, prefix caching, recompute or swap."""
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    chunked = draw(st.booleans())
    n = draw(st.integers(1, 6))
    reqs = [([draw(st.integers(1, 90)) for _ in range(draw(st.integers(1, 20)))], draw(st.integers(1, 12)))
            for _ in range(n)]
    need = max(blocks_for(len(p) + k - 1, block_size) for p, k in reqs)
    return dict(block_size=block_size, num_blocks=draw(st.integers(need, 3 * need + 2)),
                budget=draw(st.sampled_from([4, 8, 32])) if chunked else 64, chunked=chunked,
                caching=draw(st.booleans()), mode=draw(st.sampled_from(["recompute", "swap"])),
                max_num_seqs=draw(st.sampled_from([2, 8])), requests=reqs)


FAMILY_NAMES = {"short": "short requests at once", "mixed": "two long prompts among short ones"}
HELD_OUT = {"short": HeldOutSet("ex06-short-v1", (1995585921, 1131420036, 3783769923, 878391077, 840927815, 775680178,
                                                  2525520384, 3899581838, 2782607366, 348450317, 2693946827, 413392461,
                                                  447843925, 213074496, 4254210140, 3367944007),
                                f"{NUM_DRAWN['short']} workloads of {FAMILY_NAMES['short']}"),
            "mixed": HeldOutSet("ex06-mixed-v1", (1115202734, 2014629430, 2916172318, 3849748746, 2537534314,
                                                  1980887897, 1412093993, 3069743948, 2630327698, 3321938902,
                                                  2957341281, 3935212438, 989311542, 2831196990, 3492918876,
                                                  2379395167),
                                f"{NUM_DRAWN['mixed']} workloads of {FAMILY_NAMES['mixed']}")}


def held_out_measurement(admit, victim, family: str) -> Measurement:
    """The policy measured on every seed of the family's held-out set with the public `objective`."""
    per_seed = [objective(admit, victim, seed, family=family) for seed in HELD_OUT[family].seeds]
    return Measurement(HELD_OUT[family], [
        Criterion("{} the baseline's recomputed tokens", [m["recomputed"] / max(1, m["base_recomputed"])
                                                            for m in per_seed], MAX_RECOMPUTED[family], at_most=True,
                  short="recomputed tokens, yours / the baseline's"),
        Criterion("{} its forward passes", [m["steps"] / m["base_steps"] for m in per_seed], MAX_STEPS,
                  at_most=True, short="forward passes, yours / the baseline's")], per_seed)


def held_out_measurements(policy) -> list[Measurement]:
    """Every design check's measurement of `policy` = (admit, victim): one per family (tests/designs.py)."""
    return [held_out_measurement(*policy, family) for family in HELD_OUT]


def objective_verdict(m: Measurement) -> tuple[bool, str]:
    """(passed, message): what was measured on the held-out set and the targets; a failure also names the seed
    where the policy did worst, with the public line that reproduces it."""
    said = m.said()
    if m.passed:
        return True, said
    rec, steps = m.criteria
    w = m.per_seed[(rec if not rec.passed else steps).worst()]
    where = (f"Where you did worst: seed {w['seed']}, recomputed tokens: baseline {w['base_recomputed']}, yours "
             f"{w['recomputed']}; forward passes: baseline {w['base_steps']}, yours {w['steps']}; preemptions: "
             f"baseline {w['base_preemptions']}, yours {w['preemptions']}; objective(my_admit, my_victim, "
             f"seed={w['seed']}, family={w['family']!r}) reproduces it")
    if not rec.passed:
        return False, (f"{said}. Too many recomputed tokens. {where}; then read run_fake's trace: who is preempted, "
                       "when, and what had it computed?")
    return False, f"{said}. Too many forward passes: your admission holds requests back more than it needs to. {where}"


def _start(ns):
    """The learner's two functions, each called once so that a stub stops here with "not implemented yet"."""
    admit, victim = learner(ns, "my_admit"), learner(ns, "my_victim")
    call(admit, 4, 8, 1, 4, [], 4)
    call(victim, 5, [(1, 2, 6)])
    return admit, victim


# ---- the checks -----------------------------------------------------------------------------

def check_admit_keeps_the_hard_limits(ns):
    admit = learner(ns, "my_admit")
    call(admit, 4, 8, 1, 4, [], 4)

    @MANY
    @given(st.integers(1, 64), st.integers(0, 64), st.integers(0, 8), st.integers(0, 12),
           st.lists(st.integers(1, 40), max_size=8), st.sampled_from([1, 2, 4, 16]))
    def test(chunk, budget, need, free, running, block_size):
        args = (chunk, budget, need, free, list(running), block_size)
        got = call(admit, *args)
        assert isinstance(got, bool), f"my_admit{args} returned {got!r}; it must return True or False"
        if chunk > budget:
            assert not got, f"my_admit{args} admitted a chunk of {chunk} tokens with {budget} left in the budget"
        elif need > free:
            assert not got, f"my_admit{args} admitted a chunk needing {need} blocks with {free} free"
        elif not running:
            assert got, (f"my_admit{args} refused a chunk that fits into an empty engine: nothing would ever free "
                         "a block for it, and the engine would stall")

    run_hypothesis(test, FUNCTION_STATE)


def check_victim_is_a_legal_choice(ns):
    victim = learner(ns, "my_victim")
    call(victim, 5, [(1, 2, 6)])

    @MANY
    @given(st.integers(0, 5), st.lists(st.tuples(st.integers(1, 6), st.integers(1, 24)), max_size=6),
           st.randoms(use_true_random=False))
    def test(needy, held, rng):
        ids = rng.sample(range(6, 60), len(held))
        cands = [(i, blocks, tokens) for i, (blocks, tokens) in zip(ids, held)]
        got = call(victim, needy, list(cands))
        assert isinstance(got, int) and (got == needy or got in ids), (
            f"my_victim({needy}, {cands}) returned {got!r}; it must return {needy} (needy) or a seq_id from the "
            "candidates")

    run_hypothesis(test, FUNCTION_STATE)


def check_scripted_scenarios_finish_with_the_right_tokens(ns):
    admit, victim = _start(ns)
    for w in SCENARIOS:
        run_fake(w, admit, victim)


def check_random_workloads_finish_with_the_right_tokens(ns):
    admit, victim = _start(ns)

    @WORKLOADS
    @given(workloads())
    def test(w):
        run_fake(w, admit, victim)

    run_hypothesis(test, FUNCTION_STATE)


def _beats_the_baseline(ns, family: str) -> str:
    admit, victim = _start(ns)
    passed, said = objective_verdict(held_out_measurement(admit, victim, family))
    assert passed, said
    return said


def check_beats_the_baseline_on_short_requests_at_once(ns):
    return _beats_the_baseline(ns, "short")


def check_beats_the_baseline_with_long_prompts_among_short_ones(ns):
    return _beats_the_baseline(ns, "mixed")


SMOL_PROMPTS = ["The capital of France is", "A block table maps", "Once upon a time, in a small village by the sea,",
                "def fibonacci(n):", "The three laws of thermodynamics say that"]


def smollm2_under_pressure(admit, victim, max_tokens: int = 10, num_blocks: int = 14, block_size: int = 4):
    """Serve SMOL_PROMPTS greedily with this policy in a pool too small for all of them at once.
    Returns (engine outputs' token ids, transformers' token ids, preemptions, model name)."""
    from minikv.engine import LLMEngine
    from minikv.models import load_model
    from minikv.sampling import SamplingParams

    try:
        # float32 whatever the machine or $MINIKV_DTYPE: token equality is asserted, which only float32 promises
        model, tok = load_model("smollm2-135m", device="cpu", dtype=torch.float32)
        name = "SmolLM2-135M"
        prompts = [tok.encode(p) for p in SMOL_PROMPTS]
    except Exception:  # noqa: BLE001 - not installed offline: the tiny random Llama still tests the path
        model, name = _tiny_model(), "the tiny random Llama"
        prompts = [[1 + (7 * i + 3 * j) % 200 for j in range(4 + 3 * i)] for i in range(len(SMOL_PROMPTS))]
    with one_torch_thread(), torch.inference_mode():
        gold = []
        for p in prompts:
            ids = torch.tensor([p], device=model.device)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                 min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
            gold.append(out[0, len(p):].tolist())
        eng = LLMEngine(model, None, block_size=block_size, num_blocks=num_blocks, watermark=0, verbose=False,
                        max_num_batched_tokens=32, scheduler_cls=policy_scheduler(admit, victim))
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        for i, p in enumerate(prompts):
            eng.add_request(str(i), p, params)
        got = {}
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    got[int(o.request_id)] = list(o.outputs[0].token_ids)
    return [got[i] for i in range(len(prompts))], gold, eng.stats(history=0).preemptions, name


def check_smollm2_gives_transformers_tokens(ns):
    admit, victim = _start(ns)
    got, gold, preemptions, name = smollm2_under_pressure(admit, victim)
    for i, (g, w) in enumerate(zip(got, gold)):
        assert g == w, (f"{name}, prompt {i}: the engine with your policy ({preemptions} preemptions) gave {g}, "
                        f"transformers {w}")


# Each check's time budget under the grader (default: minikv.grading.grader.CHECK_SECONDS): the two hard-limit
# checks are 200 plain calls each, so a function that never returns fails the first of them within a minute.
CHECK_SECONDS = {"check_admit_keeps_the_hard_limits": 60, "check_victim_is_a_legal_choice": 60}

CHECKS = [check_admit_keeps_the_hard_limits, check_victim_is_a_legal_choice,
          check_scripted_scenarios_finish_with_the_right_tokens, check_random_workloads_finish_with_the_right_tokens,
          check_beats_the_baseline_on_short_requests_at_once,
          check_beats_the_baseline_with_long_prompts_among_short_ones, check_smollm2_gives_transformers_tokens]

# The exercise's parts and their points (its first cell states the same; the grader's score is out of 100): the
# design decides full marks.
PARTS = {"1-2. the hard limits of `my_admit` and `my_victim`": (10, [check_admit_keeps_the_hard_limits,
                                                                    check_victim_is_a_legal_choice]),
         "3. every request finishes with the right tokens": (30, [check_scripted_scenarios_finish_with_the_right_tokens,
                                                                  check_random_workloads_finish_with_the_right_tokens,
                                                                  check_smollm2_gives_transformers_tokens]),
         "3. the objective: short requests at once": (30, [check_beats_the_baseline_on_short_requests_at_once]),
         "3. the objective: two long prompts among short ones": (
             30, [check_beats_the_baseline_with_long_prompts_among_short_ones])}
