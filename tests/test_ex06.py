"""Exercise 06 is a design exercise whose checks discriminate: the solution's policy passes every check, the
untouched exercise fails each with "not implemented yet", the lecture's policy pasted into the hooks (the
baseline itself) and the old transcription answer miss the objective, admission headroom with the lecture's
victim (the old hint) or with a bad victim misses it on long prompts among short ones, the lecture's admission
with a good victim misses it on short requests, a policy that never fills the engine misses the forward-pass
bound, and a policy that breaks an invariant is named."""

import json
from pathlib import Path

import pytest

from minikv.grading import NotImplementedYet, run_checks
from minikv.grading.checks import ex06_scheduler as ex

pytestmark = pytest.mark.design   # the exercise's objective, not the interpreter (.ci/run)

REPO = Path(__file__).resolve().parents[1]


def namespace(folder: str) -> dict:
    """The notebook's `my_admit` and `my_victim`, defined by running its two graded cells."""
    nb = json.loads((REPO / folder / "06_continuous_batching.ipynb").read_text())
    ns: dict = {}
    for cell in nb["cells"]:
        src = "".join(cell["source"])
        if cell["cell_type"] == "code" and src.startswith(("def my_admit", "def my_victim")):
            exec(compile(src, f"<{folder} 06>", "exec"), ns)  # noqa: S102 - the course's own notebook
    assert {"my_admit", "my_victim"} <= ns.keys()
    return ns


def lecture_admit(chunk, budget, need, free, running, block_size):
    """minikv's default `can_admit` (watermark of one block while anyone runs), pasted as a function."""
    return chunk <= budget and need <= free - (1 if running else 0)


def lecture_victim(needy, candidates):
    """minikv's default `choose_victim` (the most recently admitted candidate), pasted as a function."""
    return candidates[-1][0] if candidates else needy


def old_ref_admit(chunk, budget, need, free, running, block_size):
    """The old exercise's transcribable answer: reserve a block per running sequence on a block boundary."""
    return chunk <= budget and need + sum(1 for t in running if t % block_size == 0) <= free


def old_ref_victim(needy, candidates):
    """The old exercise's other answer (the most blocks), adapted to the new (seq_id, blocks, tokens) triples."""
    best, most = needy, -1
    for seq_id, blocks, _tokens in candidates:
        if blocks >= most:
            best, most = seq_id, blocks
    return best


def headroom_admit(chunk, budget, need, free, running, block_size):
    """The old hint, transcribed: keep one free block per running sequence, plus a spare."""
    headroom = len(running) + 1 if running else 0
    return chunk <= budget and need + headroom <= free


def most_blocks_victim(needy, candidates):
    """A bad victim: the candidate holding the most blocks (the most freed, and the most thrown away)."""
    return max(candidates, key=lambda c: c[1])[0] if candidates else needy


SEEDS = [0, 1, 2, 12345]
FAMILIES = ["short", "mixed"]


def test_the_solution_passes_every_check():
    results = run_checks(ex.CHECKS, namespace("solutions"))
    assert all(r.passed for r in results), [(r.name, r.message) for r in results if not r.passed]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("seed", SEEDS)
def test_the_solution_meets_the_objective_with_room(seed, family):
    ns = namespace("solutions")
    m = ex.objective(ns["my_admit"], ns["my_victim"], seed, family=family)
    assert ex.objective_verdict(m) is None
    assert m["recomputed"] <= 0.8 * m["base_recomputed"], m   # room below the 0.90 target: drawn seeds vary
    assert m["steps"] <= 1.08 * m["base_steps"], m


def test_the_untouched_exercise_is_not_implemented_in_every_check():
    ns = namespace("exercises")
    for check in ex.CHECKS:
        with pytest.raises(NotImplementedYet, match="not implemented yet"):
            check(ns)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("seed", SEEDS)
def test_the_lectures_policy_is_the_baseline_and_misses_the_objective(seed, family):
    m = ex.objective(lecture_admit, lecture_victim, seed, family=family)
    assert (m["recomputed"], m["steps"]) == (m["base_recomputed"], m["base_steps"])  # it is the baseline
    verdict = ex.objective_verdict(m)
    assert verdict is not None and "Too many recomputed tokens" in verdict and "target <= 0.90x" in verdict
    assert f"seed={seed}, family={family!r}" in verdict   # how to reproduce it


