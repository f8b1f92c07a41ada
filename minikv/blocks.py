"""Fixed-size KV blocks: a reference-counted allocator and per-sequence block tables.

Paging (stage 3) cuts the KV cache into blocks of ``block_size`` token slots. A sequence
owns a list of blocks, its *block table*, which grows one block at a time as tokens arrive,
so the only waste is the unfilled tail of each sequence's last block. Token ``t`` of a
sequence lives at physical *slot* ``table[t // block_size] * block_size + t % block_size``;
the list of slots for the tokens written in one step is the *slot mapping*.

Nothing here touches tensors: blocks are just integers. The tensors (one pool per layer,
``[num_blocks, block_size, num_kv_heads, head_dim]``) live in ``minikv.paged``, and a block id
indexes every layer's pool at once, as in vLLM.

Blocks are reference counted from the start: stage 5 lets several sequences share a prefix
block (refcount > 1) and copies it only when one of them writes (copy-on-write). A block
returns to the free list when its last owner frees it.
"""

from __future__ import annotations

import operator
from collections import deque
from collections.abc import Iterable

from minikv.validation import check_block_size, check_num_blocks


def blocks_for(tokens: int, block_size: int) -> int:
    """How many blocks hold `tokens` tokens: the last one may be partly empty (ceiling division)."""
    return -(-tokens // block_size)


class BlockError(ValueError):
    """A block id that makes no sense here: out of range, not allocated, or freed twice."""


class OutOfBlocks(RuntimeError):
    """The pool cannot hold what was asked for. Nothing was allocated."""

    def __init__(self, needed: int, free: int, what: str = ""):
        self.needed, self.free = needed, free
        detail = f" for {what}" if what else ""
        super().__init__(
            f"out of KV blocks: needed {needed} block(s){detail}, but only {free} free. "
            f"Give the cache more blocks (num_blocks), shorten the request, or free/preempt a sequence."
        )


class BlockAllocator:
    """A free list of ``num_blocks`` block ids with a reference count per block.

    The free list is FIFO: ``allocate`` takes from the front, ``free`` appends to the back, so the
    block freed longest ago is reused first (nano-vllm and vLLM order their free lists the same way).
    Eviction is not decided here: stage 5's prefix cache keeps its freed full blocks *off* this list
    (``free(..., keep=True)``) in its own least-recently-used order, takes never-cached blocks from
    this list first, and evicts the least recently used cached block only when the list is empty.
    """

    def __init__(self, num_blocks: int):
        check_num_blocks(num_blocks)
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._refcount = [0] * num_blocks  # 0 <=> the block is on the free list, or kept aside
        self._kept: set[int] = set()  # ownerless blocks a caller keeps off the free list (see `free`)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free) - len(self._kept)

    @property
    def num_kept(self) -> int:
        return len(self._kept)

    def _check(self, block: int) -> int:
        try:
            block = operator.index(block)  # ints, numpy ints and 0-d integer tensors; not floats
        except TypeError:
            raise BlockError(f"a block id is an int, got {block!r}") from None
        if not 0 <= block < self.num_blocks:
            raise BlockError(f"block {block} does not exist: valid ids are 0..{self.num_blocks - 1}")
        return block

    def allocate(self) -> int:
        """Take one free block; its reference count becomes 1."""
        if not self._free:
            raise OutOfBlocks(1, 0)
        block = self._free.popleft()
        self._refcount[block] = 1
        return block

    def incref(self, block: int) -> None:
        """One more owner for an allocated block (a shared prefix, a forked sequence)."""
        block = self._check(block)
        if self._refcount[block] == 0:
            raise BlockError(f"block {block} is free; only an allocated block can be shared")
        self._refcount[block] += 1

    def refcount(self, block: int) -> int:
        block = self._check(block)
        return self._refcount[block]

    def free(self, block: int, *, keep: bool = False) -> bool:
        """Drop one owner. Returns True when that was the last one and the block is free again.

        With ``keep=True`` a block whose last owner leaves does not go back on the free list:
        the caller keeps it aside and later either hands it out again (`revive`) or gives it up
        (`release`). Stage 5's prefix cache keeps full blocks this way, because their K/V may
        be asked for again by the next request with the same prefix.
        """
        block = self._check(block)
        if self._refcount[block] == 0:
            raise BlockError(f"double free: block {block} is already free")
        self._refcount[block] -= 1
        if self._refcount[block] == 0:
            if keep:
                self._kept.add(block)
            else:
                self._free.append(block)
            return True
        return False

    def revive(self, block: int) -> None:
        """A kept block gets an owner again (a prefix-cache hit, or an eviction that reuses it)."""
        block = self._check(block)
        if block not in self._kept:
            raise BlockError(f"block {block} was not kept aside by free(..., keep=True)")
        self._kept.remove(block)
        self._refcount[block] = 1

    def release(self, block: int) -> None:
        """A kept block goes back on the free list after all."""
        block = self._check(block)
        if block not in self._kept:
            raise BlockError(f"block {block} was not kept aside by free(..., keep=True)")
        self._kept.remove(block)
        self._free.append(block)

    def __repr__(self) -> str:
        kept = f", kept={self.num_kept}" if self._kept else ""
        return f"BlockAllocator(num_blocks={self.num_blocks}, free={self.num_free}{kept})"


class BlockTable:
    """One sequence's logical -> physical block list, grown on demand from a shared allocator."""

    def __init__(self, block_size: int, allocator: BlockAllocator):
        check_block_size(block_size)
        self.block_size = block_size
        self.allocator = allocator
        self.blocks: list[int] = []  # blocks[i] holds tokens i*block_size .. (i+1)*block_size-1
        self.num_tokens = 0

    def blocks_needed(self, n: int) -> int:
        """How many new blocks ``n`` more tokens need. Check this before appending."""
        if n < 0:
            raise ValueError(f"cannot append a negative number of tokens ({n})")
        total = blocks_for(self.num_tokens + n, self.block_size)
        return max(0, total - len(self.blocks))

    def append_tokens(self, n: int) -> list[int]:
        """Make room for ``n`` more tokens and return their slots (all-or-nothing)."""
        needed = self.blocks_needed(n)
        # Check first: a failed append must leave the table and the allocator untouched.
        if needed > self.allocator.num_free:
            raise OutOfBlocks(needed, self.allocator.num_free, f"{n} more token(s)")
        self.blocks.extend(self.allocator.allocate() for _ in range(needed))
        start = self.num_tokens
        self.num_tokens += n
        return self.slots_for(range(start, start + n))

    def slots_for(self, positions: Iterable[int]) -> list[int]:
        """Physical slots of the given token positions (each in 0..num_tokens-1)."""
        bs, out = self.block_size, []
        for t in positions:
            if not 0 <= t < self.num_tokens:
                raise IndexError(f"token {t} is not in this sequence (it holds {self.num_tokens})")
            out.append(self.blocks[t // bs] * bs + t % bs)
        return out

    def free(self) -> None:
        """Give every block back (one reference each) and forget the tokens."""
        for block in self.blocks:
            self.allocator.free(block)
        self.blocks = []
        self.num_tokens = 0

    def __len__(self) -> int:
        return len(self.blocks)

    def __repr__(self) -> str:
        return f"BlockTable(tokens={self.num_tokens}, blocks={self.blocks})"
