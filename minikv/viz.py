"""Pictures of KV memory: where every token of the budget went, for slabs and for blocks.

All functions take a ``SimResult`` (or several) from ``minikv.sim``, draw on ``ax`` when
one is given (else on a new figure) and return the Figure. New figures are plain
``matplotlib.figure.Figure`` objects, not registered with pyplot: in a notebook one shows
once when it is the cell's last expression (or with ``display(fig)``), never twice, and
redrawing in a loop or a widget does not pile up open figures.

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
* ``block_tables_figure(tables, ...)``: stage 3's picture of block tables: each sequence's
  logical blocks, arrows to the physical blocks of the pool, slot numbers, last-block waste.
* Stage 4's pictures: ``roofline_figure``, ``kernel_grid_figure``, ``split_kv_figure`` and
  ``kernel_errors_figure`` (see each docstring).
* Stage 6's pictures (the engine): ``batching_figure`` (static batching's idle seats vs continuous
  batching), ``engine_occupancy_figure`` (blocks and queues over engine steps),
  ``token_timeline_figure`` (a preempted request's latency wobble), ``throughput_bars``.
"""

from __future__ import annotations

import io
import math
import sys
from collections.abc import Mapping, Sequence

import matplotlib
import numpy as np
from matplotlib.colors import rgb_to_hsv
from matplotlib.collections import PatchCollection
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle
from matplotlib.ticker import FuncFormatter

from minikv.sim import PARTS, SimResult

# Jupyter shows a plain Figure through an image formatter that the inline backend installs
# lazily, when the first pyplot figure is made; until then a returned Figure prints as text.
# Loading the backend now (it makes no figure) installs it, so these figures always show.
if "ipykernel" in sys.modules:
    import matplotlib.pyplot as plt

    plt.switch_backend(matplotlib.get_backend())

COLORS = {"live": "#2166ac", "reserved": "#92c5de", "internal": "#f4a582",
          "external": "#b2182b", "free": "#f0f0f0"}
LABELS = {"live": "live tokens", "reserved": "reserved, not yet used",
          "internal": "internal fragmentation", "external": "external fragmentation",
          "free": "free"}
PAPER_PRIOR = (0.204, 0.382)  # share of KV memory holding tokens in prior systems (Kwon et al. 2023)
# Sequence colours: the 60 of tab20, tab20b and tab20c minus the greys, which would read as
# "free"; neighbours in id order are far apart in the palette so adjacent slabs differ.
_PALETTE = [c for name in ("tab20", "tab20b", "tab20c") for c in matplotlib.colormaps[name].colors
            if rgb_to_hsv(c)[1] > 0.2]


_STRIDE = next(k for k in (11, 13, 17, 19, 23) if math.gcd(k, len(_PALETTE)) == 1)  # visits every colour


def seq_color(seq_id: int):
    return _PALETTE[(seq_id * _STRIDE) % len(_PALETTE)]


def _percent() -> FuncFormatter:  # one per axis: a formatter belongs to the axis it is set on
    return FuncFormatter(lambda v, _: f"{v:.0%}")


def _axes(ax, size=(9, 4)):
    if ax is None:
        ax = Figure(figsize=size, layout="constrained").add_subplot()
    return ax.figure, ax


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
    fig, ax = _axes(ax, (10, 5))
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


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    return buf.getvalue()


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
        self.png = _png(self.figure)
        self.image.value = self.png

    def _repr_mimebundle_(self, **kwargs):
        import base64

        bundle = self.box._repr_mimebundle_(**kwargs) or {}
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
    ax.yaxis.set_major_formatter(_percent())
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
    fig, ax = _axes(ax, (9, 1.2 + 0.7 * len(res)))
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
    ax.xaxis.set_major_formatter(_percent())
    ax.set_xlabel("share of the KV budget, averaged over saturated steps (right: mean running sequences)")
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=4, fontsize=8, frameon=False)
    return fig


