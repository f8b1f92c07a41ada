"""Shared walls (stage 5): a block manager with a hash-chained prefix cache, fork and copy-on-write.

When tenants share a prefix (a system prompt, few-shot examples, the prompt of n parallel
samples, the history of beams) they can share the physical blocks that hold it. Stage 3's
allocator already counts owners per block; this module decides *when* two sequences may
point at the same block, and what happens when one of them writes:

* **Hash chain.** A *full* block is named by a hash of (its parent block's hash, its token
  ids, an optional extra key such as an adapter id). Because the parent's hash is inside,
  equal hashes mean equal *prefixes*, not just equal blocks. Only full blocks are cached: a
  partial block is still being written. The hash is SHA-256 (stable across processes, unlike
  Python's salted ``hash()`` of strings), and each cached block also keeps its full key, so a
  collision can never hand back someone else's K/V.
* **Lookup.** A new prompt takes the longest run of leading full blocks already cached
  (refcount +1 each), but always leaves at least one prompt token to compute: the model needs
  the last token's logits to produce the first output token.
* **Cached but free.** When the last owner frees a cached block, its K/V stays in the pool and
  its hash stays in the table: the block is *evictable*. Allocation takes never-cached free
  blocks first, then evicts the least recently used evictable block (and forgets its hash).
  A hit on an evictable block takes it back, O(1).
* **Fork and copy-on-write.** ``fork`` gives a new sequence the same blocks (refcount +1).
  Writing into a block that someone else also owns first copies it to a fresh block: the
  manager records (source, destination) and the runner copies that block in every layer.
  Only a partially filled last block is ever copied; full blocks are never written again.

Nothing here touches tensors. ``BlockManager`` is what the engine (stage 6) and
``PagedKVCache`` (for ``generate``'s beam search) call; blocks are plain ints, as in stage 3.
What they call is the `BlockManagerProtocol`: ``minikv.paged.TableManager`` (stage 3's
allocator and tables, no sharing) and exercise 05's managers (behind its checks' adapter) meet
it too, so any of them can run under ``PagedKVCache(..., manager=...)``.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from minikv.blocks import BlockAllocator, BlockTable, OutOfBlocks
from minikv.validation import check_block_size, check_num_blocks


def block_hash(parent: int | None, tokens: Sequence[int], extra: object = None) -> int:
    """The stable 64-bit name of a full block: SHA-256 of (parent hash, token ids, extra key)."""
    h = hashlib.sha256(b"root" if parent is None else parent.to_bytes(8, "little"))
    h.update(array("q", tokens).tobytes())
    if extra is not None:
        h.update(repr(extra).encode())
    return int.from_bytes(h.digest()[:8], "little")


@dataclass(frozen=True, eq=False)
class BlockKey:
    """What a cached block holds. ``parent`` is the parent block's own key *object*: two keys
    match only if their whole chains are the very same cached blocks, so a hash collision (or a
    chain whose parent was evicted and computed again) is a miss, never a wrong hit."""

    hash: int
    parent: BlockKey | None
    tokens: tuple[int, ...]
    extra: object = None

    def matches(self, parent: BlockKey | None, tokens: tuple[int, ...], extra: object) -> bool:
        return self.parent is parent and self.tokens == tokens and self.extra == extra


@dataclass
class PrefixStats:
    lookups: int = 0         # prompts looked up
    tokens_queried: int = 0  # their tokens
    tokens_hit: int = 0      # tokens served from cached blocks
    evictions: int = 0       # cached blocks thrown away to make room
    cow_copies: int = 0      # partial blocks copied because a sharer wrote into them

    @property
    def hit_rate(self) -> float:
        return self.tokens_hit / self.tokens_queried if self.tokens_queried else 0.0


class PrefixCache:
    """Stage 3's allocator plus a table of cached full blocks and an LRU list of evictable ones.

    It has the allocator's interface (``allocate``, ``free``, ``incref``, ``num_free``), so a
    stage-3 ``BlockTable`` grows from it unchanged; ``num_free`` counts evictable blocks too,
    because allocation can take them.
    """

    def __init__(self, allocator: BlockAllocator):
        self.allocator = allocator
        self.num_blocks = allocator.num_blocks
        self.by_hash: dict[int, int] = {}       # hash -> cached block
        self.key_of: dict[int, BlockKey] = {}   # cached block -> its key
        self.evictable: OrderedDict[int, None] = OrderedDict()  # ownerless cached blocks, LRU first
        self.stats = PrefixStats()

    @property
    def num_free(self) -> int:
        return self.allocator.num_free + len(self.evictable)

    def allocate(self) -> int:
        if self.allocator.num_free:  # never-cached blocks first: evicting throws away a possible hit
            return self.allocator.allocate()
        if not self.evictable:
            raise OutOfBlocks(1, 0)
        block, _ = self.evictable.popitem(last=False)  # least recently used
        del self.by_hash[self.key_of.pop(block).hash]
        self.stats.evictions += 1
        self.allocator.revive(block)
        return block

    def incref(self, block: int) -> None:
        self.allocator.incref(block)

    def refcount(self, block: int) -> int:
        return self.allocator.refcount(block)

    def free(self, block: int) -> bool:
        cached = block in self.key_of
        last = self.allocator.free(block, keep=cached)
        if last and cached:
            self.evictable[block] = None  # most recently used end
        return last

    def match(self, parent: BlockKey | None, tokens: tuple[int, ...], extra: object) -> int | None:
        """The cached block holding exactly ``tokens`` after ``parent``, or None."""
        block = self.by_hash.get(block_hash(parent.hash if parent else None, tokens, extra))
        if block is not None and self.key_of[block].matches(parent, tokens, extra):
            return block
        return None

    def take(self, block: int) -> None:
        """A hit: one more owner; an evictable block comes back off the LRU list."""
        if block in self.evictable:
            del self.evictable[block]
            self.allocator.revive(block)
        else:
            self.allocator.incref(block)

    def register(self, block: int, parent: BlockKey | None, tokens: tuple[int, ...], extra: object) -> BlockKey | None:
        """Cache a block that just became full. Returns the key the next block should chain from:
        this block's, or an equal block's already cached (this one then stays uncached), or None
        on a hash collision with a different block (the chain stops being cached here)."""
        h = block_hash(parent.hash if parent else None, tokens, extra)
        other = self.by_hash.get(h)
        if other is not None:
            key = self.key_of[other]
            return key if key.matches(parent, tokens, extra) else None
        key = BlockKey(h, parent, tokens, extra)
        self.by_hash[h], self.key_of[block] = block, key
        return key

    def clear(self) -> None:
        """Forget every cached block; evictable ones go back on the free list."""
        for block in self.evictable:
            self.allocator.release(block)
        self.evictable.clear()
        self.by_hash.clear()
        self.key_of.clear()


class SeqTable(BlockTable):
    """Stage 3's block table plus what sharing needs: the tokens written (to hash blocks as they
    fill) and the keys of the leading full blocks that are cached (to chain the next one)."""

    def __init__(self, block_size: int, cache: PrefixCache, extra: object = None):
        super().__init__(block_size, cache)
        self.extra = extra
        self.token_ids: list[int | None] = []  # None: a token whose id was not given (never cached)
        self.keys: list[BlockKey] = []
        self.chain_broken = False  # a collision or an unknown token: later blocks are not cached


@runtime_checkable
class BlockManagerProtocol(Protocol):
    """What the scheduler and ``PagedKVCache`` ask of a block manager. Sequences are named by any
    hashable id; blocks are ints in ``range(num_blocks)``; a slot is ``block * block_size + offset``."""

    num_blocks: int
    block_size: int

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new sequence could take now (cached blocks nobody owns included)."""

    def open(self, seq_id, prompt_token_ids: Sequence[int], extra_key: object = None) -> int:
        """Start a sequence; returns how many leading prompt tokens its cached blocks already hold."""

    def blocks_needed(self, seq_id, n: int) -> int:
        """New blocks that appending `n` tokens would take (a copy-on-write copy included)."""

    def append(self, seq_id, token_ids: Sequence[int] | int) -> list[int]:
        """Write tokens (or just a count) after the sequence's end; each one's slot. All or nothing."""

    def block_table(self, seq_id) -> list[int]:
        """The sequence's physical blocks, in token order."""

    def num_tokens(self, seq_id) -> int:
        """Tokens the sequence has written."""

    def fork(self, parent_id, child_id) -> None:
        """A new sequence sharing every block of `parent_id`."""

    def free(self, seq_id) -> None:
        """Drop a sequence and give its blocks back."""

    def take_copies(self) -> list[tuple[int, int]]:
        """The (source, destination) block copies to apply to every layer's pool before the next forward."""


