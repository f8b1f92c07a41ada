"""The KV memory simulator, its traces, pictures and `bench memory`.

The accounting must add up at every step under every policy; first-fit must make real
holes; paging must waste only each sequence's last block; every request must leave the
system (finished, or rejected with a reason); and the default run must reproduce the
paper's bands by mechanism.
"""

import json
from collections import defaultdict

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minikv.sim.memory import PARTS, StepCost, compare, simulate
from minikv.sim.policies import ContiguousMax, ContiguousOracle, ContiguousPow2, Paged
from minikv.sim.traces import WORKLOADS, TraceRequest, load_trace, make_trace

POLICIES = {
    "max": lambda bs: ContiguousMax(),
    "pow2": lambda bs: ContiguousPow2(),
    "oracle": lambda bs: ContiguousOracle(),
    "paged": lambda bs: Paged(bs),
}


def check_books(result, n_requests, block_size=None):
    """Everything the simulator claims, checked from the outside at every step."""
    tl = result.timeline
    assert (sum(tl[p] for p in PARTS) == result.budget).all()
    assert all((tl[p] >= 0).all() for p in PARTS)
    assert tl["finished"].sum() + len(result.rejected) == n_requests  # nothing lost
    assert tl["running"][-1] == 0 and tl["waiting"][-1] == 0
    for step in range(result.steps):
        segs = result.snapshot(step)
        # The address-space snapshot agrees with the per-step books ...
        for part in ("live", "reserved", "internal"):
            assert sum(getattr(s, part) for s in segs) == tl[part][step], (step, part)
        assert len({s.seq_id for s in segs}) == tl["running"][step]
        # ... and no two pieces of memory overlap or leave the budget.
        end = 0
        for s in segs:
            assert s.offset >= end and s.size > 0
            end = s.offset + s.size
        assert end <= result.budget
        if block_size is not None:  # paged: only the last block of a sequence is not full
            by_seq = defaultdict(list)
            for s in segs:
                by_seq[s.seq_id].append(s)
            for pieces in by_seq.values():
                pieces.sort(key=lambda s: s.live, reverse=True)
                assert sum(s.size - s.live for s in pieces) < block_size
                assert sum(1 for s in pieces if s.live < s.size) <= 1


requests = st.lists(st.tuples(st.integers(0, 15), st.integers(1, 40), st.integers(1, 40)),
                    min_size=1, max_size=12)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=requests, budget=st.integers(4, 160), max_seq_len=st.integers(2, 96),
       block_size=st.sampled_from([1, 2, 3, 4, 8, 16]), policy=st.sampled_from(sorted(POLICIES)))
