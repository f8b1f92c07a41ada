"""The stage-5 block manager: invariants under long random operation sequences, and regression
tests for the failure modes real engines had with prefix caching and copy-on-write."""

from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import minikv.prefix as prefix
from minikv.blocks import OutOfBlocks
from minikv.prefix import BlockManager, block_hash


def check_invariants(bm: BlockManager) -> None:
    """Everything the block manager promises, checked from the outside."""
    owners = Counter(b for t in bm.tables.values() for b in t.blocks)
    alloc, cache = bm.allocator, bm.cache
    free = set(alloc._free)
    assert len(free) == len(alloc._free), "a block is on the free list twice"
    for b in range(bm.num_blocks):
        # refcount == the number of block-table entries naming the block
        assert alloc.refcount(b) == owners[b], f"block {b}: refcount {alloc.refcount(b)}, named {owners[b]} times"
        states = [owners[b] > 0, b in cache.evictable, b in free]
        assert sum(states) == 1, f"block {b} is in {states} of (owned, evictable, free)"
    assert set(cache.evictable) == alloc._kept, "evictable blocks are exactly the ones the allocator keeps aside"
    assert set(cache.evictable) <= set(cache.key_of), "an evictable block must be cached"
    for h, b in cache.by_hash.items():  # every cached hash names a block holding those tokens
        key = cache.key_of[b]
        assert key.hash == h
        assert block_hash(key.parent.hash if key.parent else None, key.tokens, key.extra) == h
        assert key.parent is None or key.parent.hash is not None
    assert len(cache.by_hash) == len(cache.key_of)
    for t in bm.tables.values():
        assert len(t.blocks) == -(-t.num_tokens // bm.block_size)
        assert len(t.token_ids) == t.num_tokens
        for i, key in enumerate(t.keys):  # the cached chain a table carries holds its own tokens
            assert key.tokens == tuple(t.token_ids[i * bm.block_size:(i + 1) * bm.block_size])
    assert bm.num_free_blocks == len(free) + len(cache.evictable)


class BlockManagerMachine(RuleBasedStateMachine):
    """Random open/append/fork/free over a small pool, with a tiny vocabulary so prefixes repeat."""

    @initialize(num_blocks=st.integers(1, 12), block_size=st.sampled_from([1, 2, 3, 4]), caching=st.booleans())
    def setup(self, num_blocks, block_size, caching):
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
        self.next_id = 0
        self.contents: dict[int, list[int]] = {}  # what each sequence's tokens are, by the model

    def _new_id(self):
        self.next_id += 1
        return self.next_id

    @rule(prompt=st.lists(st.integers(0, 2), min_size=1, max_size=10))
    def open_and_prefill(self, prompt):
        sid = self._new_id()
        hit = self.bm.open(sid, prompt)
        assert hit % self.bm.block_size == 0 and hit < len(prompt)
        try:
            self.bm.append(sid, prompt[hit:])
        except OutOfBlocks:
            assert self.bm.num_tokens(sid) == hit  # unchanged
            self.bm.free(sid)
            return
        self.contents[sid] = list(prompt)

    @precondition(lambda self: self.contents)
    @rule(data=st.data(), tokens=st.lists(st.integers(0, 2), min_size=1, max_size=3))
    def append(self, data, tokens):
        sid = data.draw(st.sampled_from(sorted(self.contents)))
        before = (list(self.bm.block_table(sid)), self.bm.num_free_blocks)
        try:
            self.bm.append(sid, tokens)
            self.contents[sid] += tokens
        except OutOfBlocks:
            assert (self.bm.block_table(sid), self.bm.num_free_blocks) == before

    @precondition(lambda self: self.contents)
    @rule(data=st.data())
    def fork(self, data):
        sid = data.draw(st.sampled_from(sorted(self.contents)))
        child = self._new_id()
        self.bm.fork(sid, child)
        self.contents[child] = list(self.contents[sid])

    @precondition(lambda self: self.contents)
    @rule(data=st.data())
    def free(self, data):
        sid = data.draw(st.sampled_from(sorted(self.contents)))
        self.bm.free(sid)
        del self.contents[sid]

    @rule()
    def copies_are_from_shared_to_fresh(self):
        for src, dst in self.bm.take_copies():
            assert src != dst

    @invariant()
    def invariants(self):
        if hasattr(self, "bm"):
            check_invariants(self.bm)
            for sid, tokens in self.contents.items():
                assert self.bm.tables[sid].token_ids == tokens

    def teardown(self):
        if hasattr(self, "bm"):
            for sid in list(self.contents):
                self.bm.free(sid)
            check_invariants(self.bm)
            assert self.bm.num_free_blocks == self.bm.num_blocks  # everything back: free or evictable


BlockManagerMachine.TestCase.settings = settings(
    max_examples=250, stateful_step_count=60, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])  # about 12,000 operations (counted: 250 runs of up to 60)
