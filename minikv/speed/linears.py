"""Prepacked linears: the runner's matmuls on weights packed once, each call on the path measured fastest here.

Eager fp32 ``F.linear`` on the CPU runs MKL's sgemm on the raw weight for every call. A weight can also be
packed once, into oneDNN's blocked layout (vLLM's CPU build does this for every linear) or into MKL's packed
sgemm layout. Which of the three is fastest depends on the row count (a decode step's few rows against a
prefill's hundreds) and on the CPU: on one AMD EPYC host MKL's packed sgemm won decode by 6-10%, on another of
the same kind it made decode twice as slow as oneDNN's. So the path is not a constant: for each weight shape
and each row bucket (:data:`ROW_BUCKETS`) the candidates are timed at start on this machine, over the model's
own weights of that shape (so each streams from memory, as in a step), and the fastest is kept
(``minikv.speed.choose``: remembered on disk per CPU model, PyTorch and thread count; ``MINIKV_LINEAR`` or
``--linears`` forces one). Every path is the same fp32 arithmetic in another summation order.

Under ``torch.compile`` the packed weight cannot be a graph input (its oneDNN layout has no fake
tensor) and inductor's own prepacking needs a static row count, so with ``dynamic=True`` it falls back
to sgemm on the raw weight. :func:`packed_linear` is our own operator, ``minikv_speed::packed_linear(x,
weight, bias)``: to the compiler an opaque call with ``F.linear``'s signature and a fake implementation
(its output's shape), at run time the chosen path on the packed copies of ``weight``. So a compiled
graph fuses the elementwise ops between the matmuls and still runs every matmul on the chosen path.

Sibling linears that read one input (a layer's q/k/v projections, its MLP's gate and up projections) are
packed as one weight and run as one matmul, as vLLM's ``QKVParallelLinear`` and
``MergedColumnParallelLinear`` do: one call streams the weights of three (or two), so a step makes 90
fewer calls on a 30-layer model. Each output column is the same dot product, so the result is bitwise
the separate calls' (``tests/test_runner.py`` checks that on the row counts a step uses).
"""

from __future__ import annotations

import bisect
import time
import weakref
from contextlib import contextmanager

import torch

from minikv.speed.choose import PATHS, choices, cpu_model, fastest, requested
from minikv.speed.hugepages import HugePages, decide
from minikv.speed.operators import operator

__all__ = ["MERGED", "PackedLinears", "merged_linear", "packed_linear"]

# Names of sibling linears a module calls on one input, in the order it calls them (Llama, Mistral, Qwen2...).
MERGED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))

# The row counts a path is chosen for: a call of r rows takes the choice of the largest bucket <= r. Up to 16
# rows a decode step's (where the libraries differ most), timed over every layer's weight of the shape so that
# each streams from memory as in a step; the larger ones a prefill chunk's, where every path is compute-bound,
# timed on MEASURE_LAYERS layers only, so that the first start stays short. The lm_head only ever sees one row
# per sequence, so it is measured up to LM_HEAD_ROWS (the larger buckets take that one's choice).
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MEASURE_LAYERS, LM_HEAD_ROWS = 2, 64
# The lm_head (LM_HEAD_SIZE weights or more) gets no MKL copy: it would cost as much memory as the weight
# (113 MB for SmolLM2) for one call a step.
LM_HEAD_SIZE = 10**7


def mkl_packing() -> bool:
    """Whether this PyTorch has MKL's packed sgemm as an operator (x86 builds with MKL do)."""
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


# The two packed matmuls' overloads, looked up once: torch.ops' attribute lookups cost a microsecond a call.
_ONEDNN_LINEAR = getattr(getattr(torch.ops.mkldnn, "_linear_pointwise", None), "default", None)
_MKL_LINEAR = getattr(getattr(torch.ops.mkl, "_mkl_linear", None), "default", None)


def bucket_of(rows: int) -> int:
    """The largest of ROW_BUCKETS that is at most `rows` (rows >= 1)."""
    return ROW_BUCKETS[max(0, bisect.bisect_right(ROW_BUCKETS, rows) - 1)]


