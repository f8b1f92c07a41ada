"""The scheduler and block manager under random traffic, with a model-free runner (minikv.sim.fake_runner).

The fake runner's next token is a hash of the whole sequence read back through the block table,
so the greedy tokens are known in advance (`reference_tokens`) and any bookkeeping slip (a wrong
slot, a block reused too early, a missed copy-on-write or swap) shows up as a wrong token.

FCFS, the precise rule enforced: **a request is admitted for the first time only when every
request that arrived before it has already been admitted (or aborted)**. Head of line: if the
oldest waiting request does not fit, nobody behind it is admitted; sequences preempted by
recompute go back to the *front* of the queue. Requests that could never fit are refused when
added, so the head of the line always fits eventually and nothing stalls.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from minikv.engine import LLMEngine
from minikv.models import tiny_random_llama
from minikv.sampling import SamplingParams
from minikv.scheduler import Scheduler, SchedulerStep
from minikv.sequence import SeqStatus
from minikv.sim.fake_runner import FakeRunner, reference_tokens

MODEL = tiny_random_llama()
VOCAB = MODEL.config.vocab_size
EOS = MODEL.config.eos_token_id
SHARED = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]   # a "system prompt" several requests start with


def make_engine(num_blocks=24, block_size=4, **kw) -> LLMEngine:
    return LLMEngine(MODEL, None, num_blocks=num_blocks, block_size=block_size, verbose=False,
                     runner=FakeRunner(num_blocks, block_size, VOCAB), **kw)


def expected(prompt, params):
    eos = None if params.ignore_eos else EOS
    return reference_tokens(prompt, params.max_tokens, VOCAB, eos)


def check_block_accounting(eng: LLMEngine) -> None:
    """Refcounts exact: each block's count is the number of live block tables holding it."""
    bm = eng.bm
    owners = [0] * eng.num_blocks
    for table in bm.tables.values():
        for b in table.blocks:
            owners[b] += 1
    for b in range(eng.num_blocks):
        assert bm.allocator.refcount(b) == owners[b], (f"block {b}: refcount {bm.allocator.refcount(b)} "
                                                       f"!= {owners[b]} owners")
    held = sum(1 for c in owners if c)
    assert bm.num_free_blocks == eng.num_blocks - held
    sched = eng.scheduler
    for seq in sched.running:
        assert seq.status is SeqStatus.RUNNING and bm.num_tokens(seq.seq_id) == seq.num_computed
    live = {s.seq_id for s in sched.running}
    assert set(bm.tables) == live, "a sequence outside `running` holds blocks"
    for seq in list(sched.waiting) + list(sched.swapped):
        assert seq.seq_id not in bm.tables
    swap = sched.swap   # between steps every swap-out has run: each swapped sequence's K/V is there, nobody else's
    assert set(swap.held) == set(swap.data) == {s.seq_id for s in sched.swapped}
    assert swap.num_used_blocks <= sched.config.swap_blocks
    assert len(sched.running) <= sched.config.max_num_seqs


class EngineMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.eng = None
        self.arrived: list[str] = []        # request ids in arrival order
        self.admitted: list[str] = []       # in order of first admission
        self.aborted: set[str] = set()
        self.prompts: dict[str, tuple[list[int], SamplingParams]] = {}
        self.finished: dict[str, object] = {}

    @precondition(lambda self: self.eng is None)
    @rule(mode=st.sampled_from(["recompute", "swap"]), chunked=st.booleans(), caching=st.booleans(),
          budget=st.sampled_from([4, 7, 32]), seqs=st.sampled_from([2, 4, 64]), watermark=st.sampled_from([0, 0.05]),
          swap_blocks=st.sampled_from([None, "4KiB"]), cap=st.sampled_from([None, 3, 5]))
    def start(self, mode, chunked, caching, budget, seqs, watermark, swap_blocks, cap):
        if not chunked:
            budget, cap = 64, None   # a whole sequence must fit in one step without chunking
        self.eng = make_engine(preemption_mode=mode, enable_chunked_prefill=chunked, enable_prefix_caching=caching,
                               max_num_batched_tokens=budget, max_num_seqs=seqs, watermark=watermark,
                               swap_space=swap_blocks, long_prefill_token_threshold=cap)

    @precondition(lambda self: self.eng is not None)
    @rule(shared=st.booleans(), tail=st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=20),
          max_tokens=st.integers(1, 24), n=st.sampled_from([1, 1, 1, 2, 3]), ignore_eos=st.booleans())
    def add(self, shared, tail, max_tokens, n, ignore_eos):
        n = min(n, self.eng.scheduler.config.max_num_seqs)   # more is refused (tested in test_engine)
        rid = str(len(self.arrived))
        prompt = (SHARED if shared else []) + tail
        params = SamplingParams(temperature=0, max_tokens=max_tokens, n=n, ignore_eos=ignore_eos)
        self.eng.add_request(rid, prompt, params)
        self.arrived.append(rid)
        self.prompts[rid] = (prompt, params)

    @precondition(lambda self: self.eng is not None and self.eng.requests)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.eng.requests)))
        out = self.eng.abort_request(rid)
        assert out.finished and any(c.finish_reason == "abort" for c in out.outputs)
        self.aborted.add(rid)
        self.finished[rid] = out

    @precondition(lambda self: self.eng is not None)
    @rule(times=st.integers(1, 8))
    def step(self, times):
        for _ in range(times):
            self._one_step()

    def _one_step(self):
        for out in self.eng.step():
            if out.finished:
                self.finished[out.request_id] = out
        # FCFS: first admissions happen in arrival order, and never skip a waiting request.
        for rid in self.arrived:
            req = self.eng.requests.get(rid)
            if req is not None and req.admitted and rid not in self.admitted:
                self.admitted.append(rid)
            elif rid not in self.admitted and rid in self.finished and rid not in self.aborted:
                self.admitted.append(rid)
        order = [r for r in self.arrived if r in set(self.admitted)]
        assert self.admitted == order, "a request was admitted before an earlier one"
        first_not_admitted = next((r for r in self.arrived if r not in set(self.admitted) and r not in self.aborted),
                                  None)
        if first_not_admitted is not None:
            later = self.arrived[self.arrived.index(first_not_admitted) + 1:]
            assert not set(later) & set(self.admitted), "a waiting request was skipped"

    @invariant()
    def accounting(self):
        if self.eng is not None:
            check_block_accounting(self.eng)

    def teardown(self):
        if self.eng is None:
            return
        steps = 0
        while self.eng.has_unfinished_requests():
            self._one_step()
            steps += 1
            check_block_accounting(self.eng)
            assert steps < 10_000, "the engine stopped making progress"
        assert set(self.finished) == set(self.arrived)
        for rid, out in self.finished.items():
            prompt, params = self.prompts[rid]
            assert out.finished
            for c in out.outputs:
                assert c.finish_reason in ("stop", "length", "abort")
                if rid not in self.aborted:
                    assert c.token_ids == expected(prompt, params)   # greedy: all n samples agree
                    assert c.finish_reason == ("stop" if c.token_ids[-1] == EOS and not params.ignore_eos else "length")
            if rid not in self.aborted:
                assert len(out.outputs) == params.n
        bm = self.eng.bm
        assert not bm.tables and bm.num_free_blocks == self.eng.num_blocks   # free or cached-evictable
        assert self.eng.scheduler.swap.num_used_blocks == 0


TestEngineMachine = EngineMachine.TestCase
TestEngineMachine.settings = settings(max_examples=120, stateful_step_count=40, deadline=None,
                                      suppress_health_check=[HealthCheck.too_slow])


# ---- scripted scenarios -----------------------------------------------------------------------

def run_all(eng, requests):
    for rid, prompt, params in requests:
        eng.add_request(rid, prompt, params)
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
    return outs


def pressure_requests(k=24, seed=0):
    import random

    rng = random.Random(seed)
    return [(str(i), [rng.randrange(3, VOCAB) for _ in range(rng.randint(4, 24))],
             SamplingParams(temperature=0, max_tokens=rng.randint(8, 32), ignore_eos=True)) for i in range(k)]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_pressure_same_tokens_as_reference(mode):
    eng = make_engine(num_blocks=24, block_size=4, preemption_mode=mode)
    reqs = pressure_requests()
    outs = run_all(eng, reqs)
    for rid, prompt, params in reqs:
        assert outs[rid].outputs[0].token_ids == expected(prompt, params)
    assert eng.scheduler.num_preemptions > 0
    print(f"{mode}: {eng.scheduler.num_preemptions} preemptions in {len(eng.step_stats)} steps")


def preemptions(watermark):
    eng = make_engine(num_blocks=48, block_size=4, watermark=watermark, max_num_batched_tokens=64)
    run_all(eng, pressure_requests(k=48, seed=1))
    return eng.scheduler.num_preemptions


