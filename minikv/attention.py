"""Paged attention for one decode step: the readable PyTorch reference and its calling convention.

During decoding every sequence adds one token, whose query must attend to all the keys and
values the sequence has cached so far. With a paged cache those keys and values are not in
one slab: they sit in fixed-size blocks scattered over a shared pool, and each sequence's
*block table* lists which physical blocks hold its tokens, in order. Paged attention is
ordinary attention that reads K and V *through* the block table.

This module holds:

* ``paged_attention_ref``: the reference. A short loop over sequences that gathers each
  sequence's K/V into a contiguous tensor and runs plain softmax attention on it. It is slow
  and meant to be read; the Triton kernel (``kernels/paged_attention.py``) must agree with it.
* ``gather_kv``: the gathering step on its own, so tests and notebooks can compare against
  any contiguous attention (e.g. ``torch.nn.functional.scaled_dot_product_attention``).
* ``check_paged_attention_inputs``: the single place where the calling convention is checked,
  shared by the reference and the kernel wrapper, so both reject bad input with the same message.
  This module imports no kernel: ``kernels/paged_attention.py`` imports the check from here, and
  ``minikv.dispatch`` is the one place that chooses between the reference and the kernel.
* ``attend_gathered`` (with ``causal_bias``): the engine's vectorized form of the same arithmetic, over a
  planned step (``minikv.step``): whole blocks gathered per group of sequences, grouped matmuls, a masked
  softmax; ``minikv.dispatch.attend_layer`` calls it for the groups no kernel takes.
* ``random_paged_inputs``: a random decode batch laid out the way a real pool ends up, blocks
  scattered and table tails full of garbage, for tests and notebooks.

The calling convention, shared by the reference and the Triton kernel::

    query        [num_seqs, num_heads, head_dim]                  one new token per sequence
    key_cache    [num_blocks, block_size, num_kv_heads, head_dim] one layer
    value_cache  [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables [num_seqs, max_blocks_per_seq] int32   entries past a sequence's end are ignored
    seq_lens     [num_seqs] int32                       cached tokens, including the new one
    returns      [num_seqs, num_heads, head_dim]        in query's dtype

Grouped-query attention (GQA): ``num_heads`` is a multiple of ``num_kv_heads``; query head
``h`` reads KV head ``h // (num_heads // num_kv_heads)``. Multi-query attention (MQA) is the
case ``num_kv_heads == 1``; classic multi-head attention is ``num_kv_heads == num_heads``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from minikv.blocks import blocks_for
from minikv.step import AttnGroup

__all__ = [
    "PagedInputs",
    "check_paged_attention_inputs",
    "gather_kv",
    "paged_attention_ref",
    "random_paged_inputs",
]

_INDEX_DTYPES = (torch.int32, torch.int64)


def check_paged_attention_inputs(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    check_values: bool = True,
) -> None:
    """Raise a ``ValueError`` naming the problem if the inputs break the calling convention.

    Shapes, dtypes and devices are checked always (free). With ``check_values`` the lengths
    and the block-table entries each sequence actually uses are checked too; that reads
    ``seq_lens`` back to the host, which on a GPU is a synchronisation, so a hot loop that
    already trusts its inputs may turn it off.
    """
    if query.dim() != 3:
        raise ValueError(
            f"query must be [num_seqs, num_heads, head_dim] (one decode token per sequence); "
            f"got shape {tuple(query.shape)}"
        )
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if cache.dim() != 4:
            raise ValueError(
                f"{name} must be [num_blocks, block_size, num_kv_heads, head_dim] (one layer); "
                f"got shape {tuple(cache.shape)}"
            )
    if key_cache.shape != value_cache.shape:
        raise ValueError(
            f"key_cache {tuple(key_cache.shape)} and value_cache {tuple(value_cache.shape)} must have the same shape"
        )
    if block_tables.dim() != 2:
        raise ValueError(
            f"block_tables must be [num_seqs, max_blocks_per_seq]; got shape {tuple(block_tables.shape)}"
        )
    if seq_lens.dim() != 1:
        raise ValueError(f"seq_lens must be [num_seqs]; got shape {tuple(seq_lens.shape)}")

    num_seqs, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, cache_head_dim = key_cache.shape
    if head_dim != cache_head_dim:
        raise ValueError(f"query head_dim {head_dim} != cache head_dim {cache_head_dim}")
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads}): "
            f"each KV head serves an equal group of query heads (GQA)"
        )
    if block_tables.shape[0] != num_seqs or seq_lens.shape[0] != num_seqs:
        raise ValueError(
            f"query has {num_seqs} sequences but block_tables has {block_tables.shape[0]} rows "
            f"and seq_lens has {seq_lens.shape[0]} entries; they must match"
        )
    if block_tables.dtype not in _INDEX_DTYPES:
        raise ValueError(f"block_tables must be an integer tensor (int32); got {block_tables.dtype}: use .int()")
    if seq_lens.dtype not in _INDEX_DTYPES:
        raise ValueError(f"seq_lens must be an integer tensor (int32); got {seq_lens.dtype}: use .int()")
    if not query.is_floating_point():
        raise ValueError(f"query must be a floating-point tensor; got {query.dtype}")
    if key_cache.dtype != value_cache.dtype:
        raise ValueError(f"key_cache ({key_cache.dtype}) and value_cache ({value_cache.dtype}) must share a dtype")
    devices = {t.device for t in (query, key_cache, value_cache, block_tables, seq_lens)}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device; got {sorted(str(d) for d in devices)}")

    if not check_values or num_seqs == 0:
        return
    lens = seq_lens.long()
    capacity = block_tables.shape[1] * block_size
    bad = (lens < 1) | (lens > capacity)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"seq_lens[{i}] = {int(lens[i])} is out of range: each sequence holds at least its new token (>= 1) "
            f"and at most max_blocks_per_seq * block_size = {block_tables.shape[1]} * {block_size} = {capacity} "
            f"tokens; a longer sequence needs a wider block table with its new blocks in it"
        )
    # Only the entries a sequence uses must be valid block numbers; the rest may be garbage.
    blocks_used = (lens + block_size - 1) // block_size
    used = torch.arange(block_tables.shape[1], device=lens.device)[None, :] < blocks_used[:, None]
    out_of_pool = used & ((block_tables < 0) | (block_tables >= num_blocks))
    if bool(out_of_pool.any()):
        i, j = (int(x) for x in out_of_pool.nonzero()[0])
        raise ValueError(
            f"block_tables[{i}, {j}] = {int(block_tables[i, j])} is not a block of the pool "
            f"(0 .. {num_blocks - 1}) but sequence {i} needs it to hold its tokens: allocate the block first"
        )


def gather_kv(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table_row: torch.Tensor,
    seq_len: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy one sequence's keys and values out of the block pool, in token order.

    Returns contiguous K and V of shape ``[seq_len, num_kv_heads, head_dim]``: token ``t`` lives
    in logical block ``t // block_size`` (physical block ``block_table_row[t // block_size]``) at
    offset ``t % block_size``. Table entries past the blocks the sequence needs are not read.
    """
    block_size = key_cache.shape[1]
    blocks_needed = blocks_for(seq_len, block_size)
    physical = block_table_row[:blocks_needed].long()
    # [blocks_needed, block_size, kv_heads, dim] -> [blocks_needed * block_size, kv_heads, dim],
    # then drop the unused tail of the last block.
    keys = key_cache[physical].flatten(0, 1)[:seq_len]
    values = value_cache[physical].flatten(0, 1)[:seq_len]
    return keys, values