class Packed:
    """One weight (or merged siblings' weights) and its packed copies, each made on first need.

    ``run(path, x, bias)`` computes ``F.linear`` on one path: ``"eager"`` on the dense weights themselves
    (siblings one by one, their outputs side by side), ``"onednn"`` on oneDNN's blocked copy
    (``_reorder_linear_weight``, run by ``_linear_pointwise``), ``"mkl"`` on MKL's packed copy
    (``_mkl_reorder_linear_weight``, run by ``_mkl_linear``). Each packed copy costs as much memory as the
    weight; :meth:`keep` makes the ones the chosen paths use and drops the others.

    torch's ``_mkl_linear`` computes on the packed copy only when told the row count it was packed for
    (else it falls back to the raw weight); MKL sizes a packed B without regard to the row count (the same
    ``cblas_sgemm_pack_get_size`` for any m) and computes with it at any row count, so each call passes its own
    (``tests/test_runner.py`` checks the outputs against F.linear's at every row count a step uses). The raw
    weight that op wants for that fallback is a stand-in of its shape: merged siblings have no joined copy.
    """

    def __init__(self, weights: torch.Tensor | list[torch.Tensor]):
        self.weights = [w.detach() for w in (weights if isinstance(weights, list) else [weights])]
        self.sizes = [w.shape[0] for w in self.weights]
        self.shape = (sum(self.sizes), self.weights[0].shape[1])
        self.paths = PATHS if mkl_packing() and self.shape[0] * self.shape[1] < LM_HEAD_SIZE else PATHS[:2]
        self.copies: dict[str, torch.Tensor] = {}

    def copy(self, path: str) -> torch.Tensor:
        if path not in self.copies:
            with torch.no_grad():
                joined = self.weights[0] if len(self.weights) == 1 else torch.cat(self.weights)  # dropped once packed
                self.copies[path] = (torch.ops.mkldnn._reorder_linear_weight(joined, None) if path == "onednn"
                                     else torch.ops.mkl._mkl_reorder_linear_weight(joined, 32))
        return self.copies[path]

    def keep(self, paths: set[str]) -> None:
        """Hold the copies of these paths (packed now, not at a step), and no other."""
        for path in set(self.copies) - paths:
            del self.copies[path]
        for path in paths - {"eager"}:
            self.copy(path)

    def run(self, path: str, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if path == "onednn":
            return _ONEDNN_LINEAR(x, self.copy(path), bias, "none", [], "")
        if path == "mkl":
            stand_in = x.new_empty(1).expand(self.shape)  # the (N, K) the op reads for its fallback; no data
            return _MKL_LINEAR(x, self.copy(path), stand_in, bias, x.numel() // x.shape[-1])
        if len(self.weights) == 1:
            return torch.nn.functional.linear(x, self.weights[0], bias)
        biases = bias.split(self.sizes) if bias is not None else [None] * len(self.weights)
        return torch.cat([torch.nn.functional.linear(x, w, b) for w, b in zip(self.weights, biases)], dim=-1)


class Plan:
    """The path of each row count for one weight shape: measured here, remembered, or forced."""

    def __init__(self, by_bucket: dict[int, str], ms: dict[int, dict[str, float]] | None = None, how: str = ""):
        self.by_bucket, self.ms, self.how = by_bucket, ms or {}, how
        self.by_rows = [by_bucket[bucket_of(r)] for r in range(1, ROW_BUCKETS[-1] + 1)]

    def path(self, rows: int) -> str:
        return self.by_rows[min(rows, ROW_BUCKETS[-1]) - 1]

    def describe(self) -> str:
        """e.g. "1-3 eager, 4-31 mkl, 32+ onednn"."""
        runs, last = [], None
        for bucket in ROW_BUCKETS:
            path = self.by_bucket[bucket]
            if path != last:
                runs.append([bucket, path])
                last = path
        bounds = [b for b, _ in runs[1:]] + [None]
        return ", ".join(f"{lo}+ {p}" if hi is None else (f"{lo} {p}" if hi == lo + 1 else f"{lo}-{hi - 1} {p}")
                         for (lo, p), hi in zip(runs, bounds))


def measure_plan(group: list[Packed], biases: list[torch.Tensor | None], paths) -> Plan:
    """Time every path at every row bucket over this shape's weights and keep the fastest at each."""
    gen = torch.Generator().manual_seed(0)
    by_bucket, ms = {}, {}
    lm_head = group[0].shape[0] * group[0].shape[1] >= LM_HEAD_SIZE
    with torch.inference_mode():
        for bucket in ROW_BUCKETS:
            if lm_head and bucket > LM_HEAD_ROWS:
                by_bucket[bucket] = by_bucket[LM_HEAD_ROWS]
                continue
            x = torch.randn(1, bucket, group[0].shape[1], generator=gen)
            layers = list(zip(group, biases))[:len(group) if bucket <= 16 else MEASURE_LAYERS]
            candidates = {path: (lambda path=path: [p.run(path, x, b) for p, b in layers]) for path in paths}
            by_bucket[bucket], ms[bucket] = fastest(candidates, repeats=5 if bucket <= 16 else 3)
    return Plan(by_bucket, ms, "measured")


# One packed copy per linear module, shared by every runner of its model (a notebook or a test suite
# builds many engines on one model: each would otherwise hold its own copies, ~0.5 GB each for SmolLM2). An
# entry is reused only while the weight is the same tensor, unmodified (same storage, same version counter).
_PACKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_PACKED_MERGED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # the same for merged siblings, by the first


def _shared(key_module: torch.nn.Module, weights: list[torch.Tensor], table) -> Packed:
    """The packed copies of `weights` (one module's, or merged siblings' keyed by the first), made afresh when a
    weight changed in place; inference tensors (no version counter to tell a change) are never shared."""
    if weights[0].is_inference():
        return Packed(weights if len(weights) > 1 else weights[0])
    stamp = tuple((w.data_ptr(), w._version) for w in weights)
    entry = table.get(key_module)
    if entry is None or entry[0] != stamp:
        entry = table[key_module] = (stamp, Packed(weights if len(weights) > 1 else weights[0]))
        _remember(weights, entry[1])
    return entry[1]


def _packed(module: torch.nn.Linear) -> Packed:
    return _shared(module, [module.weight], _PACKED)


# The packed copy of a weight (or of merged siblings' weights) by their data pointers, for the compiled graph's
# operators, which see only the dense weights: (versions, shapes, copy). Weak references: the packed copy lives
# as long as its module's entry in _PACKED or _PACKED_MERGED, never longer (a notebook that builds and drops
# many engines must not keep their copies).
# (This runs at every matmul of a compiled step: list comprehensions, not generators, which cost a microsecond more.)
_BY_WEIGHTS: dict[tuple[int, ...], tuple[list[int], list[torch.Size], weakref.ref]] = {}


def _key(weights: list[torch.Tensor]) -> tuple[int, ...]:
    return tuple([w.data_ptr() for w in weights])


def _remember(weights: list[torch.Tensor], packed: Packed) -> None:
    _BY_WEIGHTS[_key(weights)] = ([w._version for w in weights], [w.shape for w in weights], weakref.ref(packed))


def _packed_copy(weights: list[torch.Tensor]) -> Packed:
    """The live packed copies of these weights, if they are current; else packed now (correct, if slow; never a
    stale copy)."""
    entry = _BY_WEIGHTS.get(_key(weights))
    if entry is not None and entry[0] == [w._version for w in weights] and entry[1] == [w.shape for w in weights]:
        packed = entry[2]()
        if packed is not None:
            return packed
    return Packed(weights if len(weights) > 1 else weights[0])


# The move onto huge pages of a model's packed copies, by its sample Packed (see PackedLinears._huge_pages).
_HUGE_PAGES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

# The plans of the PackedLinears whose forwards are active (by weight shape), for the compiled graph's operators.
_ACTIVE_PLANS: dict[tuple[int, int], Plan] = {}


def _run(packed: Packed, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    plan = _ACTIVE_PLANS.get(packed.shape)
    path = plan.path(x.numel() // x.shape[-1]) if plan is not None else "onednn"
    return packed.run(path, x, bias)


class _Merged:
    """One matmul for sibling linears: the first sibling called computes every sibling's output; the others take
    their slice when called with that same input tensor (else they compute afresh). Where the plan says
    ``eager``, each sibling runs its own ``F.linear`` instead (merging would need a dense copy of the joined
    weights). In a compiled graph the same logic runs once, when the graph is traced: the graph holds one
    :func:`merged_linear` per group."""

    def __init__(self, modules: list[torch.nn.Linear]):
        self.modules = modules
        self.packed = _shared(modules[0], [m.weight for m in modules], _PACKED_MERGED)
        with torch.no_grad():
            self.bias = None if modules[0].bias is None else torch.cat([m.bias.detach() for m in modules])
        self.sizes = [m.out_features for m in modules]
        self.plan: Plan | None = None   # set by PackedLinears once measured
        self.input = self.outputs = None
        self.pending = 0   # siblings yet to take their slice of `outputs`

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
            path = None if graph else self.plan.path(x.numel() // x.shape[-1])
            if path == "eager":
                return torch.nn.functional.linear(x, weight, bias)
            if x is not self.input or self.pending == 0:
                if graph:
                    out = merged_linear(x, [m.weight for m in modules],
                                        [m.bias for m in modules] if modules[0].bias is not None else [])
                else:
                    out = self.packed.run(path, x, self.bias)
                self.input, self.outputs, self.pending = x, out.split(self.sizes, dim=-1), len(self.sizes)
            self.pending -= 1
            out = self.outputs[i]
            if self.pending == 0:  # every sibling served: hold no tensor past this layer
                self.input = self.outputs = None
            return out

        return forward


def _packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return _run(_packed_copy([weight]), x, bias)


def _merged_linear(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor]) -> torch.Tensor:
    return _run(_packed_copy(weights), x, torch.cat(biases) if biases else None)


# ``F.linear(x, weight, bias)`` on the path the active plan chose for this shape and row count (decided at run
# time, since a compiled graph's row count is symbolic), on ``weight``'s packed copies.
packed_linear = operator(
    "packed_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor", _packed_linear,
    lambda x, weight, bias: x.new_empty((*x.shape[:-1], weight.shape[0])))
# Sibling linears on one input, their outputs side by side (``biases``: one per weight, or none): one matmul on
# the siblings' merged packed copy, or each sibling's ``F.linear`` where the plan says eager.
merged_linear = operator(
    "merged_linear(Tensor x, Tensor[] weights, Tensor[] biases) -> Tensor", _merged_linear,
    lambda x, weights, biases: x.new_empty((*x.shape[:-1], sum(w.shape[0] for w in weights))))


class PackedLinears:
    """A model's fp32 ``nn.Linear`` weights, each call on the path chosen for its shape and row count, active only
    inside :meth:`active`.

    ``path=None`` takes $MINIKV_LINEAR if set, else measures (once per CPU model, PyTorch, thread count and
    shape: remembered on disk, see ``minikv.speed.choose``); ``"measure"`` measures again now (and remembers
    that: a choice made while the machine was busy is replaced), ``"eager"``, ``"onednn"`` or ``"mkl"`` forces
    that path. The packed copies no plan uses are dropped once chosen, so a model whose every
    bucket chose oneDNN holds one copy of its weights more, not two. The model's own parameters are
    untouched; every ``PackedLinears`` of one model shares the copies while its weights are unchanged.

    ``merge=True`` (the default) runs the siblings named in :data:`MERGED` as one matmul each group. A compiled
    graph calls :func:`merged_linear` for each group and :func:`packed_linear` for every other linear.
    """

    def __init__(self, model: torch.nn.Module, merge: bool = True, path: str | None = None):
        self.forwards: dict[torch.nn.Module, object] = {}
        self.graph_forwards: dict[torch.nn.Module, object] = {}  # the same, through packed_linear (compiled)
        groups = self._merge(model) if merge else []
        for group in groups:
            self.forwards.update({m: group.forward_of(i) for i, m in enumerate(group.modules)})
            self.graph_forwards.update({m: group.forward_of(i, graph=True) for i, m in enumerate(group.modules)})
        singles = [m for m in model.modules() if isinstance(m, torch.nn.Linear)
                   and m.weight.dtype == torch.float32 and m not in self.forwards]
        # every weight of one shape, with its bias: what a plan is measured on
        by_shape: dict[tuple[int, int], list[tuple[Packed, torch.Tensor | None]]] = {}
        for group in groups:
            by_shape.setdefault(group.packed.shape, []).append((group.packed, group.bias))
        packed = {m: _packed(m) for m in singles}
        for m in singles:
            by_shape.setdefault(packed[m].shape, []).append((packed[m], m.bias))
        self.packed = [p for entries in by_shape.values() for p, _ in entries]   # every weight's packed copies
        start = time.perf_counter()
        asked, measured = requested(path), {}
        self.plans = {shape: self._plan(shape, entries, asked, measured) for shape, entries in by_shape.items()}
        if measured:
            choices().put(measured)   # one write of the remembered choices, however many shapes were measured
        self.seconds = time.perf_counter() - start
        for shape, entries in by_shape.items():
            for p, _ in entries:
                p.keep(set(self.plans[shape].by_bucket.values()))
        self.huge_pages, self.huge_how = self._huge_pages()
        for group in groups:
            group.plan = self.plans[group.packed.shape]
        for m in singles:
            self.forwards[m] = self._forward(m, packed[m], self.plans[packed[m].shape])
            self.graph_forwards[m] = self._graph_forward(m)

    def _huge_pages(self) -> tuple[HugePages | None, str]:
        """The move of the packed copies onto huge pages, where that is measured faster here (``minikv.speed.
        hugepages``, on the largest weight a step reads per call, the lm_head aside). One per set of copies: every
        PackedLinears of a model shares its copies, and the steps of each count towards their move."""
        onednn = [p for p in self.packed if "onednn" in p.copies and p.shape[0] * p.shape[1] < LM_HEAD_SIZE]
        if not onednn:
            return None, "no oneDNN copies"
        sample = max(onednn, key=lambda p: p.shape[0] * p.shape[1])
        verdict = decide(torch.cat(sample.weights), lambda w: torch.ops.mkldnn._reorder_linear_weight(w, None))
        if verdict.saving is None:
            return None, verdict.how
        copies = [c for p in self.packed for c in p.copies.values()]
        move = _HUGE_PAGES.get(sample)
        if move is None or move.ids != [id(c) for c in copies]:
            move = _HUGE_PAGES[sample] = HugePages(copies, verdict, now=verdict.now)
        return move, verdict.how

    def move_now(self) -> None:
        """The move onto huge pages now, if it is measured faster here and not yet made (see :meth:`after_step`)."""
        if self.huge_pages is not None:
            self.huge_pages.move()

    def after_step(self, seconds: float) -> None:
        """A step took `seconds`: the move onto huge pages happens once 4 KiB pages have cost as much as it does."""
        if self.huge_pages is not None:
            self.huge_pages.after_step(seconds)

    @staticmethod
    def _plan(shape: tuple[int, int], entries, asked: str | None, measured: dict) -> Plan:
        """The plan of one shape as `asked` (see minikv.speed.choose.requested); a measured one is added to
        `measured`, for the caller to remember."""
        paths = entries[0][0].paths
        if asked in PATHS:
            return Plan(dict.fromkeys(ROW_BUCKETS, asked if asked in paths else "onednn"), how="forced")
        question = f"linear {shape[0]}x{shape[1]} fp32"
        known = None if asked == "measure" else choices().get(question)
        if known is not None and set(known["by_bucket"].values()) <= set(paths):
            return Plan({int(b): p for b, p in known["by_bucket"].items()}, how="remembered")
        plan = measure_plan([p for p, _ in entries], [b for _, b in entries], paths)
        measured[question] = {"by_bucket": plan.by_bucket, "ms": plan.ms}
        return plan

    def describe(self) -> str:
        """One line per weight shape: its paths by row count, and how they were chosen."""
        how = sorted({p.how for p in self.plans.values()})
        head = (f"linear paths on {cpu_model()} (torch {torch.__version__}, {torch.get_num_threads()} threads), "
                f"{'/'.join(how)}" + (f" in {self.seconds:.1f} s" if "measured" in how else "") + ":")
        return "\n".join([head] + [f"  {o}x{i}: {plan.describe()}" for (o, i), plan in sorted(self.plans.items())]
                         + [f"  packed weights on huge pages: {self.huge_pages or 'no'} ({self.huge_how})"])

    @staticmethod
    def _merge(model: torch.nn.Module) -> list[_Merged]:
        """Every mergeable sibling group of :data:`MERGED` in the model."""
        groups = []
        for parent in model.modules():
            for names in MERGED:
                modules = [getattr(parent, n, None) for n in names]
                if all(isinstance(m, torch.nn.Linear) and m.weight.dtype == torch.float32 for m in modules) \
                        and _Merged.mergeable(modules):
                    groups.append(_Merged(modules))
        return groups

    @staticmethod
    def _forward(module, packed: Packed, plan: Plan):
        weight, bias, run, path_of = module.weight, module.bias, packed.run, plan.path

        def forward(x: torch.Tensor) -> torch.Tensor:
            path = path_of(x.numel() // x.shape[-1])
            if path == "eager":
                return torch.nn.functional.linear(x, weight, bias)
            return run(path, x, bias)

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
        """Route each packed module's forward to its chosen path (an instance attribute), then undo it.
        ``graph=True``: through the :func:`packed_linear` operator, for a forward ``torch.compile`` traces."""
        saved = {m: m.__dict__["forward"] for m in self.forwards if "forward" in m.__dict__}
        for module, forward in (self.graph_forwards if graph else self.forwards).items():
            module.__dict__["forward"] = forward  # plain dict write: nn.Module.__setattr__ costs more
        plans = dict(_ACTIVE_PLANS)
        _ACTIVE_PLANS.update(self.plans)
        try:
            yield
        finally:
            _ACTIVE_PLANS.clear()
            _ACTIVE_PLANS.update(plans)
            for module in self.forwards:
                if module in saved:
                    module.__dict__["forward"] = saved[module]
                else:
                    del module.__dict__["forward"]
