"""Decode CUDA graphs (nano-vllm's scheme): the fixed-shape decode step, captured once per batch size.

A decode step launches hundreds of small kernels; on a GPU, launching them from Python can cost more
than running them. A CUDA graph records the launches once and replays them with one call, but it
replays them on fixed addresses and shapes. So:

* :class:`DecodeGraphPlan` keeps a decode step's inputs in persistent buffers sized for the largest
  captured batch, and pads a step of n decodes to the next captured size with rows that touch only
  a scratch block (a pool block no sequence is ever given);
* :class:`DecodeGraphs` builds, for each captured size, the runner's step plan over those buffers and
  captures the model's forward on it (``torch.cuda.graph``); a decode step then copies its inputs in
  and replays. Prefill and mixed steps stay eager.

Everything but the capture runs on the CPU too: there ``DecodeGraphs(capture=False)`` runs the same
buffers, padding and step plans through the eager forward, which is how the tests check them.
"""

from __future__ import annotations

import torch

from minikv.blocks import blocks_for
from minikv.step import GATHER, AttnGroup, SeqStep, StepPlan

__all__ = ["DecodeGraphPlan", "DecodeGraphs", "graph_batch_sizes"]


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Decode batch sizes to capture a CUDA graph for, as nano-vllm does: 1, 2, 4, 8, then multiples of 16."""
    sizes = [1, 2, 4, 8] + list(range(16, max_num_seqs + 15, 16))
    return [b for b in sizes if b < max_num_seqs] + [next(b for b in sizes if b >= max_num_seqs)]


class DecodeGraphPlan:
    """The fixed-shape decode step a CUDA graph replays, planned (and tested) without CUDA.

    A graph replays kernels on fixed addresses and shapes, so a decode step's inputs live in
    persistent buffers sized for the largest captured batch. A step of n decodes fills the first n
    rows and is padded to the next captured size with rows that only touch the scratch block (token
    0 at position 0, written to that block's first slot and attending to it alone); their logits are
    dropped. On CUDA the buffers would feed ``graph.replay()``; :meth:`steps` turns them back into
    SeqSteps for the eager path, which is how the CPU tests check the plan. Prefill stays eager.
    """

    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int, block_size: int, scratch_block: int,
                 device: torch.device | str = "cpu"):
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.block_size, self.scratch_block = block_size, scratch_block
        rows, new = self.sizes[-1], dict(device=device)
        self.input_ids = torch.zeros(rows, dtype=torch.long, **new)
        self.positions = torch.zeros(rows, dtype=torch.long, **new)
        # Every row starts as padding: it writes to and reads from the scratch block only.
        self.slots = torch.full((rows,), scratch_block * block_size, dtype=torch.long, **new)
        self.block_tables = torch.full((rows, max_blocks_per_seq), scratch_block, dtype=torch.int32, **new)
        self.seq_lens = torch.ones(rows, dtype=torch.int32, **new)
        self.batch = self.real = 0  # padded and real rows of the step loaded last

    def padded_size(self, n: int) -> int:
        if not 1 <= n <= self.sizes[-1]:
            raise ValueError(f"{n} decodes: a graph holds 1..{self.sizes[-1]}; run this step eagerly")
        return next(b for b in self.sizes if b >= n)

    def load(self, steps: list[SeqStep]) -> int:
        """Copy a decode step into the buffers, padded; returns the padded batch size."""
        if any(len(s.token_ids) != 1 for s in steps):
            raise ValueError("a graph step holds decodes only (one token per sequence); prefill stays eager")
        n, b = len(steps), self.padded_size(len(steps))
        width = self.block_tables.shape[1]
        tables = torch.full((b, width), self.scratch_block, dtype=torch.int32)
        for i, s in enumerate(steps):
            used = blocks_for(s.start_pos + 1, self.block_size)
            if used > width:
                raise ValueError(f"sequence {s.seq_id} needs {used} blocks; the graph's tables hold {width}")
            tables[i, :used] = torch.tensor(s.block_table[:used], dtype=torch.int32)
        pad = b - n
        self.input_ids[:b] = torch.tensor([s.token_ids[0] for s in steps] + [0] * pad)
        self.positions[:b] = torch.tensor([s.start_pos for s in steps] + [0] * pad)
        self.slots[:b] = torch.tensor([s.slots[0] for s in steps] + [self.scratch_block * self.block_size] * pad)
        self.seq_lens[:b] = torch.tensor([s.start_pos + 1 for s in steps] + [1] * pad, dtype=torch.int32)
        self.block_tables[:b] = tables.to(self.block_tables.device)
        self.batch, self.real = b, n
        return b

    def steps(self) -> list[SeqStep]:
        """The loaded rows, padding included, as the eager path's steps (every row computes logits, as in a graph)."""
        out = []
        for i in range(self.batch):
            length = int(self.seq_lens[i])
            table = self.block_tables[i, : blocks_for(length, self.block_size)].tolist()
            out.append(SeqStep(i, [int(self.input_ids[i])], int(self.positions[i]), table, [int(self.slots[i])], True))
        return out


class DecodeGraphs:
    """The runner's decode steps through captured CUDA graphs (``capture=False``: the same plan, run eagerly).

    ``runner`` is a ModelRunner whose pool holds ``scratch_block``, a block the block manager never hands
    out; decode attention must go through a kernel (Triton on CUDA, the C++ one on the CPU), since the
    gather path's shapes change with the sequences' lengths.
    """

    def __init__(self, runner, max_num_seqs: int, max_blocks_per_seq: int, scratch_block: int,
                 capture: bool | None = None):
        device = runner.device
        self.capture = device.type == "cuda" if capture is None else capture
        if self.capture and device.type != "cuda":
            raise ValueError("capturing CUDA graphs needs a CUDA model; capture=False runs the same plan eagerly")
        if runner.attn_backend == GATHER:
            raise ValueError("decode graphs need a decode kernel (Triton on CUDA, cpu_kernel on the CPU in fp32)")
        if not 0 <= scratch_block < runner.num_blocks:
            raise ValueError(f"scratch block {scratch_block} is outside the runner's pool of {runner.num_blocks}")
        self.runner = runner
        self.plan = DecodeGraphPlan(max_num_seqs, max_blocks_per_seq, runner.block_size, scratch_block, device)
        self.rows = torch.arange(self.plan.sizes[-1], device=device)
        self.step_plans = {b: self._step_plan(b) for b in self.plan.sizes}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.replays = 0
        if self.capture:
            self._capture_all()

    def _step_plan(self, b: int) -> StepPlan:
        """The runner's plan for a decode step of b rows, every tensor a view of the persistent buffers."""
        p, r, rows = self.plan, self.runner, self.rows[:b]
        group = AttnGroup(q_index=rows, q_valid=None, out_index=rows, block_tables=p.block_tables[:b], bias=None,
                          q_len=1, q_pos=p.positions[:b, None], q_tile=1, seq_lens=p.seq_lens[:b], identity=True,
                          backend=r.attn_backend)
        return StepPlan(r.k_stores, r.v_stores, p.slots[:b], [], [group], b)

    def _forward(self, b: int) -> torch.Tensor:
        p = self.plan
        return self.runner.forward(self.step_plans[b], p.input_ids[:b].view(1, b), p.positions[:b].view(1, b),
                                   self.rows[:b])

    @torch.inference_mode()
    def _capture_all(self) -> None:
        """Largest size first, so the smaller graphs reuse its memory pool."""
        pool = None
        for b in reversed(self.plan.sizes):
            self._forward(b)  # warm-up outside the capture: Triton compiles, the allocator settles
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[b] = self._forward(b)
            pool = pool if pool is not None else graph.pool()
            self.graphs[b] = graph
        torch.cuda.synchronize()

    def applies(self, steps: list[SeqStep]) -> bool:
        """A decode-only step that fits the buffers."""
        width = self.plan.block_tables.shape[1]
        return (0 < len(steps) <= self.plan.sizes[-1]
                and all(len(s.token_ids) == 1 and s.wants_logits for s in steps)
                and all(blocks_for(s.start_pos + 1, self.plan.block_size) <= width for s in steps))

    @torch.inference_mode()
    def run(self, steps: list[SeqStep]) -> torch.Tensor:
        """Load the step into the buffers, replay its size's graph (or run its plan); the real rows' logits."""
        b = self.plan.load(steps)
        if self.capture:
            self.graphs[b].replay()
            logits = self.outputs[b]
        else:
            logits = self._forward(b)
        self.replays += 1
        return logits[: self.plan.real]
