"""A Triton paged-attention decode kernel: attention that reads K/V through a block table.

Same calling convention (``minikv.attention``'s docstring) and answer as
``minikv.attention.paged_attention_ref``, but as one GPU pass that never builds a contiguous
copy of anybody's K/V. Decode attention does almost no arithmetic per byte (each cached K/V
element is used by a handful of query heads, once), so its speed is set by how fast the
cache can be read. Every design choice below serves one goal: read each cached byte once, in
large enough pieces, with every SM busy.

* One program per (sequence, KV head) handles *all* query heads that share that KV head, so
  under GQA/MQA each K/V byte is loaded once, not once per query head. The group is padded to
  at least 16 rows so that both products (scores and the weighted sum of V) run as ``tl.dot`` on
  tensor cores; a group wider than 64 (MQA) is cut over several programs.
* The program walks the sequence 16 tokens at a time, looking up each token's physical block in
  the block table: this indirection is all that paging adds to ordinary attention.
* Online softmax: a running max and sum let each block be folded in and forgotten, so the
  scores of a 32k-token context never need to exist at once.
* Split-KV ("flash-decoding"): with few sequences, (sequence, KV head) pairs alone cannot fill
  the GPU; then the context is cut into chunks, each a program of its own, and a second small
  kernel merges their partial results.

Without a CUDA GPU this module defines its kernels for Triton's interpreter (numpy on the CPU), so the
same kernel can be run and checked anywhere, and says so (``INTERPRETED``). The interpreter is for
correctness, never for timing; kernels/resources.py compiles the kernel for named GPUs without one, to
read its register use.
"""

from __future__ import annotations

import os
import sys

import torch

# Triton decides once, when it is imported, whether @triton.jit compiles or interprets (its own helpers such as
# tl.cdiv and tl.max are defined then), by reading TRITON_INTERPRET. Without a CUDA GPU only the interpreter can
# run a kernel, so this module, where the kernels are defined, sets that switch (nothing else in minikv does). It
# stays set: Triton reads it again later (importing its gluon helpers at a launch asserts that the interpreter
# is still on), so from here on every Triton kernel this process defines is interpreted, as on this machine it
# must be. A value already in the environment is respected (kernels/resources.py compiles for named GPUs in a
# child started with TRITON_INTERPRET=0).
_SET_HERE = not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ
if _SET_HERE:
    if "triton" in sys.modules:
        raise ImportError("Triton was imported (perhaps by torch.compile, or transformers' generate) before this "
                          "module, compiling, so its kernels cannot run on this machine without a CUDA GPU. Import "
                          "minikv_kernels.paged_attention before anything imports Triton, or start Python with "
                          "TRITON_INTERPRET=1 in the environment.")
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402  (import after choosing interpreter mode, on purpose)
import triton.language as tl  # noqa: E402

from minikv.attention import check_paged_attention_inputs  # noqa: E402

LOG2E = 1.4426950408889634  # exp(x) == exp2(x * log2(e)); exp2 is the cheaper instruction
MIN_TOKENS_PER_SPLIT = 256  # below this a split's fixed costs outweigh the parallelism it adds
MAX_SPLITS = 64


