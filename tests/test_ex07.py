"""Exercise 07's checks discriminate: the lecture's baseline (copied) scores its own goodput and so
misses the margin; a policy that holds requests until the pool can hold them passes; a wrong answer,
an unbounded queue and a policy that never admits get messages that say what is wrong. And the
server's admission hook: refusals are 429s with the policy's reason, held requests are served."""

import pytest

from minikv.grading.checks import ex07_admission as ex
from minikv.server.admission import BoundedFIFO, normalize


class Reserving:
    """Hold a request until a seat is free and the pool holds it at its longest; give up late ones."""

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


def _totals(decide):
    totals = {"base": 0, "mine": 0}
    for sc in ex.SCENARIOS.values():
        ex._add(totals, *ex.compare(decide, sc))
    return totals


def test_the_copied_baseline_misses_the_margin():
    totals = _totals(BoundedFIFO(ex.BASELINE_MAX_WAITING).decide)
    assert totals["mine"] == totals["base"] > 0
    with pytest.raises(AssertionError, match="at least 1.25x the baseline is needed"):
        ex.margin_met(totals, "the scripted scenarios")


def test_a_reserving_policy_passes_without_preemptions():
    totals = _totals(Reserving().decide)
    ex.margin_met(totals, "the scripted scenarios")
    assert all(ex.simulate(Reserving().decide, sc)["preemptions"] == 0 for sc in ex.SCENARIOS.values())


def test_nothing_is_lost_in_a_simulation():
    sc = ex.SCENARIOS["overload (12 requests/s)"]
    out = ex.simulate(BoundedFIFO(4).decide, sc)
    assert out["finished"] + out["refused"] == out["offered"] == len(sc["requests"])
    assert out["refused"] > 0 and out["preemptions"] > 0


def test_a_wrong_answer_is_named():
    with pytest.raises(ValueError, match="must return 'admit', 'queue' or 'refuse'"):
        ex.simulate(lambda request, state: "maybe", ex.SCENARIOS["light load (2 requests/s)"])
    assert normalize("refuse") == ("refuse", "the admission policy refused it")


def test_an_unbounded_queue_fails():
    with pytest.raises(AssertionError, match="not bounded back-pressure"):
        ex.simulate(lambda request, state: "queue", ex.scenario([(0.0, 10, 4)] * (ex.MAX_QUEUE + 6)))


def test_a_policy_that_never_decides_is_stopped_by_the_hold_limit():
    """Held forever with an idle engine: stopped once the head has waited HOLD_LIMIT_S simulated seconds
    (a few hundred steps), not after max_steps round trips into the submission."""
    asked = []

    def never(request, state):
        asked.append(1)
        return "queue"

    with pytest.raises(AssertionError, match="neither admitted nor refused"):
        ex.simulate(never, ex.scenario([(0.0, 10, 4)] * 3))
    assert len(asked) < 3 + ex.HOLD_LIMIT_S / 0.05 + 10


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
