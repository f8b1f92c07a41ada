"""`python -m minikv bench roofline`: this host's two ceilings, measured in this process, and a step's floor.

A decode step reads every weight once (and each sequence's K/V) to make a few rows of output: it can go no
faster than those bytes over the memory's read bandwidth (nor, with many rows, than its FLOPs at the peak).
A prefill does ~2 FLOPs per weight per token: it can go no faster than its FLOPs over the CPU's peak matmul
rate. Both ceilings are measured here, with the threads torch will compute on, because a figure from a
datasheet or from another host says nothing about this one:

* **read bandwidth**: the best of several full reads (``torch.sum``) of a buffer far larger than any cache, on
  4 KiB pages and, where the kernel gives them, on 2 MiB pages (the packed weights' pages where they were measured
  faster, ``minikv.speed.hugepages``): the better of the two, so that no step is judged against a roof lowered by
  address translations it does not pay;
* **sgemm peak**: the best of several fp32 square matmuls, by each library this PyTorch has (MKL's sgemm through
  ``torch.mm``; oneDNN's on a prepacked weight, which on AMD CPUs was found faster than MKL's).

`bench steps` divides each step's floor by its measured time: the fraction of the roofline the engine reaches.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass

import torch

from minikv.sizing import kv_bytes_per_token
from minikv.speed.choose import cpu_model
from minikv.speed.hugepages import empty_on_huge_pages


@dataclass(frozen=True)
class Roofline:
    """The host's ceilings: sustained read bandwidth (bytes/s) and fp32 matmul peak (FLOP/s)."""

    cpu: str
    threads: int
    read_bytes_per_s: float
    flops_per_s: float

    def decode_floor(self, model, batch: int, context: int) -> float:
        """Seconds a decode step of `batch` sequences at `context` tokens can take at least: its bytes read at
        the read bandwidth, or its FLOPs at the peak if that is longer (from a few dozen rows on, it is)."""
        return max(decode_bytes(model, batch, context) / self.read_bytes_per_s,
                   2 * linear_params(model) * batch / self.flops_per_s)

    def prefill_floor(self, model, tokens: int) -> float:
        """Seconds a prefill of `tokens` can take at least: its FLOPs at the peak rate."""
        return prefill_flops(model, tokens) / self.flops_per_s


def best_seconds(fn, repeats: int) -> float:
    fn()  # warm: page faults, thread pool
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)   # other load only adds time: the best run is the host's


def measure(buffer_mb: int = 512, n: int = 2048, repeats: int = 5) -> Roofline:
    """Both ceilings, with torch's current thread count (a few seconds)."""
    read = 0.0
    for buffer in (torch.empty(buffer_mb * 2**20, dtype=torch.uint8), empty_on_huge_pages(buffer_mb * 2**20)):
        if buffer is not None:
            floats = buffer.view(torch.float32).fill_(1.0)
            read = max(read, floats.nbytes / best_seconds(floats.sum, repeats))
    del buffer, floats
    a, b = torch.randn(n, n), torch.randn(n, n)
    seconds = best_seconds(lambda: torch.mm(a, b), repeats)
    if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        packed = torch.ops.mkldnn._reorder_linear_weight(b, None)
        seconds = min(seconds, best_seconds(
            lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], ""), repeats))
    return Roofline(cpu_model(), torch.get_num_threads(), read, 2 * n**3 / seconds)


def linear_params(model) -> int:
    """Weights of every linear (the lm_head included, tied or not: a step multiplies by it either way)."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def decode_bytes(model, batch: int, context: int) -> int:
    """What a decode step must read: every linear weight once, and each sequence's cached K/V."""
    param = next(model.parameters())
    weights = linear_params(model) * param.element_size()
    return weights + batch * context * kv_bytes_per_token(model.config, param.dtype)


def prefill_flops(model, tokens: int) -> int:
    """2 FLOPs per linear weight per token (the lm_head's for the last token only: the engine asks for one
    row of logits), and causal attention's two products (QK^T and PV, over T(T+1)/2 pairs each)."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    attention = 2 * 2 * config.num_hidden_layers * config.num_attention_heads * head_dim * tokens * (tokens + 1) // 2
    head = model.get_output_embeddings().weight.numel()
    return 2 * (linear_params(model) - head) * tokens + 2 * head + attention


def cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minikv bench roofline", description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: PyTorch's choice)")
    parser.add_argument("--buffer-mb", type=int, default=512, help="the buffer read for bandwidth (default 512 MB)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    roof = measure(args.buffer_mb)
    if args.json:
        print(json.dumps(asdict(roof), indent=2))
        return 0
    print(f"{roof.cpu}, {roof.threads} torch threads: read bandwidth {roof.read_bytes_per_s / 1e9:.1f} GB/s, "
          f"fp32 matmul peak {roof.flops_per_s / 1e9:.1f} GFLOP/s (best of 5 each)")
    try:
        from minikv.models import load_model

        model, _ = load_model("smollm2-135m", device="cpu", dtype=torch.float32)
    except Exception as e:   # the weights are optional here: the ceilings stand alone
        print(f"(SmolLM2's floors skipped: {e})")
        return 0
    print(f"SmolLM2-135M fp32: {linear_params(model) * 4 / 1e6:.0f} MB of linear weights")
    for batch in (1, 8, 16):
        print(f"  decode step, batch {batch:>2} at 200 tokens of context: at least "
              f"{roof.decode_floor(model, batch, 200) * 1e3:6.1f} ms ({decode_bytes(model, batch, 200) / 1e6:.0f} MB)")
    print(f"  prefill of 200 tokens: at least {roof.prefill_floor(model, 200) * 1e3:.1f} ms "
          f"({prefill_flops(model, 200) / 1e9:.1f} GFLOP)")
    return 0
