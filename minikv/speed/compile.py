"""``compile=True``: the model's forward through ``torch.compile``, one graph for every decode step.

Most of an engine's steps are pure decode steps: one new token for each running sequence. Their
shape differs only in the number of sequences S and the width W of the block tables, so one graph
compiled with those dimensions symbolic (``dynamic=True``) serves them all. Inside it, inductor
fuses what eager PyTorch runs op by op (RMSNorm, rotary embeddings, SiLU times the up projection,
residual adds). Two operators stay opaque, each registered with a fake implementation that tells the
compiler only its output's shape: the paged attention, ``torch.ops.minikv_cpu.paged_decode`` (C++),
and every matmul, ``minikv_speed::packed_linear`` (``minikv.speed.linears``), which runs oneDNN on
the weights the runner packed at start. Inductor cannot lower a packed weight itself, and its own
prepacking (``freezing``) needs a static row count, so without that operator ``dynamic=True`` sent
every matmul to sgemm on the raw weights, slower than the eager packed path. ``freezing`` is used
only when the runner has no packed weights (``prepack_linears=False``).

Steps that mix in prefill chunks keep the eager forward: their attention plan varies from step to
step (groups, tiles, masks), which would mean a recompilation for each new structure. So do decode
steps of a single sequence or a single-block table: ``dynamic=True`` specializes sizes 0 and 1, and
compiling a second graph for them costs more than it saves.

The cost is start-up: the first compilation takes one to four minutes on two busy cores (inductor
writes and builds C++), which is why it is off by default (``make demo`` and the notebooks build
engines in seconds).
Inductor keeps its compiled code in a cache on disk (``torch._inductor.config.fx_graph_cache``), so
a second process re-traces the model but skips most of the code generation; ``startup_s`` records
what this process paid.
"""

from __future__ import annotations

import time

import torch

from minikv.dispatch import CPU_KERNEL

__all__ = ["CompiledForward", "WARM_UP_SEQS", "WARM_UP_WIDTH"]

# The shape of the step that compiles the graph: sequences and block-table width. Distinct from each
# other and from the model's fixed sizes (3 KV heads, say): torch gives equal sizes one symbol at the
# first compilation ("duck sizing"), and a width equal to the KV heads would pin it to that number,
# so that the first step with another width compiled a second graph.
WARM_UP_SEQS, WARM_UP_WIDTH = 5, 7


class CompiledForward:
    """``torch.compile(model.forward, dynamic=True)`` and the rule for which steps it runs."""

    def __init__(self, model: torch.nn.Module, freezing: bool = True):
        # freezing: weights are constants of the graph, so inductor can prepack them (inference only).
        # With our packed linears (the runner's default) the graph's matmuls are the packed_linear
        # operator, which finds each weight's packed copy by the parameter itself: no freezing then.
        self.forward = torch.compile(model.forward, dynamic=True, options={"freezing": freezing})
        self.startup_s = 0.0  # seconds spent compiling (the warm-up step), recorded by warm_up
        self.steps = 0  # steps run compiled

    @staticmethod
    def applies(plan) -> bool:
        """A decode-only step of >= 2 sequences with >= 2-block tables, on a kernel that reads K/V in place."""
        if plan.groups or plan.fresh or len(plan.kernel_groups) != 1:
            return False
        group = plan.kernel_groups[0]
        return (group.identity and group.backend == CPU_KERNEL and plan.num_tokens >= 2
                and group.block_tables.shape[1] >= 2)

    def warm_up(self, run_step) -> None:
        """Compile now, by running one decode step (``run_step()``), and record how long that took."""
        start = time.perf_counter()
        run_step()
        self.startup_s = time.perf_counter() - start
