"""Stage 5's pictures (shared walls): a pool of shared blocks, copy-on-write, the hash chain, eviction
and savings against the paper: ``shared_memory_map``, ``cow_figure``, ``hash_chain_figure``,
``eviction_curve_figure``, ``sharing_savings_figure``, ``paper_comparison_figure`` (ours against the
PagedAttention paper, width by width), ``beam_sharing_plot``. They take a block manager
(``minikv.prefix.BlockManager``) or the numbers a replay (``minikv.sim.sharing``) returns."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from minikv.viz.style import COLORS, MAX_WIDTH_IN, axes, percent_axis, seq_color


def beam_sharing_plot(history: Sequence[tuple[int, int, int]], ax=None, title: str = "") -> Figure:
    """Blocks in use vs the blocks the same sequences would take unshared, per step.

    ``history`` is ``PagedKVCache.sharing_history``: (step, blocks in use, blocks unshared)."""
    fig, ax = axes(ax)
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
    fig, ax = axes(ax, (min(MAX_WIDTH_IN, 0.3 * cols + 0.8), 0.32 * rows + 1.6))  # 32 columns fit unscaled
    names = list(bm.tables)
    color = {name: seq_color(i) for i, name in enumerate(names)}
    owners, evictable = _owners(bm), set(bm.evictable_blocks)
    for b in range(n):
        x, y = b % cols, b // cols
        own = owners.get(b, [])
        if own:
            kinds = list(dict.fromkeys(own))  # a sequence appears once per block it owns
            for k, name in enumerate(kinds):
                ax.add_patch(Rectangle((x + k / len(kinds) * 0.9, y), 0.9 / len(kinds), 0.9,
                                       facecolor=color[name], lw=0))
            if len(own) > 1:
                ax.add_patch(Rectangle((x, y), 0.9, 0.9, fill=False, edgecolor=SHARED_EDGE, lw=1.6))
                ax.text(x + 0.45, y + 0.47, f"×{len(own)}", ha="center", va="center", fontsize=7.5, weight="bold",
                        color="white", bbox=dict(boxstyle="round,pad=0.1", fc="black", alpha=0.55, lw=0))
        elif b in evictable:
            ax.add_patch(Rectangle((x, y), 0.9, 0.9, facecolor=CACHED, edgecolor="#999999", hatch="..", lw=0.5))
        else:
            ax.add_patch(Rectangle((x, y), 0.9, 0.9, facecolor=FREE_BLOCK, edgecolor="#cccccc", lw=0.5))
        if cols <= 40:
            ax.text(x + 0.45, y + 0.98, str(b), ha="center", va="top", fontsize=7, color="#555555")
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
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0), ncol=min(len(handles), 4), fontsize=8,
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
    fig = Figure(figsize=(min(MAX_WIDTH_IN, 1.5 + 2.1 * depth_max), 1.0 + 0.95 * max(lane[0], 1)))
    ax = fig.add_subplot()
    for k in order:
        key, depth, parent, _ = nodes[k]
        x, y = depth * (W + GAP), y_of[k] * (H + 0.4)
        block = bm.cached_block(key.hash)
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
            toks = " ".join("?" if v is None else str(v) for v in rest[:max_tokens])
            toks += " …" if len(rest) > max_tokens else ""
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
    ``{num_blocks: SharingResult}`` (``minikv.sim.sharing.eviction_curve``)."""
    if isinstance(curve, Mapping):
        curve = [{"num_blocks": n, "hit_rate": r.hit_rate, "evictions": r.evictions} for n, r in curve.items()]
    fig, ax = axes(ax, (7, 3.8))
    x = [c["num_blocks"] for c in curve]
    ax.plot(x, [c["hit_rate"] for c in curve], "o-", color="tab:blue", label="block hit rate")
    ax.axhline(max(c["hit_rate"] for c in curve), color="tab:blue", ls=":", lw=1, label="with the largest pool")
    ax.yaxis.set_major_formatter(percent_axis())
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
    fig, ax = axes(ax, (7, 3.8))
    colors = {"parallel": "tab:green", "beam": "tab:purple"}
    for k, (kind, by_width) in enumerate(savings.items()):
        widths = [int(w) for w in by_width]
        ax.bar(np.arange(len(widths)) + (k - 0.5) * 0.38, list(by_width.values()), width=0.36, color=colors.get(kind),
               label=f"{kind}: ours")
        if paper and kind in paper:
            lo, hi = paper[kind]
            ax.axhspan(lo, hi, color=colors.get(kind), alpha=0.12, label=f"{kind}: paper {lo:.1%}-{hi:.1%}")
    ax.set_xticks(np.arange(len(widths)), [f"n / width {w}" for w in widths])
    ax.yaxis.set_major_formatter(percent_axis())
    ax.set_ylabel("KV block-steps saved by sharing")
    ax.legend(fontsize=8)
    ax.set_title(title or "memory saved by sharing blocks", fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    return fig


def paper_comparison_figure(ours: Mapping[str, Mapping[str, Mapping]], paper: Mapping[str, Mapping[str, tuple]],
                            title: str = "") -> Figure:
    """Memory saved by sharing, ours next to the PagedAttention paper's, width by width.

    ``ours``: ``{workload: {"parallel": {width: fraction}, "beam": {width: fraction}}}`` (``bench
    prefix``'s ``parallel_sampling_savings`` / ``beam_search_savings`` regrouped). ``paper``:
    ``{workload: {"parallel": (lo, hi), "beam": (lo, hi)}}``, the paper's range over widths 2-6 (its
    text gives the ends: the smallest width saves ``lo``, the largest ``hi``). One panel per kind of
    sharing; per width a pair of bars per workload: ours solid, the paper's hatched at the two ends and,
    between them, a line from ``lo`` to ``hi`` (the paper's text gives no figure there)."""
    kinds = ["parallel", "beam"]
    fig = Figure(figsize=(MAX_WIDTH_IN, 3.8), layout="constrained")  # unscaled in a notebook
    panels = fig.subplots(1, 2)
    colors = {"alpaca": "tab:green", "sharegpt": "tab:purple"}
    names = {"parallel": "parallel sampling (n samples)", "beam": "beam search (width)"}
    for ax, kind in zip(panels, kinds):
        workloads = list(ours)
        widths = sorted({int(w) for wl in workloads for w in ours[wl][kind]})
        step = 1 / (2 * len(workloads) + 1)
        for j, wl in enumerate(workloads):
            vals = {int(w): v for w, v in ours[wl][kind].items()}
            lo, hi = paper[wl][kind] if wl in paper and kind in paper[wl] else (None, None)
            for i, w in enumerate(widths):
                x = i + (2 * j - len(workloads) + 0.5) * step
                ax.bar(x, vals.get(w, 0.0), width=step * 0.95, color=colors.get(wl, seq_color(j)),
                       label=f"{wl}: ours" if i == 0 else None)
                if lo is None:
                    continue
                xp = x + step
                if w in (widths[0], widths[-1]):
                    ax.bar(xp, lo if w == widths[0] else hi, width=step * 0.95, facecolor="white",
                           edgecolor=colors.get(wl, "black"), hatch="///",
                           label=f"{wl}: paper ({lo:.1%}-{hi:.1%})" if i == 0 else None)
                else:
                    ax.plot([xp, xp], [lo, hi], color=colors.get(wl, "black"), lw=3, alpha=0.6)
        ax.set_xticks(range(len(widths)), [str(w) for w in widths])
        ax.set_xlabel(names[kind])
        ax.yaxis.set_major_formatter(percent_axis())
        ax.set_ylabel("KV block-steps saved")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7.5)
    fig.suptitle(title or "memory saved by sharing: ours (solid) vs Kwon et al. 2023, Fig. 15 (hatched: its "
                 "range's ends; line: width 4 lies somewhere in it)", fontsize=9)
    return fig
