"""The landlord's window as a still picture: one recorded `/landlord/snapshot`, drawn with matplotlib.

The live page (`minikv serve`'s /landlord) needs a browser that can reach the server; a notebook
opened where an IFrame cannot load (a static render, a PDF, a proxy that blocks it) still shows the
lesson through this figure, drawn from the same JSON the page draws.
"""

from __future__ import annotations

import math

from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from minikv.viz.sharing import CACHED, FREE_BLOCK, SHARED_EDGE
from minikv.viz.style import MAX_WIDTH_IN, axes, seq_color


def landlord_figure(snap: dict, *, cols: int | None = None, ax=None, title: str = "") -> Figure:
    """The pool block by block as the page draws it: a held block in its tenant's colour (a shared one
    outlined, with its reference count), an evictable cached block grey and dotted, a free block blank;
    the counts and the last preemptions underneath."""
    n = snap["num_blocks"]
    cols = cols or min(n, 32)
    rows = math.ceil(n / cols)
    fig, ax = axes(ax, (min(MAX_WIDTH_IN, 0.3 * cols + 0.8), 0.32 * rows + 2.2))
    request_of = {t["seq_id"]: t["request_id"] for t in snap["tenants"]}
    order = list(dict.fromkeys(request_of[s] for s in snap["owner"] if s in request_of))
    color = {r: seq_color(i) for i, r in enumerate(order)}
    for b in range(n):
        x, y = b % cols, b // cols
        ref, owner = snap["refcount"][b], snap["owner"][b]
        if ref > 0:
            ax.add_patch(Rectangle((x, y), 0.9, 0.9, facecolor=color.get(request_of.get(owner), "#777777"), lw=0))
            if ref > 1:
                ax.add_patch(Rectangle((x, y), 0.9, 0.9, fill=False, edgecolor=SHARED_EDGE, lw=1.6))
                ax.text(x + 0.45, y + 0.47, f"×{ref}", ha="center", va="center", fontsize=7, weight="bold",
                        color="white")
        elif snap["cached"][b]:
            ax.add_patch(Rectangle((x, y), 0.9, 0.9, facecolor=CACHED, edgecolor="#999999", hatch="..", lw=0.5))
        else:
            ax.add_patch(Rectangle((x, y), 0.9, 0.9, facecolor=FREE_BLOCK, edgecolor="#cccccc", lw=0.5))
    ax.set_xlim(-0.2, cols + 0.1)
    ax.set_ylim(rows + 0.2, -0.2)
    ax.set_aspect("equal")
    ax.axis("off")
    c = snap["counts"]
    handles = [Patch(facecolor=color[r], label=r[-10:]) for r in order[:6]]
    handles += [Patch(facecolor="white", edgecolor=SHARED_EDGE, lw=1.6, label="shared (×refcount)"),
                Patch(facecolor=CACHED, edgecolor="#999999", hatch="..", label="cached, evictable"),
                Patch(facecolor=FREE_BLOCK, edgecolor="#cccccc", label="free")]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0), ncol=3, fontsize=7.5, frameon=False)
    last = snap["preemptions"][-3:]
    preempted = "; ".join(f"#{p['n']} {p['request'][-10:]}: {p['blocks']} blocks, {p['mode']}" for p in last)
    ax.set_title(title or f"step {snap['step']}: {c['running']} running, {c['waiting']} at the door, "
                 f"{c['blocks_used']} of {n} blocks held, {c['blocks_cached']} cached; {c['preemptions']} preemptions"
                 + (f"\nlast preempted: {preempted}" if preempted else ""), fontsize=8.5)
    return fig
