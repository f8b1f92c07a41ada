"""Stages 2 and 3's pictures: where every token of the KV budget went, for slabs and for blocks.

The simulator's pictures take a ``SimResult`` (or several) from ``minikv.sim.memory``; draw on ``ax``
when one is given (else on a new figure) and return the Figure.

* ``memory_map(result, step)``: the KV pool as a strip wrapped into rows, like a page of
  memory. Each sequence has its own colour: solid where tokens are live, pale where the
  sequence will still grow into its reservation, hatched where the space will never be
  used (internal fragmentation). Free space is blank; grey cross-hatching marks free
  space that is stranded (external fragmentation) at that step.
* ``memory_map_widget(result)``: the same map with a slider over time (ipywidgets). It
  also carries a PNG of the map, so where widgets are not rendered (a static notebook
  view, nbconvert) the map still shows; without ipywidgets it returns the Figure.
* ``occupancy_plot(result)``: the breakdown of the budget over time, and below it how many
  sequences ran.
* ``waste_breakdown(results)``: one stacked bar per policy, with the paper's range.
* ``block_size_plot(results)``: paged utilization and last-block waste vs block size.
* ``block_tables_figure(tables, ...)``: stage 3's picture of block tables (it takes the tables,
  not a SimResult): each sequence's logical blocks, arrows to the physical blocks of the pool,
  slot numbers, last-block waste.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from matplotlib.collections import PatchCollection
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from minikv.sim.memory import PARTS, SimResult
from minikv.viz.style import COLORS, LABELS, MAX_WIDTH_IN, PAPER_PRIOR, axes, percent_axis, png, seq_color


def default_step(result: SimResult) -> int:
    """A representative step: the middle of the saturated stretch."""
    steps = np.flatnonzero(result.window)
    return int(steps[len(steps) // 2]) if steps.size else 0


def _wrapped(start: int, length: int, width: int):
    """Split [start, start + length) of the address space at row boundaries: (x, row, w)."""
    while length > 0:
        row, x = divmod(start, width)
        w = min(length, width - x)
        yield x, row, w
        start, length = start + w, length - w


def memory_map(result: SimResult, step: int | None = None, *, row_tokens: int = 512,
               outline_last: bool = False, ax=None) -> Figure:
    """The KV pool at the end of ``step`` (default: mid-saturation), one row per ``row_tokens``.

    ``outline_last`` outlines in red every held block (or slab) that is not full: for paged
    memory, each sequence's last block, where all of paging's waste sits."""
    step = default_step(result) if step is None else step
    fig, ax = axes(ax, (10, 5))
    budget = result.budget
    rows = -(-budget // row_tokens)
    live, pale, hatched = [], [], []  # (rect, colour)
    segs = result.snapshot(step)
    for s in segs:
        color = seq_color(s.seq_id)
        start = s.offset
        for length, bucket in ((s.live, live), (s.reserved, pale), (s.internal, hatched)):
            bucket += [(Rectangle((x, r), w, 0.8), color) for x, r, w in _wrapped(start, length, row_tokens)]
            start += length
    # Free space: gaps between held segments. Stranded (external) at steps that have it.
    stranded = result.timeline["external"][step] > 0
    gaps, end = [], 0
    for s in segs + [None]:
        nxt = budget if s is None else s.offset
        if nxt > end:
            gaps += [Rectangle((x, r), w, 0.8) for x, r, w in _wrapped(end, nxt - end, row_tokens)]
        end = end if s is None else max(end, s.offset + s.size)
    ax.add_collection(PatchCollection([Rectangle((0, r), min(row_tokens, budget - r * row_tokens), 0.8)
                                       for r in range(rows)], facecolor="white", edgecolor="#bbbbbb", lw=0.5))
    if stranded and gaps:
        ax.add_collection(PatchCollection(gaps, facecolor="white", edgecolor="#888888", hatch="xx", lw=0))
    for bucket, kw in ((live, {}), (pale, {"alpha": 0.35}), (hatched, {"hatch": "////"})):
        if not bucket:
            continue
        rects, colors = zip(*bucket)
        if "hatch" in kw:
            ax.add_collection(PatchCollection(rects, facecolor="white", edgecolor=colors, lw=0, **kw))
        else:
            ax.add_collection(PatchCollection(rects, facecolor=colors, lw=0, **kw))
    # Block (or slab) boundaries make the allocation unit visible.
    edges = [Rectangle((x, r), w, 0.8) for s in segs for x, r, w in _wrapped(s.offset, s.size, row_tokens)]
    ax.add_collection(PatchCollection(edges, facecolor="none", edgecolor="black", lw=0.3))
    if outline_last:
        partial = [Rectangle((x, r - 0.06), w, 0.92) for s in segs if s.live < s.size
                   for x, r, w in _wrapped(s.offset, s.size, row_tokens)]
        ax.add_collection(PatchCollection(partial, facecolor="none", edgecolor="red", lw=1.1, zorder=3))
    ax.set_xlim(0, row_tokens)
    ax.set_ylim(rows, -0.2)
    ax.set_xlabel(f"token slot within a row of {row_tokens}")
    ax.set_ylabel("row (address / row size)")
    t = result.timeline
    ax.set_title(f"{result.policy} — step {step}: {t['running'][step]} sequences, "
                 f"{t['live'][step] / budget:.0%} of {budget:,} slots live, {t['waiting'][step]} waiting")
    legend = [Patch(facecolor="grey", label="live tokens (one colour per sequence)"),
              Patch(facecolor="grey", alpha=0.35, label="reserved, not yet used"),
              Patch(facecolor="white", edgecolor="grey", hatch="////", label="internal fragmentation"),
              Patch(facecolor="white", edgecolor="#888888", hatch="xx", label="external fragmentation"),
              Patch(facecolor="white", edgecolor="#bbbbbb", label="free")]
    if outline_last:
        legend.append(Patch(facecolor="none", edgecolor="red", label="a sequence's last, unfilled block"))
    ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=3 if outline_last else 5,
              fontsize=8, frameon=False)
    return fig




class MemoryMapWidget:
    """A slider over simulation steps driving a memory map. Displays as a widget where
    widgets render, and as a PNG of the current step everywhere else."""

    def __init__(self, result: SimResult, step: int | None = None, **kw):
        import ipywidgets as w

        self.result, self.kw = result, kw
        self.slider = w.IntSlider(value=default_step(result) if step is None else step, min=0,
                                  max=result.steps - 1, description="step", continuous_update=False,
                                  layout=w.Layout(width="90%"))
        self.image = w.Image(format="png")
        self.slider.observe(lambda change: self.draw(), names="value")
        self.box = w.VBox([self.slider, self.image])
        self.draw()

    def draw(self) -> None:
        self.figure = memory_map(self.result, self.slider.value, **self.kw)
        self.png = png(self.figure)
        self.image.value = self.png

    def _repr_mimebundle_(self, **kwargs):
        import base64

        if hasattr(self.box, "_repr_mimebundle_"):  # ipywidgets 8
            bundle = self.box._repr_mimebundle_(**kwargs) or {}
        else:  # ipywidgets 7 (Colab's 7.7.1) displays through _ipython_display_: the same view, spelled out
            bundle = {"text/plain": repr(self.box)[:110], "application/vnd.jupyter.widget-view+json": {
                "version_major": 2, "version_minor": 0, "model_id": self.box.model_id}}
        bundle["image/png"] = base64.b64encode(self.png).decode()
        return bundle


def memory_map_widget(result: SimResult, step: int | None = None, **kw):
    """A ``MemoryMapWidget`` where ipywidgets is installed, else the static Figure."""
    try:
        return MemoryMapWidget(result, step, **kw)
    except ImportError:
        return memory_map(result, step, **kw)


def occupancy_plot(result: SimResult, ax=None) -> Figure:
    """Stacked shares of the budget at every step (top) and how many sequences ran (below, on
    its own axes, so the count is not read as the edge of a band). Given ``ax``, the count goes
    on a twin axis instead, as a dashed line."""
    t, steps = result.timeline, np.arange(result.steps)
    twin = ax is not None
    if twin:
        fig, below = ax.figure, ax.twinx()
    else:
        fig = Figure(figsize=(9, 5.5), layout="constrained")
        ax, below = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    ax.stackplot(steps, *(t[p] / result.budget for p in PARTS), colors=[COLORS[p] for p in PARTS],
                 labels=[LABELS[p] for p in PARTS], linewidth=0)
    ax.set_ylim(0, 1)
    ax.set_xlim(0, max(result.steps - 1, 1))
    ax.yaxis.set_major_formatter(percent_axis())
    ax.set_ylabel("share of the KV budget")
    ax.set_title(f"{result.policy}: {result.utilization:.1%} of KV memory live while requests wait")
    below.plot(steps, t["running"], color="black", lw=1, ls="--" if twin else "-", label="running sequences")
    below.set_ylim(0, max(int(t["running"].max(initial=0)) * 1.15, 1))
    below.set_ylabel("running sequences" if twin else "running\nsequences")
    (ax if twin else below).set_xlabel("decode step")
    handles = ax.get_legend_handles_labels()[0] + (below.get_legend_handles_labels()[0] if twin else [])
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.15) if twin else (0.5, -0.03),
              ncol=6 if twin else 5, fontsize=8, frameon=False)
    return fig


def _as_list(results) -> list[SimResult]:
    return list(results.values()) if isinstance(results, Mapping) else list(results)


def waste_breakdown(results: Mapping[str, SimResult] | Sequence[SimResult], ax=None) -> Figure:
    """One stacked bar per policy: where the KV budget went while requests waited."""
    res = _as_list(results)
    fig, ax = axes(ax, (9, 1.2 + 0.7 * len(res)))
    names = [r.policy for r in res]
    left = np.zeros(len(res))
    for p in PARTS:
        share = np.array([r.shares()[p] for r in res])
        ax.barh(names, share, left=left, color=COLORS[p], label=LABELS[p],
                hatch="//" if p in ("internal", "external") else None, edgecolor="white", lw=0.5)
        left += share
    for i, r in enumerate(res):
        s = r.summary()
        ax.text(0.01, i, f"{s['utilization']:.1%}", va="center", color="white", fontsize=9, weight="bold")
        ax.text(1.01, i, f"{s['mean_concurrent']:.0f} seqs", va="center", fontsize=8)
    ax.axvspan(*PAPER_PRIOR, ymin=0, ymax=1, facecolor="none", edgecolor="black", ls=":", lw=1,
               label="paper: prior systems 20.4–38.2% live")
    ax.axvline(0.96, color="black", ls="--", lw=1, label="paper: paging ≈ 96% live")
    ax.invert_yaxis()
    ax.set_xlim(0, 1)
    ax.xaxis.set_major_formatter(percent_axis())
    ax.set_xlabel("share of the KV budget, averaged over saturated steps (right: mean running sequences)")
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=4, fontsize=8, frameon=False)
    return fig


def block_size_plot(results: Mapping[int, SimResult], ax=None) -> Figure:
    """Paged utilization and the waste in each sequence's last block against block size
    (results from ``minikv.sim.memory.sweep_block_sizes``)."""
    fig, ax = axes(ax, (7, 4))
    sizes = sorted(results)
    shares = [results[b].shares() for b in sizes]
    ax.plot(sizes, [s["live"] for s in shares], "o-", color=COLORS["live"], label="utilization (live)")
    ax.plot(sizes, [s["reserved"] + s["internal"] for s in shares], "s-", color=COLORS["internal"],
            label="last-block slack (reserved + internal)")
    ax.plot(sizes, [s["internal"] for s in shares], "s--", color=COLORS["external"],
            label="internal fragmentation (never filled)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(b) for b in sizes])
    ax.set_ylim(0, 1)
    ax.yaxis.set_major_formatter(percent_axis())
    ax.set_xlabel("block size (tokens)")
    ax.set_ylabel("share of the KV budget")
    ax.set_title("Paged KV: bigger blocks waste more of each sequence's last block")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def block_tables_figure(tables: Mapping, num_blocks: int, block_size: int, *, written=(), title: str = "") -> Figure:
    """Each sequence's logical blocks (top row) -> the physical blocks its block table names (bottom row).

    ``tables`` maps a name to anything with ``blocks`` and ``num_tokens`` (a ``minikv.blocks.BlockTable``).

    Filled cells hold tokens (top: numbered by token position; bottom: numbered by physical slot, in
    italics, and each row says which, when blocks are small enough to label); hatched cells are the
    unfilled tail of a sequence's last block, the only waste; grey blocks are free. Red outlines:
    `written`, the slots of the last step (its slot mapping)."""
    W, GAP = 4.0, 0.6                      # a block is W wide whatever its size; cells are W / block_size
    row_width = max(sum(len(t) for t in tables.values()) * (W + GAP) + 1.5 * GAP * len(tables),
                    num_blocks * (W + GAP)) + 3.5
    # 0.2 in per unit; a wider figure would be shrunk to the notebook's width, so it is drawn at most
    # MAX_WIDTH_IN wide instead; a small block's cells carry numbers while they still fit (13 px a cell).
    fig_width = min(MAX_WIDTH_IN, 0.2 * row_width)
    cell, label = W / block_size, block_size <= 8 and 0.2 * row_width <= 12
    # the drawing (9 units tall, equal aspect) at full width, plus room for the title and the legend
    fig = Figure(figsize=(fig_width, fig_width * 9.0 / row_width + 1.3))
    ax = fig.add_subplot()
    fig.subplots_adjust(left=0.13, right=0.99)  # the side labels fit in 0.13 of the width
    owner = {b: (s, i) for s, t in enumerate(tables.values()) for i, b in enumerate(t.blocks)}

    def block(x, y, filled, color, first, number_from, slots=False):
        for k in range(block_size):
            used = k < filled
            ax.add_patch(Rectangle((x + k * cell, y), cell, 1, lw=0.4 if label else 0,
                                   facecolor=color if used else ("white" if color else "#eeeeee"),
                                   edgecolor="white" if used else "#999999",
                                   hatch=None if used or color is None else "////"))
            if label:
                ax.text(x + (k + 0.5) * cell, y + 0.5, number_from + k, ha="center", va="center", fontsize=7,
                        fontstyle="italic" if slots else "normal",
                        color="white" if used else "#999999")
            if first + k in written:
                ax.add_patch(Rectangle((x + k * cell, y), cell, 1, fill=False, edgecolor="red", lw=1.5, zorder=3))
        ax.add_patch(Rectangle((x, y), W, 1, fill=False, edgecolor="black" if color else "#999999", lw=0.8))

    pool_y, x = 5.0, 0.0                   # y grows downwards (inverted below)
    for s, (name, t) in enumerate(tables.items()):
        color = seq_color(s)
        # names alternate between two heights: a short table's name may be wider than its blocks
        ax.text(x, -0.35 - 1.1 * (s % 2), f"{name}: {t.num_tokens} tokens", fontsize=9, color=color, weight="bold",
                va="bottom")
        for i, b in enumerate(t.blocks):
            filled = min(block_size, t.num_tokens - i * block_size)
            block(x, 0, filled, color, b * block_size, i * block_size)   # logical cells show token positions
            ax.text(x + W / 2, 1.25, f"L{i}", ha="center", va="top", fontsize=7, color="#555555")
            px = b * (W + GAP)
            ax.annotate("", xy=(px + W / 2, pool_y - 0.05), xytext=(x + W / 2, 1.6),
                        arrowprops=dict(arrowstyle="-|>", color=color, lw=1.1, alpha=0.8, shrinkA=0, shrinkB=0))
            x += W + GAP
        x += 1.5 * GAP
    for b in range(num_blocks):
        px = b * (W + GAP)
        if b in owner:
            s, i = owner[b]
            t = list(tables.values())[s]
            block(px, pool_y, min(block_size, t.num_tokens - i * block_size), seq_color(s), b * block_size,
                  b * block_size, True)
        else:
            block(px, pool_y, 0, None, b * block_size, b * block_size, True)
        ax.text(px + W / 2, pool_y + 1.15, f"{b}", ha="center", va="top", fontsize=7.5,
                color="black" if b in owner else "#999999")
    right = max(x, num_blocks * (W + GAP))
    ax.text(-0.3, 0.5, "logical blocks\n" + ("cells: token\nposition" if label else ""), ha="right", va="center",
            fontsize=9 if not label else 8)
    ax.text(-0.3, pool_y + 0.5, "physical blocks\n" + ("cells: slot\nnumber (italic)" if label else ""), ha="right",
            va="center", fontsize=9 if not label else 8)
    ax.set_xlim(-3.5, right)
    ax.set_ylim(pool_y + 1.6, -1.3 - 1.1 * (len(tables) > 1))
    ax.set_aspect("equal")
    ax.axis("off")
    fig.suptitle(title, fontsize=10)
    ax.legend(handles=[Patch(facecolor="grey", label="holds a token"),
                       Patch(facecolor="white", edgecolor="grey", hatch="////",
                             label="allocated, empty (last block only)"),
                       Patch(facecolor="#eeeeee", edgecolor="#999999", label="free block"),
                       Patch(fill=False, edgecolor="red", lw=1.5, label="written this step (slot mapping)")],
              loc="upper center", bbox_to_anchor=(0.5, 0.02), ncol=4, fontsize=8, frameon=False)
    return fig
