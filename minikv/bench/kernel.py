"""Kernel benchmark (stage 4): what does paging cost at the kernel? (``python -m minikv bench kernel``)

For a Llama-3-8B-shaped attention layer (32 query heads, 8 KV heads, head_dim 128) and a grid of
batch sizes and context lengths, one run measures side by side:

* the Triton paged-attention kernel (``kernels/paged_attention.py``) reading K/V through block
  tables whose blocks are scattered by a random permutation, as in a busy server;
* the bytes it must read (the K/V it actually touches, plus query, output and tables) and so its
  achieved bandwidth, also as a share of this card's copy bandwidth measured in the same run
  (a large device-to-device copy: the practical ceiling for a memory-bound kernel);
* contiguous attention on the same tokens: PyTorch's ``scaled_dot_product_attention`` on K/V laid
  out as ``[batch, kv_heads, context, head_dim]``, and, when ``flash_attn`` is installed,
  FlashAttention's decode kernel on contiguous and on paged K/V.

Every configuration is first checked against SDPA, then timed with ``triton.testing.do_bench``.
The vLLM paper reports its paged kernel 20-26% slower than a contiguous one; ``vs_sdpa`` is our
version of that number. Without a CUDA GPU there is nothing to measure: Triton's interpreter
proves the kernel correct (tests/test_kernel.py) but says nothing about speed.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

NO_GPU = "no CUDA GPU: the kernel benchmark needs one; the interpreter proves correctness, not speed"

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128  # one attention layer of Llama-3-8B
BATCHES, CONTEXTS = (1, 8, 64), (512, 4096, 16384, 32768)
QUICK_BATCHES, QUICK_CONTEXTS = (1, 8), (512, 4096)
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
# Relative error (||kernel - sdpa|| / ||sdpa||) allowed in the pre-timing check. Both accumulate in
# fp32, but SDPA's flash path rounds probabilities to the input dtype before multiplying by V.
# A kernel reading a wrong block would be off by ~100%, not by a few tenths of a percent.
REL_TOL = {torch.float16: 1e-2, torch.bfloat16: 3e-2}

Row = dict[str, Any]

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def _time_ms(fn: Callable[[], object]) -> float:
    import triton.testing

    # Median of many runs, with the L2 cache flushed in between: every call reads from DRAM.
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def measure_copy_gbps(device: torch.device) -> float:
    """This card's practical memory bandwidth: a large device-to-device copy, bytes read + written per second."""
    free, _ = torch.cuda.mem_get_info(device)
    nbytes = min(1 << 30, free // 8)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3) / 1e9


def _flash_attn() -> Callable[..., torch.Tensor] | None:
    if importlib.util.find_spec("flash_attn") is None:
        return None
    from flash_attn import flash_attn_with_kvcache

    return flash_attn_with_kvcache


def _scatter_into_blocks(
    contiguous: torch.Tensor, block_tables: torch.Tensor, num_blocks: int, block_size: int
) -> torch.Tensor:
    """[batch, kv_heads, ctx, dim] -> a [num_blocks, block_size, kv_heads, dim] pool, via the tables."""
    batch, kv_heads, ctx, dim = contiguous.shape
    pool = torch.zeros(num_blocks, block_size, kv_heads, dim, dtype=contiguous.dtype, device=contiguous.device)
    blocks_per_seq = block_tables.shape[1]
    for seq in range(batch):  # one sequence at a time keeps the temporary copy small
        tokens = contiguous[seq].transpose(0, 1)  # [ctx, kv_heads, dim]
        tokens = F.pad(tokens, (0, 0, 0, 0, 0, blocks_per_seq * block_size - ctx))
        pool[block_tables[seq].long()] = tokens.reshape(blocks_per_seq, block_size, kv_heads, dim)
    return pool


def bench_config(batch: int, context: int, dtype: torch.dtype, block_size: int, copy_gbps: float,
                 device: torch.device) -> Row:
    """Check, then time, one (batch, context, dtype) configuration. Skips it if it cannot fit."""
    from minikv_kernels.paged_attention import choose_num_splits, paged_attention, split_plan

    row: Row = dict(dtype=str(dtype).removeprefix("torch."), batch=batch, context=context, block_size=block_size)
    elem = torch.finfo(dtype).bits // 8
    kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * elem  # K and V
    flash = _flash_attn()
    # Contiguous copy + paged pool + the same pool in table order (+ a pool for FlashAttention) + 10% slack.
    needed = kv_bytes * (4 if flash else 3) * 1.1
    free, _ = torch.cuda.mem_get_info(device)
    if needed > free:
        return row | dict(status=f"skipped: needs {needed / 1e9:.0f} GB, {free / 1e9:.0f} GB free")

    gen = torch.Generator(device=device).manual_seed(batch * 100_003 + context)
    query = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=dtype, device=device, generator=gen)
    k = torch.randn(batch, NUM_KV_HEADS, context, HEAD_DIM, dtype=dtype, device=device, generator=gen)
    v = torch.randn(batch, NUM_KV_HEADS, context, HEAD_DIM, dtype=dtype, device=device, generator=gen)
    blocks_per_seq = math.ceil(context / block_size)
    num_blocks = batch * blocks_per_seq
    # Scatter every sequence's blocks over the whole pool: neighbours in a sequence are far apart.
    block_tables = torch.randperm(num_blocks, device=device, generator=gen).to(torch.int32)
    block_tables = block_tables.view(batch, blocks_per_seq)
    key_cache = _scatter_into_blocks(k, block_tables, num_blocks, block_size)
    value_cache = _scatter_into_blocks(v, block_tables, num_blocks, block_size)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    scale = HEAD_DIM**-0.5

    def sdpa() -> torch.Tensor:
        out = F.scaled_dot_product_attention(query[:, :, None, :], k, v, scale=scale, enable_gqa=True)
        return out[:, :, 0, :]

    def kernel() -> torch.Tensor:
        # Inputs were checked once below; skipping the check avoids a GPU->CPU sync per call.
        return paged_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, check_inputs=False)

    try:
        expected = sdpa()
    except torch.cuda.OutOfMemoryError:  # e.g. a backend that expands K/V for GQA
        return row | dict(status="skipped: SDPA ran out of memory")
    got = paged_attention(query, key_cache, value_cache, block_tables, seq_lens, scale)
    rel_err = float((got.float() - expected.float()).norm() / expected.float().norm())
    row |= dict(rel_err=rel_err, ok=rel_err <= REL_TOL[dtype])
    if not row["ok"]:
        return row | dict(status=f"WRONG: relative error {rel_err:.2e} vs SDPA")

    # What the kernel must read at the least: each touched K/V byte once (the cache holds exactly
    # `context` tokens per sequence), the query, the output it writes, the tables and lengths.
    bytes_moved = kv_bytes + 2 * query.numel() * elem + block_tables.numel() * 4 + seq_lens.numel() * 4
    kernel_ms, sdpa_ms = _time_ms(kernel), _time_ms(sdpa)
    # The clean price of the indirection: the same kernel, the same tokens, but every sequence's
    # blocks stored in order (block table = 0, 1, 2, ...), against the scattered pool above. Only
    # where the blocks lie differs, so the ratio is what scattering costs this kernel; the paper's
    # 20-26% compares two different kernels and so also measures how good each one is.
    order = block_tables.flatten().long()  # pool slot of sequence s's block b, in (s, b) order
    ordered_k, ordered_v = key_cache[order], value_cache[order]
    identity = torch.arange(num_blocks, dtype=torch.int32, device=device).view(batch, blocks_per_seq)
    ordered_got = paged_attention(query, ordered_k, ordered_v, identity, seq_lens, scale)
    if not torch.equal(ordered_got, got):
        return row | dict(status="WRONG: identity-table answer differs from the permuted-table answer")
    identity_ms = _time_ms(functools.partial(paged_attention, query, ordered_k, ordered_v, identity, seq_lens, scale,
                                             check_inputs=False))
    del ordered_k, ordered_v
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    row |= dict(
        status="ok",
        num_splits=split_plan(blocks_per_seq,
                              choose_num_splits(batch, NUM_KV_HEADS, blocks_per_seq, block_size, sms))[0],
        kernel_us=kernel_ms * 1e3,
        bytes=bytes_moved,
        gbps=bytes_moved / (kernel_ms * 1e-3) / 1e9,
        copy_gbps=copy_gbps,
        copy_share=bytes_moved / (kernel_ms * 1e-3) / 1e9 / copy_gbps,
        sdpa_us=sdpa_ms * 1e3,
        vs_sdpa=kernel_ms / sdpa_ms,
        identity_us=identity_ms * 1e3,
        permuted_vs_identity=kernel_ms / identity_ms,
    )
    if flash is not None:
        row |= _bench_flash(flash, query, k, v, key_cache, value_cache, block_tables, seq_lens, scale, kernel_ms)
    return row