@pytest.mark.parametrize("check", [ex.check_beats_the_baseline_on_short_requests_at_once,
                                   ex.check_beats_the_baseline_with_long_prompts_among_short_ones])
def test_the_lectures_policy_fails_the_objective_checks(check):
    ns = {"my_admit": lecture_admit, "my_victim": lecture_victim}
    with pytest.raises(AssertionError, match=r"recomputed tokens: baseline \d+, yours \d+ \(1\.00x"):
        check(ns)


@pytest.mark.parametrize("seed", SEEDS)
def test_the_old_transcribed_answer_misses_the_objective(seed):
    assert ex.objective_verdict(ex.objective(old_ref_admit, old_ref_victim, seed)) is not None


@pytest.mark.parametrize("victim", [lecture_victim, most_blocks_victim], ids=["lecture victim", "most blocks"])
@pytest.mark.parametrize("seed", SEEDS)
def test_admission_headroom_alone_misses_the_objective_where_the_victim_decides(seed, victim):
    """Headroom passes the short-request family whatever the victim; with long prompts among short ones the
    victim decides, and neither the lecture's (the most recently admitted) nor the biggest one is enough."""
    assert ex.objective_verdict(ex.objective(headroom_admit, victim, seed, family="short")) is None
    verdict = ex.objective_verdict(ex.objective(headroom_admit, victim, seed, family="mixed"))
    assert verdict is not None and "Too many recomputed tokens" in verdict, verdict


@pytest.mark.parametrize("seed", SEEDS)
def test_a_good_victim_alone_misses_the_objective_where_admission_decides(seed):
    """The solution's victim with the lecture's admission: enough with long prompts among short ones, where the
    victim decides, and not on short requests at once, where admission does."""
    victim = namespace("solutions")["my_victim"]
    assert ex.objective_verdict(ex.objective(lecture_admit, victim, seed, family="mixed")) is None
    verdict = ex.objective_verdict(ex.objective(lecture_admit, victim, seed, family="short"))
    assert verdict is not None and "Too many recomputed tokens" in verdict, verdict


@pytest.mark.parametrize("family", FAMILIES)
def test_admitting_only_into_an_empty_engine_misses_the_step_bound(family):
    def one_at_a_time(chunk, budget, need, free, running, block_size):
        return chunk <= budget and need <= free and not running

    verdict = ex.objective_verdict(ex.objective(one_at_a_time, lecture_victim, 0, family=family))
    assert verdict is not None and "Too many forward passes" in verdict


def test_always_admitting_breaks_the_invariants():
    ns = {"my_admit": lambda *args: True, "my_victim": lecture_victim}
    with pytest.raises(AssertionError, match="admitted a chunk"):
        ex.check_admit_keeps_the_hard_limits(ns)
    with pytest.raises(AssertionError, match="the engine failed at step|over the budget"):
        ex.check_scripted_scenarios_finish_with_the_right_tokens(ns)


def test_refusing_an_empty_engine_is_a_stall():
    ns = {"my_admit": lambda *args: False, "my_victim": lecture_victim}
    with pytest.raises(AssertionError, match="empty engine"):
        ex.check_admit_keeps_the_hard_limits(ns)
    with pytest.raises(AssertionError, match="stalled at step 0"):
        ex.run_fake(ex.SCENARIOS[0], ns["my_admit"], lecture_victim, max_steps=200)


def test_a_victim_outside_the_candidates_is_named():
    with pytest.raises(AssertionError, match="must return .* or a seq_id from the candidates"):
        ex.run_fake(ex.SCENARIOS[0], lecture_admit, lambda needy, cands: -1)
    with pytest.raises(AssertionError, match="must return .* or a seq_id from the candidates"):
        ex.check_victim_is_a_legal_choice({"my_admit": lecture_admit, "my_victim": lambda needy, cands: -1})


def test_admit_must_return_a_bool():
    with pytest.raises(AssertionError, match="must return True or False"):
        ex.run_fake(ex.SCENARIOS[0], lambda *a: None, lecture_victim)


def test_the_baseline_preempts_in_every_scripted_scenario():
    assert all(ex.run_fake(w, None, None).preemptions > 0 for w in ex.SCENARIOS)
