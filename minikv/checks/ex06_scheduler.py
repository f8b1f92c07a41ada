"""Checks for exercise 06 (the scheduling policy): the learner's `my_admit` and `my_victim`.

The policy asked for is a variant of minikv's (the lecture shows FCFS admission with a fixed
watermark and "the most recently admitted sequence is the victim"):

* **admission reserves a block for each running sequence's next step**: admit the head of the
  waiting queue with a first chunk of ``chunk_tokens`` tokens that needs ``blocks_needed`` new
  blocks iff ``chunk_tokens <= budget_left`` and ``blocks_needed + reserve <= free_blocks``, where
  ``reserve`` is the number of running sequences whose cached tokens exactly fill their blocks
  (``tokens % block_size == 0``): each of those needs a fresh block for its very next token.
* **the victim is the sequence holding the most blocks**: among the candidates (running sequences
  other than the one in need, not yet scheduled this step, as ``(seq_id, blocks held)`` in admission
  order) the one with the most blocks, ties going to the most recently admitted; with no candidate,
  the sequence in need gives way itself (return ``needy``).

`PolicyScheduler` plugs any such pair of functions into minikv's `Scheduler` through its two policy
methods (`_can_admit`, `_victim`), calling them with plain ints and lists only. The checks:

1. `my_admit` and `my_victim` on hand-made cases (ties, empty lists, the budget), then on hundreds of
   hypothesis-drawn inputs against the reference functions below;
2. scripted scenarios and hypothesis-drawn workloads run through the whole engine with
   `minikv.fake_runner.FakeRunner` (no model: its tokens hash the sequence read back through the
   block table): the learner's policy must schedule and preempt exactly as the reference policy
   does, step by step, and every request must get the fake model's tokens;
3. SmolLM2-135M (the tiny random Llama if SmolLM2 is not installed) served by the engine with the
   learner's policy in a pool small enough to preempt: the greedy tokens must be `transformers`'.
"""

from __future__ import annotations

import functools

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minikv.blocks import blocks_for
from minikv.grading import NotImplementedYet, call, learner, one_torch_thread, run_hypothesis
from minikv.scheduler import Scheduler
from minikv.sequence import SeqStatus

MANY = settings(max_examples=200, deadline=None, database=None, derandomize=True, report_multiple_bugs=False)
WORKLOADS = settings(max_examples=40, deadline=None, database=None, derandomize=True, report_multiple_bugs=False)

# Delegation (see minikv.delegation): the graded functions may not call the reference functions
# below. The notebook imports SCENARIOS, run_fake and use_policy from here: those stay allowed.
GRADED = ["my_admit", "my_victim"]
FORBIDDEN = ["minikv.checks.ex06_scheduler.ref_admit", "minikv.checks.ex06_scheduler.ref_victim"]
FUNCTION_STATE = "does your function keep state between calls?"  # the likely cause of a flaky failure


# ---- the reference policy (what the exercise asks for) --------------------------------------

def ref_admit(chunk_tokens: int, budget_left: int, blocks_needed: int, free_blocks: int,
              running_tokens: list[int], block_size: int) -> bool:
    reserve = sum(1 for t in running_tokens if t % block_size == 0)
    return chunk_tokens <= budget_left and blocks_needed + reserve <= free_blocks


def ref_victim(needy: int, candidates: list[tuple[int, int]]) -> int:
    best, most = needy, -1
    for seq_id, blocks in candidates:
        if blocks >= most:   # >=: a tie goes to the later (more recently admitted) one
            best, most = seq_id, blocks
    return best


# ---- the seam: a policy as two plain functions ----------------------------------------------

