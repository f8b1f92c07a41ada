"""What exercise 07's notebook uses besides its own code: the objective, the hard limits, the
simulated clock, the load scenarios (scripted, and drawn from a seed), and the lecture's baseline.

Public on purpose: the notebook imports these, and a sandboxed submission may read this module (the
checks themselves, in ``minikv/grading/checks/ex07_admission.py``, it can neither import nor read; the
passing rule lives there). Nothing here is an answer: the baseline is the lecture's bounded FIFO.

A request of a scenario is (arrival s, prompt tokens, max_tokens, tokens it really generates): like
a chat client, most ask for far more than they use (the model stops early, at its end-of-sequence
token), and the server learns how many only when it happens. The policy sees `max_tokens`, never the
real length.
"""

from __future__ import annotations

import functools
from collections import deque

from minikv.grading import call
from minikv.server.admission import BoundedFIFO, engine_state, normalize, request_info

TTFT_SLO_S = 1.0          # simulated seconds from arrival to the first token
ITL_SLO_S = 0.3           # the longest gap a client accepts between two tokens
BASELINE_MAX_WAITING = 16
MAX_QUEUE = 64            # held + waiting in the engine: past it, a hard limit is broken
NUM_DRAWN = 12            # scenarios one seed draws: the grader measures a policy on each seed of a held-out set
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
    """`requests`: (arrival time in simulated seconds, prompt tokens, max_tokens[, tokens it really
    generates: max_tokens if not given]) for each."""
    reqs = sorted((t, p, k, k if not rest else min(k, rest[0])) for t, p, k, *rest in requests)
    return dict(requests=reqs, num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
                budget=budget)


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
    recs = {f"r{i}": {"arrival": t, "prompt": p, "max_tokens": k, "output": n, "times": [], "end": None,
                      "reason": ""}
            for i, (t, p, k, n) in enumerate(sc["requests"])}
    held: deque = deque()
    now, step_s, longest, timeline = 0.0, 0.0, 0, []

    def state() -> dict:
        started = sum(1 for r in recs.values() if r["end"] is None and r["times"])
        now_ = eng.stats(history=0)   # one sequence a request here (n = 1)
        in_engine = now_.running + now_.waiting + now_.swapped - started
        return engine_state(now_, now, len(held), len(held) + max(in_engine, 0), step_s)

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
            st_ = outs.stats if outs.ran else eng.stats(history=1).last_step
            step_s = step_seconds(st_.prefill_tokens, st_.decode_tokens)
            now += step_s
            for o in outs:
                r = recs[o.request_id]
                if r["end"] is not None:
                    continue
                r["times"] += [now] * (len(o.outputs[0].token_ids) - len(r["times"]))
                if o.finished:
                    r["end"] = o.outputs[0].finish_reason
                elif len(r["times"]) >= r["output"]:   # the model's end-of-sequence: its blocks free now
                    eng.abort_request(o.request_id)
                    r["end"] = "stop"
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
        if r["end"] in ("length", "stop"):
            t = [r["arrival"]] + r["times"]
            r["ttft"] = t[1] - t[0]
            r["max_itl"] = max((b - a for a, b in zip(t[1:], t[2:])), default=0.0)
            r["good"] = r["ttft"] <= TTFT_SLO_S and r["max_itl"] <= ITL_SLO_S
            good += r["good"]
    return {"offered": len(recs), "finished": sum(r["end"] in ("length", "stop") for r in recs.values()),
            "refused": sum(r["end"] == "refused" for r in recs.values()), "good": good,
            "preemptions": eng.stats(history=0).preemptions, "longest_queue": longest, "requests": recs,
            "timeline": timeline}


def describe(sc: dict) -> str:
    reqs = sc["requests"]
    span = reqs[-1][0] - reqs[0][0] if reqs else 0
    return (f"{len(reqs)} requests over {span:.1f}s, prompts {min(r[1] for r in reqs)}-{max(r[1] for r in reqs)} "
            f"tokens, max_tokens {min(r[2] for r in reqs)}-{max(r[2] for r in reqs)}, generating "
            f"{min(r[3] for r in reqs)}-{max(r[3] for r in reqs)}, pool {sc['num_blocks']} blocks of "
            f"{sc['block_size']}, {sc['max_num_seqs']} seats")


def baseline(sc: dict) -> dict:
    """The lecture's policy (`--max-waiting 16`) on `sc`."""
    return simulate(BoundedFIFO(BASELINE_MAX_WAITING).decide, sc)


def _poisson(rate: float, n: int, seed: int, prompts=(16, 160), outputs=(8, 48), max_tokens=None,
             short=1.0, said=(8, 40)) -> list[tuple]:
    """`n` Poisson arrivals at `rate`/s. Without `max_tokens` each generates what it asks for (drawn from
    `outputs`); with it, each asks for `max_tokens` and, with probability `short`, stops early after a
    length drawn from `said` (else it runs to a length drawn from `outputs`)."""
    import random

    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        p = rng.randint(*prompts)
        if max_tokens is None:
            k = rng.randint(*outputs)
            out.append((round(t, 4), p, k, k))
        else:
            out.append((round(t, 4), p, max_tokens, rng.randint(*(said if rng.random() < short else outputs))))
    return out


def burst(n: int, seed: int, **kw) -> list[tuple]:
    """`n` requests arriving at once (Poisson's sizes, all at t = 0)."""
    return [(0.0, *rest) for _, *rest in _poisson(1.0, n, seed, **kw)]