@triton.jit
def _paged_attention_kernel(
    out_ptr, part_max_ptr, part_sum_ptr, part_acc_ptr,
    query_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, seq_lens_ptr,
    scale_log2e, num_splits, blocks_per_split,
    stride_qs, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_ts, stride_tb,
    stride_os, stride_oh, stride_od,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    GROUP: tl.constexpr, TILE_H: tl.constexpr, HEAD_TILES: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    SPLIT_KV: tl.constexpr, IEEE_FP32: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1) // HEAD_TILES
    head_tile = tl.program_id(1) % HEAD_TILES
    split = tl.program_id(2)
    num_heads = (tl.num_programs(1) // HEAD_TILES) * GROUP

    # This split's share of the sequence, in tokens: whole blocks, ending at seq_len. The loop
    # bound comes from seq_len, so table entries past the sequence's end are never even loaded:
    # they may hold garbage.
    seq_len = tl.load(seq_lens_ptr + seq)
    start = split * blocks_per_split * BLOCK_SIZE
    end = tl.minimum(start + blocks_per_split * BLOCK_SIZE, seq_len)

    # The query heads that share this KV head, TILE_H rows at a time: TILE_H is at least 16
    # (tl.dot's smallest tile), so a group of 3 or 4 heads fills 3 or 4 rows and masks the rest.
    # Padding costs tensor-core arithmetic, which decode has to spare; it saves registers.
    h = head_tile * TILE_H + tl.arange(0, TILE_H)
    head_ok = h < GROUP
    heads = kv_head * GROUP + h
    d = tl.arange(0, HEAD_DIM_PAD)  # powers of two only: a head_dim of 80 is padded and masked
    dim_ok = d < HEAD_DIM
    n = tl.arange(0, TILE_N)

    q = tl.load(query_ptr + seq * stride_qs + heads[:, None] * stride_qh + d[None, :] * stride_qd,
                mask=head_ok[:, None] & dim_ok[None, :], other=0.0)  # [TILE_H, HEAD_DIM_PAD]

    # Online-softmax state, one row per query head, all fp32: in fp16 a sum over thousands of
    # tokens would lose precision and exp of large scores would overflow.
    m = tl.full([TILE_H], float("-inf"), tl.float32)  # running max of the scores seen (log2 units)
    l = tl.zeros([TILE_H], tl.float32)  # running sum of exp2(score - m)
    acc = tl.zeros([TILE_H, HEAD_DIM_PAD], tl.float32)  # running sum of exp2(score - m) * v

    for n0 in range(start, end, TILE_N):
        # TILE_N tokens (at least 16, for tl.dot) at a time, each found through the block table:
        # logical block pos // BLOCK_SIZE lives in physical block `physical`. With blocks of 16 or
        # more, a tile lies in one block and these loads all hit the same table entry; with blocks
        # of 1 or 8 it gathers from several. int64 before multiplying: physical * stride_kb passes
        # 2**31 elements once the pool is a few GB, and an int32 product would silently wrap.
        pos = n0 + n
        tok_ok = pos < end
        physical = tl.load(block_tables_ptr + seq * stride_ts + (pos // BLOCK_SIZE) * stride_tb,
                           mask=tok_ok, other=0).to(tl.int64)
        slot = physical * stride_kb + (pos % BLOCK_SIZE) * stride_kt
        kv_mask = tok_ok[:, None] & dim_ok[None, :]
        k = tl.load(key_cache_ptr + slot[:, None] + kv_head * stride_kh + d[None, :] * stride_kd,
                    mask=kv_mask, other=0.0)  # [TILE_N, HEAD_DIM_PAD]
        v_slot = physical * stride_vb + (pos % BLOCK_SIZE) * stride_vt
        v = tl.load(value_cache_ptr + v_slot[:, None] + kv_head * stride_vh + d[None, :] * stride_vd,
                    mask=kv_mask, other=0.0)

        # Scores for every (query head, token) pair, [TILE_H, TILE_N], on tensor cores with an
        # fp32 accumulator. Scaling by scale*log2(e) here lets the softmax use exp2 directly.
        if IEEE_FP32:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")  # fp32 inputs: no TF32 rounding
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(tok_ok[None, :], s * scale_log2e, float("-inf"))  # masked tokens: zero weight

        # Fold the tile in. Every tile visited holds at least one real token, so m_new is finite;
        # on the first tile exp2(-inf - m_new) = 0 wipes the empty initial state.
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)  # rescales what was summed under the old max
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        # P @ V on tensor cores: the probabilities are rounded to V's dtype first (as
        # FlashAttention does); the sum over tokens still accumulates in fp32.
        if IEEE_FP32:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new

    out_mask = head_ok[:, None] & dim_ok[None, :]
    if SPLIT_KV:
        # Hand the partial state to the combine kernel, unnormalised. A split that lies wholly
        # past this sequence's end writes m = -inf, l = 0, acc = 0, which the combine ignores.
        row = (seq * num_heads + heads) * num_splits + split  # [seq, head, split] in the buffers
        tl.store(part_max_ptr + row, m, mask=head_ok)
        tl.store(part_sum_ptr + row, l, mask=head_ok)
        tl.store(part_acc_ptr + row[:, None] * HEAD_DIM + d[None, :], acc, mask=out_mask)
    else:
        out = acc / l[:, None]  # l >= 1 for real rows: the max term contributes exp2(0)
        tl.store(out_ptr + seq * stride_os + heads[:, None] * stride_oh + d[None, :] * stride_od,
                 out.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _combine_splits_kernel(
    out_ptr, part_max_ptr, part_sum_ptr, part_acc_ptr, num_splits,
    stride_os, stride_oh, stride_od,
    SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):
    # One program per (sequence, query head). Each split computed its softmax against its own
    # max; rescaling split i by exp2(m_i - m) puts them all on the common max m, after which sums
    # and accumulators simply add: the same algebra as one step of the online softmax.
    seq = tl.program_id(0)
    head = tl.program_id(1)
    rows = (seq * tl.num_programs(1) + head) * num_splits + tl.arange(0, SPLITS_PAD)
    split_ok = tl.arange(0, SPLITS_PAD) < num_splits
    d = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = d < HEAD_DIM

    m_i = tl.load(part_max_ptr + rows, mask=split_ok, other=float("-inf"))
    l_i = tl.load(part_sum_ptr + rows, mask=split_ok, other=0.0)
    acc_i = tl.load(part_acc_ptr + rows[:, None] * HEAD_DIM + d[None, :],
                    mask=split_ok[:, None] & dim_ok[None, :], other=0.0)
    m = tl.max(m_i, axis=0)  # finite: seq_len >= 1, so some split saw a token
    # Empty splits (m_i = -inf) get weight exactly 0; the where() keeps any -inf - -inf = NaN out.
    w = tl.where(m_i > float("-inf"), tl.exp2(m_i - m), 0.0)
    out = tl.sum(w[:, None] * acc_i, axis=0) / tl.sum(w * l_i, axis=0)
    tl.store(out_ptr + seq * stride_os + head * stride_oh + d * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=dim_ok)


# What @triton.jit actually chose above: a compiled JITFunction, or the interpreter's stand-in.
INTERPRETED = not isinstance(_paged_attention_kernel, triton.runtime.jit.JITFunction)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_blocks_per_seq: int, block_size: int,
                      num_sms: int) -> int:
    """How many chunks to cut each context into so that the GPU has enough programs to run.

    Without splitting there are num_seqs * num_kv_heads programs. If that already covers the
    SMs, or the context is short, splitting only adds a second launch: use 1. Otherwise aim for
    about two programs per SM, but give each split at least MIN_TOKENS_PER_SPLIT tokens.
    The context length used is the table's capacity, known from shapes alone: reading the real
    lengths back from the GPU would stall the CPU on every decode step.
    """
    programs = num_seqs * num_kv_heads
    max_context = max_blocks_per_seq * block_size
    if programs >= num_sms or max_context < 2 * MIN_TOKENS_PER_SPLIT:
        return 1
    wanted = -(-2 * num_sms // programs)
    return max(1, min(wanted, max_context // MIN_TOKENS_PER_SPLIT, max_blocks_per_seq, MAX_SPLITS))


def split_plan(max_blocks_per_seq: int, num_splits: int) -> tuple[int, int]:
    """(splits that actually run, blocks per split): equal shares of the table, and no split that
    would start past every table's end (asking for 33 splits of 512 blocks runs 32 of 16)."""
    blocks_per_split = triton.cdiv(max_blocks_per_seq, num_splits)
    return triton.cdiv(max_blocks_per_seq, blocks_per_split), blocks_per_split


def launch_meta(group: int, head_dim: int, block_size: int, fp32: bool = False) -> dict:
    """The attention kernel's tile sizes and launch options for one shape (compile-time constants).

    Chosen from the compiled kernels' resource numbers (``python -m minikv bench kernel --static``),
    not by guess: see kernels/resources.py. Every tl.dot side must be a power of two >= 16.
    """
    pow2 = triton.next_power_of_2
    # Head rows per program: the group padded to >= 16, but at most 64, so that a multi-query
    # group (Falcon-7B: 71 heads on one KV head) is cut over two programs instead of holding a
    # [128, head_dim] fp32 accumulator in registers.
    head_tiles = triton.cdiv(group, 64)
    tile_h = max(16, pow2(triton.cdiv(group, head_tiles)))
    head_dim_pad = max(16, pow2(head_dim))
    return dict(
        # 16 tokens per step whatever the block size: 32 raised a T4's registers from 127 to 208
        # per thread for Llama-3-8B (half the resident warps) and spilled at head_dim 256.
        BLOCK_SIZE=block_size, TILE_N=16,
        GROUP=group, TILE_H=tile_h, HEAD_TILES=head_tiles,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        IEEE_FP32=fp32,
        # A [64, 64] (MQA) or [16, 256] (Gemma) accumulator over 4 warps takes ~220-240 registers
        # per thread on a T4; over 8 warps, ~126.
        num_warps=8 if tile_h * head_dim_pad >= 4096 else 4,
        # Two stages: the next tile's K/V loads are issued while this one is being used.
        num_stages=2,
    )


def combine_warps(splits_pad: int, head_dim_pad: int) -> int:
    """Warps for the combine kernel, which holds all splits' [SPLITS_PAD, HEAD_DIM_PAD] partial
    outputs at once: at 64 splits of head_dim 256, 4 warps needed ~190 registers per thread."""
    return 8 if splits_pad * head_dim_pad > 8192 else 4


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    num_splits: int | None = None,
    check_inputs: bool = True,
) -> torch.Tensor:
    """Paged attention for one decode step; shapes as in ``minikv.attention``'s docstring.

    ``num_splits=None`` picks split-KV by ``choose_num_splits`` on a GPU and 1 under the
    interpreter; an explicit number forces it (tests use that to run both paths anywhere).
    ``check_inputs=False`` skips the checks that read ``seq_lens`` back to the host.
    """
    check_paged_attention_inputs(query, key_cache, value_cache, block_tables, seq_lens, check_values=check_inputs)
    if INTERPRETED and torch.bfloat16 in (query.dtype, key_cache.dtype):
        raise ValueError("Triton's CPU interpreter has no bfloat16: use float16 or float32 on the CPU "
                         "(bfloat16 works with the compiled kernel on a GPU)")
    if not INTERPRETED and not query.is_cuda:
        raise ValueError("the compiled kernel needs CUDA tensors; for CPU tensors use minikv.attention."
                         "paged_attention_ref, or run with TRITON_INTERPRET=1 set before importing this module")
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    max_blocks = block_tables.shape[1]
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_seqs == 0:
        return out

    if num_splits is None:
        num_splits = 1 if INTERPRETED else choose_num_splits(
            num_seqs, num_kv_heads, max_blocks, block_size,
            torch.cuda.get_device_properties(query.device).multi_processor_count)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1; got {num_splits}")
    num_splits, blocks_per_split = split_plan(max_blocks, num_splits)

    if num_splits > 1:
        part_max = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=query.device)
        part_sum = torch.empty_like(part_max)
        part_acc = torch.empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=query.device)
    else:
        part_max = part_sum = part_acc = out  # placeholders: the unsplit kernel never touches them

    meta = launch_meta(num_heads // num_kv_heads, head_dim, block_size, query.dtype == torch.float32)
    _paged_attention_kernel[(num_seqs, num_kv_heads * meta["HEAD_TILES"], num_splits)](
        out, part_max, part_sum, part_acc,
        query, key_cache, value_cache, block_tables, seq_lens,
        scale * LOG2E, num_splits, blocks_per_split,
        *query.stride(), *key_cache.stride(), *value_cache.stride(), *block_tables.stride(), *out.stride(),
        SPLIT_KV=num_splits > 1, **meta,
    )
    if num_splits > 1:
        splits_pad, head_dim_pad = triton.next_power_of_2(num_splits), triton.next_power_of_2(head_dim)
        _combine_splits_kernel[(num_seqs, num_heads)](
            out, part_max, part_sum, part_acc, num_splits, *out.stride(),
            SPLITS_PAD=splits_pad, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
            num_warps=combine_warps(splits_pad, head_dim_pad),
        )
    return out


def compile_specs(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, split: bool, dtype: str,
                  **overrides):
    """What a launch of this shape compiles, for kernels/resources.py to compile without a GPU.

    Yields (name, kernel, signature, constexprs, num_warps, num_stages) for the attention kernel
    and, when ``split``, the combine kernel. Strides are those of contiguous tensors: the ones
    equal to 1 become constants and the rest are marked divisible by 16 when they are, exactly
    as Triton specialises a real launch. ``overrides`` replace launch_meta's choices (for tuning).
    """
    ptr = "*" + dtype
    meta = launch_meta(num_heads // num_kv_heads, head_dim, block_size, dtype == "fp32") | overrides
    warps, stages = meta.pop("num_warps"), meta.pop("num_stages")
    sig = dict(out_ptr=ptr, part_max_ptr="*fp32", part_sum_ptr="*fp32", part_acc_ptr="*fp32", query_ptr=ptr,
               key_cache_ptr=ptr, value_cache_ptr=ptr, block_tables_ptr="*i32", seq_lens_ptr="*i32",
               scale_log2e="fp32", num_splits="i32", blocks_per_split="i32")
    strides = dict(stride_qs=num_heads * head_dim, stride_qh=head_dim, stride_qd=1,
                   stride_kb=block_size * num_kv_heads * head_dim, stride_kt=num_kv_heads * head_dim,
                   stride_kh=head_dim, stride_kd=1)
    strides.update({k.replace("_k", "_v"): v for k, v in strides.items() if k.startswith("stride_k")})
    strides.update(stride_ts=1000, stride_tb=1, stride_os=num_heads * head_dim, stride_oh=head_dim, stride_od=1)
    sig.update({k: "i32" for k, v in strides.items() if v != 1})
    const = {k: 1 for k, v in strides.items() if v == 1}
    const["_divisible_by_16"] = {k: v % 16 == 0 for k, v in strides.items() if v != 1}
    const.update(meta, SPLIT_KV=split)
    specs = [("attention", _paged_attention_kernel, sig, const, warps, stages)]
    if split:
        csig = dict(out_ptr=ptr, part_max_ptr="*fp32", part_sum_ptr="*fp32", part_acc_ptr="*fp32", num_splits="i32",
                    stride_os="i32", stride_oh="i32")
        # The most splits a launch can have: the largest tile the combine kernel ever holds.
        head_dim_pad = triton.next_power_of_2(head_dim)
        cconst = dict(stride_od=1, SPLITS_PAD=MAX_SPLITS, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
                      _divisible_by_16=dict(stride_os=True, stride_oh=head_dim % 16 == 0))
        specs.append(("combine", _combine_splits_kernel, csig, cconst, combine_warps(MAX_SPLITS, head_dim_pad), 3))
    return specs
