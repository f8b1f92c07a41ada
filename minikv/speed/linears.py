"""Prepacked linears: the runner's matmuls on weights packed once, as vLLM's CPU build packs them.

Eager fp32 ``F.linear`` on the CPU runs sgemm on the raw weight for every call. Reordering each weight
once into oneDNN's blocked layout lets a step's small-M matmuls (a few dozen token rows) run oneDNN's
brgemm kernels instead; `python -m minikv bench linear` measures the difference on this machine. A
decode step's matmuls (a few to a few dozen rows) run faster still on MKL's own packed sgemm (see
:class:`Packed`), so each weight is packed for both and each call takes the copy that wins at its rows.

Under ``torch.compile`` the packed weight cannot be a graph input (its oneDNN layout has no fake
tensor) and inductor's own prepacking needs a static row count, so with ``dynamic=True`` it falls back
to sgemm on the raw weight. :func:`packed_linear` is our own operator, ``minikv_speed::packed_linear(x,
weight, bias)``: to the compiler an opaque call with ``F.linear``'s signature and a fake implementation
(its output's shape), at run time :meth:`Packed.linear` on the packed copies of ``weight``. So a compiled
graph fuses the elementwise ops between the matmuls and still runs every matmul on packed weights.

Sibling linears that read one input (a layer's q/k/v projections, its MLP's gate and up projections) are
packed as one weight and run as one matmul, as vLLM's ``QKVParallelLinear`` and
``MergedColumnParallelLinear`` do: one call streams the weights of three (or two), so a step makes 90
fewer calls on a 30-layer model. Each output column is the same dot product, so the result is bitwise
the separate calls' (``tests/test_runner.py`` checks that on the row counts a step uses).
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager

import torch

__all__ = ["MERGED", "PackedLinears", "merged_linear", "packed_linear"]

# Names of sibling linears a module calls on one input, in the order it calls them (Llama, Mistral, Qwen2...).
MERGED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))

# Calls of fewer rows than MIN_ROWS run eager F.linear on the raw weight (see PackedLinears: measured), the
# lm_head's excepted (LM_HEAD_SIZE weights or more), which is packed at every row count. Calls of fewer rows than
# MKL_ROWS (a decode step's) run MKL's packed sgemm, the others oneDNN's (see Packed: measured).
MIN_ROWS, MKL_ROWS, LM_HEAD_SIZE = 4, 32, 10**7


def mkl_packing() -> bool:
    """Whether this PyTorch has MKL's packed sgemm as an operator (x86 builds with MKL do)."""
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


class Packed:
    """One weight (or merged siblings' weights) packed once for each library that multiplies it.

    oneDNN's blocked layout (``_reorder_linear_weight``, run by ``_linear_pointwise``) and MKL's packed
    sgemm (``_mkl_reorder_linear_weight``, run by ``_mkl_linear``: ``F.linear``'s own MKL sgemm on a prepacked
    operand, whose outputs are often F.linear's bit for bit, else within rounding). Each wins at its own row
    counts: on SmolLM2's
    four layer weights over 30 layers (each streamed from memory, as in a step), in one process beside vLLM's
    ``onednn_mm`` (ms, oneDNN / MKL packed / vLLM): 4 rows 23.1 / 20.0 / 21.1, 16 rows 31.6 / 28.1 / 29.2,
    32 rows 39.9 / 43.1 / 38.1, 200 rows 137.0 / 151.9 / 133.1. So a call of fewer than MKL_ROWS rows, a
    decode step's, takes MKL's copy and a prefill's takes oneDNN's. Both copies cost memory, each as much
    as the weights.

    torch's ``_mkl_linear`` computes on the packed copy only when told the row count it was packed for
    (else it falls back to the raw weight); MKL sizes a packed B without regard to the row count (the same
    ``cblas_sgemm_pack_get_size`` for any m) and computes with it at any row count, so each call passes its own
    (``tests/test_runner.py`` checks the outputs against F.linear's at every row count a step uses). The raw
    weight that op wants for that fallback is a stand-in of its shape: merged siblings have no joined copy.
    """

    def __init__(self, weight: torch.Tensor):
        weight = weight.detach()
        self.onednn = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        # not the lm_head's (LM_HEAD_SIZE weights or more): at a decode step's rows oneDNN's was as fast as vLLM's
        # and MKL's slower (4 rows 5.0 against 4.5 ms, 8 rows 6.0 against 5.2), and it would cost 113 MB more
        small = weight.numel() < LM_HEAD_SIZE
        self.mkl = torch.ops.mkl._mkl_reorder_linear_weight(weight, MKL_ROWS) if mkl_packing() and small else None
        self.shape = weight.new_empty(1).expand(weight.shape)  # the (N, K) the MKL op reads; no data

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if self.mkl is not None and rows < MKL_ROWS:
            return torch.ops.mkl._mkl_linear(x, self.mkl, self.shape, bias, rows)
        return torch.ops.mkldnn._linear_pointwise(x, self.onednn, bias, "none", [], "")


