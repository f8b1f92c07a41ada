"""`python -m minikv bench wobble`: what makes a served stream stall between two tokens, measured with controls.

A common rule of thumb says "latency wobbles under load are often evictions"; in this course's words, the
rule is about **preemption** (a running request losing its blocks; here by recompute). Three things can stall a
stream: a **preemption** (the victim's blocks are freed; it waits, then its prompt and output are computed
again), **prefill interference** (a step that prefills another request's whole prompt makes every running
stream wait for it) and **queueing** (which delays the first token, not the gaps after it). To tell them apart,
the same seeded Poisson load runs against four `minikv serve` processes that differ in one thing each:

* the pool: ``num_blocks`` (it preempts under this load), or room for every tenant at its longest at once
  (it never does). Both have the same seats (``--max-num-seqs``, ``max_seqs``), so both run at most the same
  number of tenants at once: the roomy pool changes the blocks, not the batch;
* the prefill: whole prompts in one step, or chunked (at most ``chunk`` prompt tokens a step: stage 6's
  ``--max-num-batched-tokens`` and ``--long-prefill-token-threshold``).

The offered load is below capacity: ``load`` times the served rate of a burst of the same requests on the roomy,
chunked server (``--rate`` sets it instead). Each run gives a row: served rate, the engine's busy share (its steps'
time over the run's) and the share of steps with someone waiting, the requests' largest gap (p50, p90), ITL p99,
TTFT p50/p90, output tokens/s, from the engine's own per-step record (``/landlord/steps``) the preemptions and the
largest prefill in one step, and each request's largest gap by its index. The same seed sends the same requests
to all four servers, so a victim (a request preempted on the small pool) is compared with **the same request** on
the roomy pool with the same prefill: pairwise, seed by seed. Over several seeds a row is their mean, with the
spread (min-max). Notebook ``deep/07_wobble.ipynb`` runs a short version; README's claims row is
``python -m minikv claims --slow`` running ``WOBBLE_ARGS`` (``minikv.bench.claims``).

The keys of the JSON (``evicts`` / ``never evicts`` pools, the ``evictions`` column) are kept as earlier runs
recorded them; what is printed says preempt.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
from dataclasses import asdict, dataclass

import numpy as np

POOLS = ("evicts", "never evicts")   # JSON keys, kept as recorded; printed as LABEL says
PREFILLS = ("no chunking", "chunked")
SMALL, ROOMY = POOLS
LABEL = {SMALL: "preempts", ROOMY: "never preempts"}
PREEMPTED = "evictions"   # the row's column of preemptions (JSON key, kept as recorded)
SHOWN = {PREEMPTED: "preemptions"}
EFFECT = 1.5   # a ratio of largest-gap p90s at least this is called a cause in the verdict (stated, not fitted)


@dataclass
class Wobble:
    """The load and the four servers' shared flags."""
    model: str = "smollm2-135m"
    n: int = 12               # requests a run
    prompt: int = 128         # longest prompt (lengths from the course's chat trace, cut here)
    output: int = 24          # longest answer
    block_size: int = 16
    num_blocks: int = 24      # the pool that preempts under this load
    max_seqs: int = 4         # seats, the same on both pools: the same number of tenants at most
    chunk: int = 32           # prompt tokens a step, chunked
    threads: int = 1          # the server's torch threads: one core for it, one for the clients

    def roomy(self) -> int:
        """Blocks for every request at its longest, all at once: a pool that cannot preempt."""
        return self.n * (math.ceil((self.prompt + self.output) / self.block_size) + 1)


def flags(w: Wobble, pool: str, prefill: str) -> list[str]:
    """`minikv serve`'s flags for one of the four configurations; they differ in the pool and the prefill only."""
    blocks = w.num_blocks if pool == SMALL else w.roomy()
    step = (["--max-num-batched-tokens", str(2 * w.chunk), "--long-prefill-token-threshold", str(w.chunk)]
            if prefill == "chunked" else ["--no-enable-chunked-prefill", "--max-num-batched-tokens", "2048"])
    return ["--model", w.model, "--block-size", str(w.block_size), "--num-blocks", str(blocks),
            "--max-num-seqs", str(w.max_seqs), "--threads", str(w.threads), *step]


