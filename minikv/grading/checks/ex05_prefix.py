"""Checks for exercise 05 (shared walls): the learner's `chain_hash` and `MyBlockManager`.

`MyBlockManager` has a different shape from the lecture's `minikv.prefix.BlockManager`: one
`admit(seq_id, prompt, salt=None)` does the lookup *and* reserves the rest of the prompt, all or
nothing (a refused admit takes no cached block and changes no eviction order); `append(seq_id,
token)` writes one decoded token; a per-tenant `salt` keeps tenants from ever sharing blocks. It is
compared with minikv's `BlockManager` (driven through a small reference adapter, `Reference`, that
gives it the same interface) on hypothesis-drawn operation sequences: hits returned, OutOfBlocks
raised or not, free blocks, every sequence's length and table length, which sequences share which
blocks (block ids may differ; the sharing pattern may not), refcounts and copy-on-write copies.

The real-model check runs beam search on SmolLM2-135M (the tiny random Llama if SmolLM2 is not
installed) with `PagedKVCache(..., manager=Adapter(MyBlockManager(...)))` and wants DynamicCache's
beams, then every block back after `cache.reset()`. The adapter turns PagedKVCache's calls into
normal method calls on the learner's object (no attribute of it is touched).
"""

from __future__ import annotations

import copy
import functools
import itertools

import torch
from hypothesis import given
from hypothesis import strategies as st

from minikv.blocks import blocks_for
from minikv.grading import NotImplementedYet, call, learner, one_torch_thread, run_hypothesis
from minikv.grading.checks.ex03_paged import CLASS_STATE, MANY, OUT_OF_BLOCKS_ERRORS, _describe, _outcome
from minikv.prefix import BlockManager

# Delegation (see minikv.grading.delegation): the graded names may not be, call or subclass minikv's own
# prefix cache or this module's reference. minikv.blocks (OutOfBlocks, blocks_for, the stage-3
# allocator and table) stays allowed: the exercise is the hash chain, the lookup and copy-on-write.
GRADED = ["chain_hash", "MyBlockManager"]
FORBIDDEN = ["minikv.prefix.BlockManager", "minikv.prefix.PrefixCache", "minikv.prefix.SeqTable",
             "minikv.prefix.block_hash", "minikv.grading.checks.ex05_prefix.Reference"]


class Reference:
    """minikv's BlockManager behind the exercise's interface (what the learner's class must match).

    minikv's manager has no all-or-nothing ``admit``: it opens (takes the cache hits) and then
    appends, and leaves the undoing to its caller. The reference does not rebuild the rule the
    learner writes (counting the blocks a prompt needs before touching anything); it runs the
    two calls as a *transaction* on a copy of the whole manager and keeps the copy only if both
    succeeded. So what the checks compare is behaviour: on refusal nothing at all changed (no
    cached block taken, no eviction order moved), however a submission arranges that.
    """

    def __init__(self, num_blocks: int, block_size: int):
        self.bm = BlockManager(num_blocks, block_size)
        self.block_size = block_size

    @property
    def num_free_blocks(self) -> int:
        return self.bm.num_free_blocks

    def admit(self, seq_id, prompt, salt=None) -> int:
        if seq_id in self.bm.tables:
            raise ValueError(f"sequence {seq_id!r} is already admitted")
        trial = copy.deepcopy(self.bm)  # the manager is small here (tens of blocks): copying is cheap
        hit = trial.open(seq_id, prompt, extra_key=salt)
        trial.append(seq_id, prompt[hit:])  # OutOfBlocks here discards the trial: self.bm is untouched
        self.bm = trial
        return hit

    def append(self, seq_id, token: int) -> int:
        return self.bm.append(seq_id, [token])[0]

    def fork(self, parent_id, child_id) -> None:
        self.bm.fork(parent_id, child_id)

    def free(self, seq_id) -> None:
        self.bm.free(seq_id)

    def take_copies(self):
        return self.bm.take_copies()

    def block_table(self, seq_id):
        return self.bm.block_table(seq_id)

    def num_tokens(self, seq_id) -> int:
        return self.bm.num_tokens(seq_id)

    def refcount(self, block: int) -> int:
        return self.bm.allocator.refcount(block)


# ---- (a) the hash chain -----------------------------------------------------------------------