def block_size_plot(results: Mapping[int, SimResult], ax=None) -> Figure:
    """Paged utilization and the waste in each sequence's last block against block size
    (results from ``minikv.sim.sweep_block_sizes``)."""
    fig, ax = _axes(ax, (7, 4))
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
    ax.yaxis.set_major_formatter(_percent())
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
    italics, and each row says which, when blocks are small enough to label); hatched cells are the unfilled tail of a sequence's last block, the only waste; grey blocks
    are free. Red outlines: `written`, the slots of the last step (its slot mapping)."""
    W, GAP = 4.0, 0.6                      # a block is W wide whatever its size; cells are W / block_size
    cell, label = W / block_size, block_size <= 8
    row_width = max(sum(len(t) for t in tables.values()) * (W + GAP) + 1.5 * GAP * len(tables),
                    num_blocks * (W + GAP)) + 3.5
    fig_width = min(14, 0.2 * row_width)
    fig = Figure(figsize=(fig_width, fig_width * 9.5 / row_width + 0.5))
    ax = fig.add_subplot()
    owner = {b: (s, i) for s, t in enumerate(tables.values()) for i, b in enumerate(t.blocks)}

    def block(x, y, filled, color, first, number_from, slots=False):
        for k in range(block_size):
            used = k < filled
            ax.add_patch(Rectangle((x + k * cell, y), cell, 1, lw=0.4 if label else 0,
                                   facecolor=color if used else ("white" if color else "#eeeeee"),
                                   edgecolor="white" if used else "#999999",
                                   hatch=None if used or color is None else "////"))
            if label:
                ax.text(x + (k + 0.5) * cell, y + 0.5, number_from + k, ha="center", va="center", fontsize=6.5,
                        fontstyle="italic" if slots else "normal",
                        color="white" if used else "#999999")
            if first + k in written:
                ax.add_patch(Rectangle((x + k * cell, y), cell, 1, fill=False, edgecolor="red", lw=1.5, zorder=3))
        ax.add_patch(Rectangle((x, y), W, 1, fill=False, edgecolor="black" if color else "#999999", lw=0.8))

    pool_y, x = 5.0, 0.0                   # y grows downwards (inverted below)
    for s, (name, t) in enumerate(tables.items()):
        color = seq_color(s)
        ax.text(x, -0.35, f"{name}: {t.num_tokens} tokens", fontsize=9, color=color, weight="bold", va="bottom")
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
    ax.set_ylim(pool_y + 1.6, -1.3)
    ax.set_aspect("equal")
    ax.axis("off")
    fig.suptitle(title, fontsize=10)
    ax.legend(handles=[Patch(facecolor="grey", label="holds a token"),
                       Patch(facecolor="white", edgecolor="grey", hatch="////", label="allocated, empty (last block only)"),
                       Patch(facecolor="#eeeeee", edgecolor="#999999", label="free block"),
                       Patch(fill=False, edgecolor="red", lw=1.5, label="written this step (slot mapping)")],
              loc="upper center", bbox_to_anchor=(0.5, 0.02), ncol=4, fontsize=8, frameon=False)
    return fig


def beam_sharing_plot(history: Sequence[tuple[int, int, int]], ax=None, title: str = "") -> Figure:
    """Blocks in use vs the blocks the same sequences would take unshared, per step.

    ``history`` is ``PagedKVCache.sharing_history``: (step, blocks in use, blocks unshared)."""
    fig, ax = _axes(ax)
    steps, used, unshared = (list(c) for c in zip(*history)) if history else ([], [], [])
    ax.plot(steps, unshared, color="#999999", lw=1.5, label="unshared (every sequence its own blocks)")
    ax.plot(steps, used, color=COLORS["live"], lw=2, label="in use (shared blocks counted once)")
    ax.fill_between(steps, used, unshared, color=COLORS["live"], alpha=0.15, label="saved by sharing")
    ax.set_ylim(0, max(unshared, default=1) * 1.05)
    ax.set_xlabel("generate step")
    ax.set_ylabel("KV blocks")
    ax.set_title(title or "Beams share the blocks of their common history")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


# --- stage 4: the kernel (notebook 04) -------------------------------------------------------------

def roofline_figure(gpus: Sequence, workloads: Mapping[str, tuple[float, str]], *,
                    cuda_core_tflops: Mapping[str, float] | None = None, title: str = "") -> Figure:
    """The roofline of each GPU, log-log: the attainable TFLOP/s at each arithmetic intensity.

    ``gpus`` are ``minikv.sizing.GPU`` entries; ``workloads`` maps a label to (FLOP per byte, colour).
    Each GPU's roof (black, one line style per GPU) rises with its bandwidth until its ridge point
    (black dot), then stays flat at its fp16 tensor-core peak: what a kernel that multiplies with
    ``tl.dot`` / cuBLAS could reach. ``cuda_core_tflops`` (GPU name -> fp32 TFLOP/s, datasheet) adds
    a second, lower flat roof per GPU (purple, same line style, purple dot at its ridge): the ceiling
    of a kernel that does its arithmetic in fp32 on the ordinary CUDA cores, like the course kernel's
    first version. Every ridge dot is labelled with its GPU's name, so roofs that coincide (H100 and
    H200 share both peaks) stay apart.
    Both roofs share the bandwidth slope. Each workload is a vertical line, with a dot where it meets
    every tensor-core roof."""
    fig = Figure(figsize=(11, 7))
    ax = fig.add_subplot()
    cuda_core_tflops = cuda_core_tflops or {}
    x = np.geomspace(0.25, 5000, 400)
    for g, style in zip(gpus, ["-", "--", "-.", ":"]):
        tb_s = g.bandwidth_gb_s / 1e3
        ridge = g.fp16_tflops / tb_s
        label = f"{g.name}: {tb_s:.2f} TB/s; tensor-core fp16 {g.fp16_tflops:.0f} TFLOP/s, ridge {ridge:.0f}"
        ax.plot(x, np.minimum(g.fp16_tflops, tb_s * x), "k", ls=style, lw=1.6)
        ax.plot(ridge, g.fp16_tflops, "ko", ms=4)
        # GPUs with the same peak share a flat roof (H100 and H200: same compute, more bandwidth);
        # naming each ridge dot keeps them apart where the lines coincide.
        ax.annotate(g.name, (ridge, g.fp16_tflops), xytext=(-4, 6), textcoords="offset points", fontsize=8.5,
                    ha="right")
        if g.name in cuda_core_tflops:
            peak = cuda_core_tflops[g.name]
            ridge32 = peak / tb_s
            flat = x >= ridge32
            ax.plot(x[flat], np.full(flat.sum(), peak), color="tab:purple", ls=style, lw=1.6)
            ax.plot(ridge32, peak, "o", color="tab:purple", ms=4)
            ax.annotate(g.name, (ridge32, peak), xytext=(-4, 6), textcoords="offset points", fontsize=8.5,
                        ha="right", color="tab:purple")
            label += f";\n    CUDA-core fp32 {peak:g} TFLOP/s, ridge {ridge32:.0f} FLOP/B"
        ax.plot([], [], "k", ls=style, lw=1.6, label=label)
    gpu_legend = ax.legend(loc="upper left", fontsize=9, title="roofs (datasheet): black tensor-core fp16, "
                           "purple CUDA-core fp32", title_fontsize=9)
    ax.add_artist(gpu_legend)
    lines = []
    for label, (i, color) in workloads.items():
        lines.append(ax.axvline(i, color=color, lw=1.5, alpha=0.8, label=f"{label}: {i:,.0f} FLOP/B"))
        for g in gpus:
            ax.plot(i, min(g.fp16_tflops, g.bandwidth_gb_s * i / 1e3), "o", color=color, ms=5)
    ax.legend(handles=lines, loc="lower right", fontsize=9, title="workload (fp16 data)", title_fontsize=9)
    ax.set(xscale="log", yscale="log", xlim=(0.25, 5000), ylim=(0.015, 5000),
           xlabel="arithmetic intensity (FLOP per byte read from memory)", ylabel="attainable TFLOP/s")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    fig.tight_layout()
    return fig


def kernel_grid_figure(inputs, seq: int = 0, kv_head: int = 1) -> Figure:
    """The paged-attention kernel's grid for one decode batch, and the walk of one of its programs.

    ``inputs`` is a ``minikv.attention.PagedInputs``. Left: one box per program, rows = sequences,
    columns = KV heads, each labelled with the query heads it serves and the blocks it walks; program
    (``seq``, ``kv_head``) is orange. Right: that program's block-table row (top; hatched grey entries
    past the sequence's last block are garbage, never read), with arrows to the physical blocks of the
    pool (bottom), filled as far as they hold tokens; other sequences' blocks pale blue, free ones white."""
    from matplotlib.patches import FancyArrowPatch

    num_seqs, num_heads, _ = inputs.query.shape
    num_blocks, block_size, num_kv, _ = inputs.key_cache.shape
    group = num_heads // num_kv
    lens, tables = inputs.seq_lens.tolist(), inputs.block_tables.tolist()
    fig = Figure(figsize=(13, 4.6))
    ax, bx = fig.subplots(1, 2, gridspec_kw=dict(width_ratios=[1, 1.9]))

    # (a) the grid: rows = sequences, columns = KV heads
    for s in range(num_seqs):
        for j in range(num_kv):
            hot = (s, j) == (seq, kv_head)
            ax.add_patch(Rectangle((j, num_seqs - 1 - s), 0.94, 0.9, fc="tab:orange" if hot else "#dbe9f6", ec="k"))
            heads = f"{j * group}..{j * group + group - 1}"
            ax.text(j + 0.47, num_seqs - 0.55 - s,
                    f"program ({s}, {j})\nquery heads {heads}\nKV head {j}\n"
                    f"{math.ceil(lens[s] / block_size)} block{'s' if lens[s] > block_size else ''}",
                    ha="center", va="center", fontsize=8.5)
    ax.set(xlim=(-0.05, num_kv), ylim=(-0.05, num_seqs), title=f"(a) grid = ({num_seqs} sequences, {num_kv} KV heads)")
    ax.set_xticks([j + 0.47 for j in range(num_kv)], [f"KV head {j}" for j in range(num_kv)])
    ax.set_yticks([num_seqs - 0.55 - s for s in range(num_seqs)], [f"seq {s}\n({lens[s]} tokens)" for s in range(num_seqs)])
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)

    # (b) one program's walk: its table row (top) points into the pool (bottom)
    row, used = tables[seq], math.ceil(lens[seq] / block_size)
    top, bottom = 2.2, 0.0
    for b, phys in enumerate(row):
        garbage = b >= used
        bx.add_patch(Rectangle((b * 1.3, top), 1.1, 0.8, fc="#eeeeee" if garbage else "tab:orange", ec="k",
                               hatch="xx" if garbage else None))
        bx.text(b * 1.3 + 0.55, top + 0.4, str(phys) if not garbage else ("2^31-1" if phys > 0 else str(phys)),
                ha="center", va="center", fontsize=8 if not garbage else 7, backgroundcolor="#eeeeee" if garbage else "none")
        bx.text(b * 1.3 + 0.55, top + 0.95, f"b={b}", ha="center", fontsize=8)
    bx.text(-0.2, top + 0.4, f"block_tables[{seq}]", ha="right", va="center", fontsize=9)
    bx.text(used * 1.3 + (len(row) - used) * 0.65 - 0.1, top + 1.25, "garbage past the last block: never read",
            ha="center", fontsize=8)
    width = 11.5 / num_blocks
    owner = {p: (s, b) for s, r in enumerate(tables) for b, p in enumerate(r[: math.ceil(lens[s] / block_size)])}
    for p in range(num_blocks):
        s_b = owner.get(p)
        mine = s_b is not None and s_b[0] == seq
        fill = 1.0
        if mine and s_b[1] == used - 1:  # the partly filled last block
            fill = (lens[seq] - (used - 1) * block_size) / block_size
        bx.add_patch(Rectangle((p * width, bottom), width * 0.92, 0.8, fc="white", ec="k", lw=0.6))
        if s_b is not None:
            bx.add_patch(Rectangle((p * width, bottom), width * 0.92 * fill, 0.8,
                                   fc="tab:orange" if mine else "#dbe9f6", ec="none"))
        bx.text(p * width + width * 0.46, bottom - 0.25, str(p), ha="center", fontsize=7)
    for b in range(used):
        p = row[b]
        bx.add_patch(FancyArrowPatch((b * 1.3 + 0.55, top), (p * width + width * 0.46, bottom + 0.82),
                                     arrowstyle="-|>", mutation_scale=10, color="tab:orange", lw=1.2))
    last_fill = lens[seq] - (used - 1) * block_size
    bx.text(-0.2, bottom + 0.4, "pool", ha="right", va="center", fontsize=9)
    bx.text(0, -1.15, f"Sequence {seq} holds {lens[seq]} tokens = {used - 1} full blocks + {last_fill} of {block_size} "
            f"in its last block (its empty slots are masked out).\nProgram ({seq}, {1 - kv_head}) walks the same blocks, "
            f"reading KV head {1 - kv_head}'s slice of each.", fontsize=8.5)
    bx.legend(handles=[Patch(fc="tab:orange", label=f"sequence {seq}'s blocks (filled part: tokens)"),
                       Patch(fc="#dbe9f6", label="other sequences' blocks"), Patch(fc="white", ec="k", label="free block")],
              loc="upper center", fontsize=8, bbox_to_anchor=(0.55, 0.02), ncol=3, frameon=False)
    bx.set(xlim=(-2.6, 12.2), ylim=(-1.4, 3.7), title=f"(b) program ({seq}, {kv_head}): walk the table, block by block")
    bx.axis("off")
    fig.tight_layout()
    return fig


