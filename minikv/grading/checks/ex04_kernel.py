"""Checks for exercise 04 (kernel): the inner loop of the learner's Triton paged-attention kernel,
for a model with a sliding window.

The learner's notebook defines `paged_attention_kernel` (a `@triton.jit` function whose block loop
they write) and `exercise_paged_attention(query, key_cache, value_cache, block_tables, seq_lens,
scale, window=None)`, which launches it. Notebook 04 prints minikv's kernel loop, which attends to
every cached token; here a sequence attends only to its last `window` tokens (Mistral, Gemma's local
layers), so the loop must start at the first block of the window and mask the tokens before it.
Every check runs the kernel under Triton's interpreter on small CPU tensors and compares it with
`minikv.attention.paged_attention_ref` on shapes that hypothesis draws (derandomized, no shrinking:
a failing kernel costs the interpreter real time per example). With a window, the reference runs on
each sequence's last `window` tokens, copied into a fresh pool. Each failure names the shape and the
largest error.

What runs the kernel: the sliding-window check launches `paged_attention_kernel` itself (`launch_kernel`:
the given wrapper's grid, one program per sequence and KV head, and its arguments), so it grades the
kernel's block loop, not the wrapper's output: a wrapper that copied each window into a fresh pool (or
computed attention in PyTorch) would otherwise let a windowless kernel pass. The launch is this
module's `_launch`, run where the kernel lives (the submission's process, compiled there from this
module's source: tensors cross as copies, so the launch must hand back what the kernel wrote), and
it refuses anything that `@triton.jit` did not make under the interpreter. The learner's process can still
rewrite Triton or the builtins before the checks run; that is tampering with the grader, not a paste,
and no check here defends against it. The other checks call the learner's `exercise_paged_attention`
(the given wrapper), as before. A loop that starts at block 0 and masks every token before the window
reads no NaN, but folds in blocks whose scores are all -inf (exp2(-inf - -inf) is NaN), and fails;
one that also guards that case is correct, if slower, and passes: no check counts the blocks a loop visits.

The inputs are laid out like a busy pool, and hostile where a real one may be: every slot a sequence
does not own holds NaN (past its length in its last block, the blocks its table's tail points at,
two blocks past the end of the pool), as uninitialised GPU memory may; with a window, so does every
slot before the window, and the table entries of blocks wholly before it point at a NaN block (a
sliding-window cache gives those blocks back, as exercise 03's table does). A kernel that reads any of
them without masking returns NaN, and the check says so. One rule cannot be seen on small inputs,
the int64 block number (an int32 offset wraps only in a pool of 2**31 elements). The last check only
looks for `int64` among the names the kernel's source uses: a weak proxy, which cannot tell whether
it is the block number that gets widened, nor whether it is widened before the multiplication.

Delegation: the kernel and its wrapper may use `minikv.attention.check_paged_attention_inputs` (the
given wrapper does); `minikv.attention.paged_attention_ref` (used by the given `try_it`, which is not
graded) and the course's kernel `minikv_kernels.paged_attention` are forbidden in graded code (`FORBIDDEN`).
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import warnings

import numpy as np
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from minikv.attention import PagedInputs, paged_attention_ref, random_paged_inputs
from minikv.blocks import blocks_for
from minikv.grading import NotImplementedYet, call, learner, source_of

GRADED = ["paged_attention_kernel", "exercise_paged_attention"]
FORBIDDEN = ["minikv.attention.paged_attention_ref", "minikv_kernels.paged_attention.paged_attention",
             "minikv_kernels.paged_attention.paged_attention_kernel"]

# Few examples, no shrinking: each example is a kernel launch under the interpreter (~0.1 s).
SOME = settings(max_examples=10, deadline=None, database=None, derandomize=True,
                phases=(Phase.explicit, Phase.generate))
# |kernel - reference| <= ATOL + RTOL * |reference|. float32: only the summation order differs.
# float16: both accumulate in fp32 and round once to fp16 at the end (one ulp: ~1e-3 here).
TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.float16: (4e-3, 4e-3)}
LOG2E = 1.4426950408889634  # the given wrapper passes scale * log2(e): the kernel works in base 2


class Case:
    """One decode batch with its shape spelled out for failure messages."""

    def __init__(self, lengths, num_heads, num_kv_heads, head_dim, block_size, dtype=torch.float32,
                 spare=1, seed=0, window=None):
        self.lengths, self.num_heads, self.num_kv_heads = list(lengths), num_heads, num_kv_heads
        self.head_dim, self.block_size, self.dtype, self.window = head_dim, block_size, dtype, window
        self.inputs = poisoned_inputs(self.lengths, num_heads, num_kv_heads, head_dim, block_size, dtype,
                                      spare, seed)
        if window is not None:
            self.inputs = outside_the_window(self.inputs, self.lengths, block_size, window)
        self.scale = head_dim**-0.5

    def __str__(self) -> str:
        return (f"{len(self.lengths)} seqs, {self.num_heads} heads / {self.num_kv_heads} kv heads, "
                f"head_dim {self.head_dim}, block_size {self.block_size}, lengths {self.lengths}, "
                f"{str(self.dtype).removeprefix('torch.')}" + (f", window {self.window}" if self.window else ""))

    def reference(self) -> torch.Tensor:
        if self.window is None:
            return paged_attention_ref(*self.inputs, self.scale)  # never reads a NaN slot
        return windowed_reference(self.inputs, self.lengths, self.block_size, self.window, self.scale)


def outside_the_window(x: PagedInputs, lengths, block_size: int, window: int) -> PagedInputs:
    """NaN in every slot before each sequence's last `window` tokens; the table entries of blocks
    wholly before the window point at a NaN block (the first of the two past the pool's end)."""
    key_cache, value_cache, tables = x.key_cache.clone(), x.value_cache.clone(), x.block_tables.clone()
    nan_block = key_cache.shape[0] - 2
    for row, n in enumerate(lengths):
        start = max(0, n - window)  # the first token in the window
        tables[row, : start // block_size] = nan_block
        if start % block_size:
            first = int(tables[row, start // block_size])
            key_cache[first, : start % block_size] = value_cache[first, : start % block_size] = float("nan")
    return x._replace(key_cache=key_cache, value_cache=value_cache, block_tables=tables)


def windowed_reference(x: PagedInputs, lengths, block_size: int, window: int, scale: float) -> torch.Tensor:
    """minikv's paged_attention_ref on each sequence's last `window` tokens, copied into a fresh pool."""
    keys, values = [], []
    for row, n in enumerate(lengths):
        positions = range(max(0, n - window), n)
        blocks = [int(x.block_tables[row, t // block_size]) for t in positions]
        keys.append(torch.stack([x.key_cache[b, t % block_size] for b, t in zip(blocks, positions)]))
        values.append(torch.stack([x.value_cache[b, t % block_size] for b, t in zip(blocks, positions)]))
    kept = [len(k) for k in keys]
    per_seq = [blocks_for(n, block_size) for n in kept]
    pool_k = torch.zeros(sum(per_seq), block_size, *x.key_cache.shape[2:], dtype=x.key_cache.dtype)
    pool_v = torch.zeros_like(pool_k)
    tables = torch.zeros(len(lengths), max(per_seq), dtype=torch.int32)
    first = 0
    for row, (k, v, nb) in enumerate(zip(keys, values, per_seq)):
        pad = nb * block_size - len(k)
        pool_k[first:first + nb] = torch.cat([k, k.new_zeros(pad, *k.shape[1:])]).view(nb, block_size, *k.shape[1:])
        pool_v[first:first + nb] = torch.cat([v, v.new_zeros(pad, *v.shape[1:])]).view(nb, block_size, *v.shape[1:])
        tables[row, :nb] = torch.arange(first, first + nb, dtype=torch.int32)
        first += nb
    return paged_attention_ref(x.query, pool_k, pool_v, tables, torch.tensor(kept, dtype=torch.int32), scale)


def poisoned_inputs(lengths, num_heads, num_kv_heads, head_dim, block_size, dtype, spare, seed) -> PagedInputs:
    """`random_paged_inputs`, with NaN wherever a correct kernel must not look.

    random_paged_inputs leaves one block of the pool unowned and fills table tails with numbers
    outside the pool (-1, 2**31-1): a learner's kernel that followed those would read far outside
    memory and could crash the whole grading process instead of failing one check. Here the tails
    point at NaN blocks inside the pool instead, so the same mistake shows up as NaN in the output.
    """
    x = random_paged_inputs(lengths, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                            block_size=block_size, dtype=torch.float32, spare_table_entries=spare, seed=seed)
    num_blocks = x.key_cache.shape[0]
    # Two NaN blocks past the end of the pool: table tails point at the first, and a padded tile that
    # overruns the last block of the pool (or the first NaN block) still reads memory of this tensor.
    nan_blocks = torch.full((2, *x.key_cache.shape[1:]), float("nan"))
    key_cache, value_cache = torch.cat([x.key_cache, nan_blocks]), torch.cat([x.value_cache, nan_blocks])
    tables = x.block_tables.clone()
    blocks_used = [blocks_for(n, block_size) for n in lengths]
    owned = torch.zeros(num_blocks + 2, dtype=torch.bool)
    for row, used in enumerate(blocks_used):
        owned[tables[row, :used].long()] = True
    unowned = int((~owned[:num_blocks]).nonzero()[0, 0])  # random_paged_inputs leaves one such block
    for row, (n, used) in enumerate(zip(lengths, blocks_used)):
        # Slots past the sequence's length in its last block: stale, maybe never written.
        last, filled = int(tables[row, used - 1]), n - (used - 1) * block_size
        key_cache[last, filled:] = value_cache[last, filled:] = float("nan")
        # Table entries past the last block: garbage, here pointing at the NaN blocks.
        tail = tables.shape[1] - used
        tables[row, used:] = torch.tensor([num_blocks, unowned] * tail, dtype=tables.dtype)[:tail]
    key_cache[~owned] = value_cache[~owned] = float("nan")
    return PagedInputs(x.query.to(dtype), key_cache.to(dtype), value_cache.to(dtype), tables.int(), x.seq_lens)


def _launch(kernel, grid, args, meta):
    """Launch `kernel` on `grid` and hand back (what the kernel is, what it wrote into args[0]).

    Runs where the kernel lives: under the grader that is the submission's process, where tensors
    arrive as copies, so the launch must happen there and return the output; `_launcher` ships this
    function there as source. Self-contained for that reason (its imports are inside). Only a kernel
    that `@triton.jit` made under the interpreter is launched: a look-alike that answers `[grid](...)`
    with numbers of its own is named instead."""
    kind = f"{type(kernel).__module__}.{type(kernel).__qualname__}"
    if not kind.startswith("triton."):
        return kind, None  # and no Triton imported on its account
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    if type(kernel) is not InterpretedFunction:
        return ("compiled" if isinstance(kernel, JITFunction) else kind), None
    kernel[grid](*args, **meta)
    return "interpreted", args[0]


def _launcher(ns):
    """`_launch`, where the learner's kernel lives: this process when `ns` is a notebook's globals, else the
    sandbox's child, compiled there from this module's source through the child's builtins' `exec`."""
    if isinstance(ns, dict):
        return _launch
    source = textwrap.dedent(inspect.getsource(_launch))
    builtins = ns["__builtins__"]
    evaluate = builtins["eval"] if isinstance(builtins, dict) else builtins.eval
    return evaluate(f"(lambda scope: exec({source!r}, scope) or scope['_launch'])({{}})")


COMPILED_ADVICE = ("the kernel was compiled for the GPU, not interpreted: the checks run it on CPU tensors. Restart "
                   "the runtime and run the notebook from the top (its first cell sets TRITON_INTERPRET=1 before "
                   "triton defines the kernel)")


def _guarded(fn, case: "Case", after: str = ""):
    """Call learner code on `case`; errors become one-line verdicts (`after`: what the verdict adds to an error)."""
    try:
        # A kernel that reads NaN slots makes numpy warn from inside the interpreter; the verdict says it better.
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore", RuntimeWarning)
            return call(fn)
    except NotImplementedYet:
        raise
    except Exception as err:
        # The interpreter wraps whatever the kernel raised in an InterpreterError; report the cause.
        root = err
        while root.__cause__ is not None:
            root = root.__cause__
        if isinstance(root, NotImplementedError):
            raise NotImplementedYet(str(root) or "not implemented yet") from None
        first_line = (str(root).splitlines() or [""])[0][:200]
        if "outside of the scope of a kernel" in first_line:  # Triton's helpers were defined compiled
            raise AssertionError("Triton was imported before TRITON_INTERPRET=1 was set, so the interpreter cannot "
                                 "run its helpers: restart the kernel and run the notebook from the top") from None
        raise AssertionError(f"the kernel raised {type(root).__name__}: {first_line} [{case}]{after}") from None


def _kernel_runs_as_written(ns: dict) -> None:
    """In a notebook (not under the grader, where `launch_kernel` sees the kernel's type), the checks run the
    kernel on CPU tensors: it must have been defined under the interpreter."""
    kernel = ns.get("paged_attention_kernel") if isinstance(ns, dict) else None
    if kernel is None:
        return
    from triton.runtime.jit import JITFunction

    if isinstance(kernel, JITFunction):
        raise AssertionError(COMPILED_ADVICE)


def run(ns: dict, case: Case) -> torch.Tensor:
    """The learner's `exercise_paged_attention` on `case`."""
    wrapper = learner(ns, "exercise_paged_attention")
    _kernel_runs_as_written(ns)
    if case.window is None:
        return _guarded(lambda: wrapper(*case.inputs, case.scale), case)
    return _guarded(lambda: wrapper(*case.inputs, case.scale, window=case.window), case)


def launch_kernel(ns: dict, case: Case) -> torch.Tensor:
    """The learner's `paged_attention_kernel` on `case`, launched by this check as the given wrapper launches it
    (one program per sequence and KV head, the same arguments), so nothing the wrapper does can stand in for it."""
    kernel = learner(ns, "paged_attention_kernel")
    query, key_cache, value_cache, block_tables, seq_lens = case.inputs
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = case.num_heads // num_kv_heads
    out = torch.zeros_like(query)
    pow2 = triton_next_power_of_2
    args = (out, query, key_cache, value_cache, block_tables, seq_lens, case.scale * LOG2E,
            case.window if case.window is not None else 2**30,
            *query.stride(), *key_cache.stride(), *value_cache.stride(), *block_tables.stride(), *out.stride())
    meta = dict(BLOCK_SIZE=block_size, BLOCK_SIZE_PAD=pow2(block_size), GROUP=group, GROUP_PAD=pow2(group),
                HEAD_DIM=case.head_dim, HEAD_DIM_PAD=pow2(case.head_dim))
    launch = _launcher(ns)
    kind, got = _guarded(lambda: launch(kernel, (len(case.lengths), num_kv_heads), args, meta), case,
                            ". This check launches paged_attention_kernel itself, with the given wrapper's grid and "
                            "arguments: keep the kernel's signature as given")
    if kind == "compiled":
        raise AssertionError(COMPILED_ADVICE)
    assert kind == "interpreted", (
        f"`paged_attention_kernel` is a {str(kind)[:100]}, not a @triton.jit kernel: this check launches the kernel "
        "itself, as the given wrapper does")
    return got


def triton_next_power_of_2(n: int) -> int:
    """triton.next_power_of_2, without importing triton into the grader."""
    return 1 << (n - 1).bit_length()


def compare(ns: dict, case: Case, advice: str = "", through=run) -> None:
    """`through(ns, case)` (the learner's wrapper, or the check's own launch of the kernel) against the reference."""
    got = through(ns, case)
    what = "the kernel" if through is launch_kernel else "exercise_paged_attention"
    want = case.reference()
    assert isinstance(got, torch.Tensor) and got.shape == want.shape, (
        f"{what} returned {type(got).__name__} "
        f"{tuple(got.shape) if isinstance(got, torch.Tensor) else ''}, expected shape {tuple(want.shape)} [{case}]")
    got, want = got.float(), want.float()
    if not torch.isfinite(got).all():
        seq = int((~torch.isfinite(got)).any(dim=(1, 2)).nonzero()[0, 0])
        raise AssertionError(
            f"NaN in the output (sequence {seq}, length {case.lengths[seq]}) on {case}: the kernel used a slot that "
            f"holds no token of that sequence, and here every such slot holds NaN, as unwritten memory may "
            f"(past seq_len in the last block, past BLOCK_SIZE in a padded tile, in blocks the table's tail points to"
            + (", before the window; or the loop folded in a block wholly before the window, whose scores are all "
               "-inf: exp2(-inf - -inf) is NaN" if case.window else "") + ")")
    atol, rtol = TOLERANCE[case.dtype]
    err = (got - want).abs()
    bad = err > atol + rtol * want.abs()
    if bad.any():
        seq = int(bad.any(dim=(1, 2)).nonzero()[0, 0])
        raise AssertionError(f"max error {err.max().item():.3g} (tolerance {atol:g} + {rtol:g} x |reference|) on "
                             f"{case}, first in sequence {seq} (length {case.lengths[seq]})"
                             + (f". This check adds: {advice}" if advice else ""))


def _hypothesis(strategy, check) -> None:
    """Run `check(case)` on each case hypothesis draws (see SOME)."""
    SOME(given(strategy)(check))()


# --- strategies: small shapes, since the interpreter runs every program in Python ----------------

def cases(*, lengths, groups=(1,), kv_heads=(1, 2), head_dims=(16, 32), block_sizes=(4, 8, 16),
          dtype=torch.float32, spare=1, windows=None):
    """Cases whose lengths come from `lengths(block_size)`, a strategy for a list of ints, and whose
    window (None: no window) from `windows(block_size)`."""
    @st.composite
    def draw_case(draw):
        block_size = draw(st.sampled_from(block_sizes))
        kv, group = draw(st.sampled_from(kv_heads)), draw(st.sampled_from(groups))
        window = draw(windows(block_size)) if windows else None
        return Case(draw(lengths(block_size)), kv * group, kv, draw(st.sampled_from(head_dims)), block_size,
                    dtype, spare, draw(st.integers(0, 10_000)), window)
    return draw_case()


def _not_multiple(block_size):
    return st.integers(1, 3 * block_size).filter(lambda n: n % block_size)


# --- the checks ------------------------------------------------------------------------------------

def check_one_full_block(ns):
    compare(ns, Case([4], 2, 2, 16, 4))
    _hypothesis(cases(lengths=lambda bs: st.just([bs]), groups=(1, 2)), lambda case: compare(ns, case))


def check_partial_last_block(ns):
    advice = ("lengths that are not a multiple of BLOCK_SIZE: slots past seq_len in the last block must be masked "
              "out of the loads and get score -inf")
    compare(ns, Case([5], 2, 2, 16, 4), advice)
    _hypothesis(cases(lengths=lambda bs: st.lists(_not_multiple(bs), min_size=1, max_size=2)),
                lambda case: compare(ns, case, advice))


def check_many_scattered_blocks_garbage_past_the_end(ns):
    advice = ("many blocks scattered over the pool: logical block b is physical block block_tables[seq, b], and "
              "table entries past ceil(seq_len / BLOCK_SIZE) are garbage")
    compare(ns, Case([17, 3], 2, 1, 16, 4, spare=3), advice)
    _hypothesis(cases(lengths=lambda bs: st.lists(st.integers(1, 6 * bs), min_size=2, max_size=3),
                      block_sizes=(4, 8), spare=3),
                lambda case: compare(ns, case, advice))


def check_grouped_query_heads(ns):
    advice = ("GQA: one program serves GROUP query heads (the rows of q, m, l, acc), all reading KV head kv_head; "
              "GROUP = 3 is padded to 4 rows")
    compare(ns, Case([6], 3, 1, 16, 4), advice)
    _hypothesis(cases(lengths=lambda bs: st.lists(st.integers(1, 2 * bs + 1), min_size=1, max_size=2),
                      groups=(1, 3, 4), head_dims=(16, 24)),
                lambda case: compare(ns, case, advice))


def check_block_size_not_a_power_of_two(ns):
    advice = ("block sizes 3, 6, 12: the tile has BLOCK_SIZE_PAD slots but a block only BLOCK_SIZE; slots "
              "t >= BLOCK_SIZE are the next physical block's and must be masked in every block, not only the last")
    compare(ns, Case([7], 2, 1, 16, 6), advice)
    _hypothesis(cases(lengths=lambda bs: st.lists(st.integers(1, 3 * bs), min_size=1, max_size=2),
                      block_sizes=(3, 6, 12)),
                lambda case: compare(ns, case, advice))


def check_float16_cache(ns):
    advice = "a float16 cache: convert the tiles with .to(tl.float32) and keep the scores, m, l and acc in float32"
    compare(ns, Case([9], 2, 2, 16, 4, torch.float16), advice)
    _hypothesis(cases(lengths=lambda bs: st.lists(st.integers(1, 3 * bs), min_size=1, max_size=2),
                      groups=(1, 4), dtype=torch.float16),
                lambda case: compare(ns, case, advice))


def check_sliding_window(ns):
    # Launched by the check, not through the learner's wrapper: a wrapper that copies each window into a fresh pool
    # would let a windowless kernel pass. The windows start at tokens 7, 1, 11, 5 (inside a block) and 16 (a block's
    # first), or cover the whole sequence (3 tokens, window 5); the slots before them hold NaN, and the table entries
    # of the blocks before them point at a NaN block.
    advice = ("a window of W tokens: start at the block holding token seq_len - W, and mask the tokens before it; "
              "blocks wholly before the window were given back (their table entries point anywhere). This check "
              "launches paged_attention_kernel itself, with the given wrapper's grid and arguments")
    for case in (Case([13, 7], 2, 1, 16, 4, window=6), Case([21], 4, 2, 16, 8, window=10),
                 Case([10, 3], 2, 1, 16, 4, window=5), Case([17], 4, 2, 16, 4, window=1)):
        compare(ns, case, advice, through=launch_kernel)
    _hypothesis(cases(lengths=lambda bs: st.lists(st.integers(1, 5 * bs), min_size=1, max_size=3),
                      groups=(1, 2), block_sizes=(3, 4, 8), spare=2,
                      windows=lambda bs: st.integers(1, 3 * bs)),
                lambda case: compare(ns, case, advice, through=launch_kernel))


def check_block_number_widened_to_int64(ns):
    """Only a name check: passes when `int64` appears among the kernel's source names (e.g. `tl.int64`).

    It cannot see which value is converted or when, so a kernel that widens something else, or widens
    the block number after multiplying it, passes too; a reader of the code must judge that."""
    # The kernel must run (a stub says "not implemented yet" here too); its answers are the other checks' job.
    run(ns, Case([5], 2, 2, 16, 4))
    # The one rule no small test can catch: physical * stride_kb in int32 wraps once the pool holds
    # 2**31 elements (4 GiB of fp16), and only a pool that big would show it. So look at the code:
    src = source_of(ns, "paged_attention_kernel")
    try:
        tree = ast.parse(textwrap.dedent(src)) if isinstance(src, str) else None
    except SyntaxError:
        tree = None
    names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)} | {
        n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} if tree else set()
    assert "int64" in names, (
        "the kernel never converts to tl.int64: cast the block number you load from block_tables with "
        ".to(tl.int64) before multiplying it by stride_kb; in int32, physical * stride_kb wraps around past "
        "2**31 elements (a 4 GiB fp16 pool) and the kernel silently reads another block")


CHECKS = [check_one_full_block, check_partial_last_block, check_many_scattered_blocks_garbage_past_the_end,
          check_grouped_query_heads, check_block_size_not_a_power_of_two, check_float16_cache,
          check_sliding_window, check_block_number_widened_to_int64]

# The exercise's parts and their points (its first cell states the same; the grader's score is out of 100).
PARTS = {"the loop on full, partial and scattered blocks, GQA, odd block sizes, fp16": (
             60, [check_one_full_block, check_partial_last_block, check_many_scattered_blocks_garbage_past_the_end,
                  check_grouped_query_heads, check_block_size_not_a_power_of_two, check_float16_cache]),
         "the sliding window": (30, [check_sliding_window]),
         "block numbers widened to int64": (10, [check_block_number_widened_to_int64])}