def test_watermark_buys_fewer_preemptions():
    """Headroom at admission: running sequences can grow without evicting the newest arrival at once."""
    none, some = preemptions(0.0), preemptions(0.1)
    print(f"preemptions on the pressure workload: watermark 0 -> {none}, watermark 10% -> {some}")
    assert some < none


def test_decodes_go_first_and_prefill_is_chunked():
    eng = make_engine(num_blocks=64, block_size=4, max_num_batched_tokens=8)
    eng.add_request("short", [5, 6, 7], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    eng.step()                                      # "short" prefilled, now decoding
    eng.add_request("long", list(range(3, 43)), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    for _ in range(5):                              # 40 prompt tokens, 7 per step beside 1 decode
        before = len(eng.requests["short"].seqs[0].token_ids)
        eng.step()
        assert len(eng.requests["short"].seqs[0].token_ids) == before + 1   # never stalled by the long prompt
        s = eng.step_stats[-1]
        assert s.decode_tokens == 1 and s.prefill_tokens == 7
    assert eng.requests["long"].seqs[0].num_computed == 35


def test_long_prefill_token_threshold_caps_each_chunk_within_the_same_budget():
    """vLLM V1's knob: one request's prefill chunk is at most the cap, the step's budget is unchanged
    (two prompts can prefill side by side in one step), and a prompt under the cap goes in one piece."""
    eng = make_engine(num_blocks=64, block_size=4, max_num_batched_tokens=32, long_prefill_token_threshold=8)
    assert eng.scheduler.config.max_num_batched_tokens == 32
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    eng.add_request("short", [5, 6, 7], params)
    eng.add_request("long", list(range(3, 43)), params)        # 40 tokens: 5 chunks of 8
    eng.add_request("long2", list(range(50, 70)), params)      # 20 tokens: 8, 8, 4
    chunks: dict[str, list[int]] = {"short": [], "long": [], "long2": []}
    schedule = eng.scheduler.schedule

    def spy():   # record every step's prefill chunks as the scheduler hands them out
        batch = schedule()
        assert batch.prefill_tokens + batch.decode_tokens <= 32
        for sc in batch.scheduled:
            if sc.start < sc.seq.num_prompt_tokens:
                chunks[sc.seq.request.request_id].append(sc.num_tokens)
        return batch

    eng.scheduler.schedule = spy
    done = {}
    while eng.has_unfinished_requests():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    assert chunks == {"short": [3], "long": [8] * 5, "long2": [8, 8, 4]}
    assert eng.step_stats[0].prefill_tokens == 3 + 8 + 8        # three requests share the first step
    for rid, prompt in (("short", [5, 6, 7]), ("long", list(range(3, 43))), ("long2", list(range(50, 70)))):
        assert done[rid].outputs[0].token_ids == expected(prompt, params)


def test_request_too_big_for_pool_is_refused_and_does_not_stall():
    eng = make_engine(num_blocks=8, block_size=4)
    with pytest.raises(ValueError, match=r"cannot fit even alone.*9 blocks.*pool has 8"):
        eng.add_request("big", list(range(3, 33)), SamplingParams(max_tokens=4))
    outs = run_all(eng, [("small", [5, 6, 7], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))])
    assert outs["small"].outputs[0].finish_reason == "length"


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@given(abort_at=st.integers(0, 40))
@settings(max_examples=25, deadline=None)
def test_abort_at_any_point_frees_every_block(mode, abort_at):
    eng = make_engine(num_blocks=16, block_size=4, preemption_mode=mode, max_num_batched_tokens=6)
    for rid, prompt, params in pressure_requests(k=6, seed=2):
        eng.add_request(rid, prompt, params)
    for _ in range(abort_at):
        if not eng.has_unfinished_requests():
            break
        eng.step()
    for rid in list(eng.requests):
        assert eng.abort_request(rid).outputs[0].finish_reason in ("abort", "length")
    assert not eng.has_unfinished_requests() and not eng.scheduler.has_unfinished()
    assert not eng.bm.tables and eng.bm.num_free_blocks == 16 and eng.scheduler.swap.num_used_blocks == 0


def test_n_samples_share_the_prompt_blocks():
    eng = make_engine(num_blocks=32, block_size=4)
    eng.add_request("r", list(range(3, 13)), SamplingParams(temperature=0, n=3, max_tokens=6, ignore_eos=True))
    eng.step()   # prefill, then fork into 3
    req = eng.requests["r"]
    assert len(req.seqs) == 3 and eng.bm.num_shared_blocks == 3   # 10 prompt tokens: 3 blocks, each owned by 3
    run_all(eng, [])
    assert [c.token_ids for c in req.output.outputs] == [expected(list(range(3, 13)), req.params)] * 3


def test_prompt_at_exact_block_multiple_fully_cached():
    """The second identical prompt hits every full block but one: its last token is always computed."""
    prompt = list(range(3, 19))   # 16 tokens = 4 full blocks of 4
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    eng = make_engine(num_blocks=32, block_size=4)
    first = run_all(eng, [("a", prompt, params)])["a"]
    again = run_all(eng, [("b", prompt, params)])["b"]
    assert again.metrics.cached_prompt_tokens == 12
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == expected(prompt, params)


def test_recompute_after_preemption_hits_the_prefix_cache():
    eng = make_engine(num_blocks=24, block_size=4, preemption_mode="recompute")
    reqs = pressure_requests()
    outs = run_all(eng, reqs)
    assert eng.scheduler.num_preemptions > 0 and eng.bm.stats.tokens_hit > 0
    for rid, prompt, params in reqs:
        assert outs[rid].outputs[0].token_ids == expected(prompt, params)


def test_metrics_summaries():
    from minikv.metrics import occupancy, summarize

    eng = make_engine(num_blocks=24, block_size=4)
    outs = list(run_all(eng, pressure_requests(k=8)).values())
    s = summarize(outs, eng.step_stats, eng.bm.stats)
    assert s["requests"] == 8 and s["generated_tokens"] == sum(len(o.outputs[0].token_ids) for o in outs)
    assert s["tokens_per_s"] > 0 and s["ttft_mean"] > 0 and s["tpot_mean"] > 0 and s["steps"] == len(eng.step_stats)
    assert s["preemptions"] == eng.scheduler.num_preemptions and 0 <= s["prefix_hit_rate"] <= 1
    assert eng.summary(outs)["blocks_free"] == 24 and eng.summary(outs)["pool_bytes"] == 24 * eng.bytes_per_block
    occ = occupancy(eng.step_stats)
    assert len(occ["blocks_used"]) == len(eng.step_stats) and max(occ["blocks_used"]) <= 24
    assert sum(occ["decode_tokens"]) + sum(occ["prefill_tokens"]) >= s["generated_tokens"]
    for o in outs:
        m = o.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
        assert len(m.token_times) == len(o.outputs[0].token_ids) and m.max_gap >= m.tpot


# ---- the policy API: can_admit and choose_victim are the seam a policy overrides -----------------

class OldestFirstVictims(Scheduler):
    """A different policy through the public hooks only: the *oldest* candidate gives way, and no
    more than three sequences run at once."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.steps_seen: list[SchedulerStep] = []

    def can_admit(self, seq, num_tokens, step):
        self.steps_seen.append(step)
        return len(self.running) < 3 and super().can_admit(seq, num_tokens, step)

    def choose_victim(self, seq, step):
        candidates = self.victim_candidates(seq, step)
        return candidates[0] if candidates else seq




@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_policy_through_the_public_hooks_changes_the_schedule_not_the_tokens(mode):
    reqs = pressure_requests()
    default = make_engine(num_blocks=24, block_size=4, preemption_mode=mode)
    run_all(default, reqs)
    eng = make_engine(num_blocks=24, block_size=4, preemption_mode=mode, scheduler_cls=OldestFirstVictims)
    outs = run_all(eng, pressure_requests())
    for rid, prompt, params in reqs:
        assert outs[rid].outputs[0].token_ids == expected(prompt, params)
    assert eng.scheduler.num_preemptions > 0 and max(s.num_running for s in eng.step_stats) <= 3
    assert [s.preemptions for s in eng.step_stats] != [s.preemptions for s in default.step_stats]
    # every step got a fresh SchedulerStep: nothing of one step is left on the scheduler for the next
    assert len({id(s) for s in eng.scheduler.steps_seen}) > 1
    assert not any(name.startswith("_budget") or name in ("_done", "_out") for name in vars(eng.scheduler))


def test_a_victim_that_is_not_a_candidate_is_refused_with_a_message():
    class Bad(Scheduler):
        def choose_victim(self, seq, step):
            return next(s for s in self.running if s is not seq and s.seq_id in step.scheduled_ids)

    eng = make_engine(num_blocks=24, block_size=4, scheduler_cls=Bad)
    with pytest.raises(ValueError, match="choose_victim returned .* victim_candidates"):
        run_all(eng, pressure_requests())


class RecordingRunner(FakeRunner):
    """The fake runner, logging each block operation it is asked for."""

    def __init__(self, *args):
        super().__init__(*args)
        self.calls: list[tuple] = []

    def copy_blocks(self, pairs) -> None:
        self.calls.append(("copy", [tuple(p) for p in pairs]))
        super().copy_blocks(pairs)

    def swap_out(self, blocks):
        self.calls.append(("swap_out", list(blocks)))
        return super().swap_out(blocks)

    def swap_in(self, data, blocks) -> None:
        self.calls.append(("swap_in", list(blocks)))
        super().swap_in(data, blocks)


def test_the_scheduler_decides_block_operations_and_the_engine_applies_them_in_order():
    """The scheduler never calls the runner: it hands the engine copy / swap-out / swap-in operations in
    the order it decided them, and the engine applies exactly those, in that order, before the forward."""
    from minikv.scheduler import CopyBlocks, SwapIn, SwapOut

    with pytest.raises(TypeError, match="swap must be a minikv.scheduler.SwapSpace"):
        Scheduler(make_engine().scheduler.config, make_engine().bm, FakeRunner(24, 4, VOCAB))
    runner = RecordingRunner(24, 4, VOCAB)
    eng = LLMEngine(MODEL, None, num_blocks=24, block_size=4, verbose=False, runner=runner, preemption_mode="swap")
    assert not hasattr(eng.scheduler, "runner")
    decided = []
    schedule = eng.scheduler.schedule

    def recording_schedule():
        out = schedule()
        for op in out.block_ops:
            if isinstance(op, CopyBlocks):
                decided.append(("copy", [tuple(p) for p in op.pairs]))
            else:
                decided.append(("swap_out" if isinstance(op, SwapOut) else "swap_in", list(op.blocks)))
        return out

    eng.scheduler.schedule = recording_schedule
    reqs = pressure_requests()
    reqs += [("n", [5, 6, 7, 8, 9, 10], SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, n=3))]
    outs = run_all(eng, reqs)
    for rid, prompt, params in reqs:
        assert all(c.token_ids == expected(prompt, params) for c in outs[rid].outputs)
    assert runner.calls == decided
    assert {kind for kind, _ in decided} == {"copy", "swap_out", "swap_in"}, "the workload exercises every kind"
    assert SwapIn.__dataclass_params__.frozen and eng.scheduler.swap.num_used_blocks == 0


def test_stats_is_a_frozen_snapshot_with_a_bounded_history(monkeypatch):
    import dataclasses

    import minikv.engine

    monkeypatch.setattr(minikv.engine, "STEP_HISTORY", 8)
    eng = make_engine(num_blocks=24, block_size=4)
    reqs = pressure_requests(k=6)
    for rid, prompt, params in reqs:
        eng.add_request(rid, prompt, params)
    s = eng.stats()
    assert (s.running, s.waiting, s.swapped, s.steps) == (0, 6, 0, ())
    assert s.reserved_blocks == sum(-(-(len(p) + q.max_tokens - 1) // 4) for _, p, q in reqs)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.running = 3
    steps = 0
    while eng.has_unfinished_requests():
        eng.step()
        steps += 1
        s = eng.stats(history=3)
        sched = eng.scheduler
        assert (s.running, s.waiting, s.swapped) == (len(sched.running), len(sched.waiting), len(sched.swapped))
        assert s.blocks_used + s.blocks_free == s.num_blocks == 24 and s.blocks_cached <= s.blocks_free
        assert [x.step for x in s.steps] == list(range(max(0, steps - 3), steps))
        assert s.last_step.blocks_used == s.blocks_used and s.preemptions == sched.num_preemptions
    assert len(eng.stats(history=None).steps) <= 8 < steps, "the engine keeps a bounded history"
    assert eng.stats().reserved_blocks == 0 and eng.stats(history=0).steps == ()
    end = eng.stats()
    assert end.prefix_tokens_hit <= end.prefix_tokens_queried and end.prefix_tokens_queried >= sum(
        len(p) for _, p, _ in reqs), "every prompt was looked up at least once"
