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
   attention (the Triton kernel on CUDA; on the CPU a vectorized gather + grouped matmul), prefill
   chunks causally over their cached prefix (prefix-cache hits, earlier chunks) plus themselves.

Everything that describes the step's layout (slots, gather indices, masks) is built once per step
in :class:`StepPlan` and handed to every layer through the forward's keyword arguments, so the
per-layer work is a handful of batched tensor ops, never a loop over sequences.
We register a mask function too (``AttentionMaskInterface``) that returns no mask: the model would
otherwise build a dense [T, T] causal mask that means nothing for a flattened batch.

Only the last token of each sequence that samples this step goes through the ``lm_head``
(``logits_to_keep`` takes their indices): the vocabulary projection is the largest matmul there is.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from minikv.blocks import blocks_for

__all__ = ["ATTN_NAME", "ModelRunner", "SeqStep", "StepPlan", "paged_attention_forward"]

ATTN_NAME = "minikv_paged"


@dataclass
class SeqStep:
    """One sequence's share of one step."""

    seq_id: int
    token_ids: list[int]  # tokens computed this step: a prefill chunk, or the one newest token
    start_pos: int  # position of token_ids[0] = tokens of this sequence already in the KV cache
    block_table: list[int]  # physical blocks covering positions 0 .. start_pos + len(token_ids) - 1
    slots: list[int]  # the physical slot of each token in token_ids (block * block_size + offset)
    wants_logits: bool  # sample after this step: a decode, or a prefill's last chunk


@dataclass
class AttnGroup:
    """Sequences whose queries are attended together: padded to the group's longest query and key run.

    q_index [S, Q] token index into the flattened step (padding repeats a real index; its output is dropped)
    q_valid [S*Q] bool: which padded query rows are real tokens
    kv_index [S, L] flat pool slot of each key position (padding points at a real slot and is masked)
    bias [S, 1, Q, L] 0 where a query may attend a key, -inf elsewhere (causal + end of sequence)
    block_tables / seq_lens: the kernel's inputs (decode groups on the kernel path only)
    """

    q_index: torch.Tensor
    q_valid: torch.Tensor
    out_index: torch.Tensor  # token index of each real query row, in q_valid order
    kv_index: torch.Tensor
    bias: torch.Tensor
    block_tables: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    identity: bool = False  # the group is the whole step in order, one token each: no gather/scatter


@dataclass
class StepPlan:
    """The step's layout, built once and read by every layer's attention call."""

    k_pools: list[torch.Tensor]  # per layer [num_blocks, block_size, kv_heads, head_dim]
    v_pools: list[torch.Tensor]
    slots: torch.Tensor  # [T] int64
    groups: list[AttnGroup]
    kernel_groups: list[AttnGroup]  # decode groups that go through the Triton kernel
    num_tokens: int


def _pad_rows(rows: list[list[int]], pad: int) -> list[list[int]]:
    width = max(len(r) for r in rows)
    return [r + [pad] * (width - len(r)) for r in rows]


