"""`python -m minikv bench wobble`: what makes a served stream stall between two tokens, measured with controls.

Seed 000 says "latency wobbles under load are often evictions". Three things can stall a stream: an
**eviction** (the victim's blocks are freed; it waits, then its prompt and output are computed again),
**prefill interference** (a step that prefills another request's whole prompt makes every running stream
wait for it) and **queueing** (which delays the first token, not the gaps after it). To tell them apart, the
same seeded Poisson load runs against four `minikv serve` processes that differ in one thing each:

* the pool: ``num_blocks`` (it evicts under this load), or room for every tenant at its longest at once
  (it never does);
* the prefill: whole prompts in one step, or chunked (at most ``chunk`` prompt tokens a step: stage 6's
  ``--max-num-batched-tokens`` and ``--long-prefill-token-threshold``).

Each run gives a row: the requests' largest gap (p50, p90), ITL p99, TTFT p50/p90, output tokens/s, and from
the engine's own per-step record (``/landlord/steps``) the evictions and the largest prefill in one step.
Over several seeds a row is their mean, with the spread. Notebook 07 runs this with one seed; README's
claims row is ``python -m minikv claims --slow`` running it with three (``minikv.bench.claims``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
from dataclasses import asdict, dataclass

import numpy as np

POOLS = ("evicts", "never evicts")
PREFILLS = ("no chunking", "chunked")
EFFECT = 1.5   # a ratio of largest-gap p90s at least this is called a cause in the verdict (stated, not fitted)


@dataclass
class Wobble:
    """The load and the four servers' shared flags."""
    model: str = "smollm2-135m"
    n: int = 12               # requests a run
    prompt: int = 128         # longest prompt (lengths from the course's chat trace, cut here)
    output: int = 24          # longest answer
    block_size: int = 16
    num_blocks: int = 32      # the pool that evicts under this load
    max_seqs: int = 16
    chunk: int = 32           # prompt tokens a step, chunked
    threads: int = 1          # the server's torch threads: one core for it, one for the clients

    def roomy(self) -> int:
        """Blocks for every request at its longest, all at once: a pool that cannot evict."""
        return self.n * (math.ceil((self.prompt + self.output) / self.block_size) + 1)


def flags(w: Wobble, pool: str, prefill: str) -> list[str]:
    """`minikv serve`'s flags for one of the four configurations; they differ in the pool and the prefill only."""
    blocks = w.num_blocks if pool == "evicts" else w.roomy()
    step = (["--max-num-batched-tokens", str(2 * w.chunk), "--long-prefill-token-threshold", str(w.chunk)]
            if prefill == "chunked" else ["--no-enable-chunked-prefill", "--max-num-batched-tokens", "2048"])
    return ["--model", w.model, "--block-size", str(w.block_size), "--num-blocks", str(blocks),
            "--max-num-seqs", str(w.max_seqs), "--threads", str(w.threads), *step]


def row(rep: dict, steps: list[dict]) -> dict:
    """One run's figures: the client's report (`minikv.bench.serve.report`) and the engine's step rows."""
    per = rep["wobble"]["per_request"]
    gaps = [p["max_itl_ms"] for p in per]
    hit = [p["max_itl_ms"] for p in per if p["preemptions"]]
    return {"gap p50": float(np.percentile(gaps, 50)), "gap p90": float(np.percentile(gaps, 90)),
            "ITL p99": rep["itl_ms"]["p99"], "TTFT p50": rep["ttft_ms"]["p50"], "TTFT p90": rep["ttft_ms"]["p90"],
            "tok/s": rep["output_throughput"], "evictions": sum(s["preemptions"] for s in steps),
            "victims": len(hit), "victim gap": statistics.fmean(hit) if hit else math.nan,
            "largest prefill": max(s["prefill_tokens"] for s in steps)}


async def measure(w: Wobble, rate: float, seeds: list[int], timeout: float = 600) -> dict:
    """{(pool, prefill): [a row per seed]}: the four servers load side by side, then take the load one at a time
    (alone on the machine), each stopped when its runs are done."""
    import httpx

    from minikv.bench.serve import launch_server, make_requests, report, run_load, stop_server, wait_healthy

    keys = [(p, f) for p in POOLS for f in PREFILLS]
    servers = {k: launch_server(flags(w, *k)) for k in keys}
    runs: dict = {}
    try:
        for k in keys:
            proc, url = servers[k]
            wait_healthy(proc, url)
            info = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]
            for seed in seeds:
                mark = httpx.get(f"{url}/landlord/steps", params={"since": -1}).json()["last"]
                reqs = make_requests(w.n, seed, info.get("vocab_size", 32000), info.get("max_model_len", 2048),
                                     w.prompt, w.output, 0)
                rep = report(await run_load(url, info["id"], reqs, rate, seed, timeout), rate, math.inf, math.inf)
                if rep["completed"] != w.n:
                    raise RuntimeError(f"{k}: {rep['completed']} of {w.n} requests finished: {rep['errors']}")
                steps = httpx.get(f"{url}/landlord/steps", params={"since": mark}).json()["steps"]
                runs.setdefault(k, []).append(row(rep, steps))
            stop_server(proc)
    finally:
        for proc, _ in servers.values():
            stop_server(proc)
    return runs