test_block_manager_invariants = BlockManagerMachine.TestCase


def prefill(bm, sid, prompt):
    hit = bm.open(sid, prompt)
    bm.append(sid, prompt[hit:])
    return hit


# ---- regression tests: failure modes real engines had ----

def test_full_prompt_hit_at_an_exact_block_multiple_still_computes_the_last_token():
    bm = BlockManager(8, 4)
    prompt = list(range(8))  # exactly two full blocks
    prefill(bm, "a", prompt)
    bm.free("a")
    hit = bm.open("b", prompt)
    assert hit == 4, "the last block is recomputed so the model has the last token's logits"
    assert bm.append("b", prompt[hit:])  # and it can be written
    check_invariants(bm)


def test_prompt_shorter_than_a_block_gets_no_hit_and_no_error():
    bm = BlockManager(4, 16)
    assert prefill(bm, "a", [1, 2, 3]) == 0
    bm.free("a")
    assert bm.open("b", [1, 2, 3]) == 0
    assert bm.open("c", [7]) == 0


def test_forced_hash_collision_returns_no_wrong_block(monkeypatch):
    monkeypatch.setattr(prefix, "block_hash", lambda parent, tokens, extra=None: 42)
    bm = BlockManager(8, 2)
    prefill(bm, "a", [1, 2, 3, 4, 5])
    bm.free("a")
    assert bm.open("b", [9, 9, 3, 4, 5]) == 0, "same hash, different tokens: a miss"
    assert bm.open("c", [1, 2, 3, 4, 5]) == 2  # the honest hit still works
    assert [bm.cache.key_of[b].tokens for b in bm.cache.by_hash.values()] == [(1, 2)]  # one hash, one block


def test_a_chain_is_matched_whole_not_block_by_block():
    bm = BlockManager(8, 2)
    prefill(bm, "a", [1, 2, 3, 4, 0])
    bm.free("a")
    assert bm.open("b", [9, 9, 3, 4, 0]) == 0, "block [3, 4] after a different parent is not a hit"


def test_a_hit_on_an_evictable_block_takes_it_off_the_eviction_list():
    bm = BlockManager(4, 2)
    prefill(bm, "a", [1, 2, 3])
    bm.free("a")
    (cached,) = bm.cache.evictable
    assert bm.open("b", [1, 2, 5]) == 2
    assert cached not in bm.cache.evictable and bm.allocator.refcount(cached) == 1
    bm.append("b", [5])
    for _ in range(bm.num_free_blocks):  # use up everything else: the hit block is not evicted
        bm.open(object(), [0])
    check_invariants(bm)
    assert bm.block_table("b")[0] == cached and bm.cache.key_of[cached].tokens == (1, 2)


def test_eviction_removes_the_hash_entry_and_goes_least_recently_used_first():
    bm = BlockManager(3, 2)
    prefill(bm, "a", [1, 2, 0])
    bm.free("a")
    prefill(bm, "b", [3, 4, 0])
    bm.free("b")
    assert len(bm.cache.by_hash) == 2 and bm.allocator.num_free == 1
    prefill(bm, "c", [7, 7, 7, 7, 7])  # three blocks: the free one, then the LRU cached ([1, 2]), ...
    assert bm.stats.evictions == 2 and not bm.cache.by_hash.get(block_hash(None, (1, 2)))
    assert bm.open("d", [1, 2, 0]) == 0, "an evicted block's hash is gone"
    check_invariants(bm)


def test_never_cached_blocks_are_allocated_before_evicting():
    bm = BlockManager(4, 2)
    prefill(bm, "a", [1, 2, 0])
    bm.free("a")
    prefill(bm, "b", [5, 5, 5])
    assert bm.stats.evictions == 0 and len(bm.cache.evictable) == 1


