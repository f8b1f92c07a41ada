"""What exercise 07's notebook uses besides its own code: the objective, the simulated clock, the
load scenarios, and the lecture's baseline served on them.

Public on purpose: the notebook imports these, and a sandboxed submission may read this module (the
checks themselves, in ``minikv/grading/checks/ex07_admission.py``, it can neither import nor read).
Nothing here is an answer: the baseline is the lecture's bounded FIFO, which does not pass the checks.
"""

from __future__ import annotations

import functools
from collections import deque

from minikv.grading import call
from minikv.server.admission import BoundedFIFO, engine_state, normalize, request_info

TTFT_SLO_S = 1.0          # simulated seconds from arrival to the first token
ITL_SLO_S = 0.3           # the longest gap a client accepts between two tokens
BASELINE_MAX_WAITING = 16
MARGIN = 1.25             # the learner's good requests >= MARGIN x the baseline's, where it misses
MAX_QUEUE = 64            # held + waiting in the engine: past it, "no unbounded queue" fails
HOLD_LIMIT_S = 10.0       # a request held this long (simulated) was never decided: the check stops there,
                          # in a few hundred steps, instead of running the idle clock to max_steps


def step_seconds(prefill_tokens: int, decode_tokens: int) -> float:
    """The simulated duration of one engine step: a fixed cost, then per token (prefill is cheaper
    per token than decode: many tokens share one read of the weights)."""
    return 0.02 + 0.0004 * prefill_tokens + 0.004 * decode_tokens


@functools.lru_cache(maxsize=1)
def _tiny_model():
    from minikv.models import tiny_random_llama

    return tiny_random_llama()


def _prompt(i: int, n: int) -> list[int]:
    return [1 + (i * 131 + j * 17) % 97 for j in range(n)]


def scenario(requests, num_blocks=48, block_size=8, max_num_seqs=8, budget=128) -> dict:
    """`requests`: (arrival time in simulated seconds, prompt tokens, output tokens) for each."""
    return dict(requests=sorted(requests), num_blocks=num_blocks, block_size=block_size,
                max_num_seqs=max_num_seqs, budget=budget)


def simulate(decide, sc: dict, max_steps: int = 20000) -> dict:
    """Serve scenario `sc` with a policy's `decide` on the simulated clock. Returns per-request
    records and the totals: offered, finished, refused, good (met both objectives), preemptions,
    the longest queue, and timelines (time, running, held+waiting) for a plot."""
    from minikv.engine import LLMEngine
    from minikv.sampling import SamplingParams
    from minikv.sim.fake_runner import FakeRunner

    model = _tiny_model()
    eng = LLMEngine(model, None, block_size=sc["block_size"], num_blocks=sc["num_blocks"], verbose=False,
                    max_num_seqs=sc["max_num_seqs"], max_num_batched_tokens=sc["budget"],
                    enable_prefix_caching=False,
                    runner=FakeRunner(sc["num_blocks"], sc["block_size"], model.config.vocab_size))
    arrivals = deque(enumerate(sc["requests"]))
    recs = {f"r{i}": {"arrival": t, "prompt": p, "max_tokens": k, "times": [], "end": None, "reason": ""}
            for i, (t, p, k) in enumerate(sc["requests"])}
    held: deque = deque()
    now, step_s, longest, timeline = 0.0, 0.0, 0, []

    def state() -> dict:
        started = sum(1 for r in recs.values() if r["end"] is None and r["times"])
        in_engine = len(eng.requests) - started
        return engine_state(eng, now, len(held), len(held) + max(in_engine, 0), step_s)

    def ask(rid: str, is_held: bool) -> str:
        r = recs[rid]
        info = request_info(r["prompt"], r["max_tokens"], sc["block_size"],
                            now - r["arrival"], is_held)
        decision, reason = normalize(call(decide, info, state()), "MyPolicy.decide")
        if decision == "admit":
            eng.add_request(rid, _prompt(int(rid[1:]), r["prompt"]),
                            SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True))
        elif decision == "refuse":
            r["end"], r["reason"] = "refused", reason
        return decision

    for _ in range(max_steps):
        while arrivals and arrivals[0][1][0] <= now + 1e-12:
            i, _req = arrivals.popleft()
            if ask(f"r{i}", False) == "queue":
                held.append(f"r{i}")
        while held:
            waited = now - recs[held[0]]["arrival"]
            if waited > HOLD_LIMIT_S:
                raise AssertionError(f"request {held[0]} was held {waited:.1f}s (simulated) and neither admitted nor "
                                     f"refused: decide every held request within {HOLD_LIMIT_S:g}s; does your "
                                     f"policy hold requests forever? ({describe(sc)})")
            decision = ask(held[0], True)
            if decision == "queue":
                break
            held.popleft()
        waiting = eng.stats(history=0).waiting
        longest = max(longest, len(held) + waiting)
        if longest > MAX_QUEUE:
            raise AssertionError(f"{len(held)} requests held and {waiting} waiting in the "
                                 f"engine at t={now:.2f}s: a queue over {MAX_QUEUE} is not bounded back-pressure; "
                                 f"refuse (429) sooner ({describe(sc)})")
        if eng.has_unfinished_requests():
            outs = eng.step()
            st_ = eng.step_stats[-1]
            step_s = step_seconds(st_.prefill_tokens, st_.decode_tokens)
            now += step_s
            for o in outs:
                r = recs[o.request_id]
                r["times"] += [now] * (len(o.outputs[0].token_ids) - len(r["times"]))
                if o.finished:
                    r["end"] = o.outputs[0].finish_reason
            timeline.append((now, st_.num_running, len(held) + st_.num_waiting, st_.preemptions))
        elif arrivals:
            now = max(now, arrivals[0][1][0]) if not held else now + 0.05
        elif held:
            now += 0.05   # an idle engine and a held queue: the policy is asked again a moment later
        else:
            break
    else:
        raise AssertionError(f"the simulation did not end within {max_steps} steps (simulated t={now:.1f}s): "
                             f"does your policy hold requests forever? ({describe(sc)})")
    return _totals(recs, eng, longest, timeline)