def row(rep: dict, steps: list[dict], results: list) -> dict:
    """One run's figures: the client's report (`minikv.bench.serve.report`), the engine's step rows and the
    client's results in request order (for the pairwise comparison: ``per_request``)."""
    per = [{"max_itl_ms": 1e3 * max(r.itls) if len(r.chunk_times) > 1 else math.nan,
            "preemptions": r.preemptions, "ttft_ms": 1e3 * r.ttft if r.ttft is not None else math.nan}
           for r in results]
    gaps = [p["max_itl_ms"] for p in per if not math.isnan(p["max_itl_ms"])]
    hit = [p["max_itl_ms"] for p in per if p["preemptions"] and not math.isnan(p["max_itl_ms"])]
    wall = rep["duration_s"]
    return {"served/s": rep["request_throughput"], "busy": sum(s["duration"] for s in steps) / wall,
            "waiting": statistics.fmean(s["num_waiting"] > 0 for s in steps) if steps else 0.0,
            "gap p50": float(np.percentile(gaps, 50)), "gap p90": float(np.percentile(gaps, 90)),
            "ITL p99": rep["itl_ms"]["p99"], "TTFT p50": rep["ttft_ms"]["p50"], "TTFT p90": rep["ttft_ms"]["p90"],
            "tok/s": rep["output_throughput"], PREEMPTED: sum(s["preemptions"] for s in steps),
            "victims": len(hit), "victim gap": statistics.fmean(hit) if hit else math.nan,
            "largest prefill": max(s["prefill_tokens"] for s in steps), "per_request": per}


async def _burst_rate(url: str, model: str, reqs, timeout: float) -> float:
    from minikv.bench.serve import report, run_load

    rep = report(await run_load(url, model, reqs, math.inf, 0, timeout), math.inf, math.inf, math.inf)
    if rep["completed"] != len(reqs):
        raise RuntimeError(f"the capacity burst: {rep['completed']} of {len(reqs)} finished: {rep['errors']}")
    return rep["request_throughput"]


async def measure(w: Wobble, rate: float | None, seeds: list[int], timeout: float = 600,
                  load: float = 0.7) -> tuple[dict, dict]:
    """({(pool, prefill): [a row per seed]}, {"rate", "capacity", "load"}): the four servers load side by side,
    then take the load one at a time (alone on the machine), each stopped when its runs are done. Without a
    `rate`, the offered rate is `load` x the capacity measured first on the roomy, chunked server."""
    import httpx

    from minikv.bench.serve import launch_server, make_requests, report, run_load, stop_server, wait_healthy

    keys = [(ROOMY, "chunked")] + [(p, f) for p in POOLS for f in PREFILLS if (p, f) != (ROOMY, "chunked")]
    servers = {k: launch_server(flags(w, *k)) for k in keys}
    runs: dict = {}
    offered = {"rate": rate, "capacity": None, "load": None}
    try:
        for k in keys:
            proc, url = servers[k]
            wait_healthy(proc, url)
            info = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]

            def requests(seed):
                return make_requests(w.n, seed, info.get("vocab_size", 32000), info.get("max_model_len", 2048),
                                     w.prompt, w.output, 0)
            if offered["rate"] is None:
                offered["capacity"] = await _burst_rate(url, info["id"], requests(seeds[0]), timeout)
                offered["rate"], offered["load"] = load * offered["capacity"], load
            for seed in seeds:
                mark = httpx.get(f"{url}/landlord/steps", params={"since": -1}).json()["last"]
                run = await run_load(url, info["id"], requests(seed), offered["rate"], seed, timeout)
                rep = report(run, offered["rate"], math.inf, math.inf)
                if rep["completed"] != w.n:
                    raise RuntimeError(f"{k}: {rep['completed']} of {w.n} requests finished: {rep['errors']}")
                steps = httpx.get(f"{url}/landlord/steps", params={"since": mark}).json()["steps"]
                runs.setdefault(k, []).append(row(rep, steps, run["results"]))
            stop_server(proc)
    finally:
        for proc, _ in servers.values():
            stop_server(proc)
    return {k: runs[k] for k in [(p, f) for p in POOLS for f in PREFILLS]}, offered


def columns(rows: list[dict]) -> list[str]:
    return [c for c, v in rows[0].items() if not isinstance(v, list)]


def summarize(runs: dict) -> dict:
    """{key: {column: (mean, low, high)}} over the seeds (nan where no run had a victim)."""
    out = {}
    for k, rs in runs.items():
        cols = {}
        for c in columns(rs):
            v = np.array([r[c] for r in rs], dtype=float)
            cols[c] = (np.nan,) * 3 if np.isnan(v).all() else (np.nanmean(v), np.nanmin(v), np.nanmax(v))
        out[k] = cols
    return out