def paged_attention_ref(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Reference paged attention for one decode step (see the module docstring for shapes).

    One sequence at a time: gather its K/V through the block table, let every query head read
    the KV head of its group, and take a softmax computed in float32 (half-precision exponents
    of long rows lose too much accuracy to serve as a reference).
    """
    check_paged_attention_inputs(query, key_cache, value_cache, block_tables, seq_lens)
    num_heads = query.shape[1]
    group = num_heads // key_cache.shape[2]  # query heads per KV head
    out = torch.empty_like(query)
    for i, seq_len in enumerate(seq_lens.tolist()):
        keys, values = gather_kv(key_cache, value_cache, block_tables[i], seq_len)
        # [seq_len, kv_heads, dim] -> [seq_len, heads, dim]: KV head j is repeated for query
        # heads j*group .. j*group+group-1, i.e. query head h reads KV head h // group.
        keys = keys.float().repeat_interleave(group, dim=1)
        values = values.float().repeat_interleave(group, dim=1)
        q = query[i].float()  # [heads, dim]
        scores = torch.einsum("hd,thd->ht", q, keys) * scale  # [heads, seq_len]
        probs = torch.softmax(scores, dim=-1)
        out[i] = torch.einsum("ht,thd->hd", probs, values).to(query.dtype)
    return out


class PagedInputs(NamedTuple):
    """One decode step's arguments in the paged calling convention (see the module docstring)."""

    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor


# Written into table entries past each sequence's end: out of range for any pool, so code that
# wrongly reads through them fails loudly instead of quietly using some other sequence's block.
GARBAGE_BLOCK_NUMBERS = (-1, 2**31 - 1)


def random_paged_inputs(
    seq_lens: Sequence[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    spare_table_entries: int = 1,
    seed: int = 0,
) -> PagedInputs:
    """A random decode batch whose K/V blocks are scattered over the pool like a busy server's.

    Every sequence gets ``ceil(seq_len / block_size)`` physical blocks taken from a random
    permutation of the pool, so neighbouring logical blocks are almost never neighbours in
    memory. Each table row has ``spare_table_entries`` more columns than the longest sequence
    needs, and every entry past a sequence's last block holds garbage (``GARBAGE_BLOCK_NUMBERS``).
    """
    generator = torch.Generator().manual_seed(seed)
    blocks_needed = [blocks_for(n, block_size) for n in seq_lens]
    num_blocks = sum(blocks_needed) + 1  # one block no sequence owns: a stray read would find junk
    table_width = max(blocks_needed, default=0) + spare_table_entries
    garbage = torch.tensor(GARBAGE_BLOCK_NUMBERS, dtype=torch.int32)
    block_tables = garbage.repeat(table_width)[:table_width].repeat(len(seq_lens), 1)
    physical = torch.randperm(num_blocks, generator=generator).to(torch.int32)
    start = 0
    for row, count in enumerate(blocks_needed):
        block_tables[row, :count] = physical[start : start + count]
        start += count

    def randn(*shape: int) -> torch.Tensor:
        # Drawn in float32 on the CPU with a seeded generator (same numbers on every machine),
        # then cast and moved: the caller's device only sees the final tensor.
        return torch.randn(*shape, generator=generator).to(dtype=dtype, device=device)

    return PagedInputs(
        query=randn(len(seq_lens), num_heads, head_dim),
        key_cache=randn(num_blocks, block_size, num_kv_heads, head_dim),
        value_cache=randn(num_blocks, block_size, num_kv_heads, head_dim),
        block_tables=block_tables.to(device),
        seq_lens=torch.tensor(list(seq_lens), dtype=torch.int32, device=device),
    )


# -- the engine's gather path: the same arithmetic, vectorized over a planned step ------------------
def causal_bias(q_pos: torch.Tensor, num_keys: int, kv_heads: int, group_size: int) -> torch.Tensor:
    """[KVH*S, G*Q, num_keys]: 0 where query (at position q_pos) may see the key at that position, else -inf."""
    key_pos = torch.arange(num_keys, device=q_pos.device)
    allowed = key_pos[None, None, :] <= q_pos[:, :, None]  # causal, which also stops at each sequence's end
    bias = torch.zeros(allowed.shape, device=q_pos.device).masked_fill_(~allowed, float("-inf"))
    # One bias row per (KV head, sequence) x (query head in the group, query) row of the scores,
    # materialized once per step so every layer adds it inside its matmul (baddbmm).
    s, q_len = q_pos.shape
    bias = bias[None, :, None].expand(kv_heads, s, group_size, q_len, num_keys)
    return bias.reshape(kv_heads * s, group_size * q_len, num_keys)


def _softmax_attend(q, keys, values, bias, scaling):
    """softmax(bias + scaling * q k^T) v for [B, rows, D] queries over [B, L, D] keys and values."""
    # scores = bias + scaling * q @ k^T in one call; softmax in float32 even for half-precision models.
    scores = torch.baddbmm(bias, q, keys.transpose(1, 2), alpha=scaling)
    probs = scores.softmax(dim=-1, dtype=torch.float32).to(values.dtype)
    return torch.bmm(probs, values)


def attend_gathered(query: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor, group: AttnGroup,
            scaling: float) -> torch.Tensor:
    """Vectorized paged attention for one group: gather whole blocks, grouped matmuls, masked softmax.

    query [KVH, G, T, D]: the whole step's queries, grouped by the KV head they read.
    Returns [rows, H, D] for the group's real query rows.
    The store is head-major ([KVH, blocks, block_size, D]), so gathering a sequence's blocks yields
    each (KV head, sequence) pair's keys as one contiguous [W*block_size, D] matrix: one copy, and
    the matmuls read it as it lies. Grouped-query attention without repeating K/V: the G query
    heads that share a KV head are stacked along the query axis of one matmul.
    """
    kv_heads, g, _, head_dim = query.shape
    s, q_len = group.block_tables.shape[0], group.q_len
    q = query if group.identity else query[:, :, group.q_index]  # [KVH, G, S*Q, D]
    # [KVH, G, S, Q, D] -> [KVH, S, G*Q, D]
    q = q.view(kv_heads, g, s, q_len, head_dim).transpose(1, 2).reshape(kv_heads * s, g * q_len, head_dim)
    keys = k_store[:, group.block_tables].view(kv_heads * s, -1, head_dim)  # [KVH*S, L, D]
    values = v_store[:, group.block_tables].view(kv_heads * s, -1, head_dim)
    if group.bias is not None:
        out = _softmax_attend(q, keys, values, group.bias.to(q.dtype), scaling)  # [KVH*S, G*Q, D]
    else:  # a long prefill: one tile of queries at a time, each with its own slice of the bias
        q = q.view(kv_heads * s, g, q_len, head_dim)
        out = torch.empty_like(q)
        for t in range(0, q_len, group.q_tile):
            rows = slice(t, min(t + group.q_tile, q_len))
            bias = causal_bias(group.q_pos[:, rows], keys.shape[1], kv_heads, g).to(q.dtype)
            tile = q[:, :, rows].reshape(kv_heads * s, -1, head_dim)
            out[:, :, rows] = _softmax_attend(tile, keys, values, bias, scaling).view(
                kv_heads * s, g, -1, head_dim)
    # -> [S, Q, KVH, G, D] -> [S*Q, H, D]
    out = out.view(kv_heads, s, g, q_len, head_dim).permute(1, 3, 0, 2, 4).reshape(s * q_len, kv_heads * g, head_dim)
    return out if group.q_valid is None else out[group.q_valid]