def _bench_flash(flash: Callable[..., torch.Tensor], query: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, kernel_ms: float) -> Row:
    """FlashAttention's decode kernel on the same tokens: contiguous, and paged (its own page size if it must)."""
    q = query[:, None]  # [batch, 1 new token, heads, dim]
    contiguous = dict(k_cache=k.transpose(1, 2), v_cache=v.transpose(1, 2))  # [batch, ctx, kv_heads, dim] views
    out: Row = {}
    try:
        fa_ms = _time_ms(lambda: flash(q, **contiguous, cache_seqlens=seq_lens, softmax_scale=scale))
        out |= dict(fa_contig_us=fa_ms * 1e3, vs_fa_contig=kernel_ms / fa_ms)
    except Exception as err:  # an optional baseline: report why it is missing, keep benchmarking
        out["fa_note"] = f"contiguous: {err}"[:120]
    page = key_cache.shape[1]
    try:
        paged = dict(k_cache=key_cache, v_cache=value_cache, block_table=block_tables)
        flash(q, **paged, cache_seqlens=seq_lens, softmax_scale=scale)
    except RuntimeError:
        # Upstream FlashAttention-2 only pages in multiples of 256 tokens: give it its own pool.
        page = 256
        batch, pages_per_seq = k.shape[0], math.ceil(k.shape[2] / page)
        tables = torch.randperm(batch * pages_per_seq, device=k.device).to(torch.int32).view(batch, pages_per_seq)
        paged = dict(k_cache=_scatter_into_blocks(k, tables, tables.numel(), page),
                     v_cache=_scatter_into_blocks(v, tables, tables.numel(), page), block_table=tables)
    try:
        fa_ms = _time_ms(lambda: flash(q, **paged, cache_seqlens=seq_lens, softmax_scale=scale))
        out |= dict(fa_paged_us=fa_ms * 1e3, fa_page=page)
    except Exception as err:
        out["fa_note"] = f"paged: {err}"[:120]
    return out


