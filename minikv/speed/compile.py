"""``compile=True``: the model's forward through ``torch.compile``, one graph for every step.

A step is one flattened row of T tokens (prefill chunks and decode tokens side by side, see
``minikv.runner``); its shape differs from another step's only in T and in the number of rows that
sample, so one graph compiled with those sizes symbolic (``dynamic=True``) serves them all. Inside it,
inductor fuses what eager PyTorch runs op by op (RMSNorm, rotary embeddings, SiLU times the up
projection, residual adds), and the Python of the model's layers runs once, when it is traced.

Two operators stay opaque, each registered with a fake implementation that tells the compiler only its
output's shape, as vLLM's piecewise compilation keeps its attention out of the graph:

* attention, ``minikv_speed::paged_attention`` (``minikv.runner.paged_attention_op``): it reads the
  step's plan (groups, masks, block tables, the kernel) from beside the graph, so a step of a new
  structure reuses the graph instead of recompiling it;
* every matmul, ``minikv_speed::packed_linear`` (``minikv.speed.linears``), which runs oneDNN on the
  weights the runner packed at start; sibling linears on one input (q/k/v, gate/up) are one
  ``minikv_speed::merged_linear`` on their merged packed copy, as in the eager path.
  Inductor cannot lower a packed weight itself, and its own
  prepacking (``freezing``) needs a static row count, so without that operator ``dynamic=True`` sent
  every matmul to sgemm on the raw weights, slower than the eager packed path. ``freezing`` is used
  only when the runner has no packed weights (``prepack_linears=False``).

Steps of a single token (a decode step of one sequence) keep the eager forward: ``dynamic=True``
specializes sizes 0 and 1, and compiling a second graph for them costs more than it saves.

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

__all__ = ["CompiledForward", "WARM_UP_DECODES", "WARM_UP_PREFILL"]

# The step that compiles the graph: WARM_UP_DECODES decodes and a first chunk of WARM_UP_PREFILL tokens, so
# T = 11 tokens and 6 logit rows. Distinct from each other and from the model's fixed sizes: torch gives equal
# sizes one symbol at the first compilation ("duck sizing"), which would tie them for every later step.
WARM_UP_DECODES, WARM_UP_PREFILL = 5, 6


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
        """Every step of two tokens or more."""
        return plan.num_tokens >= 2

    def warm_up(self, run_step) -> None:
        """Compile now, by running one step (``run_step()``), and record how long that took."""
        start = time.perf_counter()
        run_step()
        self.startup_s = time.perf_counter() - start