class PolicyScheduler(Scheduler):
    """minikv's scheduler with its policy replaced by ``admit(...) -> bool`` and ``victim(...) -> seq_id``.

    Records each step's decisions in ``trace`` (request/sample names, not global seq ids, so two
    engines can be compared)."""

    def __init__(self, config, block_manager, runner, admit, victim):
        super().__init__(config, block_manager, runner)
        self.admit_fn, self.victim_fn = admit, victim
        self.trace: list[tuple] = []

    def _can_admit(self, seq, n: int) -> bool:
        bm = self.bm
        args = (n, self._budget, bm.blocks_needed(seq.seq_id, n), bm.num_free_blocks,
                [bm.num_tokens(s.seq_id) for s in self.running], bm.block_size)
        ok = call(self.admit_fn, *args)
        if not isinstance(ok, bool):
            raise AssertionError(f"my_admit{args} returned {ok!r}; it must return True or False")
        return ok

    def _victim(self, seq):
        cands = [s for s in self.running if s is not seq and s.status is SeqStatus.RUNNING
                 and s.seq_id not in self._done]
        pairs = [(s.seq_id, len(self.bm.block_table(s.seq_id))) for s in cands]
        pick = call(self.victim_fn, seq.seq_id, pairs)
        by_id = {s.seq_id: s for s in cands} | {seq.seq_id: seq}
        if not isinstance(pick, int) or pick not in by_id:
            raise AssertionError(f"my_victim({seq.seq_id}, {pairs}) returned {pick!r}; it must return "
                                 f"{seq.seq_id} (needy) or a seq_id from the candidates")
        return by_id[pick]

    def schedule(self):
        out = super().schedule()
        name = lambda s: f"{s.request.request_id}"  # noqa: E731
        self.trace.append((tuple((name(x.seq), x.start, x.num_tokens) for x in out.scheduled),
                           tuple(name(s) for s in out.preempted)))
        return out


def use_policy(engine, admit, victim) -> PolicyScheduler:
    """Give `engine` (a fresh `LLMEngine`, no request added yet) a scheduler with this policy."""
    if engine.scheduler.has_unfinished():
        raise ValueError("plug a policy into a fresh engine, before adding requests")
    old = engine.scheduler
    engine.scheduler = PolicyScheduler(old.config, old.bm, old.runner, admit, victim)
    return engine.scheduler


# ---- helpers --------------------------------------------------------------------------------





@functools.lru_cache(maxsize=1)
def _tiny_model():
    from minikv.models import tiny_random_llama

    return tiny_random_llama()


def run_fake(workload, admit, victim, max_steps: int = 3000):
    """Serve `workload` with the fake runner under a policy: (trace, {request_id: token ids}, preemptions)."""
    from minikv.engine import LLMEngine
    from minikv.fake_runner import FakeRunner
    from minikv.sampling import SamplingParams

    model = _tiny_model()
    w = workload
    eng = LLMEngine(model, None, block_size=w["block_size"], num_blocks=w["num_blocks"], verbose=False,
                    max_num_batched_tokens=w["budget"], enable_chunked_prefill=w["chunked"],
                    enable_prefix_caching=w["caching"], preemption_mode=w["mode"], watermark=0,
                    max_num_seqs=w["max_num_seqs"],
                    runner=FakeRunner(w["num_blocks"], w["block_size"], model.config.vocab_size))
    sched = use_policy(eng, admit, victim)
    for i, (prompt, k) in enumerate(w["requests"]):
        eng.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=k, ignore_eos=True))
    tokens = {}
    for _ in range(max_steps):
        if not eng.has_unfinished_requests():
            break
        for o in eng.step():
            if o.finished:
                tokens[o.request_id] = list(o.outputs[0].token_ids)
    else:
        raise AssertionError(f"the engine did not finish within {max_steps} steps: does your policy ever admit "
                             f"anyone? ({_describe(w)})")
    return sched.trace, tokens, sched.num_preemptions


def _describe(w) -> str:
    reqs = ", ".join(f"{len(p)}+{k}" for p, k in w["requests"])
    return (f"pool {w['num_blocks']} blocks of {w['block_size']}, budget {w['budget']} tokens/step, "
            f"chunked prefill {'on' if w['chunked'] else 'off'}, prefix caching {'on' if w['caching'] else 'off'}, "
            f"{w['mode']}, max_num_seqs {w['max_num_seqs']}, requests (prompt+output tokens) {reqs}")


