"""The model runner: one engine step through an unmodified ``transformers`` model, over paged KV.

The scheduler decides, each step, which sequences run and how many of their tokens: a chunk of a
prompt (prefill) or the one newest token (decode). The runner computes them all in ONE forward of
the model's own code, on one *flattened* row that holds every scheduled token back to back::

    input_ids     [1, T]   seq A's chunk | seq B's newest token | seq C's chunk | ...
    position_ids  [1, T]   each token's position in ITS sequence (rotary embeddings use it)

No padding token is computed or stored. What makes this work with a stock model is that
``transformers`` looks its attention function up by name (``AttentionInterface``): we register
``"minikv_paged"``, and every attention layer then calls :func:`paged_attention_forward` with its
fresh queries, keys and values. That function

1. writes the layer's new K/V into the layer's block pool at the step's slots, then
2. reads each sequence's whole K/V back *through its block table*: decode tokens by paged
   attention, through the backend ``minikv.dispatch`` chose once (the Triton kernel on CUDA, a C++
   kernel on the CPU, both reading K/V where it lies; without them a vectorized gather + grouped
   matmul), a prompt's first chunk (nothing cached before it) by causal attention on the step's own
   K/V, as ``transformers`` computes a prefill (the C++ kernel's prompt attention where decode uses
   that kernel, else PyTorch's SDPA: ``minikv.dispatch.prompt_attention``), and any later chunk causally
   over its cached prefix (prefix-cache hits, earlier chunks) plus itself, a tile of queries at a time.

Everything that describes the step's layout (slots, gather indices, masks) is built once per step
in :class:`StepPlan` and handed to every layer through the forward's keyword arguments, so the
per-layer work is a handful of batched tensor ops, never a loop over sequences.
We register a mask function too (``AttentionMaskInterface``) that returns no mask: the model would
otherwise build a dense [T, T] causal mask that means nothing for a flattened batch.

Only the last token of each sequence that samples this step goes through the ``lm_head``
(``logits_to_keep`` takes their indices): the vocabulary projection is the largest matmul there is.

On the CPU (fp32) the runner also prepacks every ``nn.Linear`` weight once, at start, for oneDNN and for
MKL's packed sgemm (``minikv.speed.linears``): a decode step's few rows take MKL's copy, a prefill's
oneDNN's, a call of one to three rows eager ``F.linear`` (`python -m minikv bench linear` measures each).
The packed copies are swapped in only while :meth:`ModelRunner.execute` runs, so the model the user
passed computes with stock PyTorch everywhere else.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager, nullcontext
from typing import Protocol, runtime_checkable

import torch

from minikv.attention import causal_bias
from minikv.blocks import blocks_for
from minikv.dispatch import attend_layer, choose_backend
from minikv.metrics import SPAN_ATTENTION, SPAN_EXECUTE, SPAN_PLAN, spanned
from minikv.sizing import cache_shape, kv_bytes_per_block
from minikv.speed.linears import PackedLinears
from minikv.speed.malloc import keep_freed_memory
from minikv.speed.operators import operator
from minikv.step import GATHER, AttentionBackend, AttnGroup, SeqStep, StepPlan
from minikv.validation import check_block_size, check_num_blocks

__all__ = ["ATTN_NAME", "ModelRunner", "Runner", "paged_attention_forward"]

ATTN_NAME = "minikv_paged"


@runtime_checkable
class Runner(Protocol):
    """What the engine asks of a model runner (the scheduler never sees one: it only decides the block
    operations): `ModelRunner` here, and ``minikv.sim.fake_runner.FakeRunner``, which needs no model.
    Blocks are the block manager's ints."""

    def execute(self, steps: list[SeqStep]) -> torch.Tensor:
        """Write the steps' K/V at their slots and run them; logits [one row per step that wants them, vocab]."""

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: copy each (source, destination) block, in every layer, before the next forward."""

    def swap_out(self, blocks: list[int]) -> object:
        """Those blocks' K/V, all layers, copied off the pool (preemption by swap)."""

    def swap_in(self, data: object, blocks: list[int]) -> None:
        """Write what `swap_out` returned back into (possibly other) blocks."""


# The most score elements one attention call materializes (16 MiB in fp32): a longer prefill chunk is
# attended a tile of queries at a time, so a 2,048-token chunk over an 8,192-token context stays small.
SCORE_BUDGET = 1 << 22


