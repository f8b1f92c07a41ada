"""A paged KV cache for transformers: shared block pools, per-sequence block tables (stage 3).

Instead of one worst-case slab per sequence, each layer owns one *pool* of fixed-size blocks,
``[num_blocks, block_size, num_kv_heads, head_dim]``, shared by every sequence. A sequence
takes blocks only as its tokens arrive, from one ``BlockAllocator``; its ``BlockTable`` says
which physical block holds each run of ``block_size`` tokens. One block id names the same
block in every layer's pool (as in vLLM), so one table serves all layers.

On each forward step:

1. layer 0 finds room for the new tokens of every row (all rows or none: if the pool is
   short, ``OutOfBlocks`` says how many blocks were needed and how many were free, and no
   sequence's blocks are touched) and records the *slot mapping*: where each new token goes;
2. every layer scatters its new K/V into its pool at those slots;
3. every layer gathers its sequences' K/V back through the block tables as
   ``[batch, kv_heads, seq, head_dim]``, so transformers' own attention (eager or sdpa) runs
   unchanged. That gather is a copy; the paged-attention kernel of stage 4 skips it by
   reading the blocks in place, with the same ``block_tables`` and ``seq_lens`` as here.

Padding tokens of a left-padded batch are stored like any other token (the attention mask
hides them), exactly as transformers' DynamicCache does; the engine of stage 6 avoids them.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from minikv.blocks import BlockAllocator, BlockTable, OutOfBlocks
from minikv.contiguous import cache_shape, resolve_dtype_device


class PagedLayer(CacheLayerMixin):
    """One layer's K and V pools. Which slots to use is decided once per step by the cache."""

    is_compileable = False  # block tables are Python lists; keep generate from compiling around them
    is_sliding = False

    def __init__(self, cache: PagedKVCache, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.cache = cache  # the shared bookkeeping: allocator, block tables, this step's slots
        self._allocate(dtype, device)

    def _allocate(self, dtype: torch.dtype, device: torch.device) -> None:
        c = self.cache
        shape = (c.num_blocks, c.block_size, c.shape.num_kv_heads, c.shape.head_dim)
        self.key_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.value_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.device = self.key_cache.device
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self._allocate(key_states.dtype, key_states.device)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Scatter the new K/V into the pools; return all of each row's K/V, gathered."""
        rows, heads, new, dim = key_states.shape
        if (heads, dim) != tuple(self.key_cache.shape[2:]):
            raise ValueError(f"the model gives K/V with {heads} heads of {dim}, but the pools were built for "
                             f"{tuple(self.key_cache.shape[2:])}: build the cache from this model's config")
        slots, token_slots = self.cache.slot_mapping, self.cache.token_slots
        out = []
        for pool, states in ((self.key_cache, key_states), (self.value_cache, value_states)):
            flat = pool.view(-1, heads, dim)  # [num_blocks * block_size, H, D]: a slot per row
            # [rows, H, new, D] -> [rows * new, H, D], ordered like slot_mapping (row-major).
            flat.index_copy_(0, slots, states.transpose(1, 2).reshape(rows * new, heads, dim))
            # Gather every cached token of every row: [rows, seq, H, D] -> [rows, H, seq, D].
            out.append(flat[token_slots].transpose(1, 2))
        return out[0], out[1]

    def get_seq_length(self) -> int:
        return self.cache.get_seq_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # Asked before the step runs: attention sees the cached tokens plus the new ones.
        return self.cache.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return self.cache.num_blocks * self.cache.block_size  # one sequence holding the whole pool

    def reset(self) -> None:
        pass  # stale K/V is never read: reads go through block tables. The cache frees the blocks.


class PagedKVCache(Cache):
    """A ``transformers.Cache`` storing K/V in fixed-size blocks from one shared pool per layer.

    ``PagedKVCache(model.config, num_blocks=256, block_size=16)`` reserves 256 blocks of 16
    token slots in every layer; sequences take them as they grow and give them back on
    ``free(row)`` / ``reset()``.
    """

    def __init__(self, config, num_blocks: int, block_size: int = 16,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None, *,
                 allocator: BlockAllocator | None = None, table_cls: type[BlockTable] = BlockTable):
        """``allocator`` and ``table_cls`` swap in another block allocator and block table with the
        same interface (exercise 03 runs a learner's own through a real model this way)."""
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        if allocator is not None and allocator.num_blocks != num_blocks:
            raise ValueError(f"the allocator hands out {allocator.num_blocks} blocks but the pools would hold "
                             f"{num_blocks}: build both with the same num_blocks")
        self.allocator = allocator if allocator is not None else BlockAllocator(num_blocks)  # checks num_blocks >= 1
        self.table_cls = table_cls
        self.num_blocks, self.block_size = num_blocks, block_size
        self.shape = cache_shape(config)
        self.tables: list[BlockTable] = []  # one per batch row, created at the first step
        dtype, device = resolve_dtype_device(config, dtype, device)
        layers = [PagedLayer(self, dtype, device) for _ in range(self.shape.num_layers)]
        super().__init__(layers=layers)
        self._clear_step()

    def _clear_step(self) -> None:
        device = self.layers[0].device
        self.slot_mapping = torch.empty(0, dtype=torch.long, device=device)  # [rows * new] of the last step
        self.token_slots = torch.empty(0, 0, dtype=torch.long, device=device)  # [rows, seq]: every token's slot

    # ---- the step: layer 0 allocates, every layer writes and reads ----

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if layer_idx == 0:  # transformers runs the layers in order: layer 0 opens each step
            self._follow_model(key_states)
            self._reserve_slots(rows=key_states.shape[0], new=key_states.shape[-2])
        return self.layers[layer_idx].update(key_states, value_states)

    def _follow_model(self, key_states: torch.Tensor) -> None:
        """Re-allocate the pools on the model's dtype/device, if they differ, while nothing is stored."""
        pool = self.layers[0].key_cache
        if (key_states.dtype, key_states.device) == (pool.dtype, pool.device):
            return
        if self.allocator.num_used:
            raise ValueError(
                f"the pools hold {pool.dtype} K/V on {pool.device}, but the model now gives {key_states.dtype} on "
                f"{key_states.device}; call cache.reset() first, or build the cache with dtype=model.dtype, "
                "device=model.device")
        for layer in self.layers:
            layer.lazy_initialization(key_states, key_states)
        self._clear_step()

    def _reserve_slots(self, rows: int, new: int) -> None:
        new_batch = all(t.num_tokens == 0 for t in self.tables)  # (or a first step that failed)
        if new_batch:
            self.tables = [self.table_cls(self.block_size, self.allocator) for _ in range(rows)]
        if rows != len(self.tables):
            raise ValueError(f"the batch changed from {len(self.tables)} to {rows} sequences mid-generation; "
                             "call cache.reset() before starting a new batch")
        if len({t.num_tokens for t in self.tables}) > 1:
            raise ValueError("rows hold different numbers of tokens (was one freed?); a transformers batch "
                             "moves all rows together, so call cache.reset() and start the batch again")
        # All or nothing: check every row before taking a single block, so a failure leaves
        # the allocator, the tables and every other sequence's blocks as they were.
        needed = sum(t.blocks_needed(new) for t in self.tables)
        if needed > self.allocator.num_free:
            raise OutOfBlocks(needed, self.allocator.num_free, f"{new} new token(s) in each of {rows} sequence(s)")
        slots = [t.append_tokens(new) for t in self.tables]
        step_slots = torch.tensor(slots, dtype=torch.long, device=self.layers[0].device)  # [rows, new]
        self.slot_mapping = step_slots.flatten()
        # Every cached token's slot, [rows, seq]: the earlier steps' slots and this step's. These are
        # the numbers the paged-attention kernel computes from the block table:
        # slot(b, t) = block_tables[b, t // block_size] * block_size + t % block_size.
        self.token_slots = step_slots if new_batch else torch.cat([self.token_slots, step_slots], dim=1)

    # ---- what the kernel and the notebooks read ----

    @property
    def block_tables(self) -> torch.Tensor:
        """``[batch, max_blocks]`` int32. Short rows are padded with block 0: a valid id, so a kernel
        that over-reads stays in bounds; ``seq_lens`` says where each row really ends."""
        width = max((len(t) for t in self.tables), default=0)
        padded = [t.blocks + [0] * (width - len(t)) for t in self.tables]
        return torch.tensor(padded, dtype=torch.int32, device=self.layers[0].device).view(len(self.tables), width)

    @property
    def seq_lens(self) -> torch.Tensor:
        """``[batch]`` int32: tokens cached per row."""
        return torch.tensor([t.num_tokens for t in self.tables], dtype=torch.int32, device=self.layers[0].device)

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.tables[0].num_tokens if self.tables else 0

    def bytes_per_block(self) -> int:
        """K and V, all layers: what one block id costs."""
        pool = self.layers[0].key_cache
        return 2 * len(self.layers) * pool[0].nbytes

    def reserved_bytes(self) -> int:
        """The pools, whole: fixed when the cache is built."""
        return self.num_blocks * self.bytes_per_block()

    def allocated_bytes(self) -> int:
        """Blocks handed to sequences (their unfilled tails included)."""
        return self.allocator.num_used * self.bytes_per_block()

    def used_bytes(self) -> int:
        """Slots holding tokens; allocated - used is the waste in each sequence's last block."""
        tokens = sum(t.num_tokens for t in self.tables)
        return tokens * self.bytes_per_block() // self.block_size

    # ---- giving blocks back ----

    def free(self, row: int) -> None:
        """Return every block of one batch row to the pool (a finished or aborted request)."""
        self.tables[row].free()

    def reset(self) -> None:
        """Free every row and forget the batch: the cache is ready for a new generate call."""
        for table in self.tables:
            table.free()
        self.tables = []
        self._clear_step()

    def _needs_sharing(self, *args, **kwargs):
        raise NotImplementedError(
            "PagedKVCache does not reorder, repeat or crop rows: beam search and assisted decoding need blocks "
            "shared between sequences with copy-on-write, which stage 5 (minikv.prefix) adds. Use greedy or "
            "sampling here, or ContiguousKVCache / DynamicCache for beam search.")

    reorder_cache = batch_repeat_interleave = batch_select_indices = crop = _needs_sharing

    def __repr__(self) -> str:
        return (f"PagedKVCache(num_blocks={self.num_blocks}, block_size={self.block_size}, "
                f"free={self.num_free_blocks}, seq_lens={self.seq_lens.tolist()})")
