"""Stage 4's pictures (the kernel): ``roofline_figure``, ``kernel_grid_figure``, ``split_kv_figure`` and
``kernel_errors_figure`` (see each docstring)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle


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
    ax.set_yticks([num_seqs - 0.55 - s for s in range(num_seqs)],
                  [f"seq {s}\n({lens[s]} tokens)" for s in range(num_seqs)])
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
                ha="center", va="center", fontsize=8 if not garbage else 7,
                backgroundcolor="#eeeeee" if garbage else "none")
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
            "in its last block (its empty slots are masked out).\n"
            f"Program ({seq}, {1 - kv_head}) walks the same blocks, "
            f"reading KV head {1 - kv_head}'s slice of each.", fontsize=8.5)
    bx.legend(handles=[Patch(fc="tab:orange", label=f"sequence {seq}'s blocks (filled part: tokens)"),
                       Patch(fc="#dbe9f6", label="other sequences' blocks"),
                       Patch(fc="white", ec="k", label="free block")],
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
# owns), of its hash chain, of a copy-on-write, and of minikv.sim.sharing's measurements.

SHARED_EDGE, CACHED, FREE_BLOCK = "black", "#d9d9d9", "#f7f7f7"
