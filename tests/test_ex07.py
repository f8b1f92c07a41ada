"""Exercise 07's checks discriminate: the lecture's policy (copied, or with the lecture's `--max-waiting 64`)
scores exactly the baseline's goodput and misses the target; reserving every request's `max_tokens` misses it
too (the traffic stops early); `return "admit"` breaks the queue limit, and the message names the drawn scenario
and the line that reproduces it; the solution passes with margin, and its verdicts say what was measured and the
targets (which designs pass on the held-out set, and why, is tests/test_designs.py's). A wrong answer, an
unbounded queue and a policy that never decides get messages that say what is wrong, in seconds. And the
server's admission hook: refusals are 429s with the policy's reason, held requests are served."""

import json
from pathlib import Path

import pytest

from minikv.grading.checks import ex07_admission as ex
from minikv.server.admission import BoundedFIFO, normalize

pytestmark = pytest.mark.design   # the exercise's objective, not the interpreter (.ci/run)

SOLUTION = Path(__file__).resolve().parent.parent / "solutions" / "07_landlord.ipynb"


def solution_policy():
    """The solution notebook's `MyPolicy`, from its cell (the notebook's imports it needs, given)."""
    cells = json.loads(SOLUTION.read_text())["cells"]
    code = next("".join(c["source"]) for c in cells if c["cell_type"] == "code" and "class MyPolicy" in
                "".join(c["source"]))
    ns = {"TTFT_SLO_S": ex.TTFT_SLO_S, "ITL_SLO_S": ex.ITL_SLO_S, "MAX_QUEUE": ex.MAX_QUEUE}
    exec(code, ns)  # noqa: S102 - the course's own solution
    return ns["MyPolicy"]


class Reserving:
    """Hold a request until a seat is free and the pool holds it at its `max_tokens`; give up late ones
    (the old exercise's answer: right when requests run to their max_tokens, wasteful when they stop early)."""

    def decide(self, request, state):
        fits = state["reserved_blocks"] + request["blocks_at_most"] <= state["num_blocks"]
        seat = state["running"] + state["waiting"] < state["max_num_seqs"]
        if request["held"]:
            if request["waited_s"] > 0.7 * ex.TTFT_SLO_S:
                return "refuse", "too late"
            return "admit" if fits and seat else "queue"
        if state["held"] == 0 and fits and seat:
            return "admit"
        return ("refuse", "full") if state["held"] >= 8 else "queue"


class LecturesFIFO(BoundedFIFO):
    """What notebook 07 serves with: `--max-waiting 64`."""

    def __init__(self):
        super().__init__(64)


class CopiedBaseline(BoundedFIFO):
    def __init__(self):
        super().__init__(ex.BASELINE_MAX_WAITING)


def ratio(m: dict) -> float:
    return m["good"] / m["base_good"]


@pytest.mark.parametrize("policy", [CopiedBaseline, LecturesFIFO])
def test_the_lectures_policy_scores_the_baseline_and_misses_the_target(policy):
    ms = ex.scripted_measurement(policy)
    m = ms.per_seed[0]
    assert m["good"] == m["base_good"] > 0
    passed, said = ex.scripted_verdict(ms)
    assert not passed and ": 1.000x; the target is >= 1.30x" in said, said
    assert "objective(MyPolicy, scenarios=SCENARIOS) reproduces it" in said, said


def test_reserving_max_tokens_misses_the_target():
    for m in (ex.objective(Reserving, scenarios=ex.SCENARIOS), ex.objective(Reserving, seed=0)):
        assert all(r["preemptions"] == 0 for r in m["scenarios"])   # it never overfills the pool ...
    assert not ex.scripted_verdict(ex.scripted_measurement(Reserving))[0]   # ... and leaves it idle


@pytest.fixture()
def small_set(monkeypatch):
    """A held-out set of two public seeds, so that a test of the verdicts' words takes seconds (the real set is
    measured in tests/test_designs.py)."""
    from minikv.grading.checks.held_out import HeldOutSet

    monkeypatch.setattr(ex, "HELD_OUT", HeldOutSet("ex07-test", (0, 1), "scenarios"))


def test_the_solution_passes_with_margin_and_says_what_it_measured(small_set):
    policy = solution_policy()
    ns = {"MyPolicy": policy}
    said = ex.check_goodput_on_the_scripted_scenarios(ns)
    assert said.startswith("on the 6 scripted scenarios (SCENARIOS), your policy served") and \
        said.endswith("the target is >= 1.30x"), said
    assert ex.scripted_measurement(policy).criteria[0].mean >= ex.MARGIN["scripted"] * 1.05
    said = ex.check_goodput_on_held_out_scenarios(ns)
    assert said.startswith("on held-out set ex07-test (2 seeds, scenarios each): ") and "the target is >= 6.5" in said
    assert "more good requests (TTFT <= 1.0s, every gap <= 0.3s) per 100 offered than the lecture's baseline" in said