def test_accounting_adds_up_for_random_traces(reqs, budget, max_seq_len, block_size, policy):
    trace = [TraceRequest(i, a, p, o) for i, (a, p, o) in enumerate(reqs)]
    result = simulate(trace, POLICIES[policy](block_size), budget, max_seq_len=max_seq_len)
    check_books(result, len(trace), block_size if policy == "paged" else None)
    for rid, why in result.rejected:  # a rejection is explained, and only for a real reason
        assert why
        r = trace[rid]
        assert r.total_len > max_seq_len or r.total_len > budget or (policy == "max" and max_seq_len > budget) \
            or (policy == "paged" and -(-r.total_len // block_size) > budget // block_size)


def test_first_fit_leaves_holes_that_block_a_request():
    """A and C finish, leaving holes of 4 and 3 around B: 7 free, yet D (5) must wait."""
    trace = [TraceRequest(0, 0, 3, 1),  # A: slab [0, 4), finishes at step 1
             TraceRequest(1, 0, 1, 2),  # B: slab [4, 7), finishes at step 2
             TraceRequest(2, 0, 2, 1),  # C: slab [7, 10), finishes at step 1
             TraceRequest(3, 0, 4, 1)]  # D: needs 5
    slabs = simulate(trace, ContiguousOracle(), 10)
    assert [(s.seq_id, s.offset, s.size) for s in slabs.snapshot(0)] == [(0, 0, 4), (1, 4, 3), (2, 7, 3)]
    t = slabs.timeline
    assert (t["running"][1], t["waiting"][1]) == (1, 1)  # D waits with 7 tokens free
    assert t["external"][1] == 7 and t["free"][1] == 0
    assert t["external"][0] == 0  # at step 0 memory is simply full: not fragmentation
    assert [(s.seq_id, s.offset) for s in slabs.snapshot(2)] == [(3, 0)]
    # Blocks have no holes: the same trace admits D as soon as 5 tokens are free.
    paged = simulate(trace, Paged(1), 10)
    assert paged.timeline["waiting"][1] == 0 and 3 in {s.seq_id for s in paged.snapshot(1)}
    assert paged.timeline["external"].sum() == 0


def test_pow2_doubles_by_reallocation():
    trace = [TraceRequest(0, 0, 3, 12)]  # grows 3 -> 15 tokens
    r = simulate(trace, ContiguousPow2(), 64, max_seq_len=32)
    sizes = [r.snapshot(step)[0].size for step in range(r.steps - 1)]
    assert sizes[0] == 4 and sorted(set(sizes)) == [4, 8, 16]  # next power of two, then doubling
    assert r.counters["reallocations"] == 2
    capped = simulate([TraceRequest(0, 0, 3, 8)], ContiguousPow2(), 12, max_seq_len=32)
    # live = 3 + step: the slab is 4 until token 5 arrives (step 2), 8 until token 9 (step 6),
    # then 12, the budget, since 16 would not fit.
    assert [capped.snapshot(step)[0].size for step in (0, 1, 2, 5, 6, 7)] == [4, 4, 8, 8, 12, 12]
    assert simulate(trace, ContiguousPow2(), 12, max_seq_len=32).rejected[0][0] == 0  # 15 tokens never fit


def test_growth_without_room_preempts_the_youngest_and_still_finishes():
    trace = [TraceRequest(i, 0, 8, 24) for i in range(4)]  # 4 x 32 tokens, budget for 2.5 of them
    r = simulate(trace, Paged(4), 80)
    assert r.preemptions > 0
    check_books(r, len(trace), 4)
    assert r.timeline["finished"].sum() == 4


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=requests, budget=st.integers(8, 120), policy=st.sampled_from(sorted(POLICIES)))
def test_work_is_charged_for_what_each_policy_did(reqs, budget, policy):
    """Every output token is decoded once; every admitted prompt is prefilled once; a preempted
    sequence is recomputed (prompt + output so far) each time it comes back; copies are the slab moves."""
    trace = [TraceRequest(i, a, p, o) for i, (a, p, o) in enumerate(reqs)]
    r = simulate(trace, POLICIES[policy](4), budget, max_seq_len=64)
    tl, done = r.timeline, {i for i in range(len(trace))} - {i for i, _ in r.rejected}
    assert tl["decoded"].sum() == sum(trace[i].output_len for i in done)
    assert tl["prefilled"].sum() == sum(trace[i].prompt_len for i in done)
    assert (tl["recomputed"].sum() > 0) == (r.preemptions > 0)
    assert tl["copied"].sum() == r.counters.get("copied_tokens", 0)


def test_timing_charges_recompute_and_copies():
    # One request, 4 prompt + 3 output tokens, on a toy GPU where a decode step reads 1 GB at 1 GB/s
    # (1 s, plus 1 ms per live token) and a prefill token costs 2 x 1e9 FLOPs at 2 GFLOP/s (1 s).
    toy = StepCost(weight_bytes=10**9, num_params=10**9, bandwidth_gb_s=1, fp16_tflops=2e-3, prefill_efficiency=1)
    r = simulate([TraceRequest(0, 0, 4, 3)], Paged(4), 16, bytes_per_token=10**6)
    t = r.timing(toy)
    assert t["prefill_s"] == pytest.approx(4) and t["recompute_s"] == 0 == t["copy_s"]
    # the three decode steps attend over 4 + 1, 4 + 2 and 4 + 3 tokens
    assert t["decode_s"] == pytest.approx(3 + (5 + 6 + 7) * 1e-3) and t["tokens"] == 3
    assert t["tokens_per_s"] == pytest.approx(3 / (4 + 3 + 18e-3))
    # Under pressure pow2 preempts and moves slabs: charging that makes it slower than counting steps says
    pow2 = simulate(make_trace("sharegpt", 200, seed=3), ContiguousPow2())
    t = pow2.timing()
    assert pow2.preemptions > 0 and t["recompute_s"] > 0 and t["copy_s"] > 0
    assert t["tokens_per_s"] < t["uncharged_tokens_per_s"]
    assert t["seconds"] == pytest.approx(t["decode_s"] + t["prefill_s"] + t["recompute_s"] + t["copy_s"])


def test_impossible_requests_are_rejected_with_a_reason_not_stalled():
    trace = [TraceRequest(0, 0, 10, 10), TraceRequest(1, 0, 200, 10), TraceRequest(2, 1, 5, 5),
             TraceRequest(3, 2, 40, 40)]
    for policy in (ContiguousOracle(), ContiguousPow2(), Paged(16)):
        r = simulate(trace, policy, 100, max_seq_len=64)
        reasons = dict(r.rejected)
        assert set(reasons) == {1, 3}
        assert "max_seq_len" in reasons[1] and "max_seq_len" in reasons[3]
        assert r.timeline["finished"].sum() == 2
    big = simulate([TraceRequest(0, 0, 90, 20)], Paged(16), 100, max_seq_len=2048)
    assert "blocks" in big.rejected[0][1]
    whole = simulate(trace, ContiguousMax(), 100, max_seq_len=128)  # a slab larger than memory
    assert len(whole.rejected) == 4 and all("max_seq_len slab" in dict(whole.rejected)[i] for i in (0, 2, 3))


def test_budget_in_bytes():
    trace = make_trace("alpaca", 20, seed=1)
    a = simulate(trace, Paged(16), budget_bytes=100 * 1000, bytes_per_token=1000)
    assert a.budget == 100


def test_default_run_lands_in_the_papers_bands():
    results = compare(make_trace("sharegpt", 1000, seed=0))  # the bench's default trace
    util = {name: r.utilization for name, r in results.items()}
    assert 0.20 <= util["contiguous max"] <= 0.38
    assert util["paged (block 16)"] >= 0.96
    assert util["contiguous max"] < util["contiguous oracle"] < util["paged (block 16)"]
    cmax = results["contiguous max"].summary()
    assert cmax["peak_concurrent"] == 15728 // 2048  # 7 worst-case slabs fit in 12 GiB
    assert cmax["free"] == pytest.approx((15728 - 7 * 2048) / 15728, abs=1e-9)  # the stranded tail


# ---- traces -----------------------------------------------------------------------------

def test_synthetic_traces_match_the_published_means_and_are_seeded():
    for name, w in WORKLOADS.items():
        trace = make_trace(name, 20000, seed=3)
        prompts = np.array([r.prompt_len for r in trace])
        outputs = np.array([r.output_len for r in trace])
        assert prompts.mean() == pytest.approx(w.mean_prompt, rel=0.05)
        assert outputs.mean() == pytest.approx(w.mean_output, rel=0.05)
        assert prompts.min() >= 1 and outputs.min() >= 1 and (prompts + outputs).max() <= 2048
    a, b = make_trace("sharegpt", 50, seed=7), make_trace("sharegpt", 50, seed=7)
    assert a == b and a != make_trace("sharegpt", 50, seed=8)
    arrivals = [r.arrival for r in make_trace("sharegpt", 2000, seed=0, rate=0.5)]
    assert arrivals == sorted(arrivals) and arrivals[-1] == pytest.approx(4000, rel=0.1)
    assert {r.arrival for r in make_trace("alpaca", 10, rate=None)} == {0}
    with pytest.raises(ValueError, match="unknown workload"):
        make_trace("wikipedia", 5)


def test_load_trace_csv_and_jsonl(tmp_path):
    csv_path = tmp_path / "t.csv"
    csv_path.write_text("prompt_len,output_len,arrival\n10,5,3\n20,7,0\n")
    trace = load_trace(csv_path)
    assert [(r.id, r.arrival, r.prompt_len, r.output_len) for r in trace] == [(1, 0, 20, 7), (0, 3, 10, 5)]
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text('{"prompt_len": 4, "output_len": 2}\n\n{"prompt_len": 6, "output_len": 1.0}\n')
    assert [(r.arrival, r.total_len) for r in load_trace(jsonl)] == [(0, 6), (0, 7)]
    assert load_trace(jsonl, rate=0.5, seed=1)[-1].arrival >= 0


@pytest.mark.parametrize("name,text,match", [
    ("a.csv", "prompt,output_len\n1,2\n", r"missing column\(s\) \['prompt_len'\]"),
    ("b.csv", "prompt_len,output_len\n1,\n", r"b.csv:2: missing \['output_len'\]"),
    ("c.csv", "prompt_len,output_len\nten,2\n", "not a number"),
    ("d.csv", "prompt_len,output_len\n3,0\n", "output_len=.* must be a whole number >= 1"),
    ("e.csv", "prompt_len,output_len,arrival\n3,2,-1\n", "arrival=.* >= 0"),
    ("f.csv", "prompt_len,output_len\n2.5,2\n", "whole number"),
    ("g.jsonl", '{"prompt_len": 3, "output_len": 2}\n{oops\n', r"g.jsonl:2: not valid JSON"),
    ("h.jsonl", "[1, 2]\n", "expected a JSON object"),
    ("i.jsonl", "\n", "no requests"),
    ("j.txt", "1,2\n", "unknown trace format"),
])
def test_load_trace_bad_input(tmp_path, name, text, match):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        load_trace(path)


def test_load_trace_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no trace file"):
        load_trace(tmp_path / "nope.csv")


# ---- bench memory -----------------------------------------------------------------------

def test_bench_memory_json_defaults(capsys):
    from minikv.bench.memory import cli

    assert cli(["--json", "--no-progress"]) == 0
    report = json.loads(capsys.readouterr().out)
    for key in ("contiguous_utilization", "paged_utilization", "max_concurrent_contiguous",
                "max_concurrent_paged", "policies", "settings"):
        assert key in report
    assert 0.20 <= report["contiguous_utilization"] <= 0.38
    assert report["paged_utilization"] >= 0.96
    assert report["max_concurrent_paged"] / report["max_concurrent_contiguous"] >= 2
    assert report["mean_concurrent_paged"] / report["mean_concurrent_contiguous"] >= 2
    assert set(report["policies"]) == {"contiguous_max", "contiguous_pow2", "contiguous_oracle", "paged"}
    for summary in report["policies"].values():
        assert sum(summary[p] for p in PARTS) == pytest.approx(1.0)
        assert summary["finished"] + summary["rejected"] == report["settings"]["requests"]
    assert report["settings"]["budget_tokens"] == 15728 and report["settings"]["block_size"] == 16


def test_bench_memory_table_from_a_file_and_errors(tmp_path, capsys):
    from minikv.bench.memory import cli

    path = tmp_path / "mine.csv"
    path.write_text("prompt_len,output_len\n" + "".join(f"{10 + i},{20 + i}\n" for i in range(30)))
    assert cli(["--trace", str(path), "--budget-tokens", "400", "--max-seq-len", "128",
                "--block-size", "8", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "contiguous max" in out and "paged (block 8)" in out and "30 requests" in out
    assert cli(["--trace", str(tmp_path / "missing.csv"), "--no-progress"]) == 2
    assert "no trace file" in capsys.readouterr().err


# ---- pictures ---------------------------------------------------------------------------

def test_figures_draw(tmp_path):
    from matplotlib.figure import Figure

    from minikv import viz
    from minikv.sim.memory import sweep_block_sizes

    trace = make_trace("sharegpt", 40, seed=2)
    results = compare(trace, budget_tokens=4096)
    figs = [viz.memory_map(r) for r in results.values()]
    figs += [viz.occupancy_plot(results["contiguous max"]), viz.waste_breakdown(results),
             viz.block_size_plot(sweep_block_sizes(trace, sizes=(8, 32), budget_tokens=4096))]
    assert all(isinstance(f, Figure) for f in figs)
    # the running count has its own axes below the bands (or a dashed twin line on a given ax)
    assert len(viz.occupancy_plot(results["contiguous max"]).axes) == 2
    ax = Figure().add_subplot()
    assert len(viz.occupancy_plot(results["contiguous max"], ax=ax).axes) == 2
    # outline_last outlines exactly the blocks that are not full: one per sequence at most
    paged = results["paged (block 16)"]
    step = viz.default_step(paged)
    outlined = viz.memory_map(paged, step, outline_last=True).axes[0].collections[-1]
    partial = [s for s in paged.snapshot(step) if s.live < s.size]
    assert len(outlined.get_paths()) >= len(partial) > 0
    assert len(partial) <= paged.timeline["running"][step]
    widget = viz.memory_map_widget(paged, outline_last=True)
    bundle = widget._repr_mimebundle_()
    assert "image/png" in bundle and "application/vnd.jupyter.widget-view+json" in bundle
    first = widget.png
    widget.slider.value = 1
    assert widget.png != first


def test_a_context_too_short_for_the_workload_is_refused():
    from minikv.sim.traces import make_trace

    with pytest.raises(ValueError, match="max_seq_len=256 is too short for sharegpt"):
        make_trace("sharegpt", 10, max_seq_len=256)
