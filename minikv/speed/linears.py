"""Prepacked linears: the runner's matmuls on oneDNN's blocked weight layout, as vLLM's CPU build does.

Eager fp32 ``F.linear`` on the CPU runs sgemm on the raw weight for every call. Reordering each weight
once into oneDNN's blocked layout lets a step's small-M matmuls (a few dozen token rows) run oneDNN's
brgemm kernels instead; `python -m minikv bench linear` measures the difference on this machine.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

__all__ = ["PackedLinears"]


class PackedLinears:
    """oneDNN-prepacked copies of a model's fp32 ``nn.Linear`` weights, active only inside :meth:`active`.

    The weights are reordered once (``torch.ops.mkldnn._reorder_linear_weight``); each call is then
    ``torch.ops.mkldnn._linear_pointwise``. Same fp32 arithmetic as ``F.linear``, another summation
    order (differences of a few 1e-6 on outputs of order 1). The model's own parameters are untouched;
    the packed copies cost as much memory again as the linear weights (a tied ``lm_head`` included).
    Below ``min_rows`` token rows eager ``F.linear`` is as fast for the small weights (one GEMV), so
    they keep it; see `python -m minikv bench linear`.
    """

    def __init__(self, model: torch.nn.Module, min_rows: int = 2):
        self.forwards: dict[torch.nn.Module, object] = {}
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, torch.nn.Linear) and module.weight.dtype == torch.float32:
                    packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), None)
                    small = module.weight.shape[0] * module.weight.shape[1] < 10**7  # not the lm_head
                    self.forwards[module] = self._forward(module, packed, min_rows if small else 1)

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