def split_kv_figure(num_blocks: int = 9, num_splits: int = 3) -> Figure:
    """Split-KV for one (sequence, KV head): its ``num_blocks`` logical blocks (top), cut into
    ``num_splits`` contiguous chunks, one program each (middle), each leaving its own online-softmax
    state (m, l, acc), which one small combine kernel merges (bottom)."""
    from matplotlib.patches import FancyArrowPatch

    per = math.ceil(num_blocks / num_splits)
    colors = ["tab:orange", "tab:purple", "tab:olive", "tab:cyan"]
    fig = Figure(figsize=(12, 3.6))
    ax = fig.add_subplot()
    for b in range(num_blocks):
        s = b // per
        ax.add_patch(Rectangle((b * 1.1, 2.4), 1.0, 0.7, fc=colors[s % len(colors)], alpha=0.7, ec="k"))
        ax.text(b * 1.1 + 0.5, 2.75, f"b={b}", ha="center", va="center", fontsize=8)
    ax.text(-0.2, 2.75, "one sequence's\nlogical blocks", ha="right", va="center", fontsize=9)
    for s in range(num_splits):
        first, last = s * per, min((s + 1) * per, num_blocks) - 1
        cx = (first + last + 1) * 1.1 / 2
        ax.add_patch(Rectangle((cx - 1.6, 1.0), 3.2, 0.8, fc=colors[s % len(colors)], alpha=0.35, ec="k"))
        ax.text(cx, 1.4, f"program (seq, kv head, split {s})\nblocks {first}..{last} -> m_{s}, l_{s}, acc_{s}",
                ha="center", va="center", fontsize=8)
        ax.add_patch(FancyArrowPatch((cx, 2.4), (cx, 1.82), arrowstyle="-|>", mutation_scale=10))
        ax.add_patch(FancyArrowPatch((cx, 1.0), (num_blocks * 0.55, 0.42), arrowstyle="-|>", mutation_scale=10))
    ax.add_patch(Rectangle((num_blocks * 0.55 - 2.6, -0.35), 5.2, 0.75, fc="#eeeeee", ec="k"))
    ax.text(num_blocks * 0.55, 0.02, "combine kernel, one program per (seq, query head):\n"
            "rescale each split to the common max, add, divide", ha="center", va="center", fontsize=8.5)
    ax.text(-2.1, -0.35, f"Unsplit, one program walks all {num_blocks} blocks\n"
            f"alone. Split, {num_splits} programs walk {per} each,\n"
            f"at once, on {num_splits} SMs; each writes its state (for\nits whole GQA group) to fp32 scratch.",
            ha="left", va="bottom", fontsize=8)
    ax.set(xlim=(-2.2, num_blocks * 1.1 + 0.3), ylim=(-0.5, 3.3),
           title=f"Split-KV: {num_splits} programs share one (sequence, KV head), then one small merge")
    ax.axis("off")
    fig.tight_layout()
    return fig


