"""Every figure the notebooks draw with minikv.viz is readable where a learner sees it.

Each figure function the notebooks call is drawn here with inputs shaped like the notebooks' (pool
sizes, block sizes, numbers of sequences), and ``minikv.viz.style.text_sizes_px`` measures the
smallest text as displayed: the PNG Jupyter's inline backend makes (the figure's dpi, cropped
tight), shown at most ``DISPLAY_WIDTH_PX`` = 968 px wide, which is JupyterLab 4.6's output width at
a 1,400 px window with the file browser open (measured in Chromium by tests/test_browser.py's run).
The smallest text must be at least ``MIN_TEXT_PX`` = 9 px (its em size, points x dpi / 72 x the
shrink). Figures drawn inline by a notebook's own cells are not covered here.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from minikv import viz
from minikv.viz.style import DISPLAY_WIDTH_PX, MIN_TEXT_PX, text_sizes_px


def _trace_results():
    from minikv.sim.memory import compare
    from minikv.sim.traces import make_trace

    return compare(make_trace("sharegpt", 120, seed=1))


def _block_tables(num_blocks: int, block_size: int, lengths):
    from minikv.blocks import BlockAllocator, BlockTable

    pool = BlockAllocator(num_blocks)
    tables = {}
    for name, n in lengths.items():
        tables[name] = BlockTable(block_size, pool)
        tables[name].append_tokens(n)
    return tables


def _shared_pool(num_blocks: int, beams: int):
    """A beam search's pool (notebook 05): one prompt, forks that share it, diverging tails."""
    from minikv.prefix import BlockManager

    bm = BlockManager(num_blocks, 16)
    prompt = list(range(1, 41))
    bm.open("beam 0", prompt)
    bm.append("beam 0", prompt)
    for b in range(1, beams):
        bm.fork("beam 0", f"beam {b}")
    rng = random.Random(0)
    for step in range(40):
        for b in range(beams):
            bm.append(f"beam {b}", [rng.randrange(1000)])
    bm.take_copies()
    return bm


def _steps(n=60, pool=96):
    return [SimpleNamespace(step=i, blocks_used=3 * i % pool, blocks_cached=i % 7, blocks_free=pool - 3 * i % pool,
                            num_running=i % 9, num_waiting=max(0, 20 - i), num_swapped=0, preemptions=int(i % 17 == 0),
                            prefill_tokens=0, decode_tokens=i % 9, duration=0.01, time=float(i)) for i in range(n)]


def _metrics(n, stall_at=None):
    times, t = [], 0.0
    for i in range(n):
        t += 0.133 if i == stall_at else 0.02
        times.append(t)
    return SimpleNamespace(token_times=times, arrival_time=0.0, preemptions=int(stall_at is not None))


