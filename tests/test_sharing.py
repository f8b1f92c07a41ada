"""The sharing simulator (minikv.sim.sharing) and `python -m minikv bench prefix`: mechanism-level
assertions (more samples share more, beams share most, a warm system prompt skips what its full
blocks hold, a bigger pool never hits less), not figures to the decimal."""

import json

import numpy as np
import pytest

from minikv.__main__ import main
from minikv.bench.prefix import table
from minikv.blocks import blocks_for
from minikv.sim.sharing import (
    Job,
    beam_parents,
    beam_trace,
    expected_system_prompt_skip,
    few_shot_trace,
    multi_turn_trace,
    parallel_trace,
    replay,
    system_prompt_trace,
)


def fork_saving(kind: str, width: int, requests: int = 60) -> float:
    make = parallel_trace if kind == "parallel" else beam_trace
    return replay(make("alpaca", width, requests, rate=1.0), enable_prefix_caching=False).memory_saved


def test_more_parallel_samples_share_more():
    s2, s4 = fork_saving("parallel", 2), fork_saving("parallel", 4)
    assert 0 < s2 < s4 < 0.25  # only the prompt's full blocks are shared, and Alpaca prompts are short


def test_beam_search_saves_most_and_within_a_band():
    saves = [fork_saving("beam", w) for w in (2, 4, 6)]
    assert saves == sorted(saves)
    # width w can save at most (w - 1) / w; the paper measured 37.6-55.2% for widths 2-6
    assert 0.30 < saves[0] < 0.5 and 0.45 < saves[1] < 0.75 and saves[2] < 5 / 6
    assert fork_saving("parallel", 4) < saves[1]


def test_unshared_accounting_is_exact_without_sharing():
    # one sample, no beams: nothing is shared, so blocks owned == blocks the sequences need
    jobs = [Job(i, i, 40 + i, (30,)) for i in range(5)]
    r = replay(jobs, enable_prefix_caching=False, num_blocks=64)
    assert r.memory_saved == 0 and (r.used == r.unshared).all() and r.finished == 5


def test_two_samples_share_exactly_the_prompts_full_blocks():
    # prompt 40 tokens (2 full blocks of 16 + 8), two samples of 10 tokens: 2 blocks shared each step
    r = replay([Job(0, 0, 40, (10, 10))], enable_prefix_caching=False, num_blocks=64)
    saved = (r.unshared - r.used).tolist()
    assert saved[0] == 3  # admitted and forked: the partial tail is shared too, until someone writes
    assert set(saved[1:]) == {2}
    assert r.cow_copies == 1  # the prompt's partial tail: copied by the first writer only
    assert r.unshared[0] == 2 * blocks_for(41, 16)


def test_beam_parents_picks_the_best_candidates():
    rng = np.random.default_rng(0)
    parents, scores = beam_parents(np.array([0.0, -100.0]), 2, rng, spread=0.0)
    assert parents.tolist() == [0, 0]  # the far worse beam has no survivor
    assert (np.diff(scores) <= 0).all()


def test_system_prompt_skip_matches_its_full_blocks():
    r = replay(system_prompt_trace(40))
    first_misses = 1 / 40  # the first conversation computes the system prompt
    want = expected_system_prompt_skip(1000, 125) * (1 - first_misses)
    assert r.prefill_skipped == pytest.approx(want, abs=0.02)
    assert r.memory_saved > 0.3 and r.finished == 40 and r.preemptions == 0


def test_few_shot_prompts_hit():
    r = replay(few_shot_trace(60))
    assert r.prefill_skipped > 0.5 and r.finished == 60


def test_eviction_curve_rises_with_the_pool():
    rates = [replay(multi_turn_trace(12), num_blocks=n).hit_rate for n in (160, 400, 800, 3000)]
    assert all(b >= a - 0.02 for a, b in zip(rates, rates[1:])), rates
    assert rates[-1] > 0.5 > rates[0], rates
    assert replay(multi_turn_trace(12), num_blocks=3000).evictions == 0


def test_a_job_too_big_for_the_pool_is_refused_clearly():
    with pytest.raises(ValueError, match="give the replay more blocks"):
        replay([Job(0, 0, 500, (10, 10))], num_blocks=8)


def test_bench_prefix_json(capsys):
    assert main(["bench", "prefix", "--json", "--requests", "20"]) == 0
    report = json.loads(capsys.readouterr().out)
    for key in ("parallel_sampling_saving", "beam_search_saving", "system_prompt_prefill_skipped", "hit_rate"):
        assert 0 < report[key] < 1, key
    assert report["beam_search_saving"] > report["parallel_sampling_saving"]
    assert set(report["beam_search_savings"]["sharegpt"]) == {"2", "4", "6"}
    assert report["system_prompt_prefill_skipped"] == pytest.approx(report["system_prompt_expected_skip"], abs=0.06)
    text = table(report)
    assert "beam width 4" in text and "eviction curve" in text and "Kwon" in text


def test_pictures_of_shared_walls_draw():
    from matplotlib.figure import Figure

    from minikv.prefix import BlockManager
    from minikv.viz import (
        cow_figure,
        eviction_curve_figure,
        hash_chain_figure,
        shared_memory_map,
        sharing_savings_figure,
    )

    bm = BlockManager(12, 4)
    for i, q in enumerate([[1, 2, 3], [4, 5, 6, 7, 8]]):
        bm.open(i, list(range(10, 18)) + q)
        bm.append(i, list(range(10, 18))[bm.num_tokens(i):] + q)
    bm.fork(0, "0b")
    bm.append("0b", [9])
    figs = [shared_memory_map(bm, copies=bm.take_copies()), hash_chain_figure(bm), cow_figure(),
            eviction_curve_figure([{"num_blocks": 10, "hit_rate": 0.1, "evictions": 5},
                                   {"num_blocks": 20, "hit_rate": 0.6, "evictions": 0}]),
            sharing_savings_figure({"parallel": {2: 0.05, 4: 0.08}, "beam": {2: 0.4, 4: 0.55}},
                                   {"parallel": (0.061, 0.098)})]
    assert all(isinstance(f, Figure) for f in figs)
    assert "2 shared" in figs[0].axes[0].get_title()  # blocks 0 and 1 (the shared prompt blocks)