def kernel_errors_figure(results: Sequence, tolerance: Mapping, title: str = "") -> Figure:
    """The kernel's largest error per configuration, against two answers (log scale).

    ``results`` holds (label, dtype, error vs paged_attention_ref, error vs SDPA); ``tolerance`` maps a
    dtype to its allowed error, drawn as a dashed line across that dtype's rows. Errors of exactly 0
    (bit-identical) cannot sit on a log axis: they are drawn at a floor of 1e-9 and labelled."""
    floor = 1e-9
    fig = Figure(figsize=(10, 4.8))
    ax = fig.add_subplot()
    y = np.arange(len(results))
    for offset, column, color, label in [(-0.2, 2, "tab:blue", "vs paged_attention_ref"),
                                         (0.2, 3, "tab:orange", "vs SDPA in float64 on gathered K/V")]:
        errs = [r[column] for r in results]
        ax.barh(y + offset, [max(e, floor) for e in errs], height=0.4, color=color, label=label)
        for yi, e in zip(y, errs):
            if e == 0:
                ax.text(floor * 1.3, yi + offset, "0 (bit-identical)", va="center", fontsize=7.5)
    for dtype, color in zip(tolerance, ["tab:green", "tab:red", "tab:brown"]):
        rows = [i for i, r in enumerate(results) if r[1] == dtype]
        ax.vlines([tolerance[dtype]] * len(rows), [i - 0.45 for i in rows], [i + 0.45 for i in rows], color=color,
                  ls="--", label=f"tolerance for {str(dtype).removeprefix('torch.')} rows: {tolerance[dtype]:g}")
    ax.set_yticks(y, [r[0] for r in results])
    ax.invert_yaxis()
    ax.set(xscale="log", xlim=(floor, 1e-1), xlabel="max |kernel output - answer| over all outputs (log scale)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
    fig.tight_layout()
    return fig


# ---- stage 5: shared walls ----
# Pictures of a minikv.prefix.BlockManager's pool (blocks several sequences own, cached blocks nobody
# owns), of its hash chain, of a copy-on-write, and of minikv.sharing's measurements.

SHARED_EDGE, CACHED, FREE_BLOCK = "black", "#d9d9d9", "#f7f7f7"


def _owners(bm) -> dict[int, list]:
    owners: dict[int, list] = {}
    for name, table in bm.tables.items():
        for b in table.blocks:
            owners.setdefault(b, []).append(name)
    return owners


def shared_memory_map(bm, *, cols: int | None = None, ax=None, title: str = "", copies=()) -> Figure:
    """A ``BlockManager``'s pool as a grid of blocks: a block one sequence owns in its colour; a block
    several own in stripes of their colours, outlined, with its refcount; a cached block nobody owns
    (evictable, its K/V kept for a later hit) grey and dotted; a free block blank. ``copies`` (source,
    destination) pairs, e.g. from ``take_copies()``, are drawn as red arrows."""
    n = bm.num_blocks
    cols = cols or min(n, 32)
    rows = math.ceil(n / cols)
    fig, ax = _axes(ax, (min(14, 0.45 * cols + 1), 0.5 * rows + 1.4))
    names = list(bm.tables)
    color = {name: seq_color(i) for i, name in enumerate(names)}
    owners, evictable = _owners(bm), set(bm.cache.evictable)
    for b in range(n):
        x, y = b % cols, b // cols
        own = owners.get(b, [])
        if own:
            kinds = list(dict.fromkeys(own))  # a sequence appears once per block it owns
            for k, name in enumerate(kinds):
                ax.add_patch(Rectangle((x + k / len(kinds) * 0.9, y), 0.9 / len(kinds), 0.9, facecolor=color[name], lw=0))
            if len(own) > 1:
                ax.add_patch(Rectangle((x, y), 0.9, 0.9, fill=False, edgecolor=SHARED_EDGE, lw=1.6))
                ax.text(x + 0.45, y + 0.47, f"×{len(own)}", ha="center", va="center", fontsize=7, weight="bold",
                        color="white", bbox=dict(boxstyle="round,pad=0.1", fc="black", alpha=0.55, lw=0))
        elif b in evictable:
            ax.add_patch(Rectangle((x, y), 0.9, 0.9, facecolor=CACHED, edgecolor="#999999", hatch="..", lw=0.5))
        else:
            ax.add_patch(Rectangle((x, y), 0.9, 0.9, facecolor=FREE_BLOCK, edgecolor="#cccccc", lw=0.5))
        if cols <= 40:
            ax.text(x + 0.45, y + 0.98, str(b), ha="center", va="top", fontsize=6, color="#666666")
    for src, dst in copies:
        ax.annotate("", xy=(dst % cols + 0.45, dst // cols + 0.1), xytext=(src % cols + 0.45, src // cols + 0.1),
                    arrowprops=dict(arrowstyle="-|>", color="red", lw=1.5, connectionstyle="arc3,rad=-0.5"))
    ax.set_xlim(-0.2, cols + 0.1)
    ax.set_ylim(rows + 0.2, -0.9 if copies else -0.2)
    ax.set_aspect("equal")
    ax.axis("off")
    handles = [Patch(facecolor=color[name], label=str(name)) for name in names[:8]]
    handles += [Patch(facecolor="white", edgecolor=SHARED_EDGE, lw=1.6, label="shared (×refcount)"),
                Patch(facecolor=CACHED, edgecolor="#999999", hatch="..", label="cached, nobody owns it (evictable)"),
                Patch(facecolor=FREE_BLOCK, edgecolor="#cccccc", label="free")]
    if copies:
        handles.append(Patch(facecolor="red", label="copy-on-write: source -> copy"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0), ncol=min(len(handles), 5), fontsize=7,
              frameon=False)
    shared = sum(len(o) > 1 for o in owners.values())
    saved = sum(len(o) - 1 for o in owners.values())
    ax.set_title(title or f"{len(owners)} blocks owned, {shared} shared: {saved} block(s) saved by sharing",
                 fontsize=9)
    return fig


def cow_figure(block_size: int = 4, prompt: Sequence[int] = (5, 8, 13, 21, 34, 55)) -> Figure:
    """Fork and copy-on-write, step by step, on a fresh ``BlockManager`` (a drawing, not a measurement):
    a prompt is prefilled, forked into two samples that share all its blocks, then each writes a token."""
    from minikv.prefix import BlockManager

    bm = BlockManager(8, block_size)
    bm.open("A", prompt)
    bm.append("A", list(prompt))
    fig = Figure(figsize=(9, 6.6), layout="constrained")
    axes = fig.subplots(3, 1)
    steps = [("fork: B shares all of A's blocks", lambda: bm.fork("A", "B")),
             ("B writes a token: its shared, partly filled last block is copied first", lambda: bm.append("B", [89])),
             ("A writes a token: its last block is its own now, written in place", lambda: bm.append("A", [144]))]
    for ax, (what, act) in zip(axes, steps):
        act()
        tables = "   ".join(f"{s}: blocks {bm.block_table(s)}, {bm.num_tokens(s)} tokens" for s in bm.tables)
        shared_memory_map(bm, cols=8, ax=ax, title=f"{what}\n{tables}", copies=bm.take_copies())
    return fig


def hash_chain_figure(bm, seq_ids: Sequence | None = None, *, max_tokens: int = 6) -> Figure:
    """The prefix cache as a tree: each cached full block names its parent by hash, so equal prefixes
    are one path and sequences branch where they first differ. A box is a full block (physical id,
    the first bytes of its hash, its tokens, refcount); a dashed box is a sequence's partly filled
    last block, which is not cached yet."""
    ids = list(bm.tables) if seq_ids is None else list(seq_ids)
    # one lane per sequence; a cached block sits on the lane of the first sequence that reached it
    nodes: dict[int, tuple] = {}   # id(key) -> (key, depth, parent id or None, lane)
    order: list[int] = []
    leaves = []
    for lane, s in enumerate(ids):
        t = bm.tables[s]
        parent = None
        for depth, key in enumerate(t.keys):
            if id(key) not in nodes:
                nodes[id(key)] = (key, depth, parent, lane)
                order.append(id(key))
            parent = id(key)
        leaves.append((s, parent, len(t.keys), t, lane))
    y_of = {k: v[3] for k, v in nodes.items()}
    lane = [len(ids)]
    W, H, GAP = 3.2, 1.3, 0.9
    depth_max = max([nodes[k][1] for k in nodes] + [0]) + 2
    fig = Figure(figsize=(min(15, 1.5 + 2.1 * depth_max), 1.0 + 0.95 * max(lane[0], 1)))
    ax = fig.add_subplot()
    cache = bm.cache
    for k in order:
        key, depth, parent, _ = nodes[k]
        x, y = depth * (W + GAP), y_of[k] * (H + 0.4)
        block = cache.by_hash.get(key.hash)
        refs = bm.allocator.refcount(block) if block is not None else 0
        ax.add_patch(Rectangle((x, y), W, H, facecolor="#e8f0fa" if refs < 2 else "#fde9c9",
                               edgecolor="black", lw=1.6 if refs > 1 else 0.8))
        toks = " ".join(map(str, key.tokens[:max_tokens])) + (" …" if len(key.tokens) > max_tokens else "")
        ax.text(x + W / 2, y + H / 2, f"block {block}  ×{refs}\n#{key.hash & 0xFFFFFF:06x}\n[{toks}]", ha="center",
                va="center", fontsize=7, family="monospace")
        if parent is not None:
            py = y_of[parent] * (H + 0.4)
            ax.annotate("", xy=(x, y + H / 2), xytext=(x - GAP, py + H / 2),
                        arrowprops=dict(arrowstyle="-|>", color="#555555", lw=1))
    for s, parent, depth, t, lane_ in leaves:
        x, y = depth * (W + GAP), lane_ * (H + 0.4)
        rest = t.token_ids[depth * bm.block_size:]
        color = seq_color(ids.index(s))
        if rest:
            toks = " ".join("?" if v is None else str(v) for v in rest[:max_tokens]) + (" …" if len(rest) > max_tokens else "")
            ax.add_patch(Rectangle((x, y), W, H, facecolor="white", edgecolor=color, ls="--", lw=1.2))
            ax.text(x + W / 2, y + H / 2, f"block {t.blocks[depth]}  ×{bm.allocator.refcount(t.blocks[depth])}\n"
                    f"(partial)\n[{toks}]", ha="center", va="center", fontsize=7, family="monospace")
            if parent is not None:
                py = y_of[parent] * (H + 0.4)
                ax.annotate("", xy=(x, y + H / 2), xytext=(x - GAP, py + H / 2),
                            arrowprops=dict(arrowstyle="-|>", color=color, lw=1, ls="--"))
            x += W
        ax.text(x + 0.25, y + H / 2, str(s), color=color, weight="bold", va="center", fontsize=9)
    ax.set_xlim(-0.3, depth_max * (W + GAP) + 1.5)
    ax.set_ylim(max(lane[0], 1) * (H + 0.4) + 0.2, -0.4)
    ax.axis("off")
    ax.set_title("hash chain: hash(block) = H(parent's hash, its tokens); orange, thick: shared (×refcount)",
                 fontsize=9)
    fig.tight_layout()
    return fig


def eviction_curve_figure(curve, ax=None, title: str = "") -> Figure:
    """Block hit rate against pool size: where LRU starts throwing away blocks that would have hit.
    ``curve``: ``[{"num_blocks", "hit_rate", "evictions"}, ...]`` (``bench prefix``'s JSON) or
    ``{num_blocks: SharingResult}`` (``minikv.sharing.eviction_curve``)."""
    if isinstance(curve, Mapping):
        curve = [{"num_blocks": n, "hit_rate": r.hit_rate, "evictions": r.evictions} for n, r in curve.items()]
    fig, ax = _axes(ax, (7, 3.8))
    x = [c["num_blocks"] for c in curve]
    ax.plot(x, [c["hit_rate"] for c in curve], "o-", color="tab:blue", label="block hit rate")
    ax.axhline(max(c["hit_rate"] for c in curve), color="tab:blue", ls=":", lw=1, label="with the largest pool")
    ax.yaxis.set_major_formatter(_percent())
    ax.set(xlabel="pool size (blocks)", ylabel="hit rate", ylim=(0, 1.02))
    ax2 = ax.twinx()
    ax2.bar(x, [c["evictions"] for c in curve], width=(max(x) - min(x)) / len(x) / 3 if len(x) > 1 else 1,
            color="tab:red", alpha=0.3, label="evictions")
    ax2.set_ylabel("cached blocks evicted", color="tab:red")
    lines = ax.get_legend_handles_labels()
    bars = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + bars[0], lines[1] + bars[1], fontsize=8, loc="center right")
    ax.set_title(title or "eviction curve: a small pool evicts cached prefixes before they are asked for again",
                 fontsize=9)
    ax.grid(alpha=0.3)
    return fig


def sharing_savings_figure(savings: Mapping[str, Mapping], paper: Mapping[str, tuple] | None = None, ax=None,
                           title: str = "") -> Figure:
    """Memory saved by sharing per width: ``{"parallel": {n: fraction}, "beam": {w: fraction}}`` (one
    workload of ``bench prefix``'s ``parallel_sampling_savings``/``beam_search_savings``); the paper's
    ranges shaded."""
    fig, ax = _axes(ax, (7, 3.8))
    colors = {"parallel": "tab:green", "beam": "tab:purple"}
    for k, (kind, by_width) in enumerate(savings.items()):
        widths = [int(w) for w in by_width]
        ax.bar(np.arange(len(widths)) + (k - 0.5) * 0.38, list(by_width.values()), width=0.36, color=colors.get(kind),
               label=f"{kind}: ours")
        if paper and kind in paper:
            lo, hi = paper[kind]
            ax.axhspan(lo, hi, color=colors.get(kind), alpha=0.12, label=f"{kind}: paper {lo:.1%}-{hi:.1%}")
    ax.set_xticks(np.arange(len(widths)), [f"n / width {w}" for w in widths])
    ax.yaxis.set_major_formatter(_percent())
    ax.set_ylabel("KV block-steps saved by sharing")
    ax.legend(fontsize=8)
    ax.set_title(title or "memory saved by sharing blocks", fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    return fig



# ---- stage 6: continuous batching ----
# Pictures of the engine (minikv.engine): who holds a seat in the batch at each step, the block
# pool and the queues over steps (from the engine's per-step metrics, `StepStats`), one request's
# token timeline (from its `RequestMetrics`) and throughput bars. They read only attributes
# (duck typing), so a notebook can also draw hand-made or simulated data.

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
    """The engine's occupancy timeline from its per-step metrics (``engine.step_stats``).

    Top: the block pool at every step, stacked: blocks held by running sequences, free blocks that
    still hold a cached prefix (evictable), never-used free blocks. Bottom: sequences running,
    waiting and swapped out; a red tick marks each step that preempted someone."""
    if not steps:
        raise ValueError("no steps to draw: run the engine first (engine.step_stats is empty)")
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
            right.annotate(f"{gaps[j]:.0f} ms", (j + 2, gaps[j]), textcoords="offset points", xytext=(4, 2),
                           fontsize=8, color=color)
    left.set(xlabel="generated token", ylabel="seconds since arrival", title="token arrival times")
    right.set(xlabel="generated token", ylabel="gap before this token (ms)", title="time between tokens")
    right.set_ylim(bottom=0)
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
    fig, ax = _axes(None, (8, 1.2 + 0.6 * len(names)))
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