def few_rows(x: torch.Tensor, min_rows: int = MIN_ROWS) -> bool:
    """Whether a call on `x` has fewer than `min_rows` rows: the one test of the eager and the compiled paths."""
    return x.numel() < min_rows * x.shape[-1]


# One packed copy per linear module, shared by every runner of its model (a notebook or a test suite
# builds many engines on one model: each would otherwise hold its own ~0.5 GB for SmolLM2). An entry
# is reused only while the weight is the same tensor, unmodified (same storage, same version counter).
_PACKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_PACKED_MERGED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # the same for merged siblings, by the first


def _packed(module: torch.nn.Linear) -> Packed:
    weight = module.weight
    with torch.no_grad():
        if weight.is_inference():  # no version counter to tell an in-place change: pack afresh, keep nothing
            return Packed(weight)
        stamp = (weight.data_ptr(), weight._version)
        entry = _PACKED.get(module)
        if entry is None or entry[0] != stamp:
            entry = _PACKED[module] = (stamp, Packed(weight))
            _remember([weight], entry[1])
    return entry[1]


# The packed copy of a weight (or of merged siblings' weights) by their data pointers, for the compiled graph's
# operators, which see only the dense weights: (versions, shapes, copy). Weak references: the packed copy lives
# as long as its module's entry in _PACKED or _PACKED_MERGED, never longer (a notebook that builds and drops
# many engines must not keep their copies).
_BY_WEIGHTS: dict[tuple[int, ...], tuple[tuple[int, ...], tuple, weakref.ref]] = {}


def _stamp(weights: list[torch.Tensor]) -> tuple[tuple[int, ...], tuple]:
    return tuple(w._version for w in weights), tuple(tuple(w.shape) for w in weights)


def _remember(weights: list[torch.Tensor], packed: Packed) -> None:
    _BY_WEIGHTS[tuple(w.data_ptr() for w in weights)] = (*_stamp(weights), weakref.ref(packed))


def _packed_copy(weights: list[torch.Tensor]) -> Packed:
    """The live packed copies of these weights, joined, if they are current; else packed now (correct, if
    slow; never a stale copy)."""
    entry = _BY_WEIGHTS.get(tuple(w.data_ptr() for w in weights))
    packed = entry[2]() if entry is not None and entry[:2] == _stamp(weights) else None
    if packed is None:
        packed = Packed(weights[0] if len(weights) == 1 else torch.cat(weights))
    return packed