def test_copy_on_write_when_two_forks_append_to_the_same_partial_block():
    bm = BlockManager(8, 4)
    prefill(bm, "p", [1, 2, 3, 4, 5, 6])  # one full block, one partial (2 of 4)
    bm.fork("p", "c")
    shared_tail = bm.block_table("p")[-1]
    assert bm.blocks_needed("c", 1) == 1
    bm.append("c", [7])
    (copy,) = bm.take_copies()
    assert copy[0] == shared_tail and bm.block_table("c")[-1] == copy[1]
    assert bm.block_table("c")[0] == bm.block_table("p")[0], "the full block stays shared"
    bm.append("p", [8])  # p is now the only owner of the old tail: no copy
    assert bm.take_copies() == [] and bm.block_table("p")[-1] == shared_tail
    assert bm.stats.cow_copies == 1
    check_invariants(bm)


def test_a_full_last_block_is_never_copied():
    bm = BlockManager(8, 2)
    prefill(bm, "p", [1, 2, 3, 4])
    bm.fork("p", "c")
    bm.append("c", [5])
    bm.append("p", [6])
    assert bm.take_copies() == []


def test_freeing_a_fork_leaves_its_sibling_intact():
    bm = BlockManager(8, 4)
    prefill(bm, "p", [1, 2, 3, 4, 5])
    bm.fork("p", "c")
    blocks = list(bm.block_table("p"))
    bm.free("c")
    assert bm.block_table("p") == blocks and all(bm.allocator.refcount(b) == 1 for b in blocks)
    bm.append("p", [6, 7, 8, 9])
    assert bm.take_copies() == []
    check_invariants(bm)


def test_out_of_blocks_leaves_everything_unchanged():
    bm = BlockManager(2, 2)
    prefill(bm, "a", [1, 2, 3])
    bm.fork("a", "b")
    with pytest.raises(OutOfBlocks):
        bm.append("b", [4, 5, 6])  # one COW copy + one new block, but only 0 free
    assert bm.block_table("b") == bm.block_table("a") and bm.take_copies() == []
    check_invariants(bm)


def test_blocks_filled_during_decode_become_cacheable():
    bm = BlockManager(8, 2)
    prefill(bm, "a", [1, 2, 3])
    bm.append("a", [4])  # decode fills the second block
    bm.append("a", [5])
    bm.free("a")
    assert bm.open("b", [1, 2, 3, 4, 5]) == 4


def test_extra_key_separates_otherwise_equal_prefixes():
    bm = BlockManager(8, 2)
    hit = bm.open("a", [1, 2, 3], extra_key="adapter-1")
    bm.append("a", [1, 2, 3][hit:])
    bm.free("a")
    assert bm.open("b", [1, 2, 3], extra_key="adapter-2") == 0
    assert bm.open("c", [1, 2, 3], extra_key="adapter-1") == 2


def test_unknown_token_ids_are_never_cached():
    bm = BlockManager(8, 2)
    bm.open("a", [1, 2, 3])
    bm.append("a", 3)  # three tokens whose ids are not known
    bm.free("a")
    assert not bm.cache.by_hash and bm.num_free_blocks == 8


def test_the_hash_is_stable_across_processes():
    import subprocess
    import sys

    code = "from minikv.prefix import block_hash; print(block_hash(block_hash(None, [1, 2]), [3, 4], 'x'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert int(out) == block_hash(block_hash(None, [1, 2]), [3, 4], "x")


def test_counters_and_bytes_saved():
    bm = BlockManager(16, 4, bytes_per_block=1000)
    prefill(bm, "a", list(range(10)))
    bm.fork("a", "b")
    bm.fork("a", "c")
    assert bm.num_shared_blocks == 3 and bm.blocks_saved == 6 and bm.bytes_saved == 6000
    bm.free("a")
    bm.free("b")
    bm.free("c")
    hit = bm.open("d", list(range(10)))
    assert hit == 8 and bm.stats.lookups == 2 and bm.stats.tokens_hit == 8
    assert bm.stats.hit_rate == pytest.approx(8 / 20)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, 0)
    bm = BlockManager(4, 2)
    bm.open("a", [1])
    with pytest.raises(ValueError, match="already open"):
        bm.open("a", [1])
    with pytest.raises(KeyError, match="no sequence"):
        bm.free("zzz")