@dataclass
class BlockManager:
    """Per-sequence block tables over one shared, prefix-caching pool. Sequences are named by
    any hashable id. Every operation that can run out of blocks checks first and leaves
    everything unchanged on failure (``OutOfBlocks``)."""

    num_blocks: int
    block_size: int
    enable_prefix_caching: bool = True
    bytes_per_block: int = 0  # only for `bytes_saved`
    allocator: BlockAllocator | None = None
    tables: dict = field(default_factory=dict, init=False)
    copies: list[tuple[int, int]] = field(default_factory=list, init=False)

    def __post_init__(self):
        check_num_blocks(self.num_blocks)
        check_block_size(self.block_size)
        self.allocator = self.allocator or BlockAllocator(self.num_blocks)
        self.cache = PrefixCache(self.allocator)
        self.stats = self.cache.stats

    # ---- reading ----

    @property
    def num_free_blocks(self) -> int:
        return self.cache.num_free

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cache.key_of)

    @property
    def evictable_blocks(self) -> list[int]:
        """Free blocks that still hold a cached prefix, least recently used first (evicted in that order)."""
        return list(self.cache.evictable)

    @property
    def num_evictable_blocks(self) -> int:
        return len(self.cache.evictable)

    def cached_block(self, block_hash: int) -> int | None:
        """The block that holds the cached full block of this hash, if any (for pictures of the cache)."""
        return self.cache.by_hash.get(block_hash)

    def block_table(self, seq_id) -> list[int]:
        return self._table(seq_id).blocks

    def num_tokens(self, seq_id) -> int:
        return self._table(seq_id).num_tokens

    def _table(self, seq_id) -> SeqTable:
        try:
            return self.tables[seq_id]
        except KeyError:
            raise KeyError(f"no sequence {seq_id!r} in the block manager (never opened, or already freed)") from None

    def pool_map(self) -> tuple[list[int], list[int], list[bool]]:
        """(owner, refcount, cached) per block: one sequence holding it (-1 if none), how many hold it,
        and whether it is free but still holds a cached prefix. A scan, for pictures, not the hot path."""
        owner, refcount = [-1] * self.num_blocks, [0] * self.num_blocks
        for seq_id, table in self.tables.items():
            for b in table.blocks:
                refcount[b] += 1
                if owner[b] == -1:
                    owner[b] = seq_id
        cached = [False] * self.num_blocks
        for b in self.cache.evictable:
            cached[b] = True
        return owner, refcount, cached

    @property
    def num_shared_blocks(self) -> int:
        """Blocks owned by more than one sequence right now (a scan: for reports, not the hot path)."""
        return sum(self.allocator.refcount(b) > 1 for b in range(self.num_blocks))

    @property
    def blocks_saved(self) -> int:
        """Blocks the same sequences would take unshared, minus the blocks they take."""
        return sum(max(self.allocator.refcount(b) - 1, 0) for b in range(self.num_blocks))

    @property
    def bytes_saved(self) -> int:
        return self.blocks_saved * self.bytes_per_block

    # ---- sequences ----

    def open(self, seq_id, prompt_token_ids: Sequence[int], extra_key: object = None) -> int:
        """Start a sequence with the longest cached run of its prompt's leading full blocks.
        Returns how many prompt tokens they hold (a multiple of block_size, < len(prompt))."""
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id!r} is already open; free it first")
        table = SeqTable(self.block_size, self.cache, extra_key)
        self.tables[seq_id] = table
        if not self.enable_prefix_caching:
            return 0
        bs, parent = self.block_size, None
        self.stats.lookups += 1
        self.stats.tokens_queried += len(prompt_token_ids)
        # (len - 1) // bs full blocks at most: the prompt's last token is always computed.
        for i in range((len(prompt_token_ids) - 1) // bs):
            tokens = tuple(prompt_token_ids[i * bs:(i + 1) * bs])
            block = self.cache.match(parent, tokens, extra_key)
            if block is None:
                break
            self.cache.take(block)
            parent = self.cache.key_of[block]
            table.blocks.append(block)
            table.keys.append(parent)
            table.token_ids.extend(tokens)
        table.num_tokens = len(table.blocks) * bs
        self.stats.tokens_hit += table.num_tokens
        return table.num_tokens

    def blocks_needed(self, seq_id, n: int) -> int:
        """New blocks that appending ``n`` tokens takes, a copy-on-write copy included."""
        table = self._table(seq_id)
        return table.blocks_needed(n) + (n > 0 and self._shared_tail(table))

    def _shared_tail(self, table: SeqTable) -> bool:
        """Is the next write going into a partly filled block that another sequence also owns?"""
        return table.num_tokens % self.block_size != 0 and self.allocator.refcount(table.blocks[-1]) > 1

    def append(self, seq_id, token_ids: Sequence[int] | int) -> list[int]:
        """Write tokens after the sequence's end; returns each one's physical slot.

        ``token_ids`` is the tokens, or just how many (their ids unknown: such blocks are never
        cached). Blocks that become full join the prefix cache."""
        table = self._table(seq_id)
        ids = [None] * token_ids if isinstance(token_ids, int) else list(token_ids)
        needed = self.blocks_needed(seq_id, len(ids))
        if needed > self.cache.num_free:  # check first: all or nothing
            raise OutOfBlocks(needed, self.cache.num_free, f"{len(ids)} more token(s) of sequence {seq_id!r}")
        if ids and self._shared_tail(table):  # copy-on-write: the sharers keep the original
            src, dst = table.blocks[-1], self.cache.allocate()
            self.cache.free(src)
            table.blocks[-1] = dst
            self.copies.append((src, dst))
            self.stats.cow_copies += 1
        slots = table.append_tokens(len(ids))
        table.token_ids.extend(ids)
        if self.enable_prefix_caching:
            self._cache_full_blocks(table)
        return slots

    def _cache_full_blocks(self, table: SeqTable) -> None:
        bs = self.block_size
        while not table.chain_broken and len(table.keys) < table.num_tokens // bs:
            i = len(table.keys)
            tokens = table.token_ids[i * bs:(i + 1) * bs]
            parent = table.keys[-1] if table.keys else None
            key = None if None in tokens else self.cache.register(table.blocks[i], parent, tuple(tokens), table.extra)
            if key is None:
                table.chain_broken = True
            else:
                table.keys.append(key)

    def take_copies(self) -> list[tuple[int, int]]:
        """The (source, destination) block copies to apply to every layer's pool before the next forward."""
        copies, self.copies = self.copies, []
        return copies

    def fork(self, parent_id, child_id) -> None:
        """A new sequence sharing every block of ``parent_id`` (n samples, beams). Cannot run out."""
        if child_id in self.tables:
            raise ValueError(f"sequence {child_id!r} is already open; free it first")
        parent = self._table(parent_id)
        child = SeqTable(self.block_size, self.cache, parent.extra)
        for block in parent.blocks:
            self.cache.incref(block)
        child.blocks, child.num_tokens = list(parent.blocks), parent.num_tokens
        child.token_ids, child.keys, child.chain_broken = list(parent.token_ids), list(parent.keys), parent.chain_broken
        self.tables[child_id] = child

    def free(self, seq_id) -> None:
        """Drop a sequence. Its cached full blocks stay, evictable; tail blocks first in line."""
        table = self.tables.pop(seq_id, None)
        if table is None:
            raise KeyError(f"no sequence {seq_id!r} to free (never opened, or freed twice)")
        for block in reversed(table.blocks):  # the LRU list then evicts a chain from its end
            self.cache.free(block)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (e.g. to measure without it); owned blocks are untouched."""
        self.cache.clear()
        for table in self.tables.values():
            table.keys, table.chain_broken = [], True