def check_chain_hash(ns):
    h = learner(ns, "chain_hash")
    a = call(h, None, (1, 2, 3, 4))
    if not isinstance(a, int):
        raise AssertionError(f"chain_hash(None, (1, 2, 3, 4)) returned {a!r}; expected an int")
    cases = [("the same arguments again", call(h, None, (1, 2, 3, 4)), True),
             ("other tokens", call(h, None, (1, 2, 3, 5)), False),
             ("the same tokens after a parent", call(h, a, (1, 2, 3, 4)), False),
             ("a salt", call(h, None, (1, 2, 3, 4), "tenant-b"), False)]
    for what, got, same in cases:
        if (got == a) != same:
            raise AssertionError(f"chain_hash(None, (1, 2, 3, 4)) = {a} and with {what} = {got}: expected "
                                 f"{'the same' if same else 'a different'} hash")
    b1, b2 = call(h, a, (5, 6)), call(h, call(h, None, (9, 9, 9, 9)), (5, 6))
    if b1 == b2:
        raise AssertionError("two blocks holding (5, 6) after different parents got the same hash: the parent's "
                             "hash must go into the child's, so that equal hashes mean equal *prefixes*")
    salted = [call(h, call(h, None, (1, 2), s), (3, 4)) for s in (None, "a", "b")]
    if len(set(salted)) != 3:
        raise AssertionError(f"the second block's hash after first blocks salted None, 'a', 'b' is {salted}: a salt "
                             "must change the whole chain (it is enough to put it in the first block's hash)")


# ---- (b) scripted regressions ------------------------------------------------------------------

def _manager_cls(ns):
    return learner(ns, "MyBlockManager")


def replay(cls, num_blocks: int, block_size: int, ops) -> None:
    """Run `ops` on cls(num_blocks, block_size) and on the Reference; AssertionError at the first difference."""
    ref, mine = Reference(num_blocks, block_size), call(cls, num_blocks, block_size)
    history = [f"m = MyBlockManager({num_blocks}, {block_size})"]

    def fail(problem: str):
        raise AssertionError(f"{'; '.join(history)}: {problem}")

    def compare_state():
        got = call(lambda: mine.num_free_blocks)
        if got != ref.num_free_blocks:
            fail(f"then m.num_free_blocks is {got!r}, expected {ref.num_free_blocks} (free + cached-but-evictable)")
        pairs: dict = {}
        back: dict = {}
        for s in ref.bm.tables:
            n, table = call(mine.num_tokens, s), list(call(mine.block_table, s))
            want = ref.block_table(s)
            if n != ref.num_tokens(s) or len(table) != len(want):
                fail(f"then sequence {s!r} holds {n} tokens in blocks {table}; expected {ref.num_tokens(s)} tokens "
                     f"in {len(want)} blocks")
            for i, (b, r) in enumerate(zip(table, want)):
                if pairs.setdefault(b, r) != r or back.setdefault(r, b) != b:
                    fail(f"then block {i} of sequence {s!r} is block {b}: the sharing is wrong (minikv's manager "
                         f"shares a block between exactly the sequences that share a prefix or a fork, and no others)")
        for b, r in pairs.items():
            got = call(mine.refcount, b)
            if got != ref.refcount(r):
                fail(f"then m.refcount({b}) is {got!r}, expected {ref.refcount(r)} (one per sequence naming it)")

    compare_state()
    for op in ops:
        name, args = op[0], op[1:]
        shown = f"m.{name}({', '.join(map(repr, args))})"
        want = _outcome(lambda: getattr(ref, name)(*args))
        got = _outcome(lambda: call(getattr(mine, name), *args))
        if want[0] == "raised":
            if not (got[0] == "raised" and isinstance(got[1], OUT_OF_BLOCKS_ERRORS + (ValueError, KeyError))):
                fail(f"{shown} {_describe(got)}; expected it to raise ({type(want[1]).__name__}: {want[1]})")
        elif got[0] == "raised":
            fail(f"{shown} raised {type(got[1]).__name__}: {got[1]}; minikv's manager {_describe(want)}")
        elif name == "admit" and got[1] != want[1]:
            fail(f"{shown} returned {got[1]!r} cached prompt tokens, expected {want[1]}")
        copies, want_copies = list(call(mine.take_copies)), ref.take_copies()
        if len(copies) != len(want_copies):
            fail(f"{shown}: then m.take_copies() gave {copies}; expected {len(want_copies)} copy-on-write cop"
                 f"{'y' if len(want_copies) == 1 else 'ies'}")
        history.append(shown + (f" -> {got[1]!r}" if name == "admit" and got[0] == "ok" else "")
                       + (" -> OutOfBlocks" if want[0] == "raised" else ""))
        compare_state()


