"""`bench steps`: what one step costs in minikv and in vLLM, shape by shape, from one command.

`bench engine` times a whole workload, where the two engines' schedules differ; a served request's
latency is made of steps of a few shapes. This times both engines on the same shapes, each through its
own ``generate`` (so a step's scheduling and sampling count, as they do when serving):

* a prefill: one prompt of P tokens, one output token;
* a decode step at batch B: B prompts of C tokens, generating 1 token each and then 1 + N; the
  difference over N is one decode step at batch B, C to C + N tokens of context. The two calls
  alternate and the median of their differences is kept, so a slow spell of the machine lands in
  both halves of a pair.

Prompts are fresh random token ids every call, the same for every engine (vLLM's prefix caching is off;
each minikv column is an engine of its own, whose cache finds nothing to share in them). Every engine
of the run (minikv, with ``--compile`` minikv compiled too, with ``--vllm``
vLLM in its own virtualenv as a :class:`~minikv.bench.vllm_peer.Worker`) is alive at once and makes each
call in turn on the same prompts, so the machine's slow spells, which last minutes on a shared host,
land on all of them alike.

``--model depth30`` is a random Llama with SmolLM2's depth, heads and head size (30 layers, 64-wide
heads) but a width of 192: its matmuls cost next to nothing, so what is left of a step is each
engine's cost per layer and per step (Python, operator dispatch, launching kernels).

``--beside DUTY`` adds minikv beside a busy Python thread of its own process and beside a busy process
(``minikv.bench.contention``): the served engine's forward shares the GIL with the event loop.

``--from-thread`` adds two minikv engines in processes of their own, each loaded on its process's main
thread: one stepped from that thread, one from a second, long-lived thread, while the main thread keeps
torch's OpenMP pool. The second is how `minikv serve` ran its engine until its engine thread built the
engine itself (`minikv.server.engine_loop`, "Why one thread runs torch"); only the calling thread differs.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from functools import partial
from pathlib import Path

from minikv.bench import vllm_peer
from minikv.bench.vllm_peer import PAUSE, interleaved

DEPTH30 = dict(num_hidden_layers=30, hidden_size=192, intermediate_size=256, num_attention_heads=3,
               num_key_value_heads=1, head_dim=64, vocab_size=1024, max_position_embeddings=2048,
               tie_word_embeddings=True)


def measure(runs: dict, spec: dict, pause: float = PAUSE) -> dict:
    """Seconds of a prefill and of a decode step at each batch, for each engine in `runs` (a name to its
    ``run(prompts, max_tokens) -> seconds``), one figure per repetition: {name: {shape: [seconds, ...]}}.
    Every call is made by each engine in turn on the same fresh prompts, the order rotating, after `pause`
    seconds in which the engine that ran last goes idle; repetition i of every engine ran within seconds."""
    import random

    rng = random.Random(spec["seed"])
    names = list(runs)
    turn = 0

    def each(prompts: list[list[int]], max_tokens: int) -> dict:
        nonlocal turn
        calls = {name: lambda run=run: run(prompts, max_tokens) for name, run in runs.items()}
        seconds = {name: got[0] for name, got in interleaved(calls, 1, pause, first=turn).items()}
        turn = (turn + 1) % len(names)
        return seconds

    def prompts(n: int, length: int) -> list[list[int]]:
        return [[rng.randrange(spec["low"], spec["high"]) for _ in range(length)] for _ in range(n)]

    each(prompts(2, 16), 4)  # warm-up: first-call costs (allocations, lazy builds) are not a step's
    calls = [each(prompts(1, spec["prefill"]), 1) for _ in range(spec["repeat"])]
    out = {name: {"prefill": [c[name] for c in calls]} for name in names}
    for batch in spec["batches"]:
        pairs = [(each(prompts(batch, spec["context"]), 1), each(prompts(batch, spec["context"]), 1 + spec["steps"]))
                 for _ in range(spec["repeat"])]
        for name in names:
            out[name][f"decode_b{batch}"] = [(b[name] - a[name]) / spec["steps"] for a, b in pairs]
    return out


def summarize(samples: dict, peer: str | None = None) -> dict:
    """Each engine's median per shape and, against `peer`, the median of the ratios repetition by repetition
    (a pair ran seconds apart, so a slow minute of the machine divides out): {name: {shape: (median, ratio)}}."""
    import statistics

    def ratio(mine: list[float], theirs: list[float]) -> float:
        # a pair with a decode sample <= 0 (noise larger than the steps; the cli warns of it) is left out;
        # NaN when no pair is left
        pairs = [m / t for m, t in zip(mine, theirs) if t > 0 and m > 0]
        return statistics.median(pairs) if pairs else float("nan")

    return {name: {shape: (statistics.median(values), ratio(values, samples[peer][shape]) if peer in samples
                           else None)
                   for shape, values in shapes.items()} for name, shapes in samples.items()}


def minikv_run(model, tokenizer, compile: bool = False, linears: str | None = None):
    """``run(prompts, max_tokens) -> seconds`` on one minikv engine with its defaults (and ``compile``,
    ``linears``); ``run.levers`` says what it chose on this host."""
    from minikv.engine import LLM
    from minikv.sampling import SamplingParams

    llm = LLM(model, tokenizer=tokenizer, verbose=False, compile=compile, linears=linears)
    llm.engine.long_run()   # its steady state, as a server runs: the weights' move made first

    def run(prompts: list[list[int]], max_tokens: int) -> float:
        params = [SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)] * len(prompts)
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - start

    run.levers = llm.engine.speed_levers()
    return run


def loaded_run(name: str):
    """`minikv_run` on the model `name`, loaded here (`--from-thread`'s processes each load their own)."""
    return minikv_run(*load(name))


def load(name: str):
    """(model, tokenizer) of smollm2-135m or depth30 (no tokenizer: random token ids need none), fp32 on the CPU."""
    import torch

    from minikv.models import load_model, tiny_random_llama

    if name == "depth30":
        return tiny_random_llama(**DEPTH30), None
    return load_model(name, device="cpu", dtype=torch.float32)


@contextmanager
def vllm_worker(model, tokenizer, spec: dict, venv: Path):
    """vLLM's CPU build on the same model, answering timed calls (depth30: its random weights saved for it)."""
    from minikv.models import smollm2_dir

    longest = max(spec["prefill"], spec["context"] + 1 + spec["steps"])
    settings = {"max_model_len": max(1024, longest), "skip_tokenizer": tokenizer is None}
    with tempfile.TemporaryDirectory(prefix="minikv-depth30-") as folder:
        if tokenizer is None:
            model.save_pretrained(folder)
        with vllm_peer.Worker({**settings, "model_dir": folder if tokenizer is None else str(smollm2_dir())},
                              venv=venv) as worker:
            yield worker.run


def cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minikv bench steps", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", choices=["smollm2-135m", "depth30"],
                        help="smollm2-135m (default) or depth30 (SmolLM2's depth at a tiny width: fixed costs)")
    parser.add_argument("--prefill", type=int, default=200, help="prompt tokens of the prefill (default 200)")
    parser.add_argument("--context", type=int, default=200, help="prompt tokens before decoding (default 200)")
    parser.add_argument("--batches", default="1,4,8", help="decode batch sizes (default 1,4,8)")
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed per call (default 32)")
    parser.add_argument("--repeat", type=int, default=5, help="calls per figure, the median kept (default 5)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts (default 0)")
    parser.add_argument("--linears", choices=["measure", "eager", "onednn", "mkl"], default=None,
                        help="minikv's linear path (default: $MINIKV_LINEAR, else measured fastest on this host)")
    parser.add_argument("--compile", action="store_true",
                        help="also minikv with compile=True (its start-up is not timed)")
    parser.add_argument("--vllm", action="store_true", help="also vLLM's CPU build (.venv-vllm, `make vllm`)")
    parser.add_argument("--beside", type=float, metavar="DUTY",
                        help="also minikv beside a Python thread, and beside a process, each busy DUTY of the "
                             "time (e.g. 0.3): what sharing the GIL costs a forward (minikv.bench.contention)")
    parser.add_argument("--from-thread", action="store_true",
                        help="also minikv stepped from a second thread while the main thread holds torch's CPU "
                             "thread pool: what two OpenMP pools on this machine's cores cost a step")
    parser.add_argument("--vllm-venv", default=str(vllm_peer.VENV), help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object")
    args = parser.parse_args(argv)
    try:
        batches = [int(b) for b in args.batches.split(",") if b.strip()]
    except ValueError:
        parser.error(f"--batches takes comma-separated integers, got {args.batches!r}")
    for what, value in (("--prefill", args.prefill), ("--context", args.context), ("--steps", args.steps),
                        ("--repeat", args.repeat), *(("--batches", b) for b in batches)):
        if value < 1:
            parser.error(f"{what} must be >= 1, got {value}")
    if args.beside is not None and not 0 < args.beside < 1:
        parser.error(f"--beside takes a share of the time between 0 and 1, got {args.beside}")
    if args.vllm and vllm_peer.python(Path(args.vllm_venv)) is None:
        print(vllm_peer.HOW_TO_GET_IT)
        return 2

    model, tokenizer = load(args.model)
    vocab = model.config.vocab_size
    spec = {"seed": args.seed, "low": 3 if args.model == "depth30" else 100, "high": min(vocab, 40000),
            "prefill": args.prefill, "context": args.context, "batches": batches, "steps": args.steps,
            "repeat": args.repeat}
    from minikv.bench import roofline

    # The host's ceilings beside the figures, measured first: no engine is alive yet (vLLM's keeps a core busy
    # between calls). A stand-in model, as in the tests, has no weights to read.
    roof = roofline.measure() if hasattr(model, "modules") else None
    floors = {}
    if roof is not None:
        floors = {"prefill": roof.prefill_floor(model, args.prefill)}
        floors.update({f"decode_b{b}": roof.decode_floor(model, b, args.context) for b in batches})
    runs = {"minikv": minikv_run(model, tokenizer, linears=args.linears)}
    if args.compile:
        runs["minikv+compile"] = minikv_run(model, tokenizer, compile=True, linears=args.linears)
    neighbours = {}
    if args.beside is not None:
        from minikv.bench.contention import beside

        # minikv again, with a busy neighbour in its process or beside it: an engine of its own each, since
        # every engine gets the same prompts and one engine's prefix cache would serve the next
        neighbours = {f"beside a {kind}": kind for kind in ("thread", "process")}
        runs.update({name: beside(minikv_run(model, tokenizer), kind, args.beside)
                     for name, kind in neighbours.items()})
    with ExitStack() as stack:
        if args.from_thread:
            from minikv.bench.contention import own_process

            for name, second in (("own process", False), ("2nd thread", True)):
                runs[name] = stack.enter_context(own_process(partial(loaded_run, args.model), second))
        if args.vllm:
            runs["vllm"] = stack.enter_context(vllm_worker(model, tokenizer, spec, Path(args.vllm_venv)))
        samples = measure(runs, spec)
    results = summarize(samples, "vllm" if args.vllm else None)
    report = {"model": args.model, "spec": spec, "levers": getattr(runs["minikv"], "levers", None),
              "roofline": roof and {"read_GB_per_s": roof.read_bytes_per_s / 1e9, "GFLOP_per_s": roof.flops_per_s / 1e9,
                                    "fraction": {name: {key: floors[key] / r[key][0] for key in floors}
                                                 for name, r in results.items()}},
              "seconds": {name: {shape: figures[0] for shape, figures in r.items()} for name, r in results.items()},
              "ratio_to_vllm": {name: {shape: figures[1] for shape, figures in r.items()}
                                for name, r in results.items() if args.vllm},
              "samples": samples}
    for name, shapes in samples.items():   # a decode step is a difference of two calls: noise can swamp it
        for shape, values in shapes.items():
            if shape.startswith("decode") and min(values) <= 0:
                print(f"warning: {name}, {shape}: a sample of {min(values) * 1e3:.1f} ms; {args.steps} steps were "
                      "smaller than the noise of one call: raise --steps", file=sys.stderr)
    alone = summarize(samples, "minikv")
    if neighbours:
        report["beside"] = {"duty": args.beside, "ratio_to_alone": {
            name: {shape: figures[1] for shape, figures in alone[name].items()} for name in neighbours}}
    if args.from_thread:
        report["from_thread"] = {"ratio_to_main_thread": {
            shape: figures[1] for shape, figures in summarize(samples, "own process")["2nd thread"].items()}}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    labels = {"prefill": f"prefill, {args.prefill} tokens"}
    labels.update({f"decode_b{b}": f"decode step, batch {b} (context {args.context})" for b in batches})
    print(f"{args.model}, fp32, {args.repeat} calls per figure: medians; a ratio is the median of the"
          " ratios of calls made seconds apart" + (f"\nminikv's {report['levers']}" if report["levers"] else ""))
    ours = [name for name in ("minikv", "minikv+compile") if name in results]
    if neighbours:
        ours += list(neighbours)
    if args.from_thread:
        ours += ["own process", "2nd thread"]
    header = f"{'shape':<40}" + "".join(f"{name + ' ms':>20}" for name in ours)
    header += f"{'floor ms':>10}" if floors else ""
    if args.vllm:
        header += f"{'vLLM ms':>12}" + "".join(f"{name + '/vLLM':>20}" for name in ours)
    print(header)
    for key, label in labels.items():
        line = f"{label:<40}" + "".join(f"{results[name][key][0] * 1e3:>20.1f}" for name in ours)
        line += f"{floors[key] * 1e3:>10.1f}" if floors else ""
        if args.vllm:
            line += f"{results['vllm'][key][0] * 1e3:>12.1f}" + "".join(f"{results[name][key][1]:>20.2f}"
                                                                      for name in ours)
        print(line)
    if roof is not None:
        print(f"\nthe roofline ({roof.cpu}, {roof.threads} threads: read {roof.read_bytes_per_s / 1e9:.1f} GB/s, fp32 "
              f"matmul {roof.flops_per_s / 1e9:.0f} GFLOP/s, `bench roofline`): each step's floor over its time "
              "(decode: weights and K/V read once; prefill: FLOPs at the peak)")
        with_peer = ours + (["vllm"] if args.vllm else [])
        print(f"{'shape':<40}" + "".join(f"{name:>20}" for name in with_peer))
        for key, label in labels.items():
            print(f"{label:<40}" + "".join(f"{report['roofline']['fraction'][name][key]:>20.0%}"
                                          for name in with_peer))
    if neighbours:
        print(f"\nminikv beside a neighbour busy {args.beside:.0%} of the time, over minikv alone (the median of "
              "paired ratios): a thread shares the GIL and the cores, a process only the cores")
        print(f"{'shape':<40}" + "".join(f"{name + ' / alone':>26}" for name in neighbours))
        for key, label in labels.items():
            print(f"{label:<40}" + "".join(f"{alone[name][key][1]:>26.2f}" for name in neighbours))
    if args.from_thread:
        print("\nminikv in a process of its own, stepped from a 2nd thread over stepped from the main thread that "
              "loaded it (the median of paired ratios): the cost of two OpenMP pools on the cores")
        for key, label in labels.items():
            print(f"{label:<40}{report['from_thread']['ratio_to_main_thread'][key]:>12.2f}")
    return 0