class _Merged:
    """One packed matmul for sibling linears: the first sibling called computes every sibling's output; the
    others take their slice when called with that same input tensor (else they compute afresh). Calls of
    fewer than ``min_rows`` rows run each sibling's own eager ``F.linear`` instead. In a compiled graph the
    same logic runs once, when the graph is traced: the graph holds one :func:`merged_linear` per group."""

    def __init__(self, modules: list[torch.nn.Linear], min_rows: int):
        self.modules, self.min_rows = modules, min_rows
        self.packed, self.bias = self._weights(modules)
        self.sizes = [m.out_features for m in modules]
        self.input = self.outputs = None
        self.pending = 0   # siblings yet to take their slice of `outputs`

    @staticmethod
    def _weights(modules: list[torch.nn.Linear]) -> tuple[Packed, torch.Tensor | None]:
        """The siblings' weights packed as one, and their biases joined; shared like `_packed`'s copies."""
        stamp = tuple((m.weight.data_ptr(), m.weight._version) for m in modules)
        entry = None if modules[0].weight.is_inference() else _PACKED_MERGED.get(modules[0])
        if entry is None or entry[0] != stamp:
            with torch.no_grad():
                weight = torch.cat([m.weight.detach() for m in modules])  # dropped once packed
                bias = None if modules[0].bias is None else torch.cat([m.bias.detach() for m in modules])
                entry = (stamp, (Packed(weight), bias))
            if not modules[0].weight.is_inference():
                _PACKED_MERGED[modules[0]] = entry
                _remember([m.weight for m in modules], entry[1][0])
        return entry[1]

    @staticmethod
    def mergeable(modules: list[torch.nn.Linear]) -> bool:
        first = modules[0]   # the caller has checked that each is an fp32 nn.Linear
        return all(m.in_features == first.in_features and (m.bias is None) == (first.bias is None) for m in modules)

    def forward_of(self, i: int, graph: bool = False):
        """Sibling i's forward; ``graph=True``: through :func:`merged_linear`, for a forward torch.compile traces
        (the modules' own parameters are its arguments, so the graph sees parameters)."""
        weight, bias = self.modules[i].weight, self.modules[i].bias
        modules = self.modules

        def forward(x: torch.Tensor) -> torch.Tensor:
            if not graph and few_rows(x, self.min_rows):
                return torch.nn.functional.linear(x, weight, bias)
            if x is not self.input or self.pending == 0:
                if graph:
                    out = merged_linear(x, [m.weight for m in modules],
                                        [m.bias for m in modules] if modules[0].bias is not None else [])
                else:
                    out = self.packed.linear(x, self.bias)
                self.input, self.outputs, self.pending = x, out.split(self.sizes, dim=-1), len(self.sizes)
            self.pending -= 1
            out = self.outputs[i]
            if self.pending == 0:  # every sibling served: hold no tensor past this layer
                self.input = self.outputs = None
            return out

        return forward