def compare_on(workload, admit, victim) -> int:
    """Run `workload` under the reference policy and the learner's; raise at the first differing step."""
    from minikv.fake_runner import reference_tokens

    ref_trace, ref_tokens, ref_pre = run_fake(workload, ref_admit, ref_victim)
    trace, tokens, _ = run_fake(workload, admit, victim)
    for step, (want, got) in enumerate(zip(ref_trace, trace)):
        if want != got:
            raise AssertionError(
                f"{_describe(workload)}: at step {step} the reference policy scheduled "
                f"{_fmt(want)}, yours {_fmt(got)}")
    if len(ref_trace) != len(trace):
        raise AssertionError(f"{_describe(workload)}: the reference took {len(ref_trace)} steps, yours {len(trace)}")
    vocab = _tiny_model().config.vocab_size
    for i, (prompt, k) in enumerate(workload["requests"]):
        gold = reference_tokens(prompt, k, vocab)
        if tokens.get(f"r{i}") != gold:
            raise AssertionError(f"{_describe(workload)}: request r{i} got {tokens.get(f'r{i}')}, the model's "
                                 f"tokens are {gold}")
    return ref_pre


def _fmt(entry) -> str:
    sched, pre = entry
    s = ", ".join(f"{r}[{start}:{start + n}]" for r, start, n in sched) or "nothing"
    return s + (f" and preempted {', '.join(pre)}" if pre else "")


# Scripted scenarios: each one separates the asked-for policy from minikv's default (FCFS with a
# fixed watermark, most recent victim), so copying the lecture's policy does not pass them.
def _scenario(block_size, num_blocks, budget, requests, chunked=True, caching=False, mode="recompute",
              max_num_seqs=8):
    return dict(block_size=block_size, num_blocks=num_blocks, budget=budget, chunked=chunked, caching=caching,
                mode=mode, max_num_seqs=max_num_seqs, requests=requests)


def _prompt(seed: int, n: int) -> list[int]:
    return [1 + (seed * 131 + i * 17) % 97 for i in range(n)]


def _requests(shape):
    return [(_prompt(i, n), k) for i, (n, k) in enumerate(shape)]


# Found by a search over random workloads for ones where both halves of minikv's own policy
# (watermark admission, most-recent victim) schedule differently from the policy asked for.
SCENARIOS = [
    _scenario(4, 11, 8, _requests([(13, 7), (12, 11), (11, 12), (8, 4)])),
    _scenario(2, 11, 8, _requests([(11, 6), (4, 6), (6, 10), (8, 6), (3, 7)]), mode="swap"),
    _scenario(4, 8, 64, _requests([(9, 9), (8, 6), (4, 8), (4, 8)]), chunked=False, mode="swap"),
    _scenario(2, 14, 64, _requests([(5, 7), (10, 12), (8, 12)]), chunked=False),
]


@st.composite
def workloads(draw):
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


# ---- the checks -----------------------------------------------------------------------------

ADMIT_CASES = [  # (args, expected, why)
    ((8, 8, 2, 2, [], 4), True, "an empty engine reserves nothing"),
    ((9, 8, 1, 5, [], 4), False, "the chunk is over the budget left"),
    ((4, 8, 1, 2, [4, 6], 4), True, "one running sequence fills its blocks (4 % 4 == 0): reserve 1"),
    ((4, 8, 1, 2, [4, 8], 4), False, "two running sequences fill their blocks: reserve 2"),
    ((4, 8, 0, 2, [4, 8], 4), True, "a chunk that fits in the table's last block needs 0 new blocks"),
    ((3, 3, 2, 9, [3, 5, 7], 4), True, "nobody fills their blocks: reserve 0"),
]

VICTIM_CASES = [
    ((5, []), 5, "no candidate: the needy sequence gives way itself"),
    ((5, [(1, 3), (2, 7), (3, 2)]), 2, "seq 2 holds the most blocks"),
    ((5, [(1, 7), (2, 7), (3, 2)]), 2, "a tie goes to the most recently admitted (the later one in the list)"),
    ((0, [(9, 1)]), 9, "a single candidate is the victim, even with one block"),
]


def check_admit_on_hand_made_cases(ns):
    admit = learner(ns, "my_admit")
    for args, want, why in ADMIT_CASES:
        got = call(admit, *args)
        assert got == want, f"my_admit{args} returned {got!r}, expected {want} ({why})"


