"""`python -m minikv bench serve`: real clients under real load, measured from the client's side.

In the shape of vLLM's serving benchmark (`vllm bench serve`): N requests arrive as a Poisson
process at ``--rate`` requests/s (``inf``: all at once), each a prompt of token ids (optionally
behind one shared "system prompt" of ``--shared-prefix`` tokens) with prompt and output lengths
drawn from the course's ShareGPT-shaped trace (`minikv.sim.traces`, clipped to
``--max-prompt-len`` / ``--max-output-len``). Every request streams (greedy, EOS ignored, so each
generates exactly its length) and the client records when each chunk of tokens arrived:

* **TTFT** (arrival to first token), **TPOT** ((e2e - TTFT) / (tokens - 1)), **ITL** (the gaps
  between chunks), **e2e latency**: mean, p50, p90, p99;
* **throughput**: requests/s and output tokens/s over the run; **goodput**: requests/s that met
  the stated objective (TTFT <= ``--slo-ttft`` and TPOT <= ``--slo-tpot``);
* from ``/metrics``, polled during the run: KV occupancy, requests running / waiting,
  preemptions and prefix-cache hits over time;
* **the wobble**: each request's largest inter-token gap against how often the engine preempted
  it (the server's ``minikv.preemptions`` field), their correlation, and how much of the ITL tail
  the preempted requests own. A pool small enough to preempt (``--num-blocks``) shows it;
* ``--profile``: where a served token's time goes, the server's per-step record joined with the
  client's clock (`minikv.bench.profile`): TPOT and TTFT split into measured terms.

``--url`` points it at a running server (loopback only); without it, it starts ``minikv serve``
itself on a free loopback port with the given engine flags and stops it afterwards.
``--rates 0.5,1,2`` runs the load at each rate (a sweep) and draws latency against offered load.
Bounded: ``--num-requests`` requests, ``--timeout`` seconds in all.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

import numpy as np

from minikv.bench.profile import (
    breakdown,
    compare_control,
    control_batches,
    offline_steps,
    print_breakdown,
    print_control,
    switch,
)
from minikv.config import add_engine_args, engine_flags

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
POLLED = {  # /metrics name -> our column
    "minikv:num_requests_running": "running", "minikv:num_requests_waiting": "waiting",
    "minikv:kv_cache_usage_perc": "kv_usage", "minikv:kv_blocks_used": "blocks_used",
    "minikv:num_preemptions_total": "preemptions_total", "minikv:prefix_cache_hits_total": "prefix_hits_total",
    "minikv:prefix_cache_queries_total": "prefix_queries_total",
}


@dataclass
class Result:
    """One request as the client saw it."""
    prompt_len: int
    output_len: int                     # asked for
    start: float = 0.0                  # when it was sent (perf_counter)
    status: int = 0                     # HTTP status (429: refused)
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    preemptions: int = 0
    cached_tokens: int = 0
    error: str | None = None
    stamps: list[dict] = field(default_factory=list)   # --profile: the server's stamp of each chunk in chunk_times
    server: dict | None = None                          # the server's own figures of it (the `minikv` field)

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and self.finish_reason in ("length", "stop")

    @property
    def tokens(self) -> int:
        return sum(self.chunk_tokens)

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def e2e(self) -> float | None:
        return self.chunk_times[-1] - self.start if self.chunk_times else None

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.tokens - 1) if self.tokens > 1 else None

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


def make_requests(n: int, seed: int, vocab_size: int, context: int, max_prompt: int, max_output: int,
                  shared_prefix: int, workload: str = "sharegpt") -> list[tuple[list[int], int]]:
    """n (prompt token ids, output length) pairs: lengths from the course's trace (or, ``fixed``, exactly
    ``max_prompt`` in and ``max_output`` out, as vLLM's benchmark's random dataset), random ids, one shared prefix."""
    from minikv.sim.traces import TraceRequest, make_trace

    if workload == "fixed":
        trace = [TraceRequest(i, 0, max_prompt, max_output) for i in range(n)]
    else:
        trace = make_trace(workload, n, seed=seed, rate=None, max_seq_len=2048)
    rng = np.random.default_rng(seed)
    low = min(100, vocab_size // 4)            # skip the special tokens at the start of the vocabulary
    prefix = rng.integers(low, vocab_size, shared_prefix).tolist()
    out = []
    for r in trace:
        plen = max(4, min(r.prompt_len, max_prompt))
        olen = max(2, min(r.output_len, max_output, context - shared_prefix - plen - 1))
        out.append((prefix + rng.integers(low, vocab_size, plen).tolist(), olen))
    return out


def pct(xs: list[float], scale: float = 1e3) -> dict:
    """mean / p50 / p90 / p99 in milliseconds (None when there is nothing to measure)."""
    if not xs:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    a = np.asarray(xs) * scale
    return {"mean": float(a.mean()), **{f"p{q}": float(np.percentile(a, q)) for q in (50, 90, 99)}}


def parse_metrics(text: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    row = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            name = s.name.replace("vllm:", "minikv:", 1)   # vLLM's names, as a dashboard would rename them
            if name in POLLED:
                row[POLLED[name]] = s.value
    return row


# -- the client ----------------------------------------------------------------------------------
async def one_request(client, url: str, model: str, prompt: list[int], max_tokens: int, res: Result) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    res.start = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            res.status = resp.status_code
            if resp.status_code != 200:
                res.error = (await resp.aread()).decode(errors="replace")[:300]
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = chunk["error"].get("message")
                    continue
                now = time.perf_counter()
                for c in chunk.get("choices", []):
                    n = len(c.get("token_ids") or [])
                    if n:
                        res.chunk_times.append(now)
                        res.chunk_tokens.append(n)
                        if "minikv_profile" in chunk:
                            res.stamps.append(chunk["minikv_profile"])
                    res.finish_reason = c.get("finish_reason") or res.finish_reason
                if "minikv" in chunk:
                    res.server = chunk["minikv"]
                    res.preemptions = chunk["minikv"].get("preemptions", 0)
                    res.cached_tokens = chunk["minikv"].get("cached_tokens", 0)
    except Exception as err:   # a dropped connection is a result too: reported, not raised
        res.error = f"{type(err).__name__}: {err}"


async def poll_metrics(client, url: str, t0: float, rows: list, every: float) -> None:
    while True:
        try:
            r = await client.get(f"{url}/metrics")
            rows.append({"t": time.perf_counter() - t0, **parse_metrics(r.text)})
        except Exception:   # the server may be busy for a moment: the next poll will tell
            pass
        await asyncio.sleep(every)


async def run_load(url: str, model: str, requests, rate: float, seed: int, timeout: float,
                   poll_every: float = 0.25, max_concurrency: int | None = None) -> dict:
    import httpx

    rng = np.random.default_rng(seed + 1)
    gaps = np.zeros(len(requests)) if math.isinf(rate) else rng.exponential(1.0 / rate, len(requests))
    results = [Result(len(p), o) for p, o in requests]
    limits = httpx.Limits(max_connections=len(requests) + 4, max_keepalive_connections=len(requests) + 4)
    gate = asyncio.Semaphore(max_concurrency or len(requests))
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=10), limits=limits) as client:
        rows: list = []
        t0 = time.perf_counter()
        poller = asyncio.create_task(poll_metrics(client, url, t0, rows, poll_every))

        async def launch(i):
            async with gate:
                await one_request(client, url, model, requests[i][0], requests[i][1], results[i])

        tasks = []

        async def drive():
            for i, gap in enumerate(gaps):
                await asyncio.sleep(gap)
                tasks.append(asyncio.create_task(launch(i)))
            await asyncio.gather(*tasks)

        try:
            await asyncio.wait_for(drive(), timeout)
        except asyncio.TimeoutError:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for r in results:
                if not r.ok and r.error is None:
                    r.error = f"unfinished after the {timeout:g} s limit"
        duration = time.perf_counter() - t0
        await asyncio.sleep(poll_every)            # one poll after the last request: the pool empties again
        poller.cancel()
    return {"results": results, "duration": duration, "timeline": rows}


# -- the report ----------------------------------------------------------------------------------
def wobble(results: list[Result]) -> dict:
    """Each request's largest inter-token gap against its preemptions: correlation and who owns the ITL tail."""
    done = [r for r in results if r.ok and len(r.chunk_times) > 1]
    gaps = [max(r.itls) for r in done]
    pre = [r.preemptions for r in done]
    corr = None
    if len(done) > 2 and np.std(gaps) > 0 and np.std(pre) > 0:
        corr = float(np.corrcoef(gaps, pre)[0, 1])
    hit = [g for g, p in zip(gaps, pre) if p > 0]
    miss = [g for g, p in zip(gaps, pre) if p == 0]
    tail = np.percentile(gaps, 90) if gaps else None
    in_tail = [p for g, p in zip(gaps, pre) if tail is not None and g >= tail]
    return {"requests_preempted": len(hit), "requests": len(done), "correlation_max_itl_vs_preemptions": corr,
            "max_itl_ms_preempted_mean": statistics.fmean(hit) * 1e3 if hit else None,
            "max_itl_ms_not_preempted_mean": statistics.fmean(miss) * 1e3 if miss else None,
            "tail_share_preempted": (sum(p > 0 for p in in_tail) / len(in_tail)) if in_tail else None,
            "per_request": [{"max_itl_ms": g * 1e3, "preemptions": p} for g, p in zip(gaps, pre)]}


