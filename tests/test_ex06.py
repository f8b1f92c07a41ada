"""Exercise 06's checks discriminate: the asked-for policy passes its scripted scenarios, the lecture's
policy (minikv's own: watermark admission, most recent victim) fails every one of them, and a policy
that returns nonsense gets a message that says what it must return."""

import pytest

from minikv.checks import ex06_scheduler as ex


def lecture_admit(chunk, budget, need, free, running, block_size):
    return chunk <= budget and need <= free - (1 if running else 0)


def lecture_victim(needy, candidates):
    return candidates[-1][0] if candidates else needy


@pytest.mark.parametrize("scenario", range(len(ex.SCENARIOS)))
def test_the_reference_policy_passes_and_preempts(scenario):
    assert ex.compare_on(ex.SCENARIOS[scenario], ex.ref_admit, ex.ref_victim) > 0


@pytest.mark.parametrize("scenario", range(len(ex.SCENARIOS)))
@pytest.mark.parametrize("half", ["admit", "victim"])
def test_the_lectures_policy_fails_every_scenario(scenario, half):
    admit = lecture_admit if half == "admit" else ex.ref_admit
    victim = lecture_victim if half == "victim" else ex.ref_victim
    with pytest.raises(AssertionError, match="the reference policy scheduled"):
        ex.compare_on(ex.SCENARIOS[scenario], admit, victim)


def test_a_victim_outside_the_candidates_is_named():
    with pytest.raises(AssertionError, match="must return .* or a seq_id from the candidates"):
        ex.run_fake(ex.SCENARIOS[0], ex.ref_admit, lambda needy, cands: -1)


def test_admit_must_return_a_bool():
    with pytest.raises(AssertionError, match="must return True or False"):
        ex.run_fake(ex.SCENARIOS[0], lambda *a: None, ex.ref_victim)
