"""The step contract: what the engine hands the model runner each step, and the layout every attention reads.

* `SeqStep`: one sequence's share of a step (its tokens, where they start, its block table, their slots);
  the engine builds them from the scheduler's output, the runner computes them.
* `StepPlan` and its `AttnGroup`s: the step's attention layout, built once by the runner (`ModelRunner.plan`)
  and read by every layer's attention (`minikv.dispatch.attend_layer`), whichever backend runs it.

All three are frozen: a plan is built whole, then only read. The backends' names live here too, so the
runner, ``minikv.dispatch`` and the speed levers (``minikv.speed``) share them without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

AttentionBackend = Literal["triton", "cpu", "gather"]
TRITON, CPU_KERNEL, GATHER = "triton", "cpu", "gather"


@dataclass(frozen=True)
class SeqStep:
    """One sequence's share of one step."""

    seq_id: int
    token_ids: list[int]  # tokens computed this step: a prefill chunk, or the one newest token
    start_pos: int  # position of token_ids[0] = tokens of this sequence already in the KV cache
    block_table: list[int]  # physical blocks covering positions 0 .. start_pos + len(token_ids) - 1
    slots: list[int]  # the physical slot of each token in token_ids (block * block_size + offset)
    wants_logits: bool  # sample after this step: a decode, or a prefill's last chunk


@dataclass(frozen=True)
class AttnGroup:
    """Sequences whose queries are attended together, padded to the group's longest query and block run.

    q_index [S*Q] token index (into the flattened step) of each padded query row; padding repeats a real one
    q_valid: index of the real rows among the S*Q padded query rows (None: all are real)
    out_index: token index of each real query row, in q_valid order
    block_tables [S, W]: each sequence's blocks (padding repeats a real block; its keys are masked)
    bias [KVH*S, G*Q, W*block_size]: 0 where a query may attend a key, -inf elsewhere (causal + sequence end);
        None for a long prefill, whose bias is made per tile of q_tile queries from q_pos [S, Q]
    seq_lens [S] int32: the kernel's input (decode groups of a kernel backend only)
    """

    q_index: torch.Tensor
    q_valid: torch.Tensor | None
    out_index: torch.Tensor
    block_tables: torch.Tensor
    bias: torch.Tensor | None
    q_len: int
    q_pos: torch.Tensor  # [S, Q] each query row's position in its sequence (padding rows: 0)
    q_tile: int  # query rows per tile: all of them unless the scores would exceed SCORE_BUDGET
    seq_lens: torch.Tensor | None = None
    identity: bool = False  # one token per sequence, the whole step in order: no gather/scatter of queries
    backend: AttentionBackend = GATHER  # who attends it: a kernel group says which kernel


@dataclass(frozen=True)
class StepPlan:
    """The step's layout, built once and read by every layer's attention call."""

    k_stores: list[torch.Tensor]  # per layer [kv_heads, num_blocks, block_size, head_dim]
    v_stores: list[torch.Tensor]
    slots: torch.Tensor  # [T] int64
    groups: list[AttnGroup]  # gathered by PyTorch
    kernel_groups: list[AttnGroup]  # decode groups that go through a kernel (group.backend says which)
    num_tokens: int
    # (first token index, length) of each prefill chunk with nothing cached before it (start_pos 0):
    # it attends only to itself, on the step's own K/V, as transformers' prefill does (see prompt_attention)
    fresh: list[tuple[int, int]] = field(default_factory=list)
    fresh_backend: AttentionBackend = GATHER  # the runner's backend: CPU_KERNEL runs them in C++, any other SDPA
