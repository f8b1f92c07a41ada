"""`python -m minikv bench engine`: minikv's engine against transformers, same workload, one run.

The workload (issue 8): 48 requests, seed 7; prompt lengths log-normal around 60 tokens clipped to
16-256, output lengths log-normal around 32 clipped to 8-128; random token ids after BOS; greedy;
EOS ignored, so every system generates exactly the tokens each request asks for. Only those are
counted ("useful tokens/s").

Three systems, each timed from the first request handed over to the last token back:

* ``static``: ``model.generate`` in batches of 16 in arrival order, left padded; each batch runs
  until its longest request is done, so short requests sit idle in their slots (the waste
  continuous batching removes).
* ``continuous``: transformers' own continuous batching manager
  (``model.continuous_batching_context_manager``), one ``add_request`` per request with its own
  ``max_new_tokens``.
* ``minikv``: ``LLM.generate`` with one greedy ``SamplingParams(max_tokens=..., ignore_eos=True)`` each.

With ``--vllm``, vLLM's CPU build (a ``vllm_peer.Worker``) serves the same requests, and its runs and
minikv's take turns (``interleaved``): the ratio is the median of the ratios of runs made seconds apart,
so a slow spell of a shared machine falls on both.

Each system first serves two short warm-up requests (untimed). ``static`` is the token-for-token
reference: it is transformers' plain generate, one forward per step with a dense KV cache.
On CUDA the bench also times one decode step of minikv's runner at batch 1, 8 and 64.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import statistics
import time
from dataclasses import dataclass

import torch

from minikv.bench.vllm_peer import interleaved

BATCH_STATIC = 16
# The engine's speed levers (on by default), each with the engine arguments that switch it off.
LEVERS = {"prepacked linears": {"prepack_linears": False}, "CPU attention kernel": {"cpu_kernel": False},
          "any lever": {"prepack_linears": False, "cpu_kernel": False}}


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int


def make_workload(n: int = 48, seed: int = 7, *, vocab_size: int, bos: int,
                  prompt_median: float = 60, prompt_range=(16, 256),
                  output_median: float = 32, output_range=(8, 128), sigma: float = 0.6) -> list[Request]:
    """n requests with log-normal prompt/output lengths (median as given, clipped), random ids after BOS."""
    gen = torch.Generator().manual_seed(seed)

    def lognormal(median: float, lo: int, hi: int) -> int:
        z = torch.randn((), generator=gen).item()
        return int(min(max(round(median * math.exp(sigma * z)), lo), hi))

    low = min(100, vocab_size // 4)  # skip the special tokens at the start of the vocabulary
    requests = []
    for _ in range(n):
        plen = lognormal(prompt_median, *prompt_range)
        olen = lognormal(output_median, *output_range)
        ids = torch.randint(low, vocab_size, (plen - 1,), generator=gen).tolist()
        requests.append(Request([bos] + ids, olen))
    return requests


@contextlib.contextmanager
def _eos_ignored(model):
    """transformers fills an unset eos_token_id from the model's generation config: unset it there too."""
    gc = model.generation_config
    saved = gc.eos_token_id
    gc.eos_token_id = None
    try:
        yield
    finally:
        gc.eos_token_id = saved


def _generation_config(model, max_new_tokens: int, pad: int):
    gc = copy.deepcopy(model.generation_config)
    gc.update(do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=None, eos_token_id=None,
              pad_token_id=pad, temperature=None, top_p=None, top_k=None)
    return gc


@torch.inference_mode()
def run_static(model, requests: list[Request], pad: int, batch_size: int = BATCH_STATIC):
    """transformers generate in static batches: left padded, every batch runs to its longest request."""
    outputs: list[list[int]] = []
    start = time.perf_counter()
    with _eos_ignored(model):
        for b in range(0, len(requests), batch_size):
            batch = requests[b: b + batch_size]
            width = max(len(r.prompt) for r in batch)
            ids = torch.full((len(batch), width), pad, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for i, r in enumerate(batch):
                ids[i, width - len(r.prompt):] = torch.tensor(r.prompt)
                mask[i, width - len(r.prompt):] = 1
            longest = max(r.max_tokens for r in batch)
            out = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                                 generation_config=_generation_config(model, longest, pad))
            for i, r in enumerate(batch):
                outputs.append(out[i, width: width + r.max_tokens].tolist())
    return time.perf_counter() - start, outputs