def _totals(recs: dict, eng, longest: int, timeline) -> dict:
    lost = [rid for rid, r in recs.items() if r["end"] is None or (r["end"] == "refused" and not r["reason"])]
    if lost:
        raise AssertionError(f"requests {lost[:5]} were neither finished nor refused with a reason: "
                             "nothing may be lost")
    good = 0
    for r in recs.values():
        if r["end"] == "length":
            t = [r["arrival"]] + r["times"]
            r["ttft"] = t[1] - t[0]
            r["max_itl"] = max((b - a for a, b in zip(t[1:], t[2:])), default=0.0)
            r["good"] = r["ttft"] <= TTFT_SLO_S and r["max_itl"] <= ITL_SLO_S
            good += r["good"]
    return {"offered": len(recs), "finished": sum(r["end"] == "length" for r in recs.values()),
            "refused": sum(r["end"] == "refused" for r in recs.values()), "good": good,
            "preemptions": eng.scheduler.num_preemptions, "longest_queue": longest, "requests": recs,
            "timeline": timeline}


def describe(sc: dict) -> str:
    reqs = sc["requests"]
    span = reqs[-1][0] - reqs[0][0] if reqs else 0
    return (f"{len(reqs)} requests over {span:.1f}s, prompts {min(p for _, p, _ in reqs)}-"
            f"{max(p for _, p, _ in reqs)} tokens, outputs {min(k for *_, k in reqs)}-{max(k for *_, k in reqs)}, "
            f"pool {sc['num_blocks']} blocks of {sc['block_size']}, {sc['max_num_seqs']} seats")


def baseline(sc: dict) -> dict:
    return simulate(BoundedFIFO(BASELINE_MAX_WAITING).decide, sc)


def _poisson(rate: float, n: int, seed: int, prompts=(16, 160), outputs=(8, 48)) -> list[tuple]:
    import random

    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append((round(t, 4), rng.randint(*prompts), rng.randint(*outputs)))
    return out


SCENARIOS = {
    "light load (2 requests/s)": scenario(_poisson(2.0, 24, 1)),
    "a burst of 40 at once": scenario([(0.0, p, k) for _, p, k in _poisson(1.0, 40, 2)]),
    "overload (12 requests/s)": scenario(_poisson(12.0, 60, 3)),
    "long prompts in the mix (8 requests/s)": scenario(_poisson(8.0, 48, 4, prompts=(16, 300))),
}


TOLERANCE = 2   # a design may trade a scenario: at most this many good requests fewer than the baseline