def drawn_scenarios(seed: int, n: int = NUM_DRAWN) -> dict[str, dict]:
    """`n` scenarios drawn from `seed`, named by how they were drawn: chat traffic that asks for far more
    than it uses, answers that run to their full length, and bursts past the queue limit."""
    import random

    rng = random.Random(seed)
    out = {}
    for i in range(n):
        kind, s = ("chat", "chat", "long answers", "chat", "chat", "burst")[i % 6], rng.randrange(2 ** 31)
        if kind == "chat":
            rate, k = rng.choice([2.5, 3.0, 3.5, 4.0]), rng.choice([192, 256])
            sc = scenario(_poisson(rate, rng.randint(40, 56), s, prompts=(16, 128), outputs=(64, k), max_tokens=k,
                                   short=rng.choice([0.75, 0.85])), num_blocks=rng.choice([80, 96]), max_num_seqs=8)
            name = f"chat at {rate:g}/s asking for {k} tokens"
        elif kind == "long answers":
            rate = rng.choice([3.0, 4.0, 5.0])
            sc = scenario(_poisson(rate, rng.randint(30, 40), s, prompts=(16, 96), outputs=(48, 96)),
                          num_blocks=rng.choice([48, 64]), max_num_seqs=8)
            name = f"full-length answers at {rate:g}/s"
        else:
            m = rng.randint(MAX_QUEUE + 8, MAX_QUEUE + 32)
            sc = scenario(burst(m, s, prompts=(16, 120), outputs=(8, 32), max_tokens=64, short=0.7, said=(4, 24)),
                          num_blocks=96, max_num_seqs=8)
            name = f"a burst of {m} at once"
        out[f"{i + 1}. {name} (seed {seed})"] = sc
    return out


@functools.lru_cache(maxsize=64)
def _drawn_baselines(seed: int) -> dict[str, int]:
    """The baseline's good requests on each scenario `seed` draws: the same whatever policy is measured against it,
    so served once per process (the grader measures every policy on the same seeds)."""
    return {name: baseline(sc)["good"] for name, sc in drawn_scenarios(seed, NUM_DRAWN).items()}


@functools.lru_cache(maxsize=1)
def _scripted_baselines() -> dict[str, int]:
    return {name: baseline(sc)["good"] for name, sc in SCENARIOS.items()}


def reproduce(name: str, seed: int | None = None, scripted: bool = False) -> str:
    """The one line that serves scenario `name` again with the learner's policy: drawn from `seed`, or scripted."""
    where = "SCENARIOS" if scripted else f"drawn_scenarios({seed})"
    return f"simulate(MyPolicy().decide, {where}[{name!r}])"


def objective(make_policy, seed: int | None = None, scenarios: dict | None = None) -> dict:
    """Serve `scenarios` (default: `NUM_DRAWN` drawn from `seed`) with a fresh policy each (`make_policy()`:
    pass the class, ``objective(MyPolicy, seed)``) and with the lecture's baseline. Returns the good
    requests of both, summed and per scenario. Raises AssertionError where a hard limit breaks, naming the
    scenario (and its seed) and the one line that serves it again."""
    scs = drawn_scenarios(seed, NUM_DRAWN) if scenarios is None else scenarios
    bases = (_drawn_baselines(seed) if scenarios is None else _scripted_baselines() if scenarios is SCENARIOS
             else {name: baseline(sc)["good"] for name, sc in scs.items()})
    rows = []
    for name, sc in scs.items():
        try:
            m = simulate(make_policy().decide, sc)
        except AssertionError as err:
            again = (reproduce(name, seed) if scenarios is None else
                     reproduce(name, scripted=True) if scenarios is SCENARIOS else "simulate(MyPolicy().decide, sc)")
            raise AssertionError(f"scenario {name!r}: {err}; {again} reproduces it") from None
        rows.append(dict(name=name, offered=m["offered"], good=m["good"], base_good=bases[name], refused=m["refused"],
                         preemptions=m["preemptions"], longest_queue=m["longest_queue"]))
    return dict(seed=seed, n=len(rows), scenarios=rows, offered=sum(r["offered"] for r in rows),
                good=sum(r["good"] for r in rows), base_good=sum(r["base_good"] for r in rows))


SCENARIOS = {
    "light load (2 requests/s)": scenario(_poisson(2.0, 24, 1)),
    "chat at 3 requests/s, max_tokens 256, most stop early": scenario(
        _poisson(3.0, 48, 2, prompts=(16, 128), outputs=(64, 256), max_tokens=256, short=0.8), num_blocks=96),
    "full-length answers at 4 requests/s": scenario(_poisson(4.0, 36, 3, prompts=(16, 96), outputs=(48, 96))),
    "a burst of 80 at once": scenario(burst(80, 4, prompts=(16, 120), outputs=(8, 32), max_tokens=64, short=0.7,
                                            said=(4, 24)), num_blocks=96),
    "chat at 4 requests/s, max_tokens 192": scenario(
        _poisson(4.0, 48, 5, prompts=(16, 128), outputs=(64, 192), max_tokens=192, short=0.85), num_blocks=80),
    "chat at 2.5 requests/s, max_tokens 256": scenario(
        _poisson(2.5, 48, 6, prompts=(16, 128), outputs=(64, 256), max_tokens=256, short=0.75), num_blocks=96),
}