def _print_table(rows: Sequence[Row]) -> None:
    cols = [("dtype", "{}"), ("batch", "{}"), ("context", "{}"), ("num_splits", "{}"), ("kernel_us", "{:.1f}"),
            ("gbps", "{:.0f}"), ("copy_share", "{:.0%}"), ("sdpa_us", "{:.1f}"), ("vs_sdpa", "{:.2f}x"),
            ("identity_us", "{:.1f}"), ("permuted_vs_identity", "{:.2f}x"),
            ("fa_contig_us", "{:.1f}"), ("fa_paged_us", "{:.1f}"), ("regs", "{}"), ("spill_bytes", "{}"),
            ("occupancy", "{:.0%}"), ("status", "{}")]
    cols = [(name, fmt) for name, fmt in cols if any(name in r for r in rows)]
    cells = [[name for name, _ in cols]]
    cells += [[fmt.format(r[name]) if name in r else "-" for name, fmt in cols] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    for row in cells:
        print("  ".join(cell.rjust(w) for cell, w in zip(row, widths)))


def plot(results: Sequence[Row]) -> Figure:
    """Left: achieved bandwidth vs context, one line per (dtype, batch), with the copy ceiling.
    Right: kernel time / contiguous SDPA time (solid) and, dashed, kernel time on scattered blocks /
    on the same blocks in order, with the vLLM paper's 1.20-1.26x band."""
    import matplotlib.pyplot as plt

    rows = [r for r in results if "kernel_us" in r]
    fig, (bw, ratio) = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    for dtype, batch in sorted({(r["dtype"], r["batch"]) for r in rows}):
        mine = sorted((r for r in rows if r["dtype"] == dtype and r["batch"] == batch), key=lambda r: r["context"])
        label = f"{dtype}, batch {batch}"
        bw.plot([r["context"] for r in mine], [r["gbps"] for r in mine], marker="o", label=label)
        line, = ratio.plot([r["context"] for r in mine], [r["vs_sdpa"] for r in mine], marker="o", label=label)
        if all("permuted_vs_identity" in r for r in mine):  # same colour, dashed: the clean indirection cost
            ratio.plot([r["context"] for r in mine], [r["permuted_vs_identity"] for r in mine], marker="x",
                       linestyle="--", color=line.get_color(), label=f"{label}: scattered / in-order table")
    copies = [r["copy_gbps"] for r in rows if "copy_gbps" in r]
    if copies:
        bw.axhline(max(copies), color="black", linestyle="--", linewidth=1, label="device copy (measured)")
    bw.set(xscale="log", xlabel="context (tokens)", ylabel="achieved GB/s", title="paged kernel bandwidth")
    ratio.axhspan(1.20, 1.26, color="tab:red", alpha=0.15, label="vLLM paper: paged 20-26% slower")
    ratio.axhline(1.0, color="black", linewidth=1)
    ratio.set(xscale="log", xlabel="context (tokens)", ylabel="time ratio (solid: vs SDPA; dashed: vs in-order)",
              title="cost of paging (lower is better)")
    contexts = sorted({r["context"] for r in rows})
    for ax in (bw, ratio):
        ax.set_xticks(contexts, [f"{c:,}" for c in contexts])
        ax.minorticks_off()
        ax.legend(fontsize=8)
    return fig


# --- static numbers: what the compiled kernel holds, read from cubins compiled for named GPUs ---

STATIC_CONTEXT = 4096  # tokens per sequence in the "bytes per decode call" column
BEFORE_JSON = Path(__file__).resolve().parents[2] / "kernels" / "resources_before.json"
IDEAL_GPUS = ("T4", "A100-80GB", "H100")


def decode_call_bytes(num_heads: int, num_kv_heads: int, head_dim: int, context: int, batch: int = 1,
                      block_size: int = 16, elem: int = 2) -> int:
    """What one layer's decode call must read and write at the least: every cached K/V byte of every
    sequence once, the query, the output, the block tables (int32) and the lengths."""
    blocks = -(-context // block_size)
    return (2 * batch * context * num_kv_heads * head_dim * elem + 2 * batch * num_heads * head_dim * elem
            + batch * blocks * 4 + batch * 4)


def static_rows(configs: Sequence[Any], context: int = STATIC_CONTEXT) -> list[Row]:
    """Compile each config for its target (no GPU needed) and return one row per compiled kernel,
    with the bytes a decode call moves and the time a perfect memory-bound kernel would take."""
    from minikv.sizing import gpu_spec
    from minikv_kernels.resources import static_resources

    rows = []
    for res in static_resources(list(configs)):
        row = res.as_row()
        if res.kernel == "attention":
            c = res.config
            nbytes = decode_call_bytes(c.num_heads, c.num_kv_heads, c.head_dim, context, block_size=c.block_size)
            row |= dict(context=context, bytes=nbytes)
            row |= {f"ideal_us_{g}": nbytes / (gpu_spec(g).bandwidth_gb_s * 1e9) * 1e6 for g in IDEAL_GPUS}
        rows.append(row)
    return rows


def before_rows() -> list[Row]:
    """The first kernel's numbers (broadcast multiply-and-sum, no tl.dot), compiled the same way
    at the commit named in the file, kept so the rework can be compared with what it replaced."""
    if not BEFORE_JSON.exists():
        return []
    return json.loads(BEFORE_JSON.read_text())["rows"]


def _key(row: Row) -> tuple:
    return (row["model"], row["block_size"], row["dtype"], row["split"], row["arch"], row["kernel"])


def print_static_table(rows: Sequence[Row], before: Sequence[Row] = ()) -> None:
    """Registers, spills, shared memory and occupancy per compiled kernel, the first kernel's
    registers, spills and resident warps beside them where known (kernels/resources_before.json),
    and the memory-bound ideal time per GPU."""
    from minikv_kernels.resources import ARCHS

    old = {_key(r): r for r in before}
    cols = ["model", "gpu", "dtype", "block", "split", "kernel", "warps", "regs", "spill B", "stack B", "smem KiB",
            "resident warps", "occupancy", "before regs", "before spill B", "before warps", "KiB/call"]
    cols += [f"ideal us {g}" for g in IDEAL_GPUS]
    cells = [cols]
    for r in rows:
        b = old.get(_key(r), {})
        cells.append([
            r["model"], f"sm_{r['arch']} ({ARCHS.get(r['arch'], '?')})", r["dtype"], str(r["block_size"]),
            "yes" if r["split"] else "no", r["kernel"], str(r["num_warps"]), str(r["registers"]),
            str(r["spill_stores"]), str(r["stack"]), f"{r['shared'] / 1024:.1f}",
            f"{r['resident_warps']} ({r['limited_by']})", f"{r['occupancy']:.0%}",
            str(b.get("registers", "-")), str(b.get("spill_stores", "-")), str(b.get("resident_warps", "-")),
            f"{r['bytes'] / 1024:.0f}" if "bytes" in r else "-",
        ] + [f"{r[f'ideal_us_{g}']:.1f}" if f"ideal_us_{g}" in r else "-" for g in IDEAL_GPUS])
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    for row in cells:
        print("  ".join(cell.rjust(w) for cell, w in zip(row, widths)))


def static_grid(full: bool) -> list[Any]:
    """The configs `--static` compiles: the headline shapes (Llama-3-8B, Llama-3-70B, SmolLM2 at
    block 16, fp16, on sm_75/80/90, unsplit and split) or, with --full, the compile test's grid."""
    from minikv_kernels.resources import full_grid, headline_grid

    return full_grid() if full else headline_grid()


def cli_static(args: argparse.Namespace) -> int:
    from minikv_kernels.resources import MAX_REGISTERS

    configs = static_grid(args.full)
    print(f"compiling {len(configs)} configs for their target GPUs (no GPU needed; a few seconds each) ...",
          flush=True)
    rows = static_rows(configs, args.context)
    print_static_table(rows, before_rows())
    print(f"KiB/call and ideal us: one layer, one sequence of {args.context:,} tokens, read once at the "
          f"GPU's datasheet bandwidth. Budget: no spills, <= {MAX_REGISTERS} registers per thread.")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
        print(f"wrote {len(rows)} rows to {args.json}")
    return 1 if any(r["spill_stores"] or r["registers"] > MAX_REGISTERS for r in rows) else 0


def _add_static_numbers(rows: list[Row], dtypes: Sequence[str], block_size: int, device: torch.device) -> None:
    """Put the compiled kernel's registers, spills and occupancy on this card beside each measured row."""
    from minikv_kernels.resources import KernelConfig, static_resources

    major, minor = torch.cuda.get_device_capability(device)
    arch = 10 * major + minor
    configs = [KernelConfig("llama-3-8b", NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, block_size, dtype, split, arch)
               for dtype in dtypes for split in (False, True)]
    try:
        found = {(r.config.dtype, r.config.split, r.kernel): r for r in static_resources(configs)}
    except Exception as err:  # static numbers are a bonus beside the measurement: say why they are missing
        print(f"static numbers for sm_{arch} unavailable: {str(err)[:200]}")
        return
    for row in rows:
        if "num_splits" not in row:
            continue
        res = found[(row["dtype"], row["num_splits"] > 1, "attention")]
        row |= dict(regs=res.registers, spill_bytes=res.spill_stores, smem=res.shared,
                    resident_warps=res.resident_warps, occupancy=res.occupancy, arch=arch)


def cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m minikv bench kernel",
        description="The Triton paged-attention kernel on a Llama-3-8B-shaped layer: achieved bandwidth, "
        "share of the card's copy bandwidth, and time relative to contiguous attention (CUDA only).",
    )
    parser.add_argument("--quick", action="store_true", help="a small grid: batch 1, 8 x context 512, 4096, float16")
    parser.add_argument("--json", metavar="PATH", type=Path, help="write the result rows to this JSON file")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    parser.add_argument("--device", default="cuda", help="which GPU (default: cuda, the current one)")
    parser.add_argument("--plot", metavar="PATH", type=Path, help="save the figure (png, svg, pdf)")
    parser.add_argument("--static", action="store_true",
                        help="no GPU needed: compile for sm_75/80/90 and print registers, spills, shared memory, "
                        "occupancy, bytes per decode call and the ideal memory-bound time on a T4, A100, H100")
    parser.add_argument("--full", action="store_true", help="with --static: every shape, block size, dtype and split")
    parser.add_argument("--context", type=int, default=STATIC_CONTEXT,
                        help=f"with --static: tokens per sequence for the bytes column (default {STATIC_CONTEXT})")
    args = parser.parse_args(argv)
    if args.static:
        return cli_static(args)
    if not torch.cuda.is_available():
        print(NO_GPU)
        return 0

    from tqdm.auto import tqdm

    batches, contexts = (QUICK_BATCHES, QUICK_CONTEXTS) if args.quick else (BATCHES, CONTEXTS)
    dtypes = ["float16"] if args.quick else list(DTYPES)
    device = torch.device(args.device)
    copy_gbps = measure_copy_gbps(device)
    print(f"{torch.cuda.get_device_name(device)}: device-to-device copy {copy_gbps:.0f} GB/s (read + write)")
    grid = [(d, b, c) for d in dtypes for b in batches for c in contexts]
    rows = []
    for dtype, batch, context in tqdm(grid, desc="kernel bench", unit="config"):
        rows.append(bench_config(batch, context, DTYPES[dtype], args.block_size, copy_gbps, device))
        torch.cuda.empty_cache()  # the next configuration may need most of the card
    _add_static_numbers(rows, dtypes, args.block_size, device)
    _print_table(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
        print(f"wrote {len(rows)} rows to {args.json}")
    if args.plot:
        plot(rows).savefig(args.plot, dpi=120)
        print(f"saved the figure to {args.plot}")
    return 1 if any(r.get("ok") is False for r in rows) else 0
