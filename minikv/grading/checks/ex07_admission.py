"""Checks for exercise 07 (admission and back-pressure): the learner's `MyPolicy`.

The learner designs the server's admission policy (`minikv.server.admission`: ``decide(request,
state) -> "admit" | "queue" | "refuse"``), aimed at **goodput**: the share of offered requests
that finish with a time to first token of at most `TTFT_SLO_S` and no gap between two of their
tokens longer than `ITL_SLO_S`. There is no single right answer, so the checks do not compare
decisions with a reference: they serve load scenarios with the learner's policy and with the
lecture's baseline (`BoundedFIFO(BASELINE_MAX_WAITING)`) and compare the goodput, on a
**simulated clock**: minikv's real `LLMEngine` with `minikv.sim.fake_runner.FakeRunner` (no model)
and a step that lasts `step_seconds(prefill, decode)` simulated seconds. The checks:

1. the policy answers sensibly on hand-made states (a valid decision; an idle server admits);
2. scripted scenarios (light load, a burst, a long-prompt mix): every request finished or refused
   with a reason, the queue bounded, goodput at most `TOLERANCE` requests below the baseline's in
   each, and `MARGIN` times the baseline's in total where the baseline misses the objective;
3. scenarios drawn by hypothesis at grading time, the same way (the margin on their total);
4. the real server (`minikv serve`'s app, in this process, tiny random model) with the policy:
   a flood of concurrent requests all end in a completion or a 429 with a reason, and every
   block is free afterwards.

Copying the baseline scores its goodput, not the margin, so it fails checks 2 and 3.
"""

from __future__ import annotations

import contextlib
import time

from hypothesis import given, settings
from hypothesis import strategies as st

from minikv.grading import call, learner, one_torch_thread, run_hypothesis
from minikv.grading.public.ex07_admission import (  # noqa: F401 - the notebook's helpers, re-exported
    BASELINE_MAX_WAITING,
    HOLD_LIMIT_S,
    ITL_SLO_S,
    MARGIN,
    MAX_QUEUE,
    SCENARIOS,
    TOLERANCE,
    TTFT_SLO_S,
    _poisson,
    _prompt,
    _tiny_model,
    baseline,
    describe,
    scenario,
    simulate,
    step_seconds,
)
from minikv.server.admission import normalize, request_info

GRADED = ["MyPolicy"]
FORBIDDEN: list[str] = []  # nothing to delegate to: the baseline is importable but does not pass
SCENARIOS_DRAWN = settings(max_examples=8, deadline=None, database=None, derandomize=True,
                           report_multiple_bugs=False)


def compare(decide, sc: dict) -> tuple[dict, dict]:
    """Serve `sc` with the baseline and with `decide`; raise when `decide` is more than TOLERANCE short."""
    base, mine = baseline(sc), simulate(decide, sc)
    if mine["good"] < base["good"] - TOLERANCE:
        raise AssertionError(
            f"{describe(sc)}: your policy served {mine['good']} of {mine['offered']} requests within the objective "
            f"(TTFT <= {TTFT_SLO_S}s, every gap <= {ITL_SLO_S}s), the baseline {base['good']}: at most "
            f"{TOLERANCE} fewer is allowed (you refused {mine['refused']}, preemptions {mine['preemptions']}, "
            f"longest queue {mine['longest_queue']})")
    return base, mine


def margin_met(totals: dict, what: str) -> None:
    assert totals["mine"] >= MARGIN * totals["base"], (
        f"over {what} where the baseline missed the objective, your policy served {totals['mine']} requests "
        f"within it, the baseline {totals['base']}: at least {MARGIN}x the baseline is needed")


def _add(totals: dict, base: dict, mine: dict) -> None:
    if base["good"] < base["offered"]:
        totals["base"] += base["good"]
        totals["mine"] += mine["good"]


@st.composite
def scenarios(draw):
    rate = draw(st.sampled_from([1.0, 3.0, 6.0, 10.0, 20.0]))
    long_prompts = draw(st.booleans())
    reqs = _poisson(rate, draw(st.integers(20, 50)), draw(st.integers(0, 10**6)),
                    prompts=(16, 300 if long_prompts else 120), outputs=(4, draw(st.sampled_from([24, 64]))))
    return scenario(reqs, num_blocks=draw(st.sampled_from([48, 96])), max_num_seqs=draw(st.sampled_from([4, 8, 16])))


# ---- the real server, in this process ---------------------------------------------------------

@contextlib.contextmanager
def serve_in_process(policy=None, max_waiting: int = 8, num_blocks: int = 24, max_num_seqs: int = 2):
    """`minikv serve`'s app on the tiny random model on a free loopback port, with `policy` (a
    `BackPressurePolicy`; None: `--max-waiting` only). Yields (base URL, engine); stops on exit."""
    import socket
    import threading

    import uvicorn

    from minikv.engine import LLMEngine
    from minikv.server.app import ServerState, create_app
    from minikv.server.engine_loop import EngineLoop
    from minikv.server.metrics import ServerMetrics
    from minikv.server.tokenizer import byte_tokenizer

    tok = byte_tokenizer()
    engine = LLMEngine(_tiny_model(), tok, block_size=8, num_blocks=num_blocks, max_num_seqs=max_num_seqs,
                       verbose=False)
    metrics = ServerMetrics("tiny")
    loop = EngineLoop(engine, metrics, policy)
    state = ServerState(loop, tok, "tiny", max_waiting=max_waiting, metrics=metrics)
    metrics.after_step(engine, live=False, stepped=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(state), host="127.0.0.1", port=port, log_level="warning",
                                           access_log=False, lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    loop.start()
    thread.start()
    try:
        for _ in range(200):
            if server.started:
                break
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}", engine
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        loop.shutdown()
        loop.join(timeout=10)