def test_a_failing_held_out_verdict_names_the_worst_seed(small_set):
    passed, said = ex.objective_verdict(ex.held_out_measurement(CopiedBaseline))
    assert not passed and ": 0.00 more good requests" in said and "(+0.0 per 100 offered)" in said, said
    assert "objective(MyPolicy, seed=0) reproduces it" in said and "Where you lost most there" in said, said


def test_return_admit_breaks_the_queue_limit():
    with pytest.raises(AssertionError, match="not bounded back-pressure"):
        ex.simulate(lambda request, state: "admit", ex.SCENARIOS["a burst of 80 at once"])
    assert len(ex.SCENARIOS["a burst of 80 at once"]["requests"]) > ex.MAX_QUEUE


def test_requests_stop_early_and_nothing_is_lost():
    sc = ex.SCENARIOS["chat at 3 requests/s, max_tokens 256, most stop early"]
    out = ex.simulate(BoundedFIFO(4).decide, sc)
    assert out["finished"] + out["refused"] == out["offered"] == len(sc["requests"])
    assert out["refused"] > 0 and out["preemptions"] > 0
    done = [r for r in out["requests"].values() if r["end"] in ("stop", "length")]
    assert all(len(r["times"]) == r["output"] for r in done)
    assert sum(r["output"] < r["max_tokens"] for r in done) > len(done) / 2


def test_drawn_scenarios_come_from_the_seed():
    assert ex.drawn_scenarios(5, 6) == ex.drawn_scenarios(5, 6) != ex.drawn_scenarios(6, 6)
    assert all("(seed 5)" in name for name in ex.drawn_scenarios(5, 6))
    assert list(ex.drawn_scenarios(5, 3)) == list(ex.drawn_scenarios(5, 6))[:3]   # a name means one scenario


def test_a_hard_limit_broken_in_a_drawn_scenario_names_it_and_the_line_that_reproduces_it():
    """`return "admit"` overflows the queue on a burst: the message names the scenario and its seed, and the line it
    gives, run, breaks the same limit."""
    class AdmitAll:
        def decide(self, request, state):
            return "admit"

    with pytest.raises(AssertionError) as broke:
        ex.objective(AdmitAll, seed=5)
    said = str(broke.value)
    assert said.startswith("scenario '") and "(seed 5)" in said and "not bounded back-pressure" in said, said
    line = said.rsplit("; ", 1)[1].removesuffix(" reproduces it")
    assert line.startswith("simulate(MyPolicy().decide, drawn_scenarios(5)["), line
    with pytest.raises(AssertionError, match="not bounded back-pressure"):
        eval(line, {"simulate": ex.simulate, "drawn_scenarios": ex.drawn_scenarios,  # noqa: S307 - our own line
                    "MyPolicy": AdmitAll})


def test_a_wrong_answer_is_named():
    with pytest.raises(ValueError, match="must return 'admit', 'queue' or 'refuse'"):
        ex.simulate(lambda request, state: "maybe", ex.SCENARIOS["light load (2 requests/s)"])
    assert normalize("refuse") == ("refuse", "the admission policy refused it")


def test_an_unbounded_queue_fails():
    with pytest.raises(AssertionError, match="not bounded back-pressure"):
        ex.simulate(lambda request, state: "queue", ex.scenario([(0.0, 10, 4)] * (ex.MAX_QUEUE + 6)))


def test_a_policy_that_never_decides_fails_the_hard_limits_at_once():
    """Held forever with an idle engine: the hard-limits check stops once the head has waited HOLD_LIMIT_S
    simulated seconds (a few hundred calls), before any objective or the real server."""
    asked = []

    class Never:
        def decide(self, request, state):
            asked.append(1)
            return "queue" if request["held"] or state["running"] + state["waiting"] else "admit"

    with pytest.raises(AssertionError, match="neither admitted nor refused"):
        ex.check_keeps_the_hard_limits({"MyPolicy": Never})
    assert len(asked) < 100 + ex.HOLD_LIMIT_S / 0.05 * 2


def test_a_policy_that_holds_forever_is_stopped():
    with pytest.raises(AssertionError, match="hold requests forever"):
        ex.simulate(lambda r, s: ("refuse", "x") if s["held"] >= 4 else "queue",
                    ex.scenario([(0.0, 10, 4)] * 3), max_steps=300)


def test_the_server_refuses_with_the_policys_reason_and_serves_held_requests():
    out = ex.flood(BoundedFIFO(2), n=12)
    assert out["lost"] == 0 and out["refused"] > 0 and out["blocks_in_use_after"] == 0
    assert "max 2" in out["first_refusal"]
    held = ex.flood(Reserving(), n=12)
    assert held["lost"] == 0 and held["ok"] > 0 and held["blocks_in_use_after"] == 0


def test_a_broken_policy_refuses_instead_of_stopping_the_server():
    class Broken:
        def decide(self, request, state):
            raise KeyError("oops")

    out = ex.flood(Broken(), n=6)
    assert out["lost"] == 0 and out["refused"] == 6 and "admission policy failed" in out["first_refusal"]