def _build_group(steps: list[SeqStep], offsets: list[int], block_size: int, device, kv_heads: int,
                 group_size: int, total_tokens: int, backend: AttentionBackend = GATHER) -> AttnGroup:
    """Index tensors for a set of sequences: a few small Python lists, then vectorized tensor ops. A kernel
    backend's group carries its int32 inputs (block tables, seq_lens), which the kernel reads as they are."""
    with_kernel_inputs = backend != GATHER
    lens = [len(s.token_ids) for s in steps]
    seq_lens = [s.start_pos + n for s, n in zip(steps, lens)]
    q_len = max(lens)
    width = max(blocks_for(n, block_size) for n in seq_lens)
    tables = [s.block_table[: blocks_for(n, block_size)] for s, n in zip(steps, seq_lens)]
    tables = [t + [t[0]] * (width - len(t)) for t in tables]
    block_tables = torch.tensor(tables, dtype=torch.int32 if with_kernel_inputs else torch.long, device=device)
    offsets_t = torch.tensor(offsets, device=device)
    lens_t = torch.tensor(lens, device=device)
    starts_t = torch.tensor([s.start_pos for s in steps], device=device)
    row = torch.arange(q_len, device=device)
    valid = row[None, :] < lens_t[:, None]  # [S, Q]
    q_index = torch.where(valid, offsets_t[:, None] + row[None, :], offsets_t[:, None])
    # Padding query rows get position 0: they may see key 0, so their softmax never divides by zero.
    q_pos = torch.where(valid, starts_t[:, None] + row[None, :], 0)
    s = len(steps)
    if kv_heads * s * group_size * q_len * width * block_size <= SCORE_BUDGET:
        bias, q_tile = causal_bias(q_pos, width * block_size, kv_heads, group_size), q_len
    else:  # a long prefill: the bias, like the scores, is made per tile of queries (attend_gathered)
        bias = None
        q_tile = max(1, SCORE_BUDGET // (kv_heads * s * group_size * width * block_size))
    return AttnGroup(
        q_index=q_index.flatten(),
        q_valid=None if q_len == 1 else valid.flatten().nonzero().flatten(),
        out_index=q_index[valid],
        block_tables=block_tables,
        bias=bias,
        q_len=q_len,
        q_pos=q_pos,
        q_tile=q_tile,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device) if with_kernel_inputs else None,
        identity=q_len == 1 and offsets == list(range(total_tokens)),
        backend=backend,
    )


# What one more attention group costs per layer (a dozen small ops), in gathered blocks' worth of work.
GROUP_COST_BLOCKS = 16


def split_by_length(seq_lens: list[int], block_size: int, q_lens: list[int] | None = None,
                    max_groups: int = 3) -> list[list[int]]:
    """Indices of sequences split into <= max_groups groups of similar length.

    A group is padded to its longest query run and its longest block run, so it costs
    size x max query rows x max blocks (the scores it computes, the blocks it gathers), plus a
    fixed GROUP_COST_BLOCKS for its dozen extra ops per layer. Sorted by length, the best split
    points are found by trying them all (a few thousand sums for a batch of 64).
    """
    n = len(seq_lens)
    order = sorted(range(n), key=lambda i: (seq_lens[i], q_lens[i] if q_lens else 1))
    blocks = [blocks_for(seq_lens[i], block_size) for i in order]
    queries = [q_lens[i] if q_lens else 1 for i in order]
    # longest query run in sorted positions a..b-1, for every a < b
    q_max = [[0] * (n + 1) for _ in range(n)]
    for a in range(n):
        for b in range(a + 1, n + 1):
            q_max[a][b] = max(q_max[a][b - 1], queries[b - 1])

    def cost(a: int, b: int) -> int:
        return (b - a) * blocks[b - 1] * q_max[a][b] + GROUP_COST_BLOCKS

    best = (cost(0, n), [n])
    if max_groups >= 2:
        for i in range(1, n):
            best = min(best, (cost(0, i) + cost(i, n), [i, n]))
            if max_groups >= 3:
                for j in range(i + 1, n):
                    best = min(best, (cost(0, i) + cost(i, j) + cost(j, n), [i, j, n]))
    bounds = [0] + best[1]
    return [order[a:b] for a, b in zip(bounds, bounds[1:])]