@torch.library.custom_op("minikv_speed::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` computed on ``weight``'s oneDNN-packed copy (packed now if it has none);
    a call of fewer than :data:`MIN_ROWS` rows on eager ``F.linear``, as the eager path does (decided here, at
    run time, since a compiled graph's row count is symbolic)."""
    if few_rows(x) and weight.numel() < LM_HEAD_SIZE:
        return torch.nn.functional.linear(x, weight, bias)
    return _packed_copy([weight]).linear(x, bias)


@packed_linear.register_fake
def _(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("minikv_speed::merged_linear", mutates_args=())
def merged_linear(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor]) -> torch.Tensor:
    """Sibling linears on one input, their outputs side by side (``biases``: one per weight, or none): one
    matmul on the siblings' merged packed copy; a call of fewer than :data:`MIN_ROWS` rows, each sibling's
    eager ``F.linear``, as the eager path does."""
    if few_rows(x):
        return torch.cat([torch.nn.functional.linear(x, w, b)
                          for w, b in zip(weights, biases or [None] * len(weights))], dim=-1)
    bias = torch.cat(biases) if biases else None
    return _packed_copy(weights).linear(x, bias)


@merged_linear.register_fake
def _(x, weights, biases):
    return x.new_empty((*x.shape[:-1], sum(w.shape[0] for w in weights)))


class PackedLinears:
    """Prepacked copies of a model's fp32 ``nn.Linear`` weights (:class:`Packed`), active only inside :meth:`active`.

    The weights are packed once, for oneDNN and for MKL; each call then runs on the copy that wins at its
    row count (:meth:`Packed.linear`). Same fp32 arithmetic as ``F.linear``, in another summation order
    (differences of a few 1e-6 on outputs of order 1). The model's own parameters
    are untouched; the packed copies cost twice as much memory again as the linear weights (a tied
    ``lm_head`` included), once per model: every ``PackedLinears`` of one model shares them while its
    weights are unchanged.

    Calls of ``min_rows`` rows or more take the packed path; fewer (by default: up to three rows, a decode
    step of up to three sequences) take eager ``F.linear`` on the module's own weight, the lm_head excepted.
    A matmul of a few rows is close to a matrix-vector product whose weight streams from memory once: MKL's
    sgemm does that faster than oneDNN's brgemm on the packed layout, until about four rows. Measured on a
    2-core CPU, SmolLM2's four per-layer shapes over 30 layers of distinct weights (so each streams from
    memory, as in a step), packed against eager: 39.5/34.0 ms at one row, 40.2/31.3 at two, 40.4/35.0 at
    three, 39.3/51.2 at four. A whole decode step at 260 tokens of context, the two settings alternating 25
    times: ``min_rows=4`` against 2 took 65.6 against 76.6 ms at batch 2 and 83.9 against 96.1 ms at batch
    3 (batches 1 and 4, on the same path either way, within 1.3 ms). ``min_rows=1`` packs every call.

    ``merge=True`` (the default) runs the siblings named in :data:`MERGED` as one matmul each group, on the
    packed path (a call of fewer rows still runs each sibling's own ``F.linear``: merging would need a dense
    copy of the joined weights, memory for one or two milliseconds). A compiled graph calls
    :func:`merged_linear` for each group and :func:`packed_linear` for every other linear.
    """

    def __init__(self, model: torch.nn.Module, min_rows: int = MIN_ROWS, merge: bool = True):
        self.forwards: dict[torch.nn.Module, object] = {}
        self.graph_forwards: dict[torch.nn.Module, object] = {}  # the same, through packed_linear (compiled)
        merged, graph_merged = self._merge(model, min_rows) if merge else ({}, {})
        self.forwards.update(merged)
        self.graph_forwards.update(graph_merged)
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module.weight.dtype == torch.float32 and module not in merged:
                small = module.weight.numel() < LM_HEAD_SIZE  # not the lm_head
                self.forwards[module] = self._forward(module, _packed(module), min_rows if small else 1)
                self.graph_forwards[module] = self._graph_forward(module)

    @staticmethod
    def _merge(model: torch.nn.Module, min_rows: int) -> tuple[dict, dict]:
        """The forwards of every mergeable sibling group in :data:`MERGED`, by module: eager, and for a graph."""
        forwards, graph_forwards = {}, {}
        for parent in model.modules():
            for names in MERGED:
                modules = [getattr(parent, n, None) for n in names]
                if all(isinstance(m, torch.nn.Linear) and m.weight.dtype == torch.float32 for m in modules) \
                        and _Merged.mergeable(modules):
                    group = _Merged(modules, min_rows)
                    forwards.update({m: group.forward_of(i) for i, m in enumerate(modules)})
                    graph_forwards.update({m: group.forward_of(i, graph=True) for i, m in enumerate(modules)})
        return forwards, graph_forwards

    @staticmethod
    def _forward(module, packed: Packed, min_rows):
        weight, bias, linear = module.weight, module.bias, packed.linear

        def forward(x: torch.Tensor) -> torch.Tensor:
            if few_rows(x, min_rows):
                return torch.nn.functional.linear(x, weight, bias)
            return linear(x, bias)

        return forward

    @staticmethod
    def _graph_forward(module):
        def forward(x: torch.Tensor) -> torch.Tensor:
            return packed_linear(x, module.weight, module.bias)  # the module's own, so the graph sees a parameter

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
    def active(self, graph: bool = False):
        """Route each packed module's forward to its packed weight (an instance attribute), then undo it.
        ``graph=True``: through the :func:`packed_linear` operator, for a forward ``torch.compile`` traces."""
        saved = {m: m.__dict__["forward"] for m in self.forwards if "forward" in m.__dict__}
        for module, forward in (self.graph_forwards if graph else self.forwards).items():
            module.__dict__["forward"] = forward  # plain dict write: nn.Module.__setattr__ costs more
        try:
            yield
        finally:
            for module in self.forwards:
                if module in saved:
                    module.__dict__["forward"] = saved[module]
                else:
                    del module.__dict__["forward"]