def report(run: dict, rate: float, slo_ttft: float, slo_tpot: float) -> dict:
    results, duration, rows = run["results"], run["duration"], run["timeline"]
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.tokens for r in ok)
    good = [r for r in ok if r.ttft <= slo_ttft and (r.tpot is None or r.tpot <= slo_tpot)]
    timeline = {k: [row.get(k) for row in rows] for k in ("t", *POLLED.values())}
    first = rows[0] if rows else {}
    last = rows[-1] if rows else {}
    queried = (last.get("prefix_queries_total") or 0) - (first.get("prefix_queries_total") or 0)
    hits = (last.get("prefix_hits_total") or 0) - (first.get("prefix_hits_total") or 0)
    return {
        "rate": None if math.isinf(rate) else rate,
        "requests": len(results), "completed": len(ok),
        "refused_429": sum(r.status == 429 for r in results),
        "failed": sum(not r.ok and r.status != 429 for r in results),
        "errors": sorted({r.error for r in results if r.error and r.status != 429})[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + sum(r.prompt_len for r in ok)) / duration,
        "prompt_tokens": sum(r.prompt_len for r in ok), "output_tokens": out_tokens,
        "cached_tokens": sum(r.cached_tokens for r in ok),
        "ttft_ms": pct([r.ttft for r in ok]), "tpot_ms": pct([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": pct([g for r in ok for g in r.itls]), "e2e_ms": pct([r.e2e for r in ok]),
        "goodput": {"slo_ttft_ms": slo_ttft * 1e3, "slo_tpot_ms": slo_tpot * 1e3,
                    "requests_per_s": len(good) / duration, "fraction": len(good) / len(results) if results else 0},
        "preemptions": sum(r.preemptions for r in ok),
        "preemptions_server": (last.get("preemptions_total") or 0) - (first.get("preemptions_total") or 0),
        "peak_kv_usage": max((v for v in timeline["kv_usage"] if v is not None), default=None),
        "peak_running": max((v for v in timeline["running"] if v is not None), default=None),
        "peak_waiting": max((v for v in timeline["waiting"] if v is not None), default=None),
        "prefix_hit_rate": hits / queried if queried else None,
        "timeline": timeline,
        "wobble": wobble(results),
        "profile": breakdown(results, run["profile"]) if run.get("profile") is not None else None,
    }


def _ms(x) -> str:
    return "-" if x is None else f"{x:9.1f}"


def print_report(rep: dict, config: dict) -> None:
    rate = "inf (all at once)" if rep["rate"] is None else f"{rep['rate']:g} req/s"
    print(f"{'=' * 16} Serving Benchmark Result {'=' * 16}")
    print(f"model {config['model']}  rate {rate}  requests {rep['requests']}  shared prefix "
          f"{config['shared_prefix']} tokens")
    print(f"completed {rep['completed']}, refused (429) {rep['refused_429']}, failed {rep['failed']}"
          + (f"  errors: {rep['errors']}" if rep["errors"] else ""))
    print(f"duration {rep['duration_s']:.2f} s   requests/s {rep['request_throughput']:.2f}   output tokens/s "
          f"{rep['output_throughput']:.1f}   total tokens/s {rep['total_token_throughput']:.1f}")
    print(f"{'ms':<12}{'mean':>9}{'p50':>10}{'p90':>10}{'p99':>10}")
    for name, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms")):
        s = rep[key]
        print(f"{name:<12}{_ms(s['mean'])} {_ms(s['p50'])} {_ms(s['p90'])} {_ms(s['p99'])}")
    g = rep["goodput"]
    print(f"goodput {g['requests_per_s']:.2f} req/s ({g['fraction']:.0%} of requests met TTFT <= "
          f"{g['slo_ttft_ms']:g} ms and TPOT <= {g['slo_tpot_ms']:g} ms)")
    hit = "-" if rep["prefix_hit_rate"] is None else f"{rep['prefix_hit_rate']:.0%}"
    usage = "-" if rep["peak_kv_usage"] is None else f"{rep['peak_kv_usage']:.0%}"
    print(f"prompt tokens {rep['prompt_tokens']}, cached {rep['cached_tokens']} (prefix hit rate {hit}); "
          f"peak KV usage {usage}, peak running {rep['peak_running']}, peak waiting {rep['peak_waiting']}")
    w = rep["wobble"]
    corr = w["correlation_max_itl_vs_preemptions"]
    print(f"preemptions {rep['preemptions']} (server counter {rep['preemptions_server']:g}); "
          f"{w['requests_preempted']}/{w['requests']} requests preempted")
    if w["requests_preempted"]:
        print(f"wobble: largest inter-token gap {_ms(w['max_itl_ms_preempted_mean']).strip()} ms (mean) when "
              f"preempted vs {_ms(w['max_itl_ms_not_preempted_mean']).strip()} ms when not; correlation "
              f"{'-' if corr is None else f'{corr:.2f}'}; preempted requests own "
              f"{w['tail_share_preempted']:.0%} of the top-decile largest gaps")


def plot(reports: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    last = reports[-1]
    tl = last["timeline"]
    ax = axes[0]
    ax.plot(tl["t"], tl["kv_usage"], label="KV usage (fraction)")
    ax2 = ax.twinx()
    ax2.plot(tl["t"], tl["running"], "g--", label="running")
    ax2.plot(tl["t"], tl["waiting"], "r:", label="waiting")
    ax.set(xlabel="s", title="how full is the building (last run)")
    ax.legend(loc="upper left")
    ax2.legend(loc="upper right")
    w = last["wobble"]["per_request"]
    axes[1].scatter([r["preemptions"] for r in w], [r["max_itl_ms"] for r in w], alpha=0.6)
    axes[1].set(xlabel="preemptions of the request", ylabel="largest inter-token gap (ms)",
                title="who is being preempted: the wobble")
    if len(reports) > 1:
        rates = [r["rate"] or float("nan") for r in reports]
        for key, style in (("ttft_ms", "o-"), ("tpot_ms", "s-")):
            for q in ("p50", "p99"):
                axes[2].plot(rates, [r[key][q] for r in reports], style, label=f"{key[:4].upper()} {q}")
        axes[2].set(xlabel="offered load (requests/s)", ylabel="ms", yscale="log", title="latency vs load")
        axes[2].legend()
    else:
        axes[2].hist([g for r in w for g in [r["max_itl_ms"]]], bins=30)
        axes[2].set(xlabel="largest inter-token gap per request (ms)", title="ITL tail")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


# -- the server it may start ------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(server_args: list[str], wait: float = 300):
    """`python -m minikv serve` on a free loopback port; returns (process, url) once /health answers."""
    proc, url = launch_server(server_args)
    wait_healthy(proc, url, wait)
    return proc, url


def launch_server(server_args: list[str]):
    """Start `python -m minikv serve` on a free loopback port without waiting for it (start several at once).

    Its output goes to a temporary file (a pipe nobody reads could fill and stall it); `stop_server` returns it.
    """
    import tempfile

    port = free_port()
    cmd = [sys.executable, "-m", "minikv", "serve", "--host", "127.0.0.1", "--port", str(port), *server_args]
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
    proc.log = log
    return proc, f"http://127.0.0.1:{port}"


def wait_healthy(proc, url: str, wait: float = 300, name: str = "minikv serve") -> None:
    """Poll `url`/health until it answers 200; if the server exits or `wait` s pass, stop it and raise
    with the end of its log (`proc.log`, as `launch_server` sets it)."""
    import httpx

    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}:\n{stop_server(proc)[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{name} did not answer /health within {wait:g} s:\n{stop_server(proc)[-3000:]}")


def stop_server(proc, timeout: float = 30) -> str:
    """SIGTERM (a graceful stop), SIGKILL after `timeout` s; returns what the server printed."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    proc.log.seek(0)
    return proc.log.read()


# -- the command ------------------------------------------------------------------------------------
def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m minikv bench serve", description=__doc__.splitlines()[0])
    p.add_argument("--url", help="a running server (loopback only), e.g. http://127.0.0.1:8000; "
                                 "default: start `minikv serve` on a free port")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--rate", type=float, default=float("inf"), help="requests/s, Poisson (default inf: all at once)")
    p.add_argument("--rates", help="a sweep, e.g. 0.5,1,2,4: one run per rate against the same server")
    p.add_argument("--shared-prefix", type=int, default=0, help="tokens of one system prompt every request shares")
    p.add_argument("--max-prompt-len", type=int, default=256)
    p.add_argument("--max-output-len", type=int, default=64)
    p.add_argument("--workload", default="sharegpt", help="length model of minikv.sim.traces (sharegpt, alpaca), "
                                                          "or fixed: every prompt --max-prompt-len tokens, every "
                                                          "output --max-output-len (vLLM's random dataset)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft", type=float, default=2.0, help="goodput objective: TTFT seconds (default 2)")
    p.add_argument("--slo-tpot", type=float, default=0.2, help="goodput objective: TPOT seconds (default 0.2)")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most (default: all)")
    p.add_argument("--timeout", type=float, default=600, help="seconds for each run in all (default 600)")
    p.add_argument("--json", nargs="?", const="-", metavar="FILE", help="write the report as JSON (to stdout: -)")
    p.add_argument("--plot", metavar="PNG", help="draw occupancy, the wobble and (a sweep) latency vs load")
    p.add_argument("--profile", action="store_true",
                   help="also record the server's steps, engine thread and event loop (/debug/profile) and print "
                        "where a served token's time goes (minikv.bench.profile)")
    p.add_argument("--offline-control", action="store_true",
                   help="with --profile and a server it starts: after the run, time decode steps of the same model "
                        "and engine flags in this process, no server, at the batch sizes the run stepped most")
    v = p.add_argument_group("a peer (minikv.bench.against)")
    v.add_argument("--against", choices=("vllm",), help="run the same load against vLLM's server too, side by side")
    v.add_argument("--vllm-url", help="a running vLLM server (loopback); default: start one from .venv-vllm")
    v.add_argument("--vllm-wait", type=float, default=600, help="seconds to wait for vLLM's start (default 600)")
    v.add_argument("--client", choices=("minikv", "vllm"), default="minikv",
                   help="whose load generator: minikv's (default) or vLLM's own `vllm bench serve` (random dataset, "
                        "text prompts of --input-len tokens, --max-output-len out, EOS ignored), run from .venv-vllm")
    v.add_argument("--input-len", type=int, default=200, help="with --client vllm: prompt tokens (default 200)")
    v.add_argument("--rho", help="with --client vllm: rates as fractions of vLLM's capacity, measured first (all "
                                 "requests at once), e.g. 0.5,0.8; replaces --rate/--rates")
    v.add_argument("--rounds", type=int, default=1,
                   help="runs of each rate against each server, the order alternating (minikv first, then vLLM "
                        "first, ...), fresh prompts each round, the same for both servers; the median of the "
                        "rounds' ratios is printed: a shared machine's speed drifts within minutes")
    s = p.add_argument_group("the server it starts (without --url)")
    s.add_argument("--model", default="smollm2-135m")
    s.add_argument("--max-waiting", type=int)
    s.add_argument("--threads", type=int, help="torch CPU threads of the server (1 on a busy machine)")
    add_engine_args(s)   # the engine's own flags, as `minikv serve` takes them
    args = p.parse_args(argv)
    if args.num_requests < 1 or args.num_requests > 10_000:
        raise ValueError(f"--num-requests must be in [1, 10000], got {args.num_requests}")
    if args.url and urlparse(args.url).hostname not in LOOPBACK:
        raise ValueError(f"--url must be a loopback address ({', '.join(sorted(LOOPBACK))}); this load generator "
                         f"does not load other machines, got {args.url}")
    if args.offline_control and (not args.profile or args.url):
        raise ValueError("--offline-control needs --profile and a server bench serve starts itself (no --url): "
                         "it loads the same model with the same engine flags after stopping that server")
    if args.vllm_url and urlparse(args.vllm_url).hostname not in LOOPBACK:
        raise ValueError(f"--vllm-url must be a loopback address, got {args.vllm_url}")
    if not 1 <= args.rounds <= 20:
        raise ValueError(f"--rounds must be in [1, 20], got {args.rounds}")
    rates = [float(x) for x in args.rates.split(",")] if args.rates else [args.rate]
    if any(not r > 0 for r in rates):
        raise ValueError(f"rates must be > 0 requests/s (inf for all at once), got {rates}")
    return args, rates


def profiled_load(url: str, model: str, requests, rate: float, seed: int, args, profile: bool) -> dict:
    """`run_load`, with the server's profile switched on around it when `profile` (the run's "profile")."""
    if profile:
        switch(url, True)
    run = asyncio.run(run_load(url, model, requests, rate, seed, args.timeout, max_concurrency=args.max_concurrency))
    if profile:
        run["profile"] = switch(url, False)
    return run


def server_flags(args) -> list[str]:
    flags = ["--model", args.model]
    for name in ("max_waiting", "threads"):
        if getattr(args, name) is not None:
            flags += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return flags + engine_flags(args)


def cli(argv: list[str]) -> int:
    import httpx

    args, rates = parse_args(argv)
    if args.against:
        raise ValueError("--against runs through `python -m minikv bench serve --against vllm` "
                         "(minikv.bench.against.cli)")
    proc, url = (None, args.url.rstrip("/")) if args.url else start_server(server_flags(args))
    try:
        info = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]
        model, context, vocab = info["id"], info.get("max_model_len", 2048), info.get("vocab_size", 32000)
        config = {"url": url, "model": model, "num_requests": args.num_requests, "rates": rates,
                  "shared_prefix": args.shared_prefix, "max_prompt_len": args.max_prompt_len,
                  "max_output_len": args.max_output_len, "workload": args.workload, "seed": args.seed,
                  "server_flags": None if args.url else server_flags(args), "started_server": proc is not None}
        reports, controls = [], []
        for i, rate in enumerate(rates):
            requests = make_requests(args.num_requests, args.seed + i, vocab, context, args.max_prompt_len,
                                     args.max_output_len, args.shared_prefix, args.workload)
            run = profiled_load(url, model, requests, rate, args.seed + i, args, args.profile)
            rep = report(run, rate, args.slo_ttft, args.slo_tpot)
            reports.append(rep)
            if args.offline_control and rep.get("profile") is not None:
                controls.append(rep["profile"])
            if args.json != "-":
                print_report(rep, config)
                if rep.get("profile") is not None:
                    print_breakdown(rep["profile"])
        if controls:   # the server is stopped first: the control must not share the cores with it
            stop_server(proc)
            for prof in controls:
                prof["control"] = compare_control(prof, offline_steps(args, control_batches(prof),
                                                                      args.max_prompt_len))
                if args.json != "-":
                    print_control(prof)
        if len(reports) > 1 and args.json != "-":
            print(f"{'rate':>6}{'req/s':>8}{'tok/s':>8}{'TTFT p50':>10}{'p99':>9}{'TPOT p50':>10}{'p99':>8}"
                  f"{'ITL p99':>9}{'preempt':>9}")
            for r in reports:
                print(f"{r['rate'] or float('inf'):>6g}{r['request_throughput']:8.2f}{r['output_throughput']:8.1f}"
                      f"{_ms(r['ttft_ms']['p50'])} {_ms(r['ttft_ms']['p99'])}{_ms(r['tpot_ms']['p50'])}"
                      f"{_ms(r['tpot_ms']['p99'])}{_ms(r['itl_ms']['p99'])}{r['preemptions']:>9}")
        doc = {"config": config, "runs": reports}
        if args.json == "-":
            print(json.dumps(doc))
        elif args.json:
            with open(args.json, "w") as f:
                json.dump(doc, f)
            print(f"wrote {args.json}")
        if args.plot:
            plot(reports, args.plot)
    finally:
        if proc is not None:
            log = stop_server(proc)
            if proc.returncode not in (0, None) and os.environ.get("MINIKV_BENCH_QUIET") is None:
                print(f"minikv serve exited with {proc.returncode}:\n{log[-2000:]}", file=sys.stderr)
    return 0 if all(r["failed"] == 0 for r in reports) else 1