# The plan of the step a compiled forward is running, per thread (set by ModelRunner._compiled_forward).
# A compiled graph calls each layer's attention as one opaque operator, which reads the plan from here, as
# vLLM's attention reads its forward context: the graph never sees a plan's Python structure (its groups,
# masks, kernel), so one graph serves every step, prefill chunks and decodes mixed in any way.
_COMPILED = threading.local()


def _paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int,
                     scaling: float) -> torch.Tensor:
    return attend_layer(_COMPILED.plan, layer, query, key, value, scaling)


# :func:`paged_attention_forward` as one operator, for compiled graphs. It writes the layer's K/V store, which is
# not an argument: the graph orders the layers' calls by their data, as it does any operator's.
paged_attention_op = operator(
    "paged_attention(Tensor query, Tensor key, Tensor value, int layer, float scaling) -> Tensor",
    _paged_attention,
    lambda query, key, value, layer, scaling: query.new_empty((1, query.shape[2], query.shape[1], query.shape[3])))


@spanned(SPAN_ATTENTION)
def paged_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                            minikv_plan: StepPlan | None = None, **kwargs):
    """The attention function ``transformers`` calls in every layer (registered as ``"minikv_paged"``).

    query [1, H, T, D], key/value [1, KVH, T, D]: this step's tokens, rotary already applied.
    Returns ([1, T, H, D], None), the layout the model's ``o_proj`` expects.
    """
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    if torch.compiler.is_compiling():   # traced by torch.compile: one opaque call (see paged_attention_op)
        return paged_attention_op(query, key, value, module.layer_idx, scaling), None
    if minikv_plan is None:
        raise RuntimeError(
            f"attention '{ATTN_NAME}' runs only inside ModelRunner.execute (it needs the step's block "
            f"tables); set model.config._attn_implementation back to 'sdpa' to use the model alone"
        )
    return attend_layer(minikv_plan, module.layer_idx, query, key, value, scaling), None


def _no_mask(*args, **kwargs):
    """The mask function for ``"minikv_paged"``: none. Masks live in the StepPlan, per sequence."""
    return None


