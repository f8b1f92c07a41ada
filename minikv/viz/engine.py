"""Stage 6's pictures (the engine): ``batching_figure`` (static batching's idle seats vs continuous
batching), ``engine_occupancy_figure`` (blocks and queues over engine steps), ``token_timeline_figure``
(a preempted request's latency wobble), ``throughput_bars``, ``scheduler_states_figure`` (a request's
states in the scheduler, a map for reading its code), ``step_throughput_figure`` (a decode step's
throughput against its batch, per context length). They read only attributes (duck typing),
so a notebook can also draw hand-made or simulated data."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle
from matplotlib.ticker import FuncFormatter

from minikv.viz.style import COLORS, axes, seq_color


def batch_slots(output_lengths: Sequence[int], batch_size: int, continuous: bool) -> np.ndarray:
    """Who occupies each seat of a batch at each step: a [steps, batch_size] array of request
    indices, or -1 for an empty seat; a request that is done but still seated (static batching
    runs every batch to its longest request) is stored as ``-2 - index``.

    Static: requests go in batches of ``batch_size`` in order; a batch ends when its longest
    request ends. Continuous: a seat is refilled with the next request the step after its
    request finishes. Every request needs ``output_lengths[i]`` steps (prefill counted as one)."""
    lengths = [int(n) for n in output_lengths]
    if batch_size < 1 or any(n < 1 for n in lengths):
        raise ValueError(f"batch_size and every length must be >= 1, got {batch_size} and {lengths}")
    rows: list[list[int]] = []
    if not continuous:
        for first in range(0, len(lengths), batch_size):
            batch = list(range(first, min(first + batch_size, len(lengths))))
            for t in range(max(lengths[i] for i in batch)):
                row = [(i if t < lengths[i] else -2 - i) for i in batch]
                rows.append(row + [-1] * (batch_size - len(row)))
        return np.array(rows, dtype=int).reshape(-1, batch_size)
    seats: list[list[int]] = [[-1, 0] for _ in range(batch_size)]  # (request, steps left)
    queue = list(range(len(lengths)))
    while queue or any(s[0] >= 0 for s in seats):
        for s in seats:
            if s[0] < 0 and queue:
                i = queue.pop(0)
                s[0], s[1] = i, lengths[i]
        rows.append([s[0] for s in seats])
        for s in seats:
            if s[0] >= 0:
                s[1] -= 1
                if s[1] == 0:
                    s[0] = -1
    return np.array(rows, dtype=int).reshape(-1, batch_size)


def batching_figure(output_lengths: Sequence[int], batch_size: int = 4) -> Figure:
    """Static batching's idle seats next to continuous batching, for the same requests.

    Each row is a seat of the batch, each column a step (one forward pass). A coloured cell is a
    request computing a token; a hatched grey cell is a request that is already done but keeps its
    seat (and its KV memory) until the longest request of its batch ends. Both runs pay one
    forward pass per column, so fewer columns is higher throughput."""
    fig = Figure(figsize=(10, 1.6 + 0.9 * batch_size), layout="constrained")
    axes = fig.subplots(2, 1, sharex=True)
    grids = {mode: batch_slots(output_lengths, batch_size, mode) for mode in (False, True)}
    width = max(g.shape[0] for g in grids.values())
    for ax, continuous in zip(axes, (False, True)):
        grid = grids[continuous]
        busy = int((grid >= 0).sum())
        idle = int((grid <= -2).sum())
        for t, row in enumerate(grid):
            for seat, r in enumerate(row):
                if r >= 0:
                    ax.add_patch(Rectangle((t, seat), 1, 0.9, color=seq_color(r), lw=0))
                elif r <= -2:
                    ax.add_patch(Rectangle((t, seat), 1, 0.9, facecolor="#dddddd", hatch="///",
                                           edgecolor="#999999", lw=0))
        # label each request once, at its first step
        seen = set()
        for t, row in enumerate(grid):
            for seat, r in enumerate(row):
                if r >= 0 and r not in seen:
                    seen.add(r)
                    ax.text(t + 0.2, seat + 0.45, f"r{r}", va="center", fontsize=7, color="white", weight="bold")
        ax.set_xlim(0, width)
        ax.set_ylim(batch_size, 0)
        ax.set_yticks(np.arange(batch_size) + 0.45, [f"seat {s}" for s in range(batch_size)], fontsize=8)
        name = "continuous batching" if continuous else "static batching"
        ax.set_title(f"{name}: {grid.shape[0]} steps; {busy} seat-steps computing, {idle} done but still "
                     f"seated ({idle / max(busy + idle, 1):.0%} idle)", fontsize=10, loc="left")
    axes[-1].set_xlabel("step (one forward pass of the whole batch)")
    axes[0].legend(handles=[Patch(facecolor="#dddddd", hatch="///", edgecolor="#999999",
                                  label="done, still holding its seat and KV memory")],
                   loc="lower right", bbox_to_anchor=(1, 1.12), fontsize=8, frameon=False)
    return fig


def engine_occupancy_figure(steps: Sequence, title: str = "") -> Figure:
    """The engine's occupancy timeline from its per-step metrics (``engine.stats(history=None).steps``).

    Top: the block pool at every step, stacked: blocks held by running sequences, free blocks that
    still hold a cached prefix (evictable), never-used free blocks. Bottom: sequences running,
    waiting and swapped out; a red tick marks each step that preempted someone."""
    if not steps:
        raise ValueError("no steps to draw: run the engine first (engine.stats().steps is empty)")
    x = np.array([s.step for s in steps])
    used = np.array([s.blocks_used for s in steps])
    cached = np.array([s.blocks_cached for s in steps])
    never = np.array([s.blocks_free for s in steps]) - cached  # blocks_free counts the cached ones too
    fig = Figure(figsize=(10, 5.5), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=(3, 2))
    top.stackplot(x, used, cached, never, colors=[COLORS["live"], COLORS["reserved"], COLORS["free"]],
                  labels=["used (held by a sequence)", "cached (free, prefix kept, evictable)", "free (never used)"],
                  linewidth=0)
    top.set_ylim(0, int((used + cached + never).max()))
    top.set_ylabel("blocks")
    top.set_xlim(x[0], x[-1])
    top.legend(loc="lower right", fontsize=8)
    top.set_title(title or f"occupancy: peak {used.max()} of {int((used + cached + never).max())} blocks used",
                  fontsize=10, loc="left")
    for name, color in (("num_running", "black"), ("num_waiting", "tab:orange"), ("num_swapped", "tab:purple")):
        ys = np.array([getattr(s, name) for s in steps])
        if name == "num_swapped" and not ys.any():
            continue
        bottom.step(x, ys, where="post", color=color, lw=1.2, label=name.removeprefix("num_"))
    pre = [s.step for s in steps if s.preemptions]
    if pre:
        bottom.vlines(pre, 0, 1, transform=bottom.get_xaxis_transform(), color="tab:red", lw=0.8, alpha=0.6,
                      label=f"a preemption ({sum(s.preemptions for s in steps)} in all)")
    bottom.set_ylabel("sequences")
    bottom.set_xlabel("engine step")
    bottom.set_ylim(bottom=0)
    bottom.legend(loc="upper right", fontsize=8)
    return fig


def token_timeline_figure(metrics: Mapping[str, object], title: str = "") -> Figure:
    """Per-token timelines of a few requests (label -> ``RequestMetrics``): the latency wobble.

    Left: when each generated token arrived (seconds since the request arrived): a steady request
    climbs a straight staircase, a preempted one stalls and then catches up. Right: the gap before
    each token; a preemption is one tall spike (the victim waits for someone else's blocks and,
    with recompute, re-prefills its past)."""
    fig = Figure(figsize=(10, 3.8), layout="constrained")
    left, right = fig.subplots(1, 2)
    top = 0.0
    for k, (label, m) in enumerate(metrics.items()):
        times = np.array(m.token_times) - m.arrival_time
        if times.size == 0:
            continue
        color = f"C{k}"
        extra = f", preempted {m.preemptions}x" if getattr(m, "preemptions", 0) else ""
        left.step(np.arange(1, times.size + 1), times, where="post", color=color, label=f"{label}{extra}")
        gaps = np.diff(times) * 1e3
        right.plot(np.arange(2, times.size + 1), gaps, ".-", color=color, lw=0.8, ms=3, label=label)
        if gaps.size:
            j = int(gaps.argmax())
            top = max(top, gaps[j])
            late = j + 2 > 0.6 * times.size  # a label near the right edge goes to the peak's left, inside
            right.annotate(f"{gaps[j]:.0f} ms", (j + 2, gaps[j]), textcoords="offset points",
                           xytext=(-5 if late else 5, 3), ha="right" if late else "left", fontsize=8, color=color)
    left.set(xlabel="generated token", ylabel="seconds since arrival", title="token arrival times")
    right.set(xlabel="generated token", ylabel="gap before this token (ms)", title="time between tokens")
    right.set_ylim(0, top * 1.2 or None)  # headroom: the peaks' labels stay inside the plot
    left.legend(fontsize=8)
    left.grid(alpha=0.3)
    right.grid(alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=10)
    return fig


def throughput_bars(results: Mapping[str, float], unit: str = "useful tokens/s", title: str = "") -> Figure:
    """One bar per system (name -> throughput), each labelled with its value and its ratio to the first."""
    names, values = list(results), [float(v) for v in results.values()]
    if not values:
        raise ValueError("no results to draw")
    fig, ax = axes(None, (8, 1.2 + 0.6 * len(names)))
    y = np.arange(len(names))
    ax.barh(y, values, color=[f"C{i}" for i in range(len(names))])
    for yi, v in zip(y, values):
        ax.text(v, yi, f" {v:.1f}  ({v / values[0]:.2f}x)", va="center", fontsize=9)
    ax.set_yticks(y, names)
    ax.invert_yaxis()
    ax.set_xlim(0, max(values) * 1.3)
    ax.set_xlabel(unit)
    ax.set_title(title or f"throughput, ratios to {names[0]}", fontsize=10, loc="left")
    return fig


# A sequence's life in the scheduler: states at (x, y); moves (from, to, label, arc, label's x, y).
# The labels name the part of Scheduler.schedule (1-4) or the helper that makes the move.
_STATES = {"waiting": (0.0, 1.0), "running": (3.0, 1.0), "swapped": (3.0, -0.8), "finished": (6.0, 1.0)}
_MOVES = [
    ("waiting", "running", "admit (4): first come, first served, if the blocks\n"
                           "of its first chunk + the watermark are free", -0.3, 1.5, 1.85),
    ("running", "waiting", "preempted (a running sequence\nneeds a block), recompute:\n"
                           "blocks freed, back to the\nFRONT of the queue", -0.3, 1.05, 0.2),
    ("running", "swapped", "preempted, swap:\nblocks copied to the CPU", -0.3, 4.05, 0.1),
    ("swapped", "running", "swapped in (3)", -0.3, 2.45, -0.2),
    ("running", "finished", "finish: EOS, max_tokens,\nstop string, abort", 0.0, 4.5, 1.3),
    ("waiting", "finished", "abort (a request never admitted)", -0.45, 3.0, 2.75),
]


def scheduler_states_figure(title: str = "") -> Figure:
    """The states a sequence moves through in ``minikv.scheduler`` (waiting -> running ->
    preempted / finished), each arrow labelled with the part of ``Scheduler.schedule`` that moves
    it. Drawn, not measured: a map for reading the scheduler's code."""
    fig = Figure(figsize=(10, 4.8), layout="constrained")
    ax = fig.add_subplot()
    colors = {"waiting": "tab:orange", "running": "black", "swapped": "tab:purple", "finished": "tab:green"}
    for name, (x, y) in _STATES.items():
        ax.text(x, y, name.upper(), ha="center", va="center", fontsize=11, weight="bold", color="white",
                bbox=dict(boxstyle="round,pad=0.5", fc=colors[name], lw=0))
    for a, b, label, rad, lx, ly in _MOVES:
        ax.annotate("", xy=_STATES[b], xytext=_STATES[a],
                    arrowprops=dict(arrowstyle="-|>", lw=1.3, color="#444444", shrinkA=30, shrinkB=30,
                                    connectionstyle=f"arc3,rad={rad}"))
        ax.text(lx, ly, label, ha="center", va="center", fontsize=8,
                bbox=dict(boxstyle="round,pad=0.2", fc="white", ec="#dddddd", lw=0.5))
    ax.text(3.0, -1.55, "every step: 1. decodes, 2. prefill chunks (running sequences, in admission order); "
            "then, only if nobody was preempted: 3. swapped back in, 4. waiting admitted",
            ha="center", fontsize=8, color="#444444")
    ax.set_xlim(-0.8, 6.8)
    ax.set_ylim(-1.8, 3.1)
    ax.axis("off")
    ax.set_title(title or "a sequence's life in minikv's scheduler", fontsize=10, loc="left")
    return fig


def step_throughput_figure(series: Mapping[str, Mapping[int, float]], title: str = "") -> Figure:
    """Tokens per second of one decode step against the batch, one series per context length
    (label -> {batch size: seconds per step}); a dotted line is perfectly linear scaling from the
    smallest batch of each series."""
    fig, ax = axes(None, (7, 3.6))
    for k, (label, times) in enumerate(series.items()):
        batches = sorted(times)
        tps = [b / times[b] for b in batches]
        ax.plot(batches, tps, "o-", color=f"C{k}", label=label)
        b0 = batches[0]
        ax.plot(batches, [tps[0] * b / b0 for b in batches], ":", color=f"C{k}", lw=1)
    ax.set(xlabel="sequences decoding in the step", ylabel="tokens per second of the step",
           xscale="log", yscale="log")
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    ax.xaxis.set_major_formatter(plain)
    ax.xaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain)
    ax.set_xticks(sorted({b for times in series.values() for b in times}))
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    ax.set_title(title or "one decode step's throughput against its batch (dotted: linear)", fontsize=10)
    return fig