SCRIPTS = {
    "a prompt wholly cached at an exact block multiple still computes its last token":
        (8, 4, [("admit", "a", [1, 2, 3, 4, 5, 6, 7, 8]), ("admit", "b", [1, 2, 3, 4, 5, 6, 7, 8])]),
    "a prompt shorter than a block gets no hit (and no error)":
        (8, 4, [("admit", "a", [1, 2]), ("admit", "b", [1, 2]), ("admit", "c", [1])]),
    "tenants with different salts never share":
        (8, 2, [("admit", "a", [1, 2, 3, 4, 5], "x"), ("admit", "b", [1, 2, 3, 4, 5], "y"),
                ("admit", "c", [1, 2, 3, 4, 5], "x")]),
    "a hit on a freed (evictable) block takes it back":
        (4, 2, [("admit", "a", [1, 2, 3, 4, 5]), ("free", "a"), ("admit", "b", [1, 2, 3, 4, 9]),
                ("admit", "c", [7, 7, 7])]),
    "eviction takes never-cached blocks first, then the least recently used, a chain from its end":
        (5, 2, [("admit", "a", [1, 2, 3, 4, 5]), ("free", "a"), ("admit", "b", [6, 6, 6, 6, 6]), ("free", "b"),
                ("admit", "c", [8, 8, 8]), ("admit", "d", [1, 2, 3, 4, 9]), ("admit", "e", [6, 6, 6, 6, 6])]),
    "two forks appending to a shared partial block: one copy, then in place":
        (8, 4, [("admit", "a", [1, 2, 3, 4, 5, 6]), ("fork", "a", "b"), ("append", "b", 7), ("append", "a", 8),
                ("append", "a", 9), ("append", "b", 9)]),
    "freeing a fork leaves its sibling intact":
        (8, 2, [("admit", "a", [1, 2, 3]), ("fork", "a", "b"), ("append", "b", 4), ("free", "a"), ("append", "b", 5)]),
    "blocks filled while decoding are cached too":
        (8, 2, [("admit", "a", [1, 2, 3]), ("append", "a", 4), ("append", "a", 5), ("admit", "b", [1, 2, 3, 4, 5])]),
    "a refused admit takes nothing and changes no eviction order":
        (4, 2, [("admit", "a", [1, 2, 3, 4, 5]), ("free", "a"), ("admit", "b", [1, 2, 3, 4, 9, 9, 9, 9, 9, 9]),
                ("admit", "c", [7, 7, 7]), ("admit", "d", [1, 2, 3])]),
}


def check_lookup_and_copy_on_write_cases(ns):
    cls = _manager_cls(ns)
    for what, (n, bs, ops) in SCRIPTS.items():
        try:
            replay(cls, n, bs, ops)
        except NotImplementedYet:
            raise
        except AssertionError as err:
            raise AssertionError(f"{what}: {err}") from None


# ---- (c) random operation sequences --------------------------------------------------------------

@st.composite
def programs(draw, small_pool: bool):
    bs = draw(st.sampled_from([1, 2, 3, 4]))
    n = draw(st.integers(1, 10)) if small_pool else 200
    names = itertools.count()
    live: list[str] = []
    ops = []
    for _ in range(draw(st.integers(1, 25))):
        kind = draw(st.sampled_from(["admit", "admit", "append", "append", "fork", "free"] if live else ["admit"]))
        if kind == "admit":
            s = f"s{next(names)}"
            ops.append(("admit", s, draw(st.lists(st.integers(0, 2), min_size=1, max_size=9)),
                        draw(st.sampled_from([None, None, "t"]))))
            live.append(s)  # (if it was refused, later ops on it raise on both sides)
        elif kind == "append":
            ops.append(("append", draw(st.sampled_from(live)), draw(st.integers(0, 2))))
        elif kind == "fork":
            s = f"s{next(names)}"
            ops.append(("fork", draw(st.sampled_from(live)), s))
            live.append(s)
        else:
            s = draw(st.sampled_from(live))
            live.remove(s)
            ops.append(("free", s))
    return n, bs, ops