def pairs(runs: dict) -> dict:
    """Each victim (a request preempted on the small pool) against the same request (same seed, same index) on
    the roomy pool with the same prefill: {prefill: {"requests" (pairs compared), "victims", "gap" and "same on
    roomy" (their mean largest gaps), "ratio" (median of the victims' ratios), "others ratio" (the same median for
    the requests not preempted), "ttft" and "ttft on roomy" (the victims' mean TTFT on each pool)}}."""
    out = {}
    for c in PREFILLS:
        ratios, rest, gaps, ttfts, n = [], [], [], [], 0
        for small, roomy in zip(runs[SMALL, c], runs[ROOMY, c]):
            for a, b in zip(small["per_request"], roomy["per_request"]):
                if math.isnan(a["max_itl_ms"]) or math.isnan(b["max_itl_ms"]) or b["max_itl_ms"] <= 0:
                    continue
                n += 1
                (ratios if a["preemptions"] else rest).append(a["max_itl_ms"] / b["max_itl_ms"])
                if a["preemptions"]:
                    gaps.append((a["max_itl_ms"], b["max_itl_ms"]))
                    ttfts.append((a["ttft_ms"], b["ttft_ms"]))

        def mean(xs):
            return statistics.fmean(xs) if xs else math.nan
        out[c] = {"requests": n, "victims": len(ratios), "gap": mean([a for a, _ in gaps]),
                  "same on roomy": mean([b for _, b in gaps]),
                  "ratio": statistics.median(ratios) if ratios else math.nan,
                  "others ratio": statistics.median(rest) if rest else math.nan,
                  "ttft": mean([a for a, _ in ttfts]), "ttft on roomy": mean([b for _, b in ttfts])}
    return out


def effects(table: dict) -> dict:
    """Ratios of largest-gap p90 between rows that differ in one thing: the preemptions' effect at each prefill
    (small pool over roomy pool), and the prefill's (whole prompts over chunks) on each pool."""
    def p90(pool, prefill):
        return table[pool, prefill]["gap p90"][0]
    return {"preemptions": {f: p90(SMALL, f) / p90(ROOMY, f) for f in PREFILLS},
            "prefill": {p: p90(p, "no chunking") / p90(p, "chunked") for p in POOLS}}


def verdict(fx: dict) -> str:
    """One word on "latency wobbles under load are often evictions" (preemptions, in this course's words)."""
    preempt = max(fx["preemptions"].values()) >= EFFECT
    prefill = fx["prefill"][ROOMY] >= EFFECT     # measured on the pool with no preemptions at all
    if preempt and prefill:
        return "qualified"     # preemptions are one cause; prefill interference is another, without any preemption
    return "reproduced" if preempt else "differs"


def verdict_words(fx: dict, paired: dict) -> str:
    """The verdict in a sentence a learner can read: which cause stretched the largest gap, by how much, and how
    many requests the preemptions touched."""
    p = max(fx["preemptions"].values())
    f = fx["prefill"][ROOMY]
    hit = {c: v for c, v in paired.items() if v["victims"]}
    seen = ("; ".join(f"{v['victims']} of {v['requests']} requests preempted with {c}, their own largest gap "
                      f"x{v['ratio']:.1f} the same request's on the roomy pool" for c, v in hit.items())
            if hit else "no request was preempted, so no victim could be compared")
    word = verdict(fx)
    if word == "qualified":
        return (f"both causes. Preemption stretched the p90 of the largest gaps x{p:.2f} ({seen}), and whole "
                f"prompts stretched it x{f:.2f} on a pool that never preempts. Wobbles are sometimes preemptions, "
                "and not only: prefill interference makes them without any preemption.")
    if word == "reproduced":
        return (f"preemption. It stretched the p90 of the largest gaps x{p:.2f} ({seen}); whole prompts changed it "
                f"only x{f:.2f} on a pool that never preempts. With few victims, a p90 over few requests is the few "
                "largest gaps: read the victims' own ratio before the p90's.")
    if f >= EFFECT:
        return (f"not preemption. Whole prompts stretched the p90 of the largest gaps x{f:.2f} on a pool that never "
                f"preempts, while the smaller pool changed it x{p:.2f} ({seen}). The wobble most requests feel here "
                "is prefill interference.")
    return (f"neither cause reached x{EFFECT:g} at this load: preemption x{p:.2f} ({seen}), whole prompts x{f:.2f}. "
            "The largest gaps here are the step time itself.")