def register() -> None:
    """Make ``"minikv_paged"`` known to transformers' attention and mask registries (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_NAME, paged_attention_forward)
    AttentionMaskInterface.register(ATTN_NAME, _no_mask)


class ModelRunner:
    """Owns the KV block pools of one model and runs engine steps through it, with its speed levers.

    Pools: per layer, K and V stored head-major, [kv_heads, num_blocks, block_size, head_dim], in the
    model's dtype and device (``k_stores``; ``k_pools`` are the same memory in the course's layout,
    [num_blocks, block_size, kv_heads, head_dim]).

    Decode attention goes through one backend (``attn_backend``), chosen once by
    ``minikv.dispatch.choose_backend``: ``use_kernel=None`` takes the Triton kernel on CUDA, ``True`` on
    the CPU runs it under Triton's interpreter (slow: for testing the GPU's code path), ``False`` never;
    ``cpu_kernel=None`` takes the C++ kernel on the CPU in fp32 when it builds, ``False`` never, ``True``
    insists (and says why it cannot); otherwise the gather path. Where the C++ kernel is the backend, a
    prompt's first chunk goes through its prompt kernel too (elsewhere through PyTorch's SDPA).

    The speed levers (``minikv.speed``), each the runner's own:
    ``prepack_linears=None`` prepacks the linear weights on the CPU in fp32 and runs each call on the path
    ``linears`` names, or (None) the one measured fastest on this host for its shape and row count (see
    :class:`PackedLinears`); ``False`` keeps eager ``F.linear``.
    ``compile=True`` runs every step of two tokens or more through ``torch.compile`` (see
    ``minikv.speed.compile``), compiling once here: one to five minutes of start-up on two busy cores for a
    faster step (its matmuls stay on the packed weights, through ``minikv.speed.linears.packed_linear``, and
    each layer's attention is one opaque call, :func:`paged_attention_op`).
    ``decode_graphs=True`` runs decode steps of up to ``max_num_seqs`` sequences through CUDA graphs
    captured here (``minikv.speed.graphs``; on the CPU the same plan runs eagerly). Their padding rows
    need a scratch block no sequence is ever given, so the pool gets one block more than ``num_blocks``
    (block ``num_blocks``); the block manager still hands out ``num_blocks``.
    """

    def __init__(self, model, num_blocks: int, block_size: int, *, use_kernel: bool | None = None,
                 prepack_linears: bool | None = None, linears: str | None = None, cpu_kernel: bool | None = None,
                 compile: bool = False,
                 decode_graphs: bool = False, max_num_seqs: int = 64):
        check_num_blocks(num_blocks)
        check_block_size(block_size)
        register()
        self.model = model.eval()
        config = model.config
        pool_blocks = num_blocks + (1 if decode_graphs else 0)   # the scratch block of decode graphs
        self.num_blocks, self.block_size = pool_blocks, block_size
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        if self.device.type == "cpu":   # a CPU step's buffers are malloc's: keep them mapped (minikv.speed.malloc)
            keep_freed_memory()
        # Stage 1's ModelShape, through the caches' check: a sliding-window model is refused, since
        # attending over every cached token would silently compute something else.
        kv_shape = cache_shape(config)
        self.num_layers, self.kv_heads, self.head_dim = kv_shape.num_layers, kv_shape.num_kv_heads, kv_shape.head_dim
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.num_heads = text_config.num_attention_heads
        self.attn_backend = choose_backend(self.device, self.dtype, use_kernel, cpu_kernel)
        # Head-major, so a block gather gives each KV head's keys contiguously (see attend_gathered).
        shape = (self.kv_heads, pool_blocks, block_size, self.head_dim)
        self.k_stores = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        self.v_stores = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        self.k_pools = [store.permute(1, 2, 0, 3) for store in self.k_stores]
        self.v_pools = [store.permute(1, 2, 0, 3) for store in self.v_stores]
        self.bytes_per_block = kv_bytes_per_block(kv_shape, block_size, self.dtype)
        self.packed = (PackedLinears(model, path=linears) if PackedLinears.wanted(model, prepack_linears)
                       else None)
        self.compiled = self.graphs = None   # both None until built: the compile warm-up runs a step
        if compile:
            self._compile()
        if decode_graphs:
            from minikv.speed.graphs import DecodeGraphs

            self.graphs = DecodeGraphs(self, max_num_seqs, blocks_for(config.max_position_embeddings, block_size),
                                       scratch_block=num_blocks)

    def long_run(self) -> None:
        """This runner will run long (a server, a benchmark): make now what it would do once it paid for itself,
        rather than stall a step for it later (the packed weights' move onto huge pages, where it is measured faster
        here: ``minikv.speed.hugepages``)."""
        if self.packed is not None:
            self.packed.move_now()

    def describe(self) -> str:
        """The speed levers chosen at start, in words (LLMEngine.speed_levers)."""
        linears = self.packed.describe() if self.packed is not None else "linears: eager F.linear (not prepacked)"
        compiled = "" if self.compiled is None else (
            f"\n  compiled forward: {self.compiled.startup_s:.1f} s to compile at start; "
            f"artifacts {self.compiled.cache}")
        return f"attention: {self.attn_backend}; " + linears + compiled

    @property
    def pool_bytes(self) -> int:
        """Bytes of the K and V pools as allocated, every layer (what `minikv.sizing` predicts, measured)."""
        return sum(store.nbytes for store in (*self.k_stores, *self.v_stores))

    def _compile(self) -> None:
        """torch.compile the forward (minikv.speed.compile) and compile it now, on one warm-up step."""
        from minikv.speed.compile import WARM_UP_DECODES, WARM_UP_PREFILL, CompiledForward

        # Set first: the warm-up step runs through it. With packed linears the graph needs no freezing.
        compiled = self.compiled = CompiledForward(self.model, freezing=self.packed is None)
        s, p, b = WARM_UP_DECODES, WARM_UP_PREFILL, self.block_size
        w = blocks_for(p, b)
        if self.num_blocks >= s + w:  # else it compiles on the first step that applies
            # Decodes and a prompt's first chunk, over blocks that are all free now (what it writes there is
            # overwritten later): tokens T = s + p and logit rows s + 1 differ, so neither size is tied to the other.
            decodes = [SeqStep(i, [0], b - 1, [i], [(i + 1) * b - 1], True) for i in range(s)]
            prefill = SeqStep(s, [0] * p, 0, list(range(s, s + w)), list(range(s * b, s * b + p)), True)
            compiled.warm_up(lambda: self.execute([*decodes, prefill]))

    # -- one step ----------------------------------------------------------------------------------

    def check(self, steps: list[SeqStep]) -> None:
        """Refuse a step whose tokens, slots or block tables do not fit this pool, saying which and why."""
        capacity = self.num_blocks * self.block_size
        for step in steps:
            n = len(step.token_ids)
            if n == 0 or len(step.slots) != n:
                raise ValueError(
                    f"sequence {step.seq_id}: {n} tokens but {len(step.slots)} slots; a step needs >= 1 token "
                    f"and one slot per token (what BlockManager.append returned)"
                )
            end = step.start_pos + n
            if blocks_for(end, self.block_size) > len(step.block_table):
                raise ValueError(
                    f"sequence {step.seq_id}: block table has {len(step.block_table)} blocks but positions "
                    f"0..{end - 1} need {blocks_for(end, self.block_size)}: append before executing"
                )
            bad = [b for b in step.block_table[: blocks_for(end, self.block_size)] if not 0 <= b < self.num_blocks]
            bad += [s for s in step.slots if not 0 <= s < capacity]
            if bad:
                raise ValueError(f"sequence {step.seq_id}: block/slot {bad[0]} is outside the pool of "
                                 f"{self.num_blocks} blocks x {self.block_size}")

    @spanned(SPAN_PLAN)
    def plan(self, steps: list[SeqStep]) -> tuple[StepPlan, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Flatten the steps: input ids, positions, logit rows, and the attention plan. Checks the input."""
        ids, positions, slots, logit_rows = [], [], [], []
        decode, decode_at, prefill, prefill_at = [], [], [], []
        self.check(steps)
        for step in steps:
            n = len(step.token_ids)
            end = step.start_pos + n
            offset = len(ids)
            (decode if n == 1 else prefill).append(step)
            (decode_at if n == 1 else prefill_at).append(offset)
            ids += step.token_ids
            positions += range(step.start_pos, end)
            slots += step.slots
            if step.wants_logits:
                logit_rows.append(offset + n - 1)
        dev = self.device
        groups, kernel_groups = [], []
        g = self.num_heads // self.kv_heads
        if decode and self.attn_backend != GATHER:  # a kernel reads each sequence's own length:
            kernel_groups.append(_build_group(decode, decode_at, self.block_size, dev, self.kv_heads, g, len(ids),
                                              self.attn_backend))   # no padding to save, so one group
        elif decode:
            # Padding every decode to the longest context would gather (and multiply) mostly padding
            # when lengths differ a lot; split them into up to three groups of similar length.
            for part in split_by_length([s.start_pos + 1 for s in decode], self.block_size):
                groups.append(_build_group([decode[i] for i in part], [decode_at[i] for i in part],
                                           self.block_size, dev, self.kv_heads, g, len(ids)))
        fresh = [(at, len(s.token_ids)) for s, at in zip(prefill, prefill_at) if s.start_pos == 0]
        prefill_at = [at for s, at in zip(prefill, prefill_at) if s.start_pos > 0]
        prefill = [s for s in prefill if s.start_pos > 0]
        if prefill:  # prefill chunks pad their queries too: group them by length the same way
            for part in split_by_length([s.start_pos + len(s.token_ids) for s in prefill], self.block_size,
                                        [len(s.token_ids) for s in prefill]):
                groups.append(_build_group([prefill[i] for i in part], [prefill_at[i] for i in part],
                                           self.block_size, dev, self.kv_heads, g, len(ids)))
        plan = StepPlan(self.k_stores, self.v_stores, torch.tensor(slots, device=dev), groups, kernel_groups, len(ids),
                        fresh, self.attn_backend)
        return (plan, torch.tensor([ids], device=dev), torch.tensor([positions], device=dev),
                torch.tensor(logit_rows, device=dev))

    @contextmanager
    def _paged_attention(self):
        """Switch the model to our attention for one forward and back (a user's model stays theirs)."""
        config = self.model.config
        previous = config._attn_implementation
        config._attn_implementation = ATTN_NAME
        try:
            yield
        finally:
            config._attn_implementation = previous

    @torch.inference_mode()
    @spanned(SPAN_EXECUTE)
    def execute(self, steps: list[SeqStep]) -> torch.Tensor:
        """Run one step; return float32 logits [number of steps wanting logits, vocab], in steps' order."""
        if not steps:
            raise ValueError("execute needs at least one SeqStep")
        start = time.perf_counter()
        logits = self._execute(steps)
        if self.packed is not None:   # what the step took decides when the weights move to huge pages
            self.packed.after_step(time.perf_counter() - start)
        return logits

    def _execute(self, steps: list[SeqStep]) -> torch.Tensor:
        if self.graphs is not None and self.graphs.applies(steps):
            self.check(steps)  # the eager step's checks, without building its plan
            return self.graphs.run(steps)
        plan, input_ids, position_ids, logit_rows = self.plan(steps)
        if len(logit_rows) == 0:
            # Nothing samples (every sequence is mid-prefill): still run the model to fill the cache.
            logit_rows = torch.tensor([input_ids.shape[1] - 1], device=self.device)
            keep_none = True
        else:
            keep_none = False
        return self.forward(plan, input_ids, position_ids, logit_rows)[:0 if keep_none else None]

    def forward(self, plan: StepPlan, input_ids, position_ids, logit_rows) -> torch.Tensor:
        """The model's forward over a planned step: float32 logits of the rows in logit_rows.
        (``minikv.speed.graphs`` calls it with a plan over its persistent buffers, to capture it.)"""
        if self.compiled is not None and self.compiled.applies(plan):
            return self._compiled_forward(plan, input_ids, position_ids, logit_rows)
        packed = self.packed.active() if self.packed is not None else nullcontext()
        with self._paged_attention(), packed:
            out = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                             logits_to_keep=logit_rows, minikv_plan=plan)
        return out.logits[0].float()

    def _compiled_forward(self, plan: StepPlan, input_ids, position_ids, logit_rows) -> torch.Tensor:
        """The step through the compiled graph: the plan goes to the attention operator beside the graph, not
        through it; a single logit row is asked for twice, so that the graph never sees a size of 1 (torch
        specializes sizes 0 and 1: one graph more to compile)."""
        rows = logit_rows if len(logit_rows) > 1 else logit_rows.repeat(2)
        # The graph's matmuls are our packed_linear operator on the packed weights (minikv.speed.linears);
        # without packed weights, inductor's own (freezing prepacks what it can).
        packed = self.packed.active(graph=True) if self.packed is not None else nullcontext()
        _COMPILED.plan = plan
        try:
            with self._paged_attention(), packed:
                out = self.compiled(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                                    logits_to_keep=rows)
        finally:
            _COMPILED.plan = None
        return out.logits[0, :len(logit_rows)].float()

    # -- block operations the block manager asks for ------------------------------------------------

    def _index(self, blocks) -> torch.Tensor:
        return torch.as_tensor(list(blocks), dtype=torch.long, device=self.device)

    @torch.inference_mode()
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: block src's K and V into block dst, in every layer."""
        if not pairs:
            return
        src = self._index(p[0] for p in pairs)
        dst = self._index(p[1] for p in pairs)
        for store in (*self.k_stores, *self.v_stores):
            store[:, dst] = store[:, src]

    @torch.inference_mode()
    def swap_out(self, blocks: list[int]) -> torch.Tensor:
        """Those blocks' K/V, all layers, on the CPU: [2, layers, len(blocks), block_size, kv_heads, head_dim]."""
        index = self._index(blocks)
        data = torch.stack([torch.stack([pool[index] for pool in pools]) for pools in (self.k_pools, self.v_pools)])
        return data.to("cpu")

    @torch.inference_mode()
    def swap_in(self, data: torch.Tensor, blocks: list[int]) -> None:
        """Write data from swap_out back into (possibly other) blocks."""
        expected = (2, self.num_layers, len(blocks), self.block_size, self.kv_heads, self.head_dim)
        if tuple(data.shape) != expected:
            raise ValueError(f"swap_in data has shape {tuple(data.shape)}, expected {expected} (from swap_out)")
        index = self._index(blocks)
        data = data.to(self.device, self.dtype)
        for kv, pools in enumerate((self.k_pools, self.v_pools)):
            for layer, pool in enumerate(pools):
                pool[index] = data[kv, layer]  # a view: writes land in the head-major store
