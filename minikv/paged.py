"""A paged KV cache for transformers: shared block pools, per-sequence block tables (stages 3 and 5).

Instead of one worst-case slab per sequence, each layer owns one *pool* of fixed-size blocks,
``[num_blocks, block_size, num_kv_heads, head_dim]``, shared by every sequence. A sequence
takes blocks only as its tokens arrive; its block table says which physical block holds each
run of ``block_size`` tokens. One block id names the same block in every layer's pool (as in
vLLM), so one table serves all layers. The tables live in a *block manager*: by default stage
5's ``minikv.prefix.BlockManager``, one sequence per batch row.

On each forward step:

1. layer 0 finds room for the new tokens of every row (all rows or none: if the pool is
   short, ``OutOfBlocks`` says how many blocks were needed and how many were free, and no
   sequence's blocks are touched), applies the block manager's copy-on-write copies to every
   layer's pool, and records the *slot mapping*: where each new token goes;
2. every layer scatters its new K/V into its pool at those slots;
3. every layer gathers its sequences' K/V back through the block tables as
   ``[batch, kv_heads, seq, head_dim]``, so transformers' own attention (eager or sdpa) runs
   unchanged. That gather is a copy; the paged-attention kernel of stage 4 skips it by
   reading the blocks in place, with the same ``block_tables`` and ``seq_lens`` as here.

**Shared blocks (stage 5).** Beam search reorders its beams after every step
(``reorder_cache``): here that is refcount bookkeeping, a ``fork`` per surviving beam and a
``free`` per dropped one, never a copy of the history. When two beams then write into the
same partly filled last block, the manager copies that one block (copy-on-write) and the
cache applies the copy to every layer's pool before the step writes. ``sharing_history``
records, per step, the blocks in use and the blocks the same rows would take unshared.

**Prompt reuse across calls.** With ``enable_prefix_caching=True`` full blocks of a prompt stay
in the pool after ``reset()`` (evictable), keyed by a hash chain of their token ids. The cache
only sees K/V, never token ids, so tell it the prompts first, then call generate with the
*full* prompts::

    cache.reset()
    hit = cache.prefill_hits(input_ids, attention_mask)  # opens the rows on the cached blocks
    model.generate(input_ids, attention_mask=attention_mask, past_key_values=cache, ...)

generate asks ``cache.get_seq_length()`` (= ``hit``) and, because the attention mask is as long
as ``input_ids``, feeds the model only ``input_ids[:, hit:]`` (``GenerationMixin._prefill``);
positions come from the full mask, so the skipped tokens are simply not recomputed. A batch
moves all rows together, so a batch reuses the *smallest* hit among its rows. A left-padded row
is keyed by its padding too (``extra_key``), so pads never produce a false hit. Only prompt
tokens are cached: the cache never learns the ids of the tokens generate produces.

Padding tokens of a left-padded batch are stored like any other token (the attention mask
hides them), exactly as transformers' DynamicCache does; the engine of stage 6 avoids them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from minikv.blocks import BlockAllocator, BlockTable, OutOfBlocks
from minikv.contiguous import resolve_dtype_device
from minikv.prefix import BlockManager
from minikv.sizing import cache_shape, kv_bytes_per_block
from minikv.validation import check_block_size, check_num_blocks


class PagedLayer(CacheLayerMixin):
    """One layer's K and V pools. Which slots to use is decided once per step by the cache."""

    is_compileable = False  # block tables are Python lists; keep generate from compiling around them
    is_sliding = False

    def __init__(self, cache: PagedKVCache, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.cache = cache  # the shared bookkeeping: block manager, rows, this step's slots
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
        slots, token_slots, writers = self.cache.slot_mapping, self.cache.token_slots, self.cache.write_rows
        out = []
        for pool, states in ((self.key_cache, key_states), (self.value_cache, value_states)):
            if writers is not None:  # rows that share a prompt's blocks: one of them writes for all
                states = states[writers]
            flat = pool.view(-1, heads, dim)  # [num_blocks * block_size, H, D]: a slot per row
            # [rows, H, new, D] -> [rows * new, H, D], ordered like slot_mapping (row-major).
            flat.index_copy_(0, slots, states.transpose(1, 2).reshape(-1, heads, dim))
            # Gather every cached token of every row: [rows, seq, H, D] -> [rows, H, seq, D].
            out.append(flat[token_slots].transpose(1, 2))
        return out[0], out[1]

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy-on-write: block ``src[i]``'s K/V into block ``dst[i]``, in this layer's pools."""
        for pool in (self.key_cache, self.value_cache):
            pool[dst] = pool[src]

    def get_seq_length(self) -> int:
        return self.cache.get_seq_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # Asked before the step runs: attention sees the cached tokens plus the new ones.
        return self.cache.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return self.cache.num_blocks * self.cache.block_size  # one sequence holding the whole pool

    def reset(self) -> None:
        pass  # stale K/V is never read: reads go through block tables. The cache frees the blocks.


class TableManager:
    """Stage 3's allocator and block tables behind the block manager's interface
    (``minikv.prefix.BlockManagerProtocol``), with no sharing:
    every sequence owns its blocks alone. It lets ``PagedKVCache(..., allocator=, table_cls=)``
    run exercise 03's allocator and table class (which know nothing of prefixes or forks)."""

    def __init__(self, block_size: int, allocator, table_cls: type = BlockTable):
        self.block_size, self.allocator, self.table_cls = block_size, allocator, table_cls
        self.num_blocks = allocator.num_blocks
        self.tables: dict = {}

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    def open(self, seq_id, prompt_token_ids=(), extra_key: object = None) -> int:
        self.tables[seq_id] = self.table_cls(self.block_size, self.allocator)
        return 0  # no prefix cache: nothing is ever a hit

    def blocks_needed(self, seq_id, n: int) -> int:
        return self.tables[seq_id].blocks_needed(n)

    def append(self, seq_id, token_ids) -> list[int]:
        return self.tables[seq_id].append_tokens(token_ids if isinstance(token_ids, int) else len(token_ids))

    def block_table(self, seq_id) -> list[int]:
        return self.tables[seq_id].blocks

    def num_tokens(self, seq_id) -> int:
        return self.tables[seq_id].num_tokens

    def fork(self, parent_id, child_id) -> None:
        raise NotImplementedError(
            "this PagedKVCache runs on a stage-3 allocator and block table (allocator=/table_cls=), which cannot "
            "share blocks; beam search and batch reordering need the stage-5 block manager: build the cache "
            "without allocator=/table_cls= (or pass manager=)")

    def free(self, seq_id) -> None:
        self.tables.pop(seq_id).free()

    def take_copies(self) -> list[tuple[int, int]]:
        return []


@dataclass
class RowTable:
    """What a batch row holds right now, read from the block manager (for pictures and checks)."""

    blocks: list[int]
    num_tokens: int

    def __len__(self) -> int:
        return len(self.blocks)


class PagedKVCache(Cache):
    """A ``transformers.Cache`` storing K/V in fixed-size blocks from one shared pool per layer.

    ``PagedKVCache(model.config, num_blocks=256, block_size=16)`` reserves 256 blocks of 16
    token slots in every layer; sequences take them as they grow and give them back on
    ``free(row)`` / ``reset()``. Beam search and ``num_return_sequences`` work, on shared blocks.
    """

    def __init__(self, config, num_blocks: int, block_size: int = 16,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None, *,
                 enable_prefix_caching: bool = False, manager=None,
                 allocator: BlockAllocator | None = None, table_cls: type[BlockTable] | None = None):
        """``enable_prefix_caching`` keeps prompts' full blocks cached across calls (see ``prefill_hits``).

        ``manager`` swaps in another block manager with ``minikv.prefix.BlockManager``'s interface
        (exercise 05 runs a learner's this way). ``allocator`` and ``table_cls`` swap in a stage-3
        block allocator and block table instead (exercise 03); those cannot share blocks, so beam
        search is refused with them."""
        check_num_blocks(num_blocks)
        check_block_size(block_size)
        if manager is not None:
            if allocator is not None or table_cls is not None or enable_prefix_caching:
                raise ValueError("pass either manager= or allocator=/table_cls=/enable_prefix_caching=, not both: "
                                 "prefix caching is then the manager's own setting")
            for name, want in (("num_blocks", num_blocks), ("block_size", block_size)):
                if getattr(manager, name, want) != want:
                    raise ValueError(f"the block manager has {name}={getattr(manager, name)} but the pools would "
                                     f"have {want}: build both with the same {name}")
        elif allocator is not None or table_cls is not None:
            if enable_prefix_caching:
                raise ValueError("prefix caching needs the stage-5 block manager, not a stage-3 allocator/table: "
                                 "drop allocator=/table_cls=")
            if allocator is not None and allocator.num_blocks != num_blocks:
                raise ValueError(f"the allocator hands out {allocator.num_blocks} blocks but the pools would hold "
                                 f"{num_blocks}: build both with the same num_blocks")
            manager = TableManager(block_size, allocator or BlockAllocator(num_blocks), table_cls or BlockTable)
        else:
            manager = BlockManager(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching)
        self.manager = manager
        self.num_blocks, self.block_size = num_blocks, block_size
        self.shape = cache_shape(config)
        dtype, device = resolve_dtype_device(config, dtype, device)
        layers = [PagedLayer(self, dtype, device) for _ in range(self.shape.num_layers)]
        super().__init__(layers=layers)
        if isinstance(manager, BlockManager):
            manager.bytes_per_block = self.bytes_per_block()
        self.rows: list = []  # the block manager's sequence id of each batch row (None: freed)
        self._next_id = 0
        self._prompts: list[list[int]] | None = None  # told by prefill_hits, written at the first step
        self.steps = 0  # forward steps of this batch
        self.cow_copies = 0  # blocks copied on write, since the cache was built
        self.sharing_history: list[tuple[int, int, int]] = []  # (step, blocks in use, blocks if unshared)
        self._clear_step()

    def _clear_step(self) -> None:
        device = self.layers[0].device
        self.slot_mapping = torch.empty(0, dtype=torch.long, device=device)  # [writers * new] of the last step
        self.token_slots = torch.empty(0, 0, dtype=torch.long, device=device)  # [rows, seq]: every token's slot
        self.write_rows: torch.Tensor | None = None  # rows whose K/V this step writes; None: all

    def _new_seq(self):
        self._next_id += 1
        return self._next_id

    @property
    def allocator(self):
        return getattr(self.manager, "allocator", None)

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
        if self.get_seq_length() or self.manager.num_free_blocks < self.num_blocks:
            raise ValueError(
                f"the pools hold {pool.dtype} K/V on {pool.device}, but the model now gives {key_states.dtype} on "
                f"{key_states.device}; call cache.reset() first, or build the cache with dtype=model.dtype, "
                "device=model.device")
        for layer in self.layers:
            layer.lazy_initialization(key_states, key_states)
        if getattr(self.manager, "num_cached_blocks", 0):
            self.manager.reset_prefix_cache()  # their K/V were in the old pools
        self._clear_step()

    def _reserve_slots(self, rows: int, new: int) -> None:
        self.write_rows = None
        first = self._prompts is not None or all(s is None for s in self.rows)  # a new batch
        if first:
            try:
                writers = self._open_batch(rows, new)
            except Exception:
                self.reset()  # nothing half-done stays behind: the next generate starts clean
                raise
        else:
            writers = self._check_batch(rows)
        # All or nothing: check every row before taking a single block, so a failure leaves
        # the pool, the tables and every other sequence's blocks as they were. (Cautious by a
        # block or so: k rows sharing a partial block each count a copy, but the last writes in place.)
        needed = sum(self.manager.blocks_needed(s, new) for s in writers)
        free = self.manager.num_free_blocks
        if needed > free:
            if first:
                self.reset()
            raise OutOfBlocks(needed, free, f"{new} new token(s) in each of {len(writers)} sequence(s)")
        prompts, self._prompts = self._prompts, None
        slots = [self.manager.append(s, prompts[i] if prompts else new) for i, s in enumerate(writers)]
        self._apply_copies()
        if first and len(writers) < rows:  # num_return_sequences / beams: the copies share the prompt's blocks
            self._share_prompt(writers, rows // len(writers))
        device = self.layers[0].device
        self.slot_mapping = torch.tensor(slots, dtype=torch.long, device=device).flatten()
        self.token_slots = self._token_slots()
        self.steps += 1
        self.sharing_history.append((self.steps, *self.blocks_in_use_and_unshared()))

    def _open_batch(self, rows: int, new: int) -> list:
        """The rows that write this first step: one per prompt. generate repeats each prompt
        ``num_return_sequences`` (or ``num_beams``) times; if prefill_hits told us the prompts,
        one copy computes and stores them and the others share its blocks."""
        self.steps, self.sharing_history = 0, []
        if self._prompts is None:  # not told the prompts: every row computes its own
            self.rows = [self._new_seq() for _ in range(rows)]
            for seq in self.rows:
                self.manager.open(seq, [])
            return list(self.rows)
        if rows % len(self.rows):
            raise ValueError(f"prefill_hits was told {len(self.rows)} prompts, but generate runs {rows} rows; "
                             "pass generate the same input_ids")
        lengths = {len(p) for p in self._prompts}
        if lengths != {new}:
            raise ValueError(f"prefill_hits left {lengths.pop()} uncached token(s) per row to compute, but the "
                             f"model was given {new}: pass generate the same full input_ids (and attention_mask) "
                             "that prefill_hits was given")
        return list(self.rows)

    def _share_prompt(self, writers: list, copies: int) -> None:
        self.rows = [seq if k == 0 else self._fork(seq) for seq in writers for k in range(copies)]
        self.write_rows = torch.arange(0, len(self.rows), copies, device=self.layers[0].device)

    def _check_batch(self, rows: int) -> list:
        if rows != len(self.rows):
            raise ValueError(f"the batch changed from {len(self.rows)} to {rows} sequences mid-generation; "
                             "call cache.reset() before starting a new batch")
        if None in self.rows or len({self.manager.num_tokens(s) for s in self.rows}) > 1:
            raise ValueError("rows hold different numbers of tokens (was one freed?); a transformers batch "
                             "moves all rows together, so call cache.reset() and start the batch again")
        return list(self.rows)

    def _apply_copies(self) -> None:
        """Copy-on-write copies the manager asked for, in every layer, before this step writes."""
        copies = self.manager.take_copies()
        if copies:
            src, dst = torch.tensor(copies, dtype=torch.long, device=self.layers[0].device).T
            for layer in self.layers:
                layer.copy_blocks(src, dst)
            self.cow_copies += len(copies)

    def _token_slots(self) -> torch.Tensor:
        """Every cached token's slot, ``[rows, seq]``: the numbers the paged-attention kernel computes
        from the block table, slot(b, t) = block_tables[b, t // block_size] * block_size + t % block_size."""
        seq = self.get_seq_length()
        t = torch.arange(seq, device=self.layers[0].device)
        return self.block_tables.long()[:, t // self.block_size] * self.block_size + t % self.block_size

    # ---- prompts told in advance: prefix reuse across calls, shared prompts within one ----

    def prefill_hits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> int:
        """Tell the cache the prompts of the next ``generate`` call; returns how many leading tokens
        of every row are already cached, which generate will then not compute.

        Call it on an empty cache (after ``reset()``), then call generate with the same *full*
        ``input_ids`` and ``attention_mask``. Rows of a batch move together, so the batch reuses
        the smallest hit among its rows (a row that hit more is re-opened on that many tokens,
        which the prefix-cache counters see as a second lookup). Left padding is allowed: a padded
        row's blocks are keyed by its number of pads as well, so they only ever match a row padded
        the same way. Knowing the prompts also lets ``num_return_sequences`` and beam search
        share the prompt's blocks from the first step."""
        if self.rows:
            raise ValueError("the cache holds a batch already: call cache.reset() before prefill_hits")
        if input_ids.ndim != 2 or input_ids.shape[1] == 0:
            raise ValueError(f"input_ids must be [batch, tokens] with tokens >= 1, got shape {tuple(input_ids.shape)}")
        ids = input_ids.tolist()
        mask = attention_mask.tolist() if attention_mask is not None else [[1] * len(r) for r in ids]
        extras = []
        for row, m in enumerate(mask):
            pads = len(m) - sum(m)
            if m != [0] * pads + [1] * (len(m) - pads) or pads == len(m):
                raise ValueError(f"row {row}'s attention_mask {m} is not a left-padded prompt (zeros, then at least "
                                 "one 1): PagedKVCache supports left padding only")
            extras.append(None if pads == 0 else ("left-padded", pads))
        self.rows = [self._new_seq() for _ in ids]
        hits = [self.manager.open(seq, prompt, extra) for seq, prompt, extra in zip(self.rows, ids, extras)]
        hit = min(hits)
        for row, h in enumerate(hits):
            if h > hit:  # re-open on `hit` tokens only: prompt[:hit + 1] has hit // block_size full blocks
                self.manager.free(self.rows[row])
                self.rows[row] = self._new_seq()
                self.manager.open(self.rows[row], ids[row][:hit + 1], extras[row])
        self._prompts = [prompt[hit:] for prompt in ids]
        return hit

    # ---- beams and copies: refcounts, not copies of the history ----

    def _fork(self, seq):
        child = self._new_seq()
        self.manager.fork(seq, child)
        return child

    def _reindex(self, indices: list[int]) -> None:
        """Row i becomes old row ``indices[i]``: the first row to take an old row keeps its sequence,
        every further one forks it (shares all its blocks); old rows no one took are freed."""
        if any(not 0 <= i < len(self.rows) for i in indices):
            raise IndexError(f"row indices {indices} out of range for a batch of {len(self.rows)} rows")
        taken, new_rows = set(), []
        for i in indices:
            new_rows.append(self.rows[i] if i not in taken else self._fork(self.rows[i]))
            taken.add(i)
        for i, seq in enumerate(self.rows):
            if i not in taken and seq is not None:
                self.manager.free(seq)
        self.rows = new_rows
        self.token_slots = self._token_slots()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row i continues beam ``beam_idx[i]``."""
        self._reindex(beam_idx.tolist())

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._reindex([i for i in range(len(self.rows)) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._reindex(indices.tolist())

    def crop(self, max_length: int) -> None:
        raise NotImplementedError("PagedKVCache does not crop sequences (assisted/speculative decoding); use greedy, "
                                  "sampling or beam search here, or DynamicCache for assisted decoding")

    # ---- what the kernel, the notebooks and the reports read ----

    @property
    def tables(self) -> list[RowTable]:
        """Each row's block table and token count (a snapshot)."""
        m = self.manager
        return [RowTable([], 0) if s is None else RowTable(list(m.block_table(s)), m.num_tokens(s)) for s in self.rows]

    @property
    def block_tables(self) -> torch.Tensor:
        """``[batch, max_blocks]`` int32. Short rows are padded with block 0: a valid id, so a kernel
        that over-reads stays in bounds; ``seq_lens`` says where each row really ends."""
        tables = [t.blocks for t in self.tables]
        width = max(map(len, tables), default=0)
        padded = [t + [0] * (width - len(t)) for t in tables]
        return torch.tensor(padded, dtype=torch.int32, device=self.layers[0].device).view(len(tables), width)

    @property
    def seq_lens(self) -> torch.Tensor:
        """``[batch]`` int32: tokens cached per row."""
        return torch.tensor([t.num_tokens for t in self.tables], dtype=torch.int32, device=self.layers[0].device)

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new sequence can take (with prefix caching: cached blocks no one owns included)."""
        return self.manager.num_free_blocks

    def get_seq_length(self, layer_idx: int = 0) -> int:
        live = [s for s in self.rows if s is not None]
        return self.manager.num_tokens(live[0]) if live else 0

    def blocks_in_use_and_unshared(self) -> tuple[int, int]:
        """(distinct blocks the rows hold, blocks they would hold if none were shared)."""
        tables = self.tables
        return len({b for t in tables for b in t.blocks}), sum(len(t) for t in tables)

    def bytes_per_block(self) -> int:
        """K and V, all layers: what one block id costs (stage 1's rule, in the pools' dtype)."""
        return kv_bytes_per_block(self.shape, self.block_size, self.layers[0].key_cache.dtype)

    def reserved_bytes(self) -> int:
        """The pools, whole: fixed when the cache is built."""
        return self.num_blocks * self.bytes_per_block()

    def allocated_bytes(self) -> int:
        """Blocks the rows hold (their unfilled tails included; a shared block counts once)."""
        return self.blocks_in_use_and_unshared()[0] * self.bytes_per_block()

    def used_bytes(self) -> int:
        """Slots holding tokens; allocated - used is the waste in last blocks. A shared slot counts once."""
        filled: dict[int, int] = {}
        for t in self.tables:
            for i, b in enumerate(t.blocks):
                filled[b] = max(filled.get(b, 0), min(self.block_size, t.num_tokens - i * self.block_size))
        return sum(filled.values()) * self.bytes_per_block() // self.block_size

    # ---- giving blocks back ----

    def free(self, row: int) -> None:
        """Return every block of one batch row to the pool (a finished or aborted request)."""
        if self.rows[row] is not None:
            self.manager.free(self.rows[row])
            self.rows[row] = None

    def reset(self) -> None:
        """Free every row and forget the batch: the cache is ready for a new generate call. With
        prefix caching, the rows' cached full blocks stay in the pool, evictable, for the next call."""
        for seq in self.rows:
            if seq is not None:
                self.manager.free(seq)
        self.rows, self._prompts = [], None
        self._clear_step()

    def __repr__(self) -> str:
        return (f"PagedKVCache(num_blocks={self.num_blocks}, block_size={self.block_size}, "
                f"free={self.num_free_blocks}, seq_lens={self.seq_lens.tolist()})")