def lines(w: Wobble, offered: dict, seeds: list[int], runs: dict, table: dict) -> list[str]:
    cols = columns(next(iter(runs.values())))
    many = len(seeds) > 1
    rate = offered["rate"]
    how = (f"{offered['load']:.0%} of the {offered['capacity']:.2f}/s a burst was served at"
           if offered.get("capacity") else "as given")
    out = [f"{w.n} requests a run, Poisson at {rate:.2f}/s ({how}), prompts <= {w.prompt}, answers <= {w.output} "
           f"tokens, {w.model}; {w.max_seqs} seats on both pools; pools of {w.num_blocks} (preempts) and "
           f"{w.roomy()} blocks (never preempts); chunks of {w.chunk}; seeds {seeds}: "
           f"{'mean (min-max)' if many else 'one run'}; ms, tok/s, shares of the run",
           f"{'pool':>14} {'prefill':>12} " + " ".join(f"{SHOWN.get(c, c):>15}" for c in cols)]

    def cell(c, m, lo, hi):
        if np.isnan(m):
            return "-"
        f = ".2f" if c in ("busy", "waiting", "served/s") else ".0f"
        return format(m, f) + (f" ({lo:{f}}-{hi:{f}})" if many else "")
    for (pool, prefill), cells in table.items():
        shown = [cell(c, *cells[c]) for c in cols]
        out.append(f"{LABEL[pool]:>14} {prefill:>12} " + " ".join(f"{x:>15}" for x in shown))
    return out


def pair_lines(paired: dict) -> list[str]:
    out = []
    for c, v in paired.items():
        if v["victims"]:
            out.append(f"{c}: {v['victims']} of {v['requests']} requests preempted over the seeds; their largest gap "
                       f"{v['gap']:.0f} ms (mean) against {v['same on roomy']:.0f} ms for the same requests on the "
                       f"roomy pool: x{v['ratio']:.1f} (median of the pairs), the others x{v['others ratio']:.1f}; "
                       f"the victims' TTFT {v['ttft']:.0f} ms against {v['ttft on roomy']:.0f} ms")
        else:
            out.append(f"{c}: no request was preempted on the small pool ({v['requests']} compared)")
    return out


def cli(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m minikv bench wobble", description=__doc__.splitlines()[0])
    d = Wobble()
    p.add_argument("--model", default=d.model)
    p.add_argument("--rate", type=float, help="requests/s, Poisson, the same on all four (default: --load x the "
                   "capacity measured first on the roomy, chunked server)")
    p.add_argument("--load", type=float, default=0.7, help="without --rate: the offered share of that capacity "
                   "(default 0.7: below capacity)")
    p.add_argument("--seeds", default="0", help="comma list, e.g. 0,1,2: one run per seed on each server (default 0)")
    for name in ("n", "prompt", "output", "num_blocks", "max_seqs", "chunk", "threads"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name))
    p.add_argument("--json", action="store_true", help="print the runs, the table and the verdict as JSON")
    a = p.parse_args(argv)
    if a.rate is not None and not a.rate > 0:
        raise ValueError(f"--rate must be > 0 requests/s, got {a.rate}")
    if not 0 < a.load:
        raise ValueError(f"--load must be > 0, got {a.load}")
    w = Wobble(model=a.model, n=a.n, prompt=a.prompt, output=a.output, num_blocks=a.num_blocks,
               max_seqs=a.max_seqs, chunk=a.chunk, threads=a.threads)
    seeds = [int(s) for s in a.seeds.split(",")]
    runs, offered = asyncio.run(measure(w, a.rate, seeds, load=a.load))
    table = summarize(runs)
    fx = effects(table)
    paired = pairs(runs)
    if a.json:
        print(json.dumps({"setup": asdict(w), "rate": offered["rate"], "offered": offered, "seeds": seeds,
                          "effects": fx, "pairs": paired, "verdict": verdict(fx),
                          "verdict_words": verdict_words(fx, paired),
                          "runs": {" / ".join(k): v for k, v in runs.items()},
                          "table": {" / ".join(k): v for k, v in table.items()}}))
        return 0
    print("\n".join(lines(w, offered, seeds, runs, table) + pair_lines(paired)))
    print(f"preemptions (small pool / roomy pool, same seats and prefill): largest-gap p90 "
          f"x{fx['preemptions']['no chunking']:.2f} with whole prompts, x{fx['preemptions']['chunked']:.2f} with "
          f"chunks; prefill interference (whole / chunked): x{fx['prefill'][ROOMY]:.2f} on the roomy pool, "
          f"x{fx['prefill'][SMALL]:.2f} on the small one")
    print(f"verdict on 'wobbles are often evictions' (preemptions): {verdict(fx)}: {verdict_words(fx, paired)}")
    return 0