def check_admit_against_the_reference(ns):
    admit = learner(ns, "my_admit")
    call(admit, *ADMIT_CASES[0][0])  # a stub stops here with "not implemented yet"

    @MANY
    @given(st.integers(1, 64), st.integers(0, 64), st.integers(0, 8), st.integers(0, 12),
           st.lists(st.integers(1, 40), max_size=8), st.sampled_from([1, 2, 4, 16]))
    def test(chunk, budget, need, free, running, block_size):
        args = (chunk, budget, need, free, running, block_size)
        want, got = ref_admit(*args), call(admit, *args)
        assert got == want, f"my_admit{args} returned {got!r}, expected {want}"

    run_hypothesis(test, FUNCTION_STATE)


def check_victim_on_hand_made_cases(ns):
    victim = learner(ns, "my_victim")
    for args, want, why in VICTIM_CASES:
        got = call(victim, *args)
        assert got == want, f"my_victim{args} returned {got!r}, expected {want} ({why})"


def check_victim_against_the_reference(ns):
    victim = learner(ns, "my_victim")
    call(victim, *VICTIM_CASES[0][0])

    @MANY
    @given(st.integers(0, 5), st.lists(st.integers(1, 6), max_size=6), st.randoms(use_true_random=False))
    def test(needy, blocks, rng):
        ids = rng.sample(range(6, 60), len(blocks))
        args = (needy, list(zip(ids, blocks)))
        want, got = ref_victim(*args), call(victim, *args)
        assert got == want, f"my_victim{args} returned {got!r}, expected {want}"

    run_hypothesis(test, FUNCTION_STATE)


def check_scripted_scenarios_with_a_fake_runner(ns):
    admit, victim = learner(ns, "my_admit"), learner(ns, "my_victim")
    call(admit, *ADMIT_CASES[0][0])
    call(victim, *VICTIM_CASES[0][0])
    for w in SCENARIOS:
        compare_on(w, admit, victim)


def check_random_workloads_with_a_fake_runner(ns):
    admit, victim = learner(ns, "my_admit"), learner(ns, "my_victim")
    call(admit, *ADMIT_CASES[0][0])
    call(victim, *VICTIM_CASES[0][0])

    @WORKLOADS
    @given(workloads())
    def test(w):
        compare_on(w, admit, victim)

    run_hypothesis(test, FUNCTION_STATE)


SMOL_PROMPTS = ["The capital of France is", "A block table maps", "Once upon a time, in a small village by the sea,",
                "def fibonacci(n):", "The three laws of thermodynamics say that"]


def smollm2_under_pressure(admit, victim, max_tokens: int = 10, num_blocks: int = 14, block_size: int = 4):
    """Serve SMOL_PROMPTS greedily with this policy in a pool too small for all of them at once.
    Returns (engine outputs' token ids, transformers' token ids, preemptions, model name)."""
    from minikv.engine import LLMEngine
    from minikv.models import load_model
    from minikv.sampling import SamplingParams

    try:
        model, tok = load_model("smollm2-135m")
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
                        max_num_batched_tokens=32)
        sched = use_policy(eng, admit, victim)
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        for i, p in enumerate(prompts):
            eng.add_request(str(i), p, params)
        got = {}
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    got[int(o.request_id)] = list(o.outputs[0].token_ids)
    return [got[i] for i in range(len(prompts))], gold, sched.num_preemptions, name


def check_smollm2_gives_transformers_tokens_under_preemption(ns):
    admit, victim = learner(ns, "my_admit"), learner(ns, "my_victim")
    call(admit, *ADMIT_CASES[0][0])
    call(victim, *VICTIM_CASES[0][0])
    got, gold, preemptions, name = smollm2_under_pressure(admit, victim)
    for i, (g, w) in enumerate(zip(got, gold)):
        assert g == w, f"{name}, prompt {i}: the engine with your policy gave {g}, transformers {w}"
    assert preemptions > 0, (f"{name} ran without a single preemption under your policy, in a pool sized to force "
                             "some: does my_admit admit when it should not?")


CHECKS = [check_admit_on_hand_made_cases, check_admit_against_the_reference,
          check_victim_on_hand_made_cases, check_victim_against_the_reference,
          check_scripted_scenarios_with_a_fake_runner, check_random_workloads_with_a_fake_runner,
          check_smollm2_gives_transformers_tokens_under_preemption]
