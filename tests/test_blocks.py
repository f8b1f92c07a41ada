"""The block allocator and block tables: unit tests, errors, and a long random state machine."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from minikv.blocks import BlockAllocator, BlockError, BlockTable, OutOfBlocks

# ---- the allocator ----------------------------------------------------------------------

def test_allocate_free_and_counts():
    alloc = BlockAllocator(4)
    assert (alloc.num_blocks, alloc.num_free, alloc.num_used) == (4, 4, 0)
    a, b = alloc.allocate(), alloc.allocate()
    assert a != b and alloc.refcount(a) == alloc.refcount(b) == 1
    assert (alloc.num_free, alloc.num_used) == (2, 2)
    assert alloc.free(a) is True
    assert alloc.refcount(a) == 0 and alloc.num_free == 3


def test_free_list_is_fifo():
    """The block freed longest ago is reused first (stage 5 relies on it for LRU eviction)."""
    alloc = BlockAllocator(3)
    blocks = [alloc.allocate() for _ in range(3)]
    assert blocks == [0, 1, 2]
    alloc.free(2)
    alloc.free(0)
    assert alloc.allocate() == 2
    assert alloc.allocate() == 0


def test_refcounts_keep_shared_blocks_alive():
    alloc = BlockAllocator(2)
    block = alloc.allocate()
    alloc.incref(block)
    assert alloc.refcount(block) == 2
    assert alloc.free(block) is False  # one owner left
    assert alloc.num_free == 1 and alloc.refcount(block) == 1
    assert alloc.free(block) is True
    assert alloc.num_free == 2


def test_double_free_is_an_error_and_changes_nothing():
    alloc = BlockAllocator(2)
    block = alloc.allocate()
    alloc.free(block)
    with pytest.raises(BlockError, match="double free"):
        alloc.free(block)
    assert alloc.num_free == 2 and alloc.refcount(block) == 0
    assert sorted(alloc.allocate() for _ in range(2)) == [0, 1]  # the block is on the free list once


@pytest.mark.parametrize("bad", [-1, 3, 100, 1.0, "0", None])
def test_unknown_blocks_are_rejected(bad):
    alloc = BlockAllocator(3)
    alloc.allocate()
    for op in (alloc.free, alloc.incref, alloc.refcount):
        with pytest.raises(BlockError):
            op(bad)
    assert alloc.num_free == 2
    assert issubclass(BlockError, ValueError)


def test_incref_of_a_free_block_is_an_error():
    alloc = BlockAllocator(2)
    with pytest.raises(BlockError, match="free"):
        alloc.incref(0)


def test_out_of_blocks_says_needed_and_free():
    alloc = BlockAllocator(1)
    alloc.allocate()
    with pytest.raises(OutOfBlocks, match=r"needed 1 block.*only 0 free") as err:
        alloc.allocate()
    assert (err.value.needed, err.value.free) == (1, 0)


@pytest.mark.parametrize("bad", [0, -3, 2.5, None])
def test_pool_and_block_sizes_must_be_positive_ints(bad):
    with pytest.raises(ValueError, match="num_blocks"):
        BlockAllocator(bad)
    with pytest.raises(ValueError, match="block_size"):
        BlockTable(bad, BlockAllocator(4))


# ---- block tables -----------------------------------------------------------------------

def test_append_maps_tokens_to_slots():
    alloc = BlockAllocator(8)
    other = BlockTable(4, alloc)
    other.append_tokens(1)  # takes block 0, so `table` does not start at slot 0
    table = BlockTable(4, alloc)
    assert table.blocks_needed(5) == 2
    slots = table.append_tokens(5)
    assert table.blocks == [1, 2] and table.num_tokens == 5
    assert slots == [4, 5, 6, 7, 8]
    assert table.blocks_needed(3) == 0 and table.blocks_needed(4) == 1
    assert table.append_tokens(3) == [9, 10, 11]
    assert table.slots_for([0, 7, 4]) == [4, 11, 8]
    assert table.append_tokens(0) == [] and len(table) == 2


def test_block_size_that_divides_nothing():
    alloc = BlockAllocator(10)
    table = BlockTable(7, alloc)
    slots = table.append_tokens(13) + table.append_tokens(1) + table.append_tokens(2)
    assert len(table.blocks) == math.ceil(16 / 7) == 3
    assert slots == [table.blocks[t // 7] * 7 + t % 7 for t in range(16)]


def test_failed_append_changes_nothing():
    alloc = BlockAllocator(3)
    table = BlockTable(2, alloc)
    table.append_tokens(3)  # 2 blocks
    with pytest.raises(OutOfBlocks, match=r"needed 2 block.*only 1 free") as err:
        table.append_tokens(5)  # 8 tokens need 4 blocks: 2 new ones, and the pool has 1
    assert (err.value.needed, err.value.free) == (2, 1)
    assert table.num_tokens == 3 and len(table.blocks) == 2 and alloc.num_free == 1


def test_free_returns_every_block():
    alloc = BlockAllocator(5)
    table = BlockTable(3, alloc)
    table.append_tokens(10)
    assert alloc.num_free == 1
    table.free()
    assert alloc.num_free == 5 and table.blocks == [] and table.num_tokens == 0
    table.free()  # freeing an empty table is harmless
    assert alloc.num_free == 5


def test_bad_positions_and_counts():
    table = BlockTable(4, BlockAllocator(4))
    table.append_tokens(2)
    with pytest.raises(IndexError):
        table.slots_for([2])
    with pytest.raises(IndexError):
        table.slots_for([-1])
    with pytest.raises(ValueError, match="negative"):
        table.append_tokens(-1)


@given(block_size=st.integers(1, 9), chunks=st.lists(st.integers(0, 20), max_size=12))
def test_slots_follow_the_formula(block_size, chunks):
    alloc = BlockAllocator(12 * 20)  # enough for the longest draw at block_size 1
    table = BlockTable(block_size, alloc)
    slots = []
    for n in chunks:
        expected_new = math.ceil((table.num_tokens + n) / block_size) - len(table.blocks)
        assert table.blocks_needed(n) == expected_new
        slots += table.append_tokens(n)
    assert len(slots) == len(set(slots)) == table.num_tokens == sum(chunks)
    assert slots == [table.blocks[t // block_size] * block_size + t % block_size for t in range(len(slots))]
    assert len(table.blocks) == math.ceil(sum(chunks) / block_size)


# ---- a long random life: many tables sharing one allocator -----------------------------

class AllocatorMachine(RuleBasedStateMachine):
    """Random appends, shares (incref), releases and frees across several tables.

    The model of ownership: each table owns one reference to each of its blocks, and
    `extra` lists the references taken by incref (as a prefix-sharing sequence would).
    """

    @initialize(num_blocks=st.integers(1, 24), block_size=st.integers(1, 5))
    def setup(self, num_blocks, block_size):
        self.alloc = BlockAllocator(num_blocks)
        self.block_size = block_size
        self.tables: list[BlockTable] = []
        self.extra: list[int] = []

    def snapshot(self):
        return ([(list(t.blocks), t.num_tokens) for t in self.tables],
                [self.alloc.refcount(b) for b in range(self.alloc.num_blocks)], self.alloc.num_free)

    @rule()
    def new_table(self):
        if len(self.tables) < 6:
            self.tables.append(BlockTable(self.block_size, self.alloc))

    @precondition(lambda self: self.tables)
    @rule(data=st.data(), n=st.integers(0, 12))
    def append(self, data, n):
        table = data.draw(st.sampled_from(self.tables))
        needed, before = table.blocks_needed(n), self.snapshot()
        if needed > self.alloc.num_free:
            with pytest.raises(OutOfBlocks) as err:
                table.append_tokens(n)
            assert (err.value.needed, err.value.free) == (needed, self.alloc.num_free)
            assert self.snapshot() == before  # a failed append changes nothing
        else:
            start = table.num_tokens
            slots = table.append_tokens(n)
            assert slots == table.slots_for(range(start, start + n))
            assert self.alloc.num_free == before[2] - needed

    @precondition(lambda self: any(t.blocks for t in self.tables))
    @rule(data=st.data())
    def share(self, data):
        table = data.draw(st.sampled_from([t for t in self.tables if t.blocks]))
        block = data.draw(st.sampled_from(table.blocks))
        self.alloc.incref(block)
        self.extra.append(block)

    @precondition(lambda self: self.extra)
    @rule(data=st.data())
    def release(self, data):
        block = self.extra.pop(data.draw(st.integers(0, len(self.extra) - 1)))
        owners_left = self.owners().get(block, 0)
        assert self.alloc.free(block) is (owners_left == 0)

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def free_table(self, data):
        table = self.tables.pop(data.draw(st.integers(0, len(self.tables) - 1)))
        blocks = list(table.blocks)
        table.free()
        owners = self.owners()
        for block in blocks:  # every block the table held is free unless someone else holds it
            assert self.alloc.refcount(block) == owners.get(block, 0)

    @precondition(lambda self: self.alloc.num_free)
    @rule(data=st.data())
    def double_free_is_refused(self, data):
        free_blocks = [b for b in range(self.alloc.num_blocks) if self.alloc.refcount(b) == 0]
        block, before = data.draw(st.sampled_from(free_blocks)), self.snapshot()
        with pytest.raises(BlockError):
            self.alloc.free(block)
        assert self.snapshot() == before

    def owners(self) -> dict[int, int]:
        count: dict[int, int] = {}
        for block in [b for t in self.tables for b in t.blocks] + self.extra:
            count[block] = count.get(block, 0) + 1
        return count

    @invariant()
    def refcounts_are_exact(self):
        owners = self.owners()
        refcounts = [self.alloc.refcount(b) for b in range(self.alloc.num_blocks)]
        assert all(r >= 0 for r in refcounts)
        assert refcounts == [owners.get(b, 0) for b in range(self.alloc.num_blocks)]
        assert self.alloc.num_free == refcounts.count(0)
        assert self.alloc.num_free + self.alloc.num_used == self.alloc.num_blocks

    @invariant()
    def tables_never_share_blocks_or_slots(self):
        held = [b for t in self.tables for b in t.blocks]
        assert len(held) == len(set(held))  # tables here never share: any repeat is a leak
        slots = [s for t in self.tables for s in t.slots_for(range(t.num_tokens))]
        assert len(slots) == len(set(slots))
        for t in self.tables:
            assert len(t.blocks) == math.ceil(t.num_tokens / self.block_size)

    def teardown(self):
        for table in self.tables:
            table.free()
        for block in self.extra:
            self.alloc.free(block)
        assert self.alloc.num_free == self.alloc.num_blocks  # nothing leaked


AllocatorMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=80, deadline=None)
TestAllocatorMachine = AllocatorMachine.TestCase