def run_continuous(model, requests: list[Request], pad: int):
    """transformers' continuous batching manager, one add_request per request with its own max_new_tokens."""
    results = {}
    with _eos_ignored(model):
        gc = _generation_config(model, max(r.max_tokens for r in requests), pad)
        with model.continuous_batching_context_manager(generation_config=gc, block=True, timeout=30) as manager:
            start = time.perf_counter()
            ids = [manager.add_request(r.prompt, request_id=f"r{i}", max_new_tokens=r.max_tokens)
                   for i, r in enumerate(requests)]
            while len(results) < len(requests):
                result = manager.get_result(timeout=60)
                if result is None:
                    raise RuntimeError("transformers' continuous batching manager stopped returning results")
                if result.is_finished():
                    results[result.request_id] = result
            seconds = time.perf_counter() - start
    errors = [r.error for r in results.values() if r.error]
    if errors:
        raise RuntimeError(f"transformers' continuous batching failed: {errors[0]}")
    return seconds, [results[i].generated_tokens[: r.max_tokens] for i, r in zip(ids, requests)]


def run_minikv(model, tokenizer, requests: list[Request], **engine_args):
    from minikv.engine import LLM
    from minikv.sampling import SamplingParams

    start = time.perf_counter()
    llm = LLM(model, tokenizer=tokenizer, verbose=False, **engine_args)
    llm.engine.long_run()   # as a server runs: the weights' move onto huge pages made first, if it pays here
    startup = time.perf_counter() - start  # pool allocation, weight prepacking, that move
    params = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests]
    prompts = [{"prompt_token_ids": r.prompt} for r in requests]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    run_minikv.startup_seconds = startup  # the last run's, read by cli
    return seconds, [o.outputs[0].token_ids for o in outs], llm