def check_matches_minikv_on_random_operations(ns):
    cls = _manager_cls(ns)
    replay(cls, 8, 2, [("admit", "a", [1, 2, 3])])  # a stub stops here, quickly
    run_hypothesis(MANY(given(programs(small_pool=False))(lambda p: replay(cls, *p))), CLASS_STATE)


def check_small_pool_all_or_nothing_and_eviction(ns):
    cls = _manager_cls(ns)
    replay(cls, 2, 2, [("admit", "a", [1, 2, 3, 4, 5])])
    run_hypothesis(MANY(given(programs(small_pool=True))(lambda p: replay(cls, *p))), CLASS_STATE)


# ---- (d) the real model ----------------------------------------------------------------------------

class Adapter:
    """PagedKVCache's block-manager interface, on the learner's MyBlockManager through normal method
    calls. Token ids PagedKVCache does not know (it sees K/V, not ids) become fresh negative ids, which
    never match anything cached."""

    def __init__(self, mine, num_blocks: int, block_size: int):
        self.mine, self.num_blocks, self.block_size = mine, num_blocks, block_size
        self.opened: set = set()
        self._fresh = itertools.count(-1, -1)

    @property
    def num_free_blocks(self) -> int:
        return call(lambda: self.mine.num_free_blocks)

    def open(self, seq_id, prompt_token_ids=(), extra_key=None) -> int:
        self.opened.add(seq_id)  # admitted at its first append, when the prompt's length is known
        return 0

    def blocks_needed(self, seq_id, n: int) -> int:
        if seq_id in self.opened:
            return blocks_for(n, self.block_size)
        t, table = call(self.mine.num_tokens, seq_id), list(call(self.mine.block_table, seq_id))
        shared_tail = n > 0 and t % self.block_size != 0 and call(self.mine.refcount, table[-1]) > 1
        return blocks_for(t + n, self.block_size) - len(table) + shared_tail

    def append(self, seq_id, token_ids) -> list[int]:
        ids = [next(self._fresh) for _ in range(token_ids)] if isinstance(token_ids, int) else list(token_ids)
        if seq_id in self.opened:
            self.opened.discard(seq_id)
            call(self.mine.admit, seq_id, ids)
            table = list(call(self.mine.block_table, seq_id))
            return [table[t // self.block_size] * self.block_size + t % self.block_size for t in range(len(ids))]
        return [call(self.mine.append, seq_id, t) for t in ids]

    def fork(self, parent_id, child_id) -> None:
        call(self.mine.fork, parent_id, child_id)

    def free(self, seq_id) -> None:
        if seq_id in self.opened:
            self.opened.discard(seq_id)
        else:
            call(self.mine.free, seq_id)

    def take_copies(self):
        return list(call(self.mine.take_copies))

    def block_table(self, seq_id):
        return [] if seq_id in self.opened else list(call(self.mine.block_table, seq_id))

    def num_tokens(self, seq_id) -> int:
        return 0 if seq_id in self.opened else call(self.mine.num_tokens, seq_id)


PROMPT = "In one sentence, why do beams share memory?"
BEAMS, NEW_TOKENS, BLOCK_SIZE = 3, 10, 5


@functools.lru_cache(maxsize=1)
def _real_model():
    from transformers import DynamicCache

    from minikv.models import ModelNotAvailable, load_model, tiny_random_llama

    try:
        # float32 whatever the machine or $MINIKV_DTYPE: token equality is asserted, which only float32 promises
        model, tokenizer = load_model("smollm2-135m", device="cpu", dtype=torch.float32)
        ids = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
        name = "SmolLM2-135M"
    except ModelNotAvailable as err:
        print(f"note: {err} Checking on the tiny random Llama instead.")
        model, name = tiny_random_llama(), "the tiny random Llama"
        ids = torch.randint(3, 256, (1, 13), generator=torch.Generator().manual_seed(0))
    kw = dict(num_beams=BEAMS, num_return_sequences=BEAMS, do_sample=False, max_new_tokens=NEW_TOKENS,
              early_stopping=False)
    with torch.inference_mode():
        expected = model.generate(ids, past_key_values=DynamicCache(config=model.config), **kw)
    return model, name, ids, kw, expected


@one_torch_thread()
def check_real_model_beams_with_your_manager(ns):
    from minikv.paged import PagedKVCache

    cls = _manager_cls(ns)
    call(lambda: cls(4, BLOCK_SIZE).admit("probe", [1, 2]))  # a stub says so before a model loads
    model, name, ids, kw, expected = _real_model()
    num_blocks = BEAMS * blocks_for(ids.shape[1] + NEW_TOKENS, BLOCK_SIZE) + 4
    mine = call(cls, num_blocks, BLOCK_SIZE)
    built = (f"PagedKVCache(model.config, {num_blocks}, {BLOCK_SIZE}, "
             f"manager=<MyBlockManager({num_blocks}, {BLOCK_SIZE})>)")
    cache = PagedKVCache(model.config, num_blocks, BLOCK_SIZE, manager=Adapter(mine, num_blocks, BLOCK_SIZE))
    try:
        with torch.inference_mode():
            out = model.generate(ids, past_key_values=cache, **kw)
    except (AssertionError, NotImplementedYet):
        raise
    except Exception as err:  # noqa: BLE001
        raise AssertionError(f"beam search on {name} with {built} raised {type(err).__name__}: {err}") from None
    if out.shape != expected.shape or not torch.equal(out, expected):
        raise AssertionError(f"beam search ({BEAMS} beams) on {name} with {built} gave {out[:, ids.shape[1]:].tolist()}"
                             f", DynamicCache {expected[:, ids.shape[1]:].tolist()}: a beam read K/V it does not own "
                             "(a shared partial block written without copy-on-write?)")
    if cache.cow_copies == 0:
        raise AssertionError(f"beam search with {built} made no copy-on-write copy: beams that share a partly "
                             "filled block must copy it before writing")
    cache.reset()
    free = call(lambda: mine.num_free_blocks)
    if free != num_blocks:
        raise AssertionError(f"after beam search and cache.reset() your manager has {free} free blocks, expected all "
                             f"{num_blocks}")


# ---- (e) your own code ------------------------------------------------------------------------------

# The share of minikv/prefix.py's fingerprints (`minikv.grading.similarity`: runs of 25 normalised tokens)
# a submission may have. Measured: the solution 0.02, the untouched exercise 0.01, the lecture's code 0.00,
# minikv's other modules (blocks.py, paged.py) 0.00; prefix.py pasted with names changed 1.00, half of it 0.39.
COPY_LIMIT = 0.15


def check_your_code_is_not_minikvs_module(ns):
    """Why a similarity check, not a second objective: the exercise's interface differs from minikv's
    (all-or-nothing admit, salts), and the other checks grade behaviour against minikv's module, so any
    objective minikv's module misses would also grade the reference wrong. A paste of that module plus an
    adapter is what passed; its tokens, renamed or not, are what gives it away."""
    from minikv import prefix
    from minikv.grading.similarity import overlap

    cls = _manager_cls(ns)
    call(lambda: cls(4, BLOCK_SIZE).admit("probe", [1, 2]))  # an untouched exercise says "not implemented yet"
    cells = getattr(ns, "cells", None)
    if cells is None:  # the notebook's self-check: its input history
        cells = [c for c in ns.get("In", []) if isinstance(c, str)]
    with open(prefix.__file__) as f:
        share = overlap("\n".join(cells), f.read())
    if share > COPY_LIMIT:
        raise AssertionError(f"{share:.0%} of minikv/prefix.py's code (compared as MOSS does: names, strings and "
                             f"layout ignored) is in your notebook; at most {COPY_LIMIT:.0%} may be: write your "
                             "own block manager instead of pasting minikv's")


CHECKS = [check_chain_hash, check_lookup_and_copy_on_write_cases, check_matches_minikv_on_random_operations,
          check_small_pool_all_or_nothing_and_eviction, check_real_model_beams_with_your_manager,
          check_your_code_is_not_minikvs_module]

# The exercise's parts and their points (its first cell states the same; the grader's score is out of 100).
PARTS = {"1. `chain_hash`": (10, [check_chain_hash]),
         "2. `MyBlockManager`: the scripted cases": (20, [check_lookup_and_copy_on_write_cases]),
         "2. `MyBlockManager` against minikv's on random operations": (25, [check_matches_minikv_on_random_operations]),
         "2. `MyBlockManager` in small pools: all or nothing, eviction": (
             15, [check_small_pool_all_or_nothing_and_eviction]),
         "2. `MyBlockManager` under SmolLM2's beam search": (15, [check_real_model_beams_with_your_manager]),
         "your own code, not minikv's module": (15, [check_your_code_is_not_minikvs_module])}