FIGURES = {
    # notebook 02, 03
    "memory_map": lambda: viz.memory_map(_trace_results()["contiguous max"]),
    "waste_breakdown": lambda: viz.waste_breakdown(_trace_results()),
    "occupancy_plot": lambda: viz.occupancy_plot(_trace_results()["contiguous max"]),
    # notebook 03: section 1's three sequences in blocks of 4, then SmolLM2's cache in blocks of 16
    "block_tables_figure, blocks of 4": lambda: viz.block_tables_figure(
        _block_tables(12, 4, {"A": 7, "B": 10, "C": 8}), 12, 4, title="Block tables"),
    "block_tables_figure, SmolLM2's paged cache": lambda: viz.block_tables_figure(
        _block_tables(24, 16, {f"row {i}": n for i, n in enumerate((41, 41, 41))}), 24, 16,
        title="SmolLM2's paged cache: 9 of 24 blocks of 16 slots in use"),
    # notebook 04
    "split_kv_figure": lambda: viz.split_kv_figure(num_blocks=9, num_splits=3),
    # notebook 05
    "shared_memory_map, the pool after the beam search": lambda: viz.shared_memory_map(
        _shared_pool(64, 4), title="the pool after the beam search: the beams' shared walls"),
    "shared_memory_map, a small pool": lambda: viz.shared_memory_map(_shared_pool(16, 2)),
    "hash_chain_figure": lambda: viz.hash_chain_figure(_shared_pool(24, 3)),
    "cow_figure": lambda: viz.cow_figure(),
    "beam_sharing_plot": lambda: viz.beam_sharing_plot([(i, 3 + i // 4, 3 + i) for i in range(40)], title="4 beams"),
    "sharing_savings_figure": lambda: viz.sharing_savings_figure(
        {"parallel": {2: 0.05, 4: 0.08}, "beam": {2: 0.3, 4: 0.45}},
        {"parallel": (0.061, 0.099), "beam": (0.376, 0.553)},
        title="Alpaca-shaped trace: memory saved by sharing, vs Kwon et al. 2023"),
    "paper_comparison_figure": lambda: viz.paper_comparison_figure(
        {w: {"parallel": {2: 0.05, 4: 0.08, 6: 0.09}, "beam": {2: 0.3, 4: 0.45, 6: 0.5}}
         for w in ("alpaca", "sharegpt")},
        {w: {"parallel": (0.061, 0.099), "beam": (0.376, 0.553)} for w in ("alpaca", "sharegpt")}),
    "eviction_curve_figure": lambda: viz.eviction_curve_figure(
        [{"num_blocks": n, "hit_rate": min(0.9, n / 400), "evictions": max(0, 2000 - 5 * n)}
         for n in range(50, 450, 50)]),
    # notebook 06
    "batching_figure": lambda: viz.batching_figure([5, 12, 3, 9, 7, 14, 4, 6], batch_size=4),
    "scheduler_states_figure": lambda: viz.scheduler_states_figure(),
    "step_throughput_figure": lambda: viz.step_throughput_figure(
        {f"context {c}": {b: 0.02 + 0.001 * b * c / 64 for b in (1, 2, 4, 8, 16, 32)} for c in (64, 512)}),
    "engine_occupancy_figure": lambda: viz.engine_occupancy_figure(_steps()),
    "throughput_bars": lambda: viz.throughput_bars({"transformers static generate (batches of 8)": 40.0,
                                                   "minikv LLM.generate": 95.0}, title="32 requests"),
    "token_timeline_figure": lambda: viz.token_timeline_figure(
        {"request 3 (never preempted)": _metrics(16), "request 9 (victim)": _metrics(16, stall_at=14)},
        title="recompute preemption: the victim waits, then re-prefills its past"),
}


@pytest.mark.parametrize("name", list(FIGURES))
def test_smallest_text_is_readable_at_the_notebook_width(name):
    sizes = text_sizes_px(FIGURES[name]())
    assert sizes["smallest_px"] >= MIN_TEXT_PX, (
        f"{name}: {sizes['text']!r} at {sizes['smallest_pt']} pt shows {sizes['smallest_px']} px tall "
        f"(PNG {sizes['width_px']} px wide, shown at {DISPLAY_WIDTH_PX} px: x{sizes['scale']})")


def test_the_measure_sees_a_shrunk_figure():
    from matplotlib.figure import Figure

    fig = Figure(figsize=(19.36, 3))  # twice the notebook's width: its text shows at half size
    fig.text(0, 0.5, "left", fontsize=12)
    fig.text(1, 0.5, "right", fontsize=12, ha="right")
    sizes = text_sizes_px(fig)
    assert abs(sizes["scale"] - 0.5) < 0.02 and abs(sizes["smallest_px"] - 12 * 100 / 72 / 2) < 0.3


@pytest.mark.parametrize("stall_at", [3, 14])  # a peak early, and one by the right edge (notebook 06's 133 ms)
def test_token_timeline_peak_labels_stay_inside_their_plot(stall_at):
    fig = viz.token_timeline_figure({"steady": _metrics(16), "victim": _metrics(16, stall_at=stall_at)})
    fig.draw_without_rendering()
    renderer = fig._get_renderer()
    gaps = fig.axes[1]
    box = gaps.get_window_extent(renderer)
    labels = [t for t in gaps.texts if t.get_text().endswith(" ms")]
    assert labels
    for label in labels:
        b = label.get_window_extent(renderer)
        inside = box.padded(-3)  # clear of the frame by 3 px, not touching or crossing it
        assert inside.x0 <= b.x0 and b.x1 <= inside.x1 and inside.y0 <= b.y0 and b.y1 <= inside.y1, (label, b, box)