def median_of_runs(run, repeat: int):
    """Call run() `repeat` times; (the median seconds, every run's seconds, the last call's other results).
    run() returns (seconds, ...). With an even count the median is the lower middle run."""
    timings = []
    for _ in range(repeat):
        seconds, *rest = run()
        timings.append(seconds)
    return sorted(timings)[(len(timings) - 1) // 2], timings, rest


def decode_step_times(model, batches=(1, 8, 64, 256), context: int = 512, block_size: int = 16, repeats: int = 20):
    """Seconds per decode step of minikv's runner at each batch size (each sequence `context` tokens deep)."""
    from minikv.runner import ModelRunner
    from minikv.step import SeqStep

    per_seq = math.ceil((context + 1) / block_size)
    runner = ModelRunner(model, per_seq * max(batches), block_size)
    times = {}
    for batch in batches:
        steps = []
        for i in range(batch):
            table = list(range(i * per_seq, (i + 1) * per_seq))
            slot = table[context // block_size] * block_size + context % block_size
            steps.append(SeqStep(i, [100 + i], context, table, [slot], True))
        for _ in range(3):
            runner.execute(steps)
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(repeats):
            runner.execute(steps)
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        times[batch] = (time.perf_counter() - start) / repeats
    return times


def profile_minikv(model, tokenizer, requests: list[Request], **engine_args) -> dict:
    """Where an engine step's time goes: scheduling and bookkeeping, step planning, the model's
    forward (of which attention), the lm_head, sampling. Read from the spans the engine and the runner
    open (``minikv.metrics.span``) under ``torch.profiler`` for one run of the workload; the lm_head gets
    a span through forward hooks. The profiler records every op, so the milliseconds are inflated a
    little (the same way for every row); the shares are what to read."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from minikv.engine import LLM
    from minikv.metrics import SPAN_ATTENTION, SPAN_EXECUTE, SPAN_PLAN, SPAN_SAMPLE, SPAN_STEP
    from minikv.sampling import SamplingParams

    lm_head_span = "minikv.lm_head"
    open_spans = []

    def enter(*_):
        open_spans.append(record_function(lm_head_span))
        open_spans[-1].__enter__()

    def leave(*_):
        open_spans.pop().__exit__(None, None, None)

    # The runner swaps the lm_head's forward for its prepacked one while it executes; hooks still run.
    hooks = [model.lm_head.register_forward_pre_hook(enter), model.lm_head.register_forward_hook(leave)]
    try:
        llm = LLM(model, tokenizer=tokenizer, verbose=False, **engine_args)
        llm.engine.long_run()
        params = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests]
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            llm.generate([{"prompt_token_ids": r.prompt} for r in requests], params, use_tqdm=False)
    finally:
        for hook in hooks:
            hook.remove()
    events = {e.key: e for e in prof.key_averages()}

    def seconds(name: str) -> float:
        return events[name].cpu_time_total / 1e6 if name in events else 0.0

    steps = events[SPAN_STEP].count if SPAN_STEP in events else 1
    total, execute, plan = seconds(SPAN_STEP), seconds(SPAN_EXECUTE), seconds(SPAN_PLAN)
    attention, lm_head, sampling = seconds(SPAN_ATTENTION), seconds(lm_head_span), seconds(SPAN_SAMPLE)
    rows = {
        "scheduling, block manager, bookkeeping": total - execute - sampling,
        "plan the step (index tensors)": plan,
        "model forward without attention and lm_head": execute - plan - attention - lm_head,
        "attention (write K/V + paged attention)": attention,
        "lm_head (last token of each sampling sequence)": lm_head,
        "sampling": sampling,
    }
    return {"steps": steps, "seconds": total, "ms_per_step": {k: 1e3 * v / steps for k, v in rows.items()}}


def paired_ratio(mine: list[float], theirs: list[float]) -> tuple[float, list[float]]:
    """mine's throughput over theirs, from seconds timed in pairs: (the median of the per-repetition ratios,
    each ratio), so that each ratio compares two runs made seconds apart."""
    ratios = [t / m for m, t in zip(mine, theirs)]
    return statistics.median(ratios), ratios


def vllm_worker(model_name: str, requests):
    """vLLM's CPU build kept running on the converted SmolLM2 folder (a vllm_peer.Worker), or a sentence
    saying why not. Its prefix cache is off: the timed runs repeat the same prompts, and minikv builds a
    fresh engine (an empty cache) for each run."""
    from minikv.bench.vllm_peer import HOW_TO_GET_IT, Worker, python
    from minikv.models import smollm2_dir

    if python() is None:
        return HOW_TO_GET_IT
    if model_name != "smollm2-135m":
        return "it runs only on the converted SmolLM2 folder here"
    longest = max(len(r.prompt) + r.max_tokens for r in requests)
    return Worker({"model_dir": str(smollm2_dir()), "max_model_len": max(1024, longest)})


def plot(results: dict, llm, path: str) -> None:
    import matplotlib.pyplot as plt

    fig, (bars, timeline) = plt.subplots(1, 2, figsize=(12, 4))
    names = list(results)
    bars.bar(names, [results[k]["tokens_per_s"] for k in names], color=["#999", "#69c", "#e73", "#5a5"][: len(names)])
    bars.set_ylabel("useful tokens / s")
    bars.set_title("throughput, same workload")
    stats = llm.engine.stats(history=None).steps
    steps = [s.step for s in stats]
    timeline.plot(steps, [s.blocks_used for s in stats], label="blocks used")
    timeline.plot(steps, [s.num_running for s in stats], label="running")
    timeline.plot(steps, [s.num_waiting for s in stats], label="waiting")
    timeline.set_xlabel("engine step")
    timeline.set_title("minikv occupancy")
    timeline.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


def cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minikv bench engine", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m",
                        help="smollm2-135m (default), tiny-random-llama, or a Hub id")
    parser.add_argument("--n", type=int, default=48, help="number of requests (default 48)")
    parser.add_argument("--seed", type=int, default=7, help="workload seed (default 7)")
    parser.add_argument("--quick", action="store_true", help="a small run: 8 requests, shorter outputs")
    parser.add_argument("--systems", default="static,continuous,minikv",
                        help="comma-separated subset of static,continuous,minikv")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object")
    parser.add_argument("--profile", action="store_true",
                        help="also run minikv once more with timers and print where a step's time goes")
    parser.add_argument("--vllm", action="store_true",
                        help="also run vLLM's CPU build (.venv-vllm, from `make vllm`) in a subprocess")
    parser.add_argument("--ablate", action="store_true",
                        help="also run minikv with each speed lever switched off, back to back (what each is worth)")
    parser.add_argument("--linears", choices=["measure", "eager", "onednn", "mkl"], default=None,
                        help="minikv's linear path (default: $MINIKV_LINEAR, else measured fastest on this host)")
    parser.add_argument("--compile", action="store_true",
                        help="also run minikv with compile=True (torch.compile of every step; its start-up printed)")
    parser.add_argument("--decode-graphs", action="store_true",
                        help="also run minikv with decode_graphs=True (CUDA graphs on a GPU; on a CPU the same "
                             "plan, run eagerly)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="time each system this many times and report the median and the spread (default 1)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                        help="the model's dtype for every system (default float32, the parity path)")
    parser.add_argument("--micro", action="store_true",
                        help="only the linear microbenchmark (same as `python -m minikv bench linear`)")
    parser.add_argument("--plot", nargs="?", const="bench_engine.png", default=None,
                        help="save throughput bars and minikv's occupancy timeline (default bench_engine.png)")
    args, rest = parser.parse_known_args(argv)
    if args.micro:
        from minikv.bench.linear import cli as micro

        return micro(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(systems) - {"static", "continuous", "minikv"}
    if unknown or not systems:
        parser.error(f"--systems takes static, continuous, minikv; got {args.systems!r}")
    if args.n < 1:
        parser.error("--n must be >= 1")
    if args.repeat < 1:
        parser.error("--repeat must be >= 1")

    from minikv.models import load_model

    model, tokenizer = load_model(args.model)
    model = model.to(getattr(torch, args.dtype))
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    config = model.config
    bos = config.bos_token_id if config.bos_token_id is not None else 1
    pad = config.pad_token_id if config.pad_token_id is not None else 0
    n = 8 if args.quick and args.n == 48 else args.n
    requests = make_workload(n, args.seed, vocab_size=config.vocab_size, bos=bos,
                             output_median=12 if args.quick else 32, output_range=(4, 32) if args.quick else (8, 128))
    warmup = make_workload(2, args.seed + 1, vocab_size=config.vocab_size, bos=bos, output_median=4,
                           output_range=(2, 4))
    useful = sum(r.max_tokens for r in requests)
    if not args.json:
        print(f"workload: {n} requests, seed {args.seed}, {sum(len(r.prompt) for r in requests)} prompt tokens, "
              f"{useful} requested output tokens; model {args.model} ({args.dtype}) on {model.device}, "
              f"{torch.get_num_threads()} torch threads")

    results, outputs, llm, startup = {}, {}, None, {}
    runs = {"static": lambda: run_static(model, requests, pad),
            "continuous": lambda: run_continuous(model, requests, pad)}
    warmups = {"static": lambda: run_static(model, warmup, pad),
               "continuous": lambda: run_continuous(model, warmup, pad)}
    minikv_args = {"minikv": {"linears": args.linears},
                   **({"minikv+compile": {"compile": True, "linears": args.linears}} if args.compile else {}),
                   **({"minikv+graphs": {"decode_graphs": True}} if args.decode_graphs else {})}
    last_llm = {}

    def minikv_run(name: str, engine_args: dict, workload: list[Request]):
        seconds, tokens, last_llm[name] = run_minikv(model, tokenizer, workload, **engine_args)
        return seconds, tokens

    for name, engine_args in minikv_args.items():
        runs[name] = lambda name=name, engine_args=engine_args: minikv_run(name, engine_args, requests)
        warmups[name] = lambda name=name, engine_args=engine_args: minikv_run(name, engine_args, warmup)

    def show(name: str, timings: list[float], extra: str = "") -> None:
        seconds = sorted(timings)[(len(timings) - 1) // 2]
        results[name] = {"seconds": seconds, "tokens_per_s": useful / seconds, "runs": timings}
        if not args.json:
            spread = (f"  (runs {min(timings):.2f}-{max(timings):.2f} s, median of {len(timings)})"
                      if len(timings) > 1 else "")
            print(f"  {name:<15} {seconds:8.2f} s  {useful / seconds:8.1f} useful tokens/s{spread}{extra}", flush=True)

    # transformers' systems one after the other; minikv's and vLLM alternating, run by run (see interleaved)
    for name in [s for s in systems if s not in minikv_args]:
        warmups[name]()
        seconds, timings, (outputs[name], *rest) = median_of_runs(runs[name], args.repeat)
        show(name, timings)
    paired = [s for s in systems if s in minikv_args] + list(minikv_args)[1:]
    for name in paired:
        run_minikv.startup_seconds = None
        warmups[name]()
        startup[name] = run_minikv.startup_seconds  # the first construction: a compile, if any, happens here
    with contextlib.ExitStack() as stack:
        worker = vllm_worker(args.model, requests) if args.vllm else None
        if isinstance(worker, str):
            print(f"  vllm: skipped ({worker})")
        elif worker is not None:
            stack.enter_context(worker)
            startup["vllm"] = worker.startup_s
            worker.generate([r.prompt for r in warmup], [r.max_tokens for r in warmup])
            runs["vllm"] = lambda: worker.generate([r.prompt for r in requests], [r.max_tokens for r in requests])
            paired.append("vllm")
        got = interleaved({name: runs[name] for name in paired}, args.repeat)
    for name, calls in got.items():
        outputs[name] = calls[-1][1]
        show(name, [seconds for seconds, _ in calls],
             f"; start-up {startup['vllm']:.0f} s" if name == "vllm" else "")
    llm = last_llm.get("minikv")

    reference = "static" if "static" in outputs else ("continuous" if "continuous" in outputs else None)
    report = {"model": args.model, "device": str(model.device), "requests": n, "seed": args.seed,
              "levers": last_llm["minikv"].engine.speed_levers() if "minikv" in last_llm else None,
              "useful_tokens": useful, "systems": results}
    if "minikv" in results:
        for other in ("static", "continuous"):
            if other in results:
                report[f"minikv_vs_{other}"] = results["minikv"]["tokens_per_s"] / results[other]["tokens_per_s"]
        if reference:
            report["identical_to_transformers"] = sum(a == b for a, b in zip(outputs["minikv"], outputs[reference]))
            report["reference"] = reference
    for variant in list(minikv_args)[1:]:  # minikv+compile, minikv+graphs
        for other in ("static", "continuous"):
            if other in results:
                report[f"{variant}_vs_{other}"] = results[variant]["tokens_per_s"] / results[other]["tokens_per_s"]
        if reference:
            report[f"{variant}_identical_to_transformers"] = sum(
                a == b for a, b in zip(outputs[variant], outputs[reference]))
    if "vllm" in results:
        for mine in minikv_args:
            if mine in results:  # run by run: each ratio compares two runs made seconds apart
                ratio, each = paired_ratio(results[mine]["runs"], results["vllm"]["runs"])
                report[f"{mine}_vs_vllm"], report[f"{mine}_vs_vllm_runs"] = ratio, each
                # the target's condition, shown whether or not a transformers reference ran beside them
                report[f"{mine}_identical_to_vllm"] = sum(a == b for a, b in zip(outputs[mine], outputs["vllm"]))
        if reference:
            report["vllm_identical_to_transformers"] = sum(a == b for a, b in zip(outputs["vllm"], outputs[reference]))
    report["startup_seconds"] = startup
    if "static" in outputs and "continuous" in outputs:
        report["continuous_identical_to_static"] = sum(a == b for a, b in zip(outputs["continuous"], outputs["static"]))
    if model.device.type == "cuda":
        report["decode_step_seconds"] = decode_step_times(model)
    if llm is not None:
        stats = llm.engine.stats(history=None).steps
        report["minikv_steps"] = len(stats)
        report["minikv_mean_batch_tokens"] = sum(s.tokens_scheduled for s in stats) / max(len(stats), 1)

    if args.ablate:
        report["ablation"] = {}
        for lever, off in LEVERS.items():
            run_minikv(model, tokenizer, warmup, **off)  # timed as the systems are: warm-up, median of --repeat
            seconds, timings, (out, _) = median_of_runs(
                lambda off=off: run_minikv(model, tokenizer, requests, **off), args.repeat)
            same = sum(a == b for a, b in zip(out, outputs[reference])) if reference else None
            report["ablation"][lever] = {"seconds": seconds, "tokens_per_s": useful / seconds, "identical": same,
                                         "runs": timings}
            if not args.json:
                print(f"  minikv without {lever:<28} {seconds:8.2f} s  {useful / seconds:8.1f} useful tokens/s"
                      + (f"  identical {same}/{n}" if same is not None else ""), flush=True)

    if args.profile:
        report["profile"] = profile_minikv(model, tokenizer, requests)
        if args.ablate:
            for lever, off in LEVERS.items():
                report[f"profile_without_{lever}"] = profile_minikv(model, tokenizer, requests, **off)

    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print()
        print(f"{'system':<16}{'seconds':>10}{'tokens/s':>12}")
        for name, r in results.items():
            print(f"{name:<16}{r['seconds']:>10.2f}{r['tokens_per_s']:>12.1f}")
        for mine in minikv_args:
            for other in ("static", "continuous", "vllm"):
                if report.get(f"{mine}_vs_{other}"):
                    each = report.get(f"{mine}_vs_{other}_runs", [])
                    print(f"{mine} / {other}: {report[f'{mine}_vs_{other}']:.2f}x" + (
                        f" (the median of {len(each)} runs side by side: {', '.join(f'{r:.2f}' for r in each)})"
                        if len(each) > 1 else ""))
        for mine in minikv_args:
            if f"{mine}_identical_to_vllm" in report:
                print(f"{mine} outputs identical to vLLM's: {report[f'{mine}_identical_to_vllm']} of {n}")
        if "vllm_identical_to_transformers" in report:
            print(f"vLLM outputs identical to transformers ({reference}): "
                  f"{report['vllm_identical_to_transformers']} of {n}")
        for name, seconds in startup.items():
            print(f"start-up of {name} (engine construction, before the first request): {seconds:.1f} s")
        if report["levers"]:
            print("minikv's " + report["levers"])
        if "identical_to_transformers" in report:
            print(f"minikv outputs identical to transformers ({reference}): "
                  f"{report['identical_to_transformers']} of {n}")
        for variant in list(minikv_args)[1:]:
            if f"{variant}_identical_to_transformers" in report:
                print(f"{variant} outputs identical to transformers ({reference}): "
                      f"{report[f'{variant}_identical_to_transformers']} of {n}")
        if "continuous_identical_to_static" in report:
            print(f"continuous batching outputs identical to static generate: "
                  f"{report['continuous_identical_to_static']} of {n}")
        if "minikv_steps" in report:
            print(f"minikv: {report['minikv_steps']} engine steps, "
                  f"{report['minikv_mean_batch_tokens']:.1f} tokens per step on average")
        for batch, seconds in report.get("decode_step_seconds", {}).items():
            print(f"decode step at batch {batch}: {seconds * 1e3:.2f} ms")
        if "profile" in report:
            profiles = {"minikv": report["profile"]}
            profiles.update({f"without {k}": report[f"profile_without_{k}"] for k in LEVERS
                             if f"profile_without_{k}" in report})
            print(f"\nprofile: where a step's time goes, ms per step ({report['profile']['steps']} steps)")
            print(f"  {'':<48}" + "".join(f"{name:>30}" for name in profiles))
            for what in report["profile"]["ms_per_step"]:
                print(f"  {what:<48}" + "".join(f"{p['ms_per_step'][what]:>30.2f}" for p in profiles.values()))
            print(f"  {'total':<48}" + "".join(f"{1e3 * p['seconds'] / p['steps']:>30.2f}"
                                                for p in profiles.values()))
    if args.plot and llm is not None:
        plot(results, llm, args.plot)
    return 0
