"""`python -m minikv bench linear` (also `bench engine --micro`): one matmul, three ways, on SmolLM2's shapes.

An engine step's time is mostly its linears (7 per layer, 30 layers, plus the ``lm_head``), and each
step multiplies a small number of token rows M by large weight matrices. How fast that is depends
on the library and on the weight's memory layout:

* ``F.linear``: eager PyTorch. On the CPU it calls MKL's sgemm on the weight as it lies.
* ``onednn``: oneDNN's matmul on a weight *prepacked once* into its blocked layout
  (``torch.ops.mkldnn._reorder_linear_weight``, then ``torch.ops.mkldnn._linear_pointwise`` per
  call). This is what vLLM's CPU build does for every linear (its ``dnnl_helper``) and what
  inductor's ``freezing`` does in a compiled graph.

For each M in {1, 8, 48, 128, 2048} and each of SmolLM2-135M's weight shapes it prints the median of
``--repeats`` calls (ms), the speedup, and the largest absolute difference between the two results
(rounding order only: both are fp32).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

# SmolLM2-135M: hidden 576, 9 query heads and 3 KV heads of 64, MLP 1536, vocabulary 49152.
SHAPES = {
    "q_proj / o_proj 576x576": (576, 576),
    "k_proj / v_proj 192x576": (192, 576),
    "gate / up 1536x576": (1536, 576),
    "down 576x1536": (576, 1536),
    "lm_head 49152x576": (49152, 576),
}
# How often each shape runs in one forward of SmolLM2 (30 layers; lm_head once).
PER_FORWARD = {"q_proj / o_proj 576x576": 60, "k_proj / v_proj 192x576": 60, "gate / up 1536x576": 60,
               "down 576x1536": 30, "lm_head 49152x576": 1}
ROWS = (1, 8, 48, 128, 2048)


def onednn_available() -> bool:
    """Whether this PyTorch has the prepacked oneDNN linear (CPU builds with mkldnn do)."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def prepack(weight: torch.Tensor, batch_size: int | None = None) -> torch.Tensor:
    """The weight in oneDNN's blocked layout (an opaque mkldnn tensor), made once."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_size)


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """y = x @ W^T + b with the prepacked weight; x may have any leading dimensions."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def alternate(a, b, repeats: int, warmup: int = 3) -> tuple[list[float], list[float]]:
    """Seconds of `repeats` calls of a and of b, made alternately after `warmup` calls of each, so that both
    see the same load on a shared machine (call i of a and call i of b ran back to back). Torch only: `bench
    ops` runs it in vLLM's virtualenv too."""
    for _ in range(warmup):
        a()
        b()
    ta, tb = [], []
    for _ in range(repeats):
        for fn, times in ((a, ta), (b, tb)):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return ta, tb


def _interleaved_ms(a, b, repeats: int) -> tuple[float, float, float, float]:
    """Time a and b alternately (`alternate`): medians and minima, ms."""
    ta, tb = alternate(a, b, repeats)
    return (1e3 * statistics.median(ta), 1e3 * statistics.median(tb), 1e3 * min(ta), 1e3 * min(tb))


@torch.inference_mode()
def measure(rows=ROWS, shapes=SHAPES, repeats: int = 30, seed: int = 0) -> list[dict]:
    """One row per (shape, M): F.linear ms, oneDNN prepacked ms, speedup, max |difference|."""
    gen = torch.Generator().manual_seed(seed)
    results = []
    for name, (out_features, in_features) in shapes.items():
        weight = torch.randn(out_features, in_features, generator=gen) * in_features**-0.5
        packed = prepack(weight)
        for m in rows:
            x = torch.randn(m, in_features, generator=gen)
            # lm_head at large M is the slowest cell and says nothing new: fewer repeats there.
            n = max(5, repeats // 6) if out_features * m > 10**7 else repeats
            eager, onednn, eager_min, onednn_min = _interleaved_ms(
                lambda: F.linear(x, weight), lambda: onednn_linear(x, packed, None), n)
            diff = (F.linear(x, weight) - onednn_linear(x, packed, None)).abs().max().item()
            results.append({"shape": name, "M": m, "f_linear_ms": eager, "onednn_ms": onednn,
                            "speedup": eager / onednn,
                            "f_linear_min_ms": eager_min, "onednn_min_ms": onednn_min, "max_abs_diff": diff})
    return results


def per_forward_ms(results: list[dict], m: int, stat: str = "ms") -> tuple[float, float]:
    """Summed over one SmolLM2 forward at M rows (lm_head at M rows too): (F.linear ms, oneDNN ms).

    stat "ms" sums medians, "min_ms" minima (the machine's best case, less sensitive to other load)."""
    rows = [r for r in results if r["M"] == m]
    eager = sum(PER_FORWARD.get(r["shape"], 1) * r[f"f_linear_{stat}"] for r in rows)
    onednn = sum(PER_FORWARD.get(r["shape"], 1) * r[f"onednn_{stat}"] for r in rows)
    return eager, onednn


def cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minikv bench linear", description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30, help="calls per cell; the median is printed (default 30)")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="comma-separated M values")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: PyTorch's choice; 1 gives steadier figures on a busy machine)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    if not onednn_available():
        print("this PyTorch has no oneDNN (mkldnn) linear; nothing to compare")
        return 1
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    rows = tuple(int(r) for r in args.rows.split(","))
    results = measure(rows, repeats=args.repeats)
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"{torch.get_num_threads()} torch threads, fp32, the two timed alternately, {args.repeats} calls each: "
          f"median (min) ms")
    print(f"{'weight':<26}{'M':>6}{'F.linear':>20}{'oneDNN':>20}{'speedup':>9}{'max|diff|':>11}")
    for r in results:
        print(f"{r['shape']:<26}{r['M']:>6}{r['f_linear_ms']:>11.3f} ({r['f_linear_min_ms']:6.3f})"
              f"{r['onednn_ms']:>11.3f} ({r['onednn_min_ms']:6.3f}){r['speedup']:>8.2f}x{r['max_abs_diff']:>11.1e}")
    print("\nall linears of one SmolLM2-135M forward (30 layers + lm_head at M rows), ms, median (min):")
    for m in rows:
        eager, onednn = per_forward_ms(results, m)
        eager_min, onednn_min = per_forward_ms(results, m, "min_ms")
        print(f"  M={m:<5} F.linear {eager:9.1f} ({eager_min:8.1f})   oneDNN {onednn:9.1f} ({onednn_min:8.1f})   "
              f"{eager / onednn:5.2f}x ({eager_min / onednn_min:.2f}x)")
    return 0
