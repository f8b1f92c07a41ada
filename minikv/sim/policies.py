"""The allocation policies stage 2/3's memory simulator replays: contiguous slabs, and paged blocks.

A policy decides where a sequence's tokens live in one linear KV address space, and when it has no room.
``minikv.sim.memory.simulate`` drives every policy the same way (admit, grow one token a step,
release), so the books it keeps compare the policies and nothing else.

* ``ContiguousMax``: one ``max_seq_len`` slab per request, reserved up front (FasterTransformer;
  the paper's "Orca (Max)").
* ``ContiguousPow2``: a slab of the next power of two, doubled by reallocation when full (a growable
  array that does not know the output length).
* ``ContiguousOracle``: a slab of exactly prompt + output, known in advance (no real server can).
* ``Paged(block_size)``: fixed-size blocks taken on demand from a free list (vLLM), through stage 3's
  real ``BlockAllocator`` and ``BlockTable``.

Slabs are placed first-fit (``first_fit``), so holes between slabs are real; ``slab_waste`` and
``external_tokens`` split unused space into its kinds for the simulator's books.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from minikv.blocks import BlockAllocator, BlockTable, blocks_for
from minikv.sim.traces import TraceRequest
from minikv.validation import check_block_size


@dataclass(eq=False, slots=True)
class Seq:
    """A request while it is in the system: ``live`` tokens are in (or owed to) the cache."""

    req: TraceRequest
    live: int
    id: int = field(init=False)
    final: int = field(init=False)  # prompt + output: known to the simulator, not to a server
    cap: int = 0  # tokens the policy holds for it (cached: the per-step books read it a lot)
    running: bool = False
    since: int = 0  # step of its current admission
    live0: int = 0  # tokens it was admitted with (prompt, or prompt + output so far)
    preempted: int = 0  # times it was preempted: readmitting it recomputes its tokens

    def __post_init__(self) -> None:
        self.id, self.final = self.req.id, self.req.total_len


class Policy(Protocol):
    """How KV memory is handed out. A slot is ``(offset, size, first_token)``: ``size``
    tokens of the address space from ``offset`` holding the sequence's tokens from
    ``first_token`` on."""

    name: str
    counters: dict[str, int]

    def reset(self, budget: int, max_seq_len: int) -> None: ...
    def refuse(self, req: TraceRequest) -> str | None: ...  # why it can never fit, else None
    def need(self, seq: Seq) -> int: ...  # tokens admitting it now would take
    def admit(self, seq: Seq) -> bool: ...  # place seq.live tokens; False: no room
    def grow(self, seq: Seq) -> bool: ...  # room for token seq.live + 1; False: no room
    def release(self, seq: Seq) -> None: ...
    def capacity(self, seq: Seq) -> int: ...  # tokens it holds
    def slots(self, seq: Seq, start: int = 0) -> list[tuple[int, int, int]]: ...  # holding tokens >= start
    def free_tokens(self) -> int: ...  # free in the allocator's own books
    def usable_free(self) -> int: ...  # of which a new request could use


def first_fit(slabs: list[tuple[int, int]], size: int, budget: int) -> int | None:
    """The lowest offset in [0, budget) where ``size`` tokens fit between the ``(offset, size)``
    slabs (any order, not overlapping), or None when no hole is big enough."""
    end = 0  # end of the previous slab: the hole runs from here to the next slab
    for off, sz in sorted(slabs):
        if off - end >= size:
            return end
        end = off + sz
    return end if budget - end >= size else None


def slab_waste(size: int, live: int, final: int) -> tuple[int, int, int]:
    """Split a held slot of ``size`` tokens into (live, reserved, internal) tokens, for a
    sequence with ``live`` tokens in it now that will end with ``final``: reserved is what
    it will still fill, internal what it never will. For a block holding the sequence's tokens
    from ``first`` on, pass ``live - first`` and ``final - first``."""
    live, used = min(max(live, 0), size), min(max(final, 0), size)
    return live, used - live, size - used


def external_tokens(policy: Policy, blocked: Seq | None) -> int:
    """Free memory stranded by where it lies: all free memory when the head of the queue
    (``blocked``) was refused although the total free memory would hold it, else 0."""
    if blocked is not None and policy.need(blocked) <= policy.usable_free():
        return policy.free_tokens()
    return 0


class _Slabs:
    """One contiguous slab per sequence, placed first-fit in [0, budget)."""

    name = "contiguous"

    def reset(self, budget: int, max_seq_len: int) -> None:
        self.budget, self.max_seq_len = budget, max_seq_len
        self.slab: dict[int, tuple[int, int]] = {}  # seq id -> (offset, size)
        self.used = 0
        self.counters: dict[str, int] = {}

    def slab_size(self, seq: Seq) -> int:
        raise NotImplementedError

    def refuse(self, req: TraceRequest) -> str | None:
        if req.total_len > self.budget:
            return f"needs {req.total_len} tokens, more than the whole {self.budget}-token budget"
        return None

    def _first_fit(self, size: int, skip: int | None = None) -> int | None:
        return first_fit([s for sid, s in self.slab.items() if sid != skip], size, self.budget)

    def need(self, seq: Seq) -> int:
        return self.slab_size(seq)

    def admit(self, seq: Seq) -> bool:
        size = self.slab_size(seq)
        off = self._first_fit(size)
        if off is None:
            return False
        self.slab[seq.id] = (off, size)
        self.used += size
        return True

    def grow(self, seq: Seq) -> bool:
        return seq.live + 1 <= self.slab[seq.id][1]

    def release(self, seq: Seq) -> None:
        self.used -= self.slab.pop(seq.id)[1]

    def capacity(self, seq: Seq) -> int:
        return self.slab[seq.id][1]

    def slots(self, seq: Seq, start: int = 0) -> list[tuple[int, int, int]]:
        off, size = self.slab[seq.id]
        return [(off, size, 0)]

    def free_tokens(self) -> int:
        return self.budget - self.used

    usable_free = free_tokens


class ContiguousMax(_Slabs):
    name = "contiguous max"

    def slab_size(self, seq: Seq) -> int:
        return self.max_seq_len

    def refuse(self, req: TraceRequest) -> str | None:
        if self.max_seq_len > self.budget:
            return f"a max_seq_len slab ({self.max_seq_len}) is larger than the {self.budget}-token budget"
        return None


class ContiguousOracle(_Slabs):
    name = "contiguous oracle"

    def slab_size(self, seq: Seq) -> int:
        return seq.final


class ContiguousPow2(_Slabs):
    name = "contiguous pow2"

    def reset(self, budget: int, max_seq_len: int) -> None:
        super().reset(budget, max_seq_len)
        self.cap = min(max_seq_len, budget)  # never grow past what the model or memory allows
        self.counters = {"reallocations": 0, "copied_tokens": 0}

    def slab_size(self, seq: Seq) -> int:
        return min(1 << seq.live.bit_length(), self.cap)  # next power of two > live: room to grow

    def grow(self, seq: Seq) -> bool:
        off, size = self.slab[seq.id]
        if seq.live + 1 <= size:
            return True
        new = min(2 * size, self.cap)
        nxt = min((o for sid, (o, _) in self.slab.items() if o > off), default=self.budget)
        if nxt - off < new:  # cannot extend in place: move (the old slab counts as free)
            moved = self._first_fit(new, skip=seq.id)
            if moved is None:
                return False
            off = moved
            self.counters["copied_tokens"] += seq.live
        self.slab[seq.id] = (off, new)
        self.used += new - size
        self.counters["reallocations"] += 1
        return True


class Paged:
    """Fixed-size blocks on demand: stage 3's own BlockAllocator and BlockTable, one table per sequence."""

    def __init__(self, block_size: int = 16):
        check_block_size(block_size)
        self.block_size = block_size
        self.name = f"paged (block {block_size})"

    def reset(self, budget: int, max_seq_len: int) -> None:
        self.budget, self.num_blocks = budget, budget // self.block_size
        # The allocator's FIFO free list reuses the block freed longest ago, so as sequences come
        # and go one sequence's blocks end up scattered, as in a real pool.
        # (A budget smaller than one block has no pool at all: refuse() turns every request away.)
        self.allocator = BlockAllocator(self.num_blocks) if self.num_blocks else None
        self.tables: dict[int, BlockTable] = {}
        self.counters: dict[str, int] = {}

    def refuse(self, req: TraceRequest) -> str | None:
        blocks = blocks_for(req.total_len, self.block_size)
        if blocks > self.num_blocks:
            return f"needs {blocks} blocks of {self.block_size}, the budget has {self.num_blocks}"
        return None

    def need(self, seq: Seq) -> int:
        return blocks_for(seq.live, self.block_size) * self.block_size

    def _append(self, table: BlockTable, tokens: int) -> bool:
        if table.blocks_needed(tokens) > self.allocator.num_free:
            return False
        table.append_tokens(tokens)
        return True

    def admit(self, seq: Seq) -> bool:
        table = BlockTable(self.block_size, self.allocator)
        if not self._append(table, seq.live):
            return False
        self.tables[seq.id] = table
        return True

    def grow(self, seq: Seq) -> bool:
        # The simulator asks only when the sequence's blocks are full, so the table first catches
        # up with the tokens written into its last block since, then takes room for one more.
        table = self.tables[seq.id]
        return self._append(table, seq.live + 1 - table.num_tokens)

    def release(self, seq: Seq) -> None:
        self.tables.pop(seq.id).free()

    def capacity(self, seq: Seq) -> int:
        return len(self.tables[seq.id]) * self.block_size

    def slots(self, seq: Seq, start: int = 0) -> list[tuple[int, int, int]]:
        bs, first = self.block_size, start // self.block_size
        return [(b * bs, bs, i * bs) for i, b in enumerate(self.tables[seq.id].blocks[first:], first)]

    def free_tokens(self) -> int:  # the budget's tail past the last whole block is never usable
        return self.usable_free() + self.budget % self.block_size

    def usable_free(self) -> int:
        return self.allocator.num_free * self.block_size if self.allocator else 0


def default_policies(block_size: int = 16) -> list[Policy]:
    return [ContiguousMax(), ContiguousPow2(), ContiguousOracle(), Paged(block_size)]