def flood(policy, n: int = 24, max_tokens: int = 12) -> dict:
    """`n` concurrent completions at once against the real server with `policy`; counts the answers."""
    import asyncio

    import httpx

    async def one(client, i):
        try:
            r = await client.post("/v1/completions", json={"model": "tiny", "prompt": f"tenant {i} " * (1 + i % 5),
                                                           "max_tokens": max_tokens, "temperature": 0,
                                                           "ignore_eos": True})
        except httpx.HTTPError as err:
            return ("lost", repr(err))
        body = r.json()
        if r.status_code == 200 and body["usage"]["completion_tokens"] == max_tokens:
            return ("ok", "")
        if r.status_code == 429 and body.get("error", {}).get("message"):
            return ("refused", body["error"]["message"])
        return ("lost", f"{r.status_code} {body}")

    async def run(url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            return await asyncio.gather(*(one(client, i) for i in range(n)))

    with one_torch_thread(), serve_in_process(policy) as (url, engine):
        answers = asyncio.run(run(url))
        time.sleep(0.2)
        in_use = engine.num_blocks - engine.bm.num_free_blocks
    kinds = [k for k, _ in answers]
    return {"ok": kinds.count("ok"), "refused": kinds.count("refused"), "lost": kinds.count("lost"),
            "blocks_in_use_after": in_use, "first_refusal": next((m for k, m in answers if k == "refused"), None),
            "first_loss": next((m for k, m in answers if k == "lost"), None)}


# ---- the checks -----------------------------------------------------------------------------

def _idle_state(**kw) -> dict:
    s = {"now_s": 0.0, "running": 0, "waiting": 0, "held": 0, "queued": 0, "free_blocks": 48, "num_blocks": 48,
         "block_size": 8, "reserved_blocks": 0, "max_num_seqs": 8, "step_s": 0.0, "preemptions": 0}
    return s | kw


def _policy(ns):
    return learner(ns, "MyPolicy")()


def check_answers_on_hand_made_states(ns):
    policy = _policy(ns)
    fresh = request_info(40, 20, 8)
    decision, _ = normalize(call(policy.decide, fresh, _idle_state()), "MyPolicy.decide")
    assert decision == "admit", (f"an idle server (nothing running, nothing waiting) answered {decision!r} to a "
                                 f"request that fits: {fresh}; it must admit it")
    busy = _idle_state(running=8, waiting=20, queued=20, free_blocks=0, reserved_blocks=90, step_s=0.06)
    normalize(call(policy.decide, fresh, busy), "MyPolicy.decide")
    late = request_info(40, 20, 8, waited_s=5.0, held=True)
    normalize(call(policy.decide, late, busy | {"held": 1, "queued": 21}), "MyPolicy.decide")


def check_scripted_scenarios(ns):
    policy = _policy(ns)
    call(policy.decide, request_info(40, 20, 8), _idle_state())   # a stub stops here
    totals = {"base": 0, "mine": 0}
    for name, sc in SCENARIOS.items():
        try:
            _add(totals, *compare(learner(ns, "MyPolicy")().decide, sc))
        except AssertionError as err:
            raise AssertionError(f"{name}: {err}") from None
    margin_met(totals, "the scripted scenarios")


def check_scenarios_drawn_at_grading_time(ns):
    call(_policy(ns).decide, request_info(40, 20, 8), _idle_state())
    totals = {"base": 0, "mine": 0}

    @SCENARIOS_DRAWN
    @given(scenarios())
    def test(sc):
        _add(totals, *compare(learner(ns, "MyPolicy")().decide, sc))

    run_hypothesis(test, "does your policy keep state from one scenario to the next?")
    margin_met(totals, "the drawn scenarios")


def check_the_real_server(ns):
    policy = _policy(ns)
    call(policy.decide, request_info(40, 20, 8), _idle_state())
    report = flood(policy)
    assert report["lost"] == 0, f"the real server lost {report['lost']} requests with your policy: {report}"
    assert report["blocks_in_use_after"] == 0, f"blocks still in use after the flood: {report}"
    assert report["ok"] > 0, f"the real server completed nothing with your policy: {report}"


# Each check's time budget under the grader (default: minikv.grading.grader.CHECK_SECONDS). The hand-made
# states are a dozen calls of `decide`: a policy that never returns fails there in half a minute.
CHECK_SECONDS = {"check_answers_on_hand_made_states": 30}

CHECKS = [check_answers_on_hand_made_states, check_scripted_scenarios, check_scenarios_drawn_at_grading_time,
          check_the_real_server]