def _build_group(steps: list[SeqStep], offsets: list[int], block_size: int, device, dtype,
                 with_kernel_inputs: bool, total_tokens: int) -> AttnGroup:
    """Index tensors for a set of sequences (all in Python lists first: one tensor per field, per step)."""
    q_rows, kv_rows, q_pos_rows, seq_lens = [], [], [], []
    for step, offset in zip(steps, offsets):
        n = len(step.token_ids)
        seq_len = step.start_pos + n
        q_rows.append(list(range(offset, offset + n)))
        q_pos_rows.append(list(range(step.start_pos, seq_len)))
        # Flat slot of every key position 0 .. seq_len-1, through the block table.
        table = step.block_table
        kv_rows.append([table[p // block_size] * block_size + p % block_size for p in range(seq_len)])
        seq_lens.append(seq_len)
    q_len = max(len(r) for r in q_rows)
    kv_len = max(seq_lens)
    q_valid = [[True] * len(r) + [False] * (q_len - len(r)) for r in q_rows]
    q_index = torch.tensor(_pad_rows(q_rows, q_rows[0][0]), device=device)
    kv_index = torch.tensor(_pad_rows(kv_rows, kv_rows[0][0]), device=device)
    # Padding query rows get position 0: they may see key 0, so their softmax never divides by zero.
    q_pos = torch.tensor(_pad_rows(q_pos_rows, 0), device=device)
    key_pos = torch.arange(kv_len, device=device)
    allowed = key_pos[None, None, :] <= q_pos[:, :, None]  # causal; also stops at each sequence's end
    bias = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))
    valid = torch.tensor(q_valid, device=device).flatten()
    group = AttnGroup(
        q_index=q_index,
        q_valid=valid,
        out_index=q_index.flatten()[valid],
        kv_index=kv_index,
        bias=bias[:, None],
        identity=q_len == 1 and len(steps) == total_tokens,
    )
    if with_kernel_inputs:
        width = max(blocks_for(s, block_size) for s in seq_lens)
        group.block_tables = torch.tensor(
            _pad_rows([st.block_table[: blocks_for(n, block_size)] for st, n in zip(steps, seq_lens)], 0)
            if width else [[0]] * len(steps), dtype=torch.int32, device=device)
        group.seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return group


def _attend(query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, group: AttnGroup,
            scaling: float) -> torch.Tensor:
    """Vectorized paged attention for one group: gather K/V by slot, grouped matmuls, masked softmax.

    query [T, H, D] (the whole step's); returns [rows, H, D] for the group's real query rows.
    Grouped-query attention without copying K/V per query head: the G query heads that share a KV
    head are stacked along the query axis, so one matmul per KV head serves them all.
    """
    _, num_heads, head_dim = query.shape
    kv_heads = k_pool.shape[2]
    g = num_heads // kv_heads
    s, q_len = group.q_index.shape
    kv_len = group.kv_index.shape[1]
    q = query if group.identity else query[group.q_index.flatten()]  # [S*Q, H, D]
    # [S, Q, KVH, G, D] -> [S, KVH, G, Q, D] -> [S, KVH, G*Q, D]
    q = q.reshape(s, q_len, kv_heads, g, head_dim).permute(0, 2, 3, 1, 4).reshape(s, kv_heads, g * q_len, head_dim)
    flat_k = k_pool.view(-1, kv_heads, head_dim)
    flat_v = v_pool.view(-1, kv_heads, head_dim)
    keys = flat_k[group.kv_index].permute(0, 2, 3, 1)  # [S, KVH, D, L]
    values = flat_v[group.kv_index].transpose(1, 2)  # [S, KVH, L, D]
    scores = torch.matmul(q, keys).view(s, kv_heads, g, q_len, kv_len)
    scores = scores.float().mul_(scaling).add_(group.bias[:, :, None])
    probs = scores.softmax(dim=-1).to(values.dtype).view(s, kv_heads, g * q_len, kv_len)
    out = torch.matmul(probs, values)  # [S, KVH, G*Q, D]
    out = out.view(s, kv_heads, g, q_len, head_dim).permute(0, 3, 1, 2, 4).reshape(s * q_len, num_heads, head_dim)
    return out if group.identity else out[group.q_valid]


def paged_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                            minikv_plan: StepPlan | None = None, **kwargs):
    """The attention function ``transformers`` calls in every layer (registered as ``"minikv_paged"``).

    query [1, H, T, D], key/value [1, KVH, T, D]: this step's tokens, rotary already applied.
    Returns ([1, T, H, D], None), the layout the model's ``o_proj`` expects.
    """
    plan = minikv_plan
    if plan is None:
        raise RuntimeError(
            f"attention '{ATTN_NAME}' runs only inside ModelRunner.execute (it needs the step's block "
            f"tables); set model.config._attn_implementation back to 'sdpa' to use the model alone"
        )
    layer = module.layer_idx
    k_pool, v_pool = plan.k_pools[layer], plan.v_pools[layer]
    kv_heads, head_dim = k_pool.shape[2], k_pool.shape[3]
    scaling = scaling if scaling is not None else head_dim**-0.5
    # 1. Store this step's keys and values at their slots (prefill chunks and decode tokens alike).
    new_k = key[0].transpose(0, 1)  # [T, KVH, D]
    new_v = value[0].transpose(0, 1)
    k_pool.view(-1, kv_heads, head_dim).index_copy_(0, plan.slots, new_k.to(k_pool.dtype))
    v_pool.view(-1, kv_heads, head_dim).index_copy_(0, plan.slots, new_v.to(v_pool.dtype))
    # 2. Attend through the block tables.
    q = query[0].transpose(0, 1)  # [T, H, D]
    if len(plan.groups) == 1 and plan.groups[0].identity:
        out = _attend(q, k_pool, v_pool, plan.groups[0], scaling)
    else:
        out = torch.empty_like(q)
        for group in plan.groups:  # at most two: decodes and prefill chunks
            out[group.out_index] = _attend(q, k_pool, v_pool, group, scaling)
        for group in plan.kernel_groups:
            out[group.out_index] = _kernel_decode(q[group.out_index], k_pool, v_pool, group, scaling)
    return out.unsqueeze(0), None


