"""Prepacked linears: the runner's matmuls on oneDNN's blocked weight layout, as vLLM's CPU build does.

Eager fp32 ``F.linear`` on the CPU runs sgemm on the raw weight for every call. Reordering each weight
once into oneDNN's blocked layout lets a step's small-M matmuls (a few dozen token rows) run oneDNN's
brgemm kernels instead; `python -m minikv bench linear` measures the difference on this machine.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager

import torch

__all__ = ["PackedLinears"]

# One packed copy per linear module, shared by every runner of its model (a notebook or a test suite
# builds many engines on one model: each would otherwise hold its own ~0.5 GB for SmolLM2). An entry
# is reused only while the weight is the same tensor, unmodified (same storage, same version counter).
_PACKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _packed(module: torch.nn.Linear) -> torch.Tensor:
    weight = module.weight
    with torch.no_grad():
        if weight.is_inference():  # no version counter to tell an in-place change: pack afresh, keep nothing
            return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        stamp = (weight.data_ptr(), weight._version)
        entry = _PACKED.get(module)
        if entry is None or entry[0] != stamp:
            entry = _PACKED[module] = (stamp, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None))
    return entry[1]


class PackedLinears:
    """oneDNN-prepacked copies of a model's fp32 ``nn.Linear`` weights, active only inside :meth:`active`.

    The weights are reordered once (``torch.ops.mkldnn._reorder_linear_weight``); each call is then
    ``torch.ops.mkldnn._linear_pointwise``. Same fp32 arithmetic as ``F.linear``, another summation
    order (differences of a few 1e-6 on outputs of order 1). The model's own parameters are untouched;
    the packed copies cost as much memory again as the linear weights (a tied ``lm_head`` included), once
    per model: every ``PackedLinears`` of one model shares them while its weights are unchanged.

    Every row count takes the packed path, one row included (``min_rows=1``). In isolation a one-row
    matmul on a small weight is about as fast eagerly (`python -m minikv bench linear`, a weight hot in
    cache), but a whole batch-1 decode step, whose weights stream from memory, measured faster packed;
    and with one path, batch 1 is not a different code path from batch 2 in a throughput curve.
    ``min_rows=2`` sends one-row calls of the small weights to eager ``F.linear`` instead.
    """

    def __init__(self, model: torch.nn.Module, min_rows: int = 1):
        self.forwards: dict[torch.nn.Module, object] = {}
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module.weight.dtype == torch.float32:
                small = module.weight.shape[0] * module.weight.shape[1] < 10**7  # not the lm_head
                self.forwards[module] = self._forward(module, _packed(module), min_rows if small else 1)

    @staticmethod
    def _forward(module, packed, min_rows):
        linear_pointwise = torch.ops.mkldnn._linear_pointwise
        weight, bias = module.weight, module.bias

        def forward(x: torch.Tensor) -> torch.Tensor:
            if x.numel() < min_rows * x.shape[-1]:
                return torch.nn.functional.linear(x, weight, bias)
            return linear_pointwise(x, packed, bias, "none", [], "")

        return forward

    @staticmethod
    def wanted(model: torch.nn.Module, prepack: bool | None) -> bool:
        """None (the default): on the CPU in fp32, when this PyTorch has oneDNN's linear."""
        param = next(model.parameters())
        if prepack is False:
            return False
        possible = (param.device.type == "cpu" and torch.backends.mkldnn.is_available()
                    and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))
        if prepack and not possible:
            raise ValueError("prepack_linears=True needs a CPU model and a PyTorch built with oneDNN (mkldnn)")
        return possible and param.dtype == torch.float32

    @contextmanager
    def active(self):
        """Route each packed module's forward to its packed weight (an instance attribute), then undo it."""
        saved = {m: m.__dict__["forward"] for m in self.forwards if "forward" in m.__dict__}
        for module, forward in self.forwards.items():
            module.__dict__["forward"] = forward  # plain dict write: nn.Module.__setattr__ costs more
        try:
            yield
        finally:
            for module in self.forwards:
                if module in saved:
                    module.__dict__["forward"] = saved[module]
                else:
                    del module.__dict__["forward"]
