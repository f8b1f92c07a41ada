"""Exercise 06 is a design exercise whose checks discriminate: the solution's policy passes every check and its
verdicts say what was measured, the targets and the held-out sets; the untouched exercise fails each with "not
implemented yet"; the lecture's policy pasted into the hooks (the baseline itself) and the old transcription answer
miss the objective, with the line that reproduces it; a policy that never fills the engine misses the forward-pass
bound; a policy that breaks an invariant is named. Which designs pass on the held-out sets, and why, is
tests/test_designs.py's (GRADING.md's table)."""

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


@pytest.fixture()
def small_sets(monkeypatch):
    """Held-out sets of two public seeds each, so that a test of the verdicts' words takes seconds (the real sets are
    measured in tests/test_designs.py)."""
    from minikv.grading.checks.held_out import HeldOutSet

    monkeypatch.setattr(ex, "HELD_OUT", {family: HeldOutSet(f"ex06-{family}-test", (0, 1), "workloads")
                                         for family in ex.HELD_OUT})


def test_the_solution_passes_every_check_and_says_what_it_measured():
    results = run_checks(ex.CHECKS, namespace("solutions"))
    assert all(r.passed for r in results), [(r.name, r.message) for r in results if not r.passed]
    short, mixed = (r.message for r in results if r.name.startswith("beats the baseline"))
    assert short.startswith("on held-out set ex06-short-v1 (16 seeds, 10 workloads of short requests at once each)")
    assert "the baseline's recomputed tokens" in short and "the target is <= 0.90x" in short, short
    assert mixed.startswith("on held-out set ex06-mixed-v1 (16 seeds, 20 workloads") and "<= 0.85x" in mixed, mixed
    assert "its forward passes" in mixed and "the target is <= 1.10x" in mixed, mixed


def test_the_untouched_exercise_is_not_implemented_in_every_check():
    ns = namespace("exercises")
    for check in ex.CHECKS:
        with pytest.raises(NotImplementedYet, match="not implemented yet"):
            check(ns)


@pytest.mark.parametrize("family", ["short", "mixed"])
def test_the_lectures_policy_is_the_baseline(family):
    m = ex.objective(lecture_admit, lecture_victim, 0, family=family)
    assert (m["recomputed"], m["steps"]) == (m["base_recomputed"], m["base_steps"])  # it is the baseline


@pytest.mark.parametrize("check, family", [(ex.check_beats_the_baseline_on_short_requests_at_once, "short"),
                                           (ex.check_beats_the_baseline_with_long_prompts_among_short_ones, "mixed")])
def test_the_lectures_policy_fails_the_objective_checks_with_the_line_that_reproduces_it(check, family, small_sets):
    ns = {"my_admit": lecture_admit, "my_victim": lecture_victim}
    with pytest.raises(AssertionError) as failed:
        check(ns)
    said = str(failed.value)
    target = f"{ex.MAX_RECOMPUTED[family]:.2f}"
    assert f"on held-out set ex06-{family}-test" in said and "1.000x the baseline's recomputed tokens" in said, said
    assert f"the target is <= {target}x" in said and "Too many recomputed tokens" in said, said
    assert f"objective(my_admit, my_victim, seed=0, family={family!r}) reproduces it" in said, said


def test_admitting_only_into_an_empty_engine_misses_the_step_bound(small_sets):
    def one_at_a_time(chunk, budget, need, free, running, block_size):
        return chunk <= budget and need <= free and not running

    passed, said = ex.objective_verdict(ex.held_out_measurement(one_at_a_time, lecture_victim, "short"))
    assert not passed and "Too many forward passes" in said and "the target is <= 1.10x" in said, said


def test_the_old_transcribed_answer_misses_the_objective(small_sets):
    passed, said = ex.objective_verdict(ex.held_out_measurement(old_ref_admit, old_ref_victim, "short"))
    assert not passed, said


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