def _kernel_decode(q, k_pool, v_pool, group, scaling):
    from kernels.paged_attention import paged_attention as kernel

    # Inputs were checked once when the step was planned; re-checking per layer would read
    # seq_lens back from the GPU thirty times a step.
    return kernel(q.contiguous(), k_pool, v_pool, group.block_tables, group.seq_lens, scaling, check_inputs=False)


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
    """Owns the KV block pools of one model and runs engine steps through it.

    Pools: per layer, K and V of shape [num_blocks, block_size, kv_heads, head_dim] in the model's
    dtype and device. ``use_kernel=None`` sends decode tokens through the Triton kernel on CUDA and
    the vectorized PyTorch path on the CPU; ``True`` on the CPU runs the kernel under Triton's
    interpreter (slow: for testing the GPU's code path), ``False`` never uses it.
    """

    def __init__(self, model, num_blocks: int, block_size: int, *, use_kernel: bool | None = None):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must both be >= 1")
        register()
        self.model = model.eval()
        config = model.config
        self.num_blocks, self.block_size = num_blocks, block_size
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.num_layers, self.kv_heads, self.head_dim = self._kv_shape(config)
        self.use_kernel = self.device.type == "cuda" if use_kernel is None else use_kernel
        shape = (num_blocks, block_size, self.kv_heads, self.head_dim)
        self.k_pools = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        self.v_pools = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        self.bytes_per_block = self.bytes_per_block_for(config, block_size, self.dtype)

    @staticmethod
    def _kv_shape(config) -> tuple[int, int, int]:
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        return config.num_hidden_layers, kv_heads, head_dim

    @staticmethod
    def bytes_per_block_for(config, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one block id holds: K and V, every layer (2 * layers * block_size * kv_heads * head_dim * itemsize)."""
        layers, kv_heads, head_dim = ModelRunner._kv_shape(config)
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * layers * block_size * kv_heads * head_dim * itemsize

    # -- one step ----------------------------------------------------------------------------------

    def plan(self, steps: list[SeqStep]) -> tuple[StepPlan, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Flatten the steps: input ids, positions, logit rows, and the attention plan. Checks the input."""
        ids, positions, slots, logit_rows = [], [], [], []
        decode, decode_at, prefill, prefill_at = [], [], [], []
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
        bias_dtype = torch.float32
        for members, at in ((decode, decode_at), (prefill, prefill_at)):
            if not members:
                continue
            on_kernel = self.use_kernel and members is decode
            group = _build_group(members, at, self.block_size, dev, bias_dtype, on_kernel, len(ids))
            (kernel_groups if on_kernel else groups).append(group)
        plan = StepPlan(self.k_pools, self.v_pools, torch.tensor(slots, device=dev), groups, kernel_groups, len(ids))
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
    def execute(self, steps: list[SeqStep]) -> torch.Tensor:
        """Run one step; return float32 logits [number of steps wanting logits, vocab], in steps' order."""
        if not steps:
            raise ValueError("execute needs at least one SeqStep")
        plan, input_ids, position_ids, logit_rows = self.plan(steps)
        if len(logit_rows) == 0:
            # Nothing samples (every sequence is mid-prefill): still run the model to fill the cache.
            logit_rows = torch.tensor([input_ids.shape[1] - 1], device=self.device)
            keep_none = True
        else:
            keep_none = False
        with self._paged_attention():
            out = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                             logits_to_keep=logit_rows, minikv_plan=plan)
        logits = out.logits[0].float()
        return logits[:0] if keep_none else logits

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
        for pool in (*self.k_pools, *self.v_pools):
            pool[dst] = pool[src]

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
                pool[index] = data[kv, layer]
