"""`python -m minikv bench ops`: a step's heavy operators, minikv's against vLLM's CPU build's, on the same tensors.

`bench steps` times whole steps of the two engines; this times the two kinds of operator that make most
of a step, each as minikv runs it and as vLLM runs it, on the same tensors, alternately, in one process:

* the linears of one layer (q/k/v, o, gate/up, down; both engines merge q/k/v and gate/up) and the lm_head:
  minikv's eager forwards of ``minikv.speed.linears`` (each call on the path measured fastest for its shape
  and rows on this host: eager ``F.linear``, oneDNN's or MKL's packed weight) against vLLM's ``onednn_mm``
  (its own oneDNN matmul on a weight it packed once);
* a prompt's attention (its first chunk, which reads only itself): writing its K/V into the paged store
  and causal attention over them, minikv's ``index_copy_`` and its C++ prompt kernel (the fresh-prompt
  branch of ``minikv.dispatch.attend_layer``; PyTorch's ``scaled_dot_product_attention``, which it runs without
  the kernel, is timed beside) against vLLM's ``cpu_attn_reshape_and_cache`` and
  ``cpu_attention_with_kv_cache``;
* a decode step's attention at each batch, every sequence ``--context`` tokens long: the new token's K/V
  written at its slot, then one query per sequence reading its K/V through its block table, each engine in
  its own layout (minikv: blocks of 16 tokens, head-major; vLLM's CPU default: blocks of 128), blocks
  scattered over the pool as a served pool ends up: minikv's ``index_copy_`` and C++ decode kernel (the
  kernel branch of ``minikv.dispatch.attend_layer``) against the same two vLLM calls.

Every timed call runs one forward's worth of its operator (each layer's own weights, and each layer's own
K/V, so that a small-row matmul and a decode's attention stream from memory as in a step); summed over a
forward, the figures say how much of `bench steps`' gap, prefill and decode, the operators account for.

vLLM's operators are compiled against its virtualenv's PyTorch, so everything runs there; minikv's side
is PyTorch alone and five minikv files that import nothing else (``minikv/speed/linears.py`` with the two it
imports, its chooser ``minikv/speed/choose.py`` and ``minikv/speed/operators.py``, ``kernels/paged_attention_cpu.py``,
``minikv/bench/linear.py``), loaded by path, and the two
virtualenvs must have the same PyTorch build (checked). This file is that script: above ``cli`` it imports
torch only.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

MARKER = "MINIKV-OPS "   # the result line (vLLM logs to stdout too)
LINEARS = Path(__file__).resolve().parent.parent / "speed" / "linears.py"
CHOOSE = LINEARS.with_name("choose.py")   # what linears.py imports: the chooser of its paths,
OPERATORS = LINEARS.with_name("operators.py")   # and how its operators are registered
HUGEPAGES = LINEARS.with_name("hugepages.py")   # and whether its packed weights go on huge pages
KERNELS = Path(__file__).resolve().parent.parent.parent / "kernels" / "paged_attention_cpu.py"
TIMING = Path(__file__).resolve().parent / "linear.py"   # its `alternate`: two things timed turn about


def shapes(config: dict) -> dict:
    """Each linear of one layer (merged as both engines merge them) and the lm_head: name -> (out, in)."""
    hidden, head_dim = config["hidden_size"], config["head_dim"]
    qkv = (config["num_attention_heads"] + 2 * config["num_key_value_heads"]) * head_dim
    return {"q/k/v": (qkv, hidden), "o": (hidden, config["num_attention_heads"] * head_dim),
            "gate/up": (2 * config["intermediate_size"], hidden), "down": (hidden, config["intermediate_size"]),
            "lm_head": (config["vocab_size"], hidden)}


class VllmOps:
    """vLLM's CPU operators, called as its CPU linear layers and CPU attention backend call them."""

    name = "vllm"

    def __init__(self):
        from vllm import _custom_ops as ops

        self.ops = ops

    def linear(self, weight: torch.Tensor):
        handler = self.ops.create_onednn_mm(weight.t(), 32)   # as vLLM's dispatch_cpu_unquantized_gemm does
        return lambda x: self.ops.onednn_mm(handler, x, None)

    def _attention(self, q, kv_heads: int, starts, lengths, scale: float, block_size: int):
        """vLLM's CPU attention as its backend runs a layer, on scheduler metadata made once here: store(k, v,
        key_cache, value_cache, slots) writes K/V rows at their slots, attend(key_cache, value_cache, table, out)
        runs the kernel for the queries q [tokens, H, D], each sequence's starting at ``starts``."""
        isa = "vec" if block_size % 32 == 0 else "vec16"
        metadata = self.ops.cpu_attn_get_scheduler_metadata(
            num_reqs=len(lengths), num_heads=q.shape[1], num_kv_heads=kv_heads, head_dim=q.shape[2],
            seq_lens=lengths, dtype=q.dtype, query_start_loc=starts, causal=True, sliding_window_size=-1, isa=isa,
            enable_kv_split=True)   # VLLM_CPU_ATTN_SPLIT_KV, on by default

        def store(k, v, key_cache, value_cache, slots):
            self.ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa)

        def attend(key_cache, value_cache, table, out):
            self.ops.cpu_attention_with_kv_cache(
                query=q, key_cache=key_cache, value_cache=value_cache, output=out, query_start_loc=starts,
                seq_lens=lengths, scale=scale, causal=True, alibi_slopes=None, sliding_window=-1,
                block_table=table, softcap=0.0, scheduler_metadata=metadata, s_aux=None)
            return out

        return store, attend

    def prompt_attention(self, q, k, v, scale: float, block_size: int = 128):
        """q [T, H, D], k/v [T, KVH, D] -> a call writing k/v into a paged cache and returning [T, H, D]."""
        tokens, kv_heads = q.shape[0], k.shape[1]
        blocks = -(-tokens // block_size)
        cache = torch.zeros(blocks, kv_heads, 2 * block_size, q.shape[2])   # vLLM's CPU layout: K and V per block
        key_cache, value_cache = cache.chunk(2, dim=2)
        slots = torch.arange(tokens, dtype=torch.int64)
        starts, lengths = torch.tensor([0, tokens], dtype=torch.int32), torch.tensor([tokens], dtype=torch.int32)
        table = torch.arange(blocks, dtype=torch.int32).view(1, -1)
        store, attend = self._attention(q, kv_heads, starts, lengths, scale, block_size)
        out = torch.empty_like(q)

        def call():
            store(k, v, key_cache, value_cache, slots)
            return attend(key_cache, value_cache, table, out)

        return call

    def decode_attention(self, q, keys, values, scale: float, layers: int, gen, block_size: int = 128):
        """One query per sequence (q [S, H, D]) over keys/values [S, L, KVH, D], the last position being the new
        token's: per layer a pool of scattered blocks holding the first L - 1, and a call that writes the new
        token's K/V at its slot and attends, layer after layer; it returns the last layer's output [S, H, D]."""
        seqs, length, kv_heads, head_dim = keys.shape
        per_seq = -(-length // block_size)
        lengths = torch.full((seqs,), length, dtype=torch.int32)
        store, attend = self._attention(q, kv_heads, torch.arange(seqs + 1, dtype=torch.int32), lengths, scale,
                                        block_size)
        new_k, new_v = keys[:, -1].contiguous(), values[:, -1].contiguous()
        stores = []
        for _ in range(layers):
            table = torch.randperm(seqs * per_seq, generator=gen).view(seqs, per_seq).to(torch.int32)
            key_cache, value_cache = torch.zeros(seqs * per_seq, kv_heads, 2 * block_size, head_dim).chunk(2, dim=2)
            slots = paged_slots(table, length, block_size)
            store(keys[:, :-1].reshape(-1, kv_heads, head_dim), values[:, :-1].reshape(-1, kv_heads, head_dim),
                  key_cache, value_cache, slots[:, :-1].flatten())
            stores.append((key_cache, value_cache, table, slots[:, -1].contiguous()))
        out = torch.empty_like(q)

        def call():
            for key_cache, value_cache, table, last in stores:
                store(new_k, new_v, key_cache, value_cache, last)
                attend(key_cache, value_cache, table, out)
            return out

        return call


class TorchOps:
    """A stand-in peer in plain PyTorch (the tests' and anyone's without vLLM): unpacked F.linear, and
    attention by its definition, K/V repeated per query head."""

    name = "torch"

    def linear(self, weight: torch.Tensor):
        return lambda x: F.linear(x, weight)

    def prompt_attention(self, q, k, v, scale: float, block_size: int = 128):
        group = q.shape[1] // k.shape[1]
        mask = torch.ones(q.shape[0], q.shape[0], dtype=torch.bool).tril()

        def call():
            keys, values = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            scores = torch.einsum("thd,shd->hts", q, keys).mul(scale).masked_fill(~mask, float("-inf"))
            return torch.einsum("hts,shd->thd", scores.softmax(-1), values)

        return call

    def decode_attention(self, q, keys, values, scale: float, layers: int, gen, block_size: int = 16):
        """Each layer's K/V contiguous per sequence; the new token's K/V written, then SDPA, K/V repeated per head."""
        group = q.shape[1] // keys.shape[2]
        caches = [(keys.clone(), values.clone()) for _ in range(layers)]
        new_k, new_v = keys[:, -1].clone(), values[:, -1].clone()

        def call():
            for k, v in caches:
                k[:, -1], v[:, -1] = new_k, new_v
                out = F.scaled_dot_product_attention(q.unsqueeze(2), k.repeat_interleave(group, 2).transpose(1, 2),
                                                     v.repeat_interleave(group, 2).transpose(1, 2), scale=scale)
            return out[:, :, 0]

        return call


def _minikv_module(name: str, path: Path):
    """A minikv module that imports nothing but torch, loaded by path where the minikv package is not importable
    (it needs what vLLM's virtualenv lacks); the imported one where it is."""
    module = sys.modules.get(name) or sys.modules.get(name.replace(".", "_"))
    if module is None:
        spec = importlib.util.spec_from_file_location(name.replace(".", "_"), path)
        module = importlib.util.module_from_spec(spec)
        # loaded once: a second copy of the CPU kernels' module registers their fake kernels again, which
        # torch before 2.13 refuses (register_fake's allow_override was False), so the kernel seemed unbuilt
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return module


def minikv_linears(layers: list[list[torch.Tensor]]) -> list:
    """minikv's eager forwards of one kind of linear in every layer, as ``PackedLinears`` routes them in a model:
    each layer's weights are the siblings of a merged group (or one alone), and one ``PackedLinears`` holds them
    all, so each row count's path is chosen as the engine chooses it, over every layer's weight of the shape
    streaming from memory. (Chosen over one weight, hot in the cache, the plan took MKL at one row for three of
    SmolLM2's shapes on an AMD EPYC, which then ran twice as slow as oneDNN over thirty layers.) One callable per
    layer, as a layer calls its siblings on one input; it returns the siblings' outputs."""
    for name, path in (("minikv.speed.choose", CHOOSE), ("minikv.speed.operators", OPERATORS),
                       ("minikv.speed.hugepages", HUGEPAGES)):
        if name not in sys.modules:   # linears.py's imports of minikv, found under their own names
            sys.modules[name] = _minikv_module(name, path)
    linears = _minikv_module("minikv.speed.linears", LINEARS)
    holders = torch.nn.ModuleList()
    for weights in layers:
        modules = []
        for weight in weights:
            module = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
            module.weight = torch.nn.Parameter(weight, requires_grad=False)
            modules.append(module)
        holders.append(_Holder(modules))
    packed = linears.PackedLinears(holders, merge=len(layers[0]) > 1)
    return [lambda x, fs=[packed.forwards[m] for m in holder.children()]: [f(x) for f in fs] for holder in holders]


class _Holder(torch.nn.Module):
    """A module whose children are one merged group's siblings, under the names minikv merges by."""

    def __init__(self, modules: list[torch.nn.Module]):
        super().__init__()
        names = {3: ("q_proj", "k_proj", "v_proj"), 2: ("gate_proj", "up_proj")}.get(len(modules), ("proj",))
        for name, module in zip(names, modules):
            setattr(self, name, module)


def cpu_kernels():
    """minikv's C++ attention kernels (``kernels/paged_attention_cpu.py``), built on first use; None (and the
    module's ``why_not``) where they cannot be built, as the runner then falls back to PyTorch."""
    module = _minikv_module("minikv_kernels.paged_attention_cpu", KERNELS)
    return module if module.load() is not None else None


def minikv_prompt_attention(q, k, v, scale: float, kernel: bool, block_size: int = 16):
    """The fresh-prompt branch of ``minikv.dispatch.attend_layer``: K/V stored at their slots of the head-major
    store, then causal attention over this chunk (``minikv.dispatch.prompt_attention``): the C++ kernel
    (``kernel``, the runner's choice on the CPU in fp32 where it builds) or PyTorch's SDPA."""
    tokens, heads, head_dim = q.shape
    kv_heads, blocks = k.shape[1], -(-tokens // block_size)
    k_store = torch.zeros(kv_heads, blocks, block_size, head_dim)
    v_store = torch.zeros_like(k_store)
    slots = torch.arange(tokens)
    query, key, value = (x.unsqueeze(0).transpose(1, 2) for x in (q, k, v))   # [1, heads, T, D], as HF passes them
    attend = cpu_kernels().prompt_attention if kernel else None

    def call():
        k_store.view(kv_heads, -1, head_dim).index_copy_(1, slots, key[0])
        v_store.view(kv_heads, -1, head_dim).index_copy_(1, slots, value[0])
        out = q.new_empty(tokens, heads, head_dim)
        if attend is not None:
            out[:] = attend(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), scale)
        else:
            out[:] = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale,
                                                    enable_gqa=True)[0].transpose(0, 1)
        return out

    return call


def paged_slots(table: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """Where each of a sequence's first ``length`` tokens lies in a pool of blocks, given its block table
    [S, blocks]: slot = block * block_size + offset, as both engines number them. [S, length] int64."""
    pos = torch.arange(length)
    return table[:, pos // block_size].long() * block_size + pos % block_size


def minikv_decode_attention(q, keys, values, scale: float, layers: int, gen, block_size: int = 16):
    """The kernel branch of ``minikv.dispatch.attend_layer`` for a decode batch: per layer a head-major store
    [KVH, blocks, block_size, D] whose blocks are scattered, holding the first L - 1 positions of keys/values
    [S, L, KVH, D]; the call writes the new token's K/V at its slots (``index_copy_``) and runs the C++ decode
    kernel, layer after layer, and returns the last layer's output [S, H, D]."""
    seqs, length, kv_heads, head_dim = keys.shape
    per_seq = -(-length // block_size)
    kernel = cpu_kernels()
    lengths = torch.full((seqs,), length, dtype=torch.int32)
    new_k, new_v = (x[:, -1].transpose(0, 1).contiguous() for x in (keys, values))   # [KVH, S, D]
    stores = []
    for _ in range(layers):
        table = torch.randperm(seqs * per_seq, generator=gen).view(seqs, per_seq).to(torch.int32)
        slots = paged_slots(table, length, block_size)
        k_store, v_store = (torch.zeros(kv_heads, seqs * per_seq, block_size, head_dim) for _ in range(2))
        for store, x in ((k_store, keys), (v_store, values)):
            store.view(kv_heads, -1, head_dim)[:, slots[:, :-1].flatten()] = x[:, :-1].reshape(-1, kv_heads,
                                                                                               head_dim).transpose(0, 1)
        stores.append((k_store, v_store, table, slots[:, -1].contiguous()))

    def call():
        for k_store, v_store, table, last in stores:
            k_store.view(kv_heads, -1, head_dim).index_copy_(1, last, new_k)
            v_store.view(kv_heads, -1, head_dim).index_copy_(1, last, new_v)
            out = kernel.paged_decode(q, k_store, v_store, table, lengths, scale)
        return out

    return call


@torch.inference_mode()
def _pair(mine, theirs, repeat: int, timed=None) -> dict:
    """Time `timed` (default: `mine`) and `theirs` alternately, `repeat` times each after a first call of
    each (which compares their outputs): medians (ms), the median ratio of calls made back to back, and the
    largest difference between the outputs of `mine` and `theirs`."""
    diff = (mine() - theirs()).abs().max().item()
    a, b = _minikv_module("minikv.bench.linear", TIMING).alternate(timed or mine, theirs, repeat, warmup=0)
    return {"minikv_ms": 1e3 * statistics.median(a), "peer_ms": 1e3 * statistics.median(b),
            "ratio": statistics.median(x / y for x, y in zip(a, b)), "max_abs_diff": diff}


def measure(spec: dict, peer) -> list[dict]:
    """One row per operator and row count: a forward's worth of calls (each layer's linear of that kind, on
    its own weight; the prompt's attention once per layer), minikv's and the peer's. Weights are made as a
    model's are (outside inference mode: minikv keys its packed copies by their version counters); the calls
    run in inference mode, as the engine's do."""
    gen = torch.Generator().manual_seed(spec.get("seed", 0))
    config, layers = spec["config"], spec["config"]["num_hidden_layers"]
    rows = sorted({*spec["prompts"], *spec["batches"]})
    results = []
    for name, (out_features, in_features) in shapes(config).items():
        copies = 1 if name == "lm_head" else layers
        weights = [torch.randn(out_features, in_features, generator=gen) * in_features ** -0.5 for _ in range(copies)]
        if name == "q/k/v":
            heads, head_dim = config["num_attention_heads"] * config["head_dim"], config["head_dim"]
            split = [heads, config["num_key_value_heads"] * head_dim, config["num_key_value_heads"] * head_dim]
        elif name == "gate/up":
            split = [config["intermediate_size"]] * 2
        else:
            split = [out_features]
        ours = minikv_linears([list(w.split(split)) for w in weights])
        theirs = [peer.linear(w) for w in weights]
        for m in (sorted({*spec["batches"], 1}) if name == "lm_head" else rows):   # a prefill's lm_head reads 1 row
            x = torch.randn(m, in_features, generator=gen)
            results.append({"op": "linear", "name": f"{name} {out_features}x{in_features}", "rows": m,
                            "calls": copies, "runs": True, **_pair(lambda: torch.cat([f(x) for f in ours][-1], dim=-1),
                                                     lambda: [f(x) for f in theirs][-1], spec["repeat"],
                                                     lambda: [f(x) for f in ours])})
    heads, kv_heads, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    # the prompt's attention minikv runs (the C++ kernel where it builds), and the other one beside it
    ways = {"C++ kernel": True, "SDPA": False} if cpu_kernels() is not None else {"SDPA": False}
    for tokens in spec["prompts"]:
        q = torch.randn(tokens, heads, head_dim, generator=gen)
        k, v = (torch.randn(tokens, kv_heads, head_dim, generator=gen) for _ in range(2))
        theirs = peer.prompt_attention(q, k, v, head_dim ** -0.5)
        for i, (way, kernel) in enumerate(ways.items()):
            mine = minikv_prompt_attention(q, k, v, head_dim ** -0.5, kernel)
            results.append({"op": "attention", "name": f"prompt of {tokens}, {way}", "rows": tokens, "calls": layers,
                            "runs": i == 0,
                            **_pair(lambda: [mine() for _ in range(layers)][-1],
                                    lambda: [theirs() for _ in range(layers)][-1], spec["repeat"])})
    # a decode step's attention, where minikv runs its C++ kernel (without it, the gather path needs a step's plan)
    if cpu_kernels() is not None:
        context = spec.get("context", 200)
        for batch in spec["batches"]:
            q = torch.randn(batch, heads, head_dim, generator=gen)
            keys, values = (torch.randn(batch, context + 1, kv_heads, head_dim, generator=gen) for _ in range(2))
            mine = minikv_decode_attention(q, keys, values, head_dim ** -0.5, layers, gen)
            theirs = peer.decode_attention(q, keys, values, head_dim ** -0.5, layers, gen)
            results.append({"op": "attention", "name": f"decode, context {context + 1}", "rows": batch,
                            "calls": layers, "runs": True, **_pair(mine, theirs, spec["repeat"])})
    return results


def totals(results: list[dict], spec: dict) -> dict:
    """Summed over one forward: {label: [minikv ms, peer ms]} for a prefill of each prompt length (the layers'
    linears and attention at its length, the lm_head on its last row) and for the linears of a decode step at
    each batch, with its attention where it was timed (minikv's C++ kernel built). Of minikv's operators, the
    ones it runs (``runs``): the prompt's attention it would not choose is timed beside, not summed."""
    def ms(op: str, rows: int, lm_head: bool = False, kind: str = "") -> list[float]:
        picked = [r for r in results if r["op"] == op and r["rows"] == rows and r["runs"]
                  and r["name"].startswith("lm_head") == lm_head and r["name"].startswith(kind)]
        return [sum(r["minikv_ms"] for r in picked), sum(r["peer_ms"] for r in picked)]

    out = {f"prefill of {p}": [a + b + c for a, b, c in zip(ms("linear", p), ms("linear", 1, True),
                                                             ms("attention", p, kind="prompt"))]
           for p in spec["prompts"]}
    for b in spec["batches"]:
        attention = ms("attention", b, kind="decode")
        label = f"decode step at batch {b}, " + ("linears and attention" if attention[1] else "linears")
        out[label] = [a + c + d for a, c, d in zip(ms("linear", b), ms("linear", b, True), attention)]
    return out


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    peer = VllmOps() if spec["peer"] == "vllm" else TorchOps()
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    results = measure(spec, peer)
    print(MARKER + json.dumps({"torch": torch.__version__, "torch_config": torch.__config__.show(),
                               "threads": torch.get_num_threads(), "peer": peer.name, "results": results}),
          flush=True)



def cli(argv: list[str] | None = None) -> int:
    import argparse
    import os
    import subprocess
    import tempfile

    from minikv.bench import vllm_peer
    from minikv.bench.steps import DEPTH30

    parser = argparse.ArgumentParser(prog="python -m minikv bench ops", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", choices=["smollm2-135m", "depth30"],
                        help="whose shapes: smollm2-135m (default) or depth30 (SmolLM2's depth at a tiny width)")
    parser.add_argument("--prompts", default="200", help="prompt lengths of the prefills (default 200)")
    parser.add_argument("--batches", default="1,8,16", help="decode batch sizes (default 1,8,16)")
    parser.add_argument("--context", type=int, default=200,
                        help="tokens each sequence holds before a decode step (default 200, as bench steps)")
    parser.add_argument("--repeat", type=int, default=15, help="calls per figure, the median kept (default 15)")
    parser.add_argument("--peer", default="vllm", choices=["vllm", "torch"],
                        help="vllm (default: its CPU build, in .venv-vllm, `make vllm`) or torch (a stand-in in "
                             "plain PyTorch, run by this interpreter)")
    parser.add_argument("--vllm-venv", default=str(vllm_peer.VENV), help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object")
    args = parser.parse_args(argv)
    try:
        prompts, batches = ([int(x) for x in value.split(",") if x.strip()] for value in (args.prompts, args.batches))
    except ValueError:
        parser.error(f"--prompts and --batches take comma-separated integers, got {args.prompts!r}, {args.batches!r}")
    for what, value in (("--repeat", args.repeat), ("--context", args.context), *(("--prompts", p) for p in prompts),
                        *(("--batches", b) for b in batches)):
        if value < 1:
            parser.error(f"{what} must be >= 1, got {value}")
    if args.peer == "vllm":
        exe = vllm_peer.python(Path(args.vllm_venv))
        if exe is None:
            print(vllm_peer.HOW_TO_GET_IT)
            return 2
        env = vllm_peer.environment(Path(args.vllm_venv))
    else:
        exe, env = Path(sys.executable), dict(os.environ)
    if args.model == "depth30":
        config = dict(DEPTH30)
    else:
        from minikv.models import smollm2_dir

        config = json.loads((smollm2_dir() / "config.json").read_text())
    config.setdefault("head_dim", config["hidden_size"] // config["num_attention_heads"])
    spec = {"peer": args.peer, "config": config, "prompts": prompts, "batches": batches, "repeat": args.repeat,
            "context": args.context}
    with tempfile.TemporaryDirectory(prefix="minikv-ops-") as folder:
        spec_path = Path(folder) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        # -P: this file's folder is not put first on sys.path (minikv/bench/profile.py would shadow the stdlib's)
        done = subprocess.run([str(exe), "-P", str(Path(__file__).resolve()), str(spec_path)], env=env,
                              capture_output=True, text=True, timeout=3600)
    lines = [line for line in done.stdout.splitlines() if line.startswith(MARKER)]
    if done.returncode != 0 or not lines:
        print(f"the operators' script failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
        return 1
    report = json.loads(lines[-1][len(MARKER):])
    if report["torch_config"] != torch.__config__.show():
        print(f"{exe} runs another PyTorch build ({report['torch']}) than minikv's ({torch.__version__}): "
              "minikv's operators timed there would not be the ones minikv runs; install the same torch in both")
        return 1
    report["totals"] = totals(report["results"], spec)
    report.pop("torch_config")
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    peer = "vLLM" if args.peer == "vllm" else "stand-in"
    print(f"{args.model} shapes, fp32, PyTorch {report['torch']} ({report['threads']} threads), minikv's operators "
          f"and {peer}'s alternating on the same tensors: medians of {args.repeat} calls, each call a forward's "
          f"worth ({config['num_hidden_layers']} layers; the lm_head once)")
    print(f"{'operator':<44}{'rows':>6}{'minikv ms':>12}{peer + ' ms':>13}{'minikv/' + peer:>17}{'max|diff|':>11}")
    for r in report["results"]:
        label = f"{r['op']} {r['name']}" + ("" if r["runs"] else " (not run)")
        print(f"{label:<44}{r['rows']:>6}{r['minikv_ms']:>12.2f}{r['peer_ms']:>13.2f}"
              f"{r['ratio']:>17.2f}{r['max_abs_diff']:>11.1e}")
    print(f"\n{'summed over one forward (what minikv runs)':<50}{'minikv ms':>12}{peer + ' ms':>13}"
          f"{'minikv - ' + peer:>19}")
    for label, (mine, theirs) in report["totals"].items():
        print(f"{label:<50}{mine:>12.1f}{theirs:>13.1f}{mine - theirs:>+19.1f}")
    return 0


if __name__ == "__main__":
    main(sys.argv[1])