def summarize(runs: dict) -> dict:
    """{key: {column: (mean, low, high)}} over the seeds (nan where no run had a victim)."""
    out = {}
    for k, rs in runs.items():
        cols = {}
        for c in rs[0]:
            v = np.array([r[c] for r in rs], dtype=float)
            cols[c] = (np.nan,) * 3 if np.isnan(v).all() else (np.nanmean(v), np.nanmin(v), np.nanmax(v))
        out[k] = cols
    return out


def effects(table: dict) -> dict:
    """Ratios of largest-gap p90 between rows that differ in one thing: the evictions' effect at each prefill,
    and the prefill's (whole prompts against chunks) on each pool."""
    def p90(pool, prefill):
        return table[pool, prefill]["gap p90"][0]
    return {"evictions": {f: p90("evicts", f) / p90("never evicts", f) for f in PREFILLS},
            "prefill": {p: p90(p, "no chunking") / p90(p, "chunked") for p in POOLS}}


def verdict(fx: dict) -> str:
    """What the table says about "latency wobbles under load are often evictions"."""
    evict = max(fx["evictions"].values()) >= EFFECT
    prefill = fx["prefill"]["never evicts"] >= EFFECT     # measured on the pool with no evictions at all
    if evict and prefill:
        return "qualified"     # evictions are one cause; prefill interference is another, without any eviction
    return "reproduced" if evict else "differs"


def lines(w: Wobble, rate: float, seeds: list[int], runs: dict, table: dict) -> list[str]:
    cols = list(next(iter(runs.values()))[0])
    many = len(seeds) > 1
    out = [f"{w.n} requests a run, Poisson at {rate:.2f}/s, prompts <= {w.prompt}, answers <= {w.output} tokens, "
           f"{w.model}; pools of {w.num_blocks} (evicts) and {w.roomy()} blocks (never evicts); chunks of {w.chunk}; "
           f"seeds {seeds}: {'mean (min-max)' if many else 'one run'}; ms, tok/s",
           f"{'pool':>13} {'prefill':>12} " + " ".join(f"{c:>15}" for c in cols)]
    for (pool, prefill), cells in table.items():
        shown = [("-" if np.isnan(m) else f"{m:.0f}" + (f" ({lo:.0f}-{hi:.0f})" if many else ""))
                 for m, lo, hi in cells.values()]
        out.append(f"{pool:>13} {prefill:>12} " + " ".join(f"{x:>15}" for x in shown))
    return out


def cli(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m minikv bench wobble", description=__doc__.splitlines()[0])
    d = Wobble()
    p.add_argument("--model", default=d.model)
    p.add_argument("--rate", type=float, default=2.5, help="requests/s, Poisson, the same on all four (default 2.5: "
                   "about notebook 07's 3/4 of its measured capacity on a quiet 2-core CPU)")
    p.add_argument("--seeds", default="0", help="comma list, e.g. 0,1,2: one run per seed on each server")
    for name in ("n", "prompt", "output", "num_blocks", "chunk", "threads"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name))
    p.add_argument("--json", action="store_true", help="print the runs, the table and the verdict as JSON")
    a = p.parse_args(argv)
    if not a.rate > 0:
        raise ValueError(f"--rate must be > 0 requests/s, got {a.rate}")
    w = Wobble(model=a.model, n=a.n, prompt=a.prompt, output=a.output, num_blocks=a.num_blocks, chunk=a.chunk,
               threads=a.threads)
    seeds = [int(s) for s in a.seeds.split(",")]
    runs = asyncio.run(measure(w, a.rate, seeds))
    table = summarize(runs)
    fx = effects(table)
    if a.json:
        print(json.dumps({"setup": asdict(w), "rate": a.rate, "seeds": seeds, "effects": fx, "verdict": verdict(fx),
                          "runs": {" / ".join(k): v for k, v in runs.items()},
                          "table": {" / ".join(k): v for k, v in table.items()}}))
        return 0
    print("\n".join(lines(w, a.rate, seeds, runs, table)))
    print(f"evictions (evicting pool / roomy pool): largest-gap p90 x{fx['evictions']['no chunking']:.1f} with whole "
          f"prompts, x{fx['evictions']['chunked']:.1f} with chunks; prefill interference (whole / chunked): "
          f"x{fx['prefill']['never evicts']:.1f} on the roomy pool, x{fx['prefill']['evicts']:.1f} on the evicting "
          f"one; verdict on 'wobbles are often evictions': {verdict(fx)}")
    return 0
