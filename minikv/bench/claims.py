"""`python -m minikv claims`: every claim the course checks, the published figure, ours, and how to see it.

The claims are common rules of thumb about serving (said as such: they have no one public source) and
published figures (the PagedAttention paper, Kwon et al., SOSP 2023, and vLLM's). Each row is measured by the
same code a benchmark runs, so the figure printed here is the figure that command prints:

* cheap rows are measured live, every time (stage 1's arithmetic, the memory simulator, the sharing
  replays: about a minute of CPU in all);
* rows that take minutes (the engine against ``transformers``, a server under load) are read from
  ``recorded.json`` beside this file, which says when and where they were measured and by which command;
  ``--slow`` measures them again (and ``--slow --record`` writes the file anew);
* rows that need a GPU say so, instead of inventing a figure.

README's claims table is this command's ``--markdown`` output; ``tests/test_claims.py`` fails when the two
disagree, so the table cannot drift from what the code measures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from datetime import date
from pathlib import Path

RECORDED = Path(__file__).with_name("recorded.json")


@dataclass
class Claim:
    key: str
    claim: str        # what is claimed, in the source's words (shortened)
    source: str       # who claims it
    published: str    # the published figure
    ours: str         # our figure, as a sentence fragment
    verdict: str      # "reproduced", "near", "differs", "not measured here", "qualified"
    command: str      # the command that prints our figure
    notebook: str     # where it is taught
    value: float | None = None  # the headline number, for tests and JSON


def _sizing_claims() -> list[Claim]:
    from minikv.sizing import fmt_bytes, kv_bytes_per_token, max_sequences, model_spec, weight_bytes

    llama7 = model_spec("llama-2-7b")
    per_token = kv_bytes_per_token(llama7)
    two_k = 2000 * per_token
    rows = [Claim("kv_per_token_7b", "a 7B model's KV cache is about half a megabyte per token; 2,000 tokens "
                  "about a gigabyte", "a common rule of thumb", "~0.5 MB/token; 2,000 tokens ~1 GB",
                  f"{fmt_bytes(per_token)}/token (Llama-2-7B, fp16); 2,000 tokens = {two_k / 1e9:.2f} GB",
                  "reproduced", "python -m minikv size llama-2-7b --context 2000", "01_bytes", per_token)]
    llama3 = model_spec("llama-3-8b")
    long_kv = 131072 * kv_bytes_per_token(llama3)
    weights = weight_bytes(llama3.num_params)
    rows.append(Claim("cache_dwarfs_weights", "for a long-context model the cache dwarfs the weights",
                      "a common rule of thumb",
                      "(qualitative)", f"one 128k-token conversation on Llama-3-8B holds {fmt_bytes(long_kv)} of KV, "
                      f"{long_kv / weights:.2f}x its {fmt_bytes(weights)} of weights; "
                      f"four such hold {4 * long_kv / weights:.1f}x",
                      "reproduced", "python -m minikv size llama-3-8b --context 131072 --gpu H100", "01_bytes",
                      long_kv / weights))
    short, long = (max_sequences(llama3, "H100", n) for n in (2048, 32768))
    rows.append(Claim("long_context_tenants", "long contexts are expensive because they are large tenants",
                      "a common rule of thumb", "(qualitative)",
                      f"an H100 holds {short} Llama-3-8B conversations of 2,048 tokens but {long} of 32,768: "
                      f"{short / max(long, 1):.0f}x fewer tenants, so each pays that much more",
                      "reproduced", "python -m minikv size llama-3-8b --context 32768 --gpu H100", "01_bytes",
                      short / max(long, 1)))
    # Decode is bandwidth-bound: a step reads all weights once, plus every tenant's K/V.
    batch, context = 32, 2000
    weights = weight_bytes(llama7.num_params)
    one = weights + context * per_token
    many = weights + batch * context * per_token
    speedup = batch * one / many
    rows.append(Claim("batch_is_throughput", "batch size is throughput, almost linearly",
                      "a common rule of thumb",
                      f"{batch} conversations ~ {batch}x", f"projected from stage 1's bytes (bandwidth-bound decode, "
                      f"the rule's own numbers: 7B, {batch} x {context:,} tokens): a step reads "
                      f"{fmt_bytes(weights)} of weights "
                      f"+ {fmt_bytes(batch * context * per_token)} of KV, so {batch} tenants give {speedup:.1f}x the "
                      "tokens/s of one, not 32x: batching shares the weights, never the KV reads",
                      "qualified", "python -m minikv claims", "06_continuous_batching", speedup))
    return rows


def _memory_claims() -> list[Claim]:
    from minikv.bench import memory

    report = memory.run(memory.parse_args(["--no-progress"]))
    contiguous, paged = report["contiguous_utilization"], report["paged_utilization"]
    tokens = report["simulated_tokens_per_s"]
    throughput = tokens["paged"] / tokens["contiguous_max"]
    concurrency = report["mean_concurrent_paged"] / report["mean_concurrent_contiguous"]
    lo, hi = 0.204, 0.382
    return [
        Claim("prior_utilization", "prior systems keep only 20.4-38.2% of KV memory holding tokens (60-80% waste)",
              "PagedAttention paper (Kwon et al., SOSP 2023)", "20.4%-38.2%",
              f"{contiguous:.1%} with max-length slabs (ShareGPT-shaped trace, OPT-13B on 12 GiB of KV)",
              "reproduced" if lo <= contiguous <= hi else "differs", "python -m minikv bench memory",
              "02_contiguous", contiguous),
        Claim("paged_waste", "with paging less than 4% is wasted, only in each sequence's last block", "vLLM",
              "< 4% (~96% used)", f"{1 - paged:.1%} wasted ({paged:.1%} used), same trace and budget",
              "reproduced" if paged > 0.96 else "differs", "python -m minikv bench memory", "03_paged", paged),
        Claim("paging_throughput", "paging multiplies throughput by 2-4x on the same hardware",
              "vLLM (Kwon et al., SOSP 2023)",
              "2-4x", f"{concurrency:.1f}x the concurrent sequences; {throughput:.1f}x the tokens/s in the simulator "
              "with prefill, recompute and slab copies charged (A100 model of stage 2)",
              "reproduced" if 2 <= throughput <= 4 else "near", "python -m minikv bench memory", "03_paged",
              throughput),
    ]


def _prefix_claims() -> list[Claim]:
    from minikv.bench import prefix

    r = prefix.run(prefix.parse_args([]))
    par, beam = r["parallel_sampling_saving"], r["beam_search_saving"]
    (plo, phi), (blo, bhi) = r["paper"]["parallel_sampling"], r["paper"]["beam_search"]

    def verdict(x, lo, hi):
        return "reproduced" if lo <= x <= hi else ("near" if lo - 0.02 <= x <= hi + 0.02 else "differs")

    return [
        Claim("parallel_sampling_saving", "parallel sampling shares the prompt's blocks", "vLLM paper, Fig. 15",
              f"{plo:.1%}-{phi:.1%} of KV memory saved (Alpaca, n = 2-6)", f"{par:.1%} at n = 4 (Alpaca-shaped)",
              verdict(par, plo, phi), "python -m minikv bench prefix", "05_prefix_sharing", par),
        Claim("beam_search_saving", "beams share their common history", "vLLM paper, Fig. 15",
              f"{blo:.1%}-{bhi:.1%} saved (Alpaca, width 2-6)", f"{beam:.1%} at width 4 (Alpaca-shaped)",
              verdict(beam, blo, bhi), "python -m minikv bench prefix", "05_prefix_sharing", beam),
        Claim("shared_walls", "prompt caching discounts are shared walls",
              "a common rule of thumb", "(qualitative)",
              f"{r['system_prompt_prefill_skipped']:.1%} of prompt tokens skipped and "
              f"{r['system_prompt_memory_saved']:.1%} of KV memory saved when 100 requests share a 1,000-token "
              "system prompt", "reproduced", "python -m minikv bench prefix", "05_prefix_sharing",
              r["system_prompt_prefill_skipped"]),
    ]


def _gpu_claims() -> list[Claim]:
    return [Claim("kernel_overhead", "a paged attention kernel is 20-26% slower than a contiguous one",
                  "vLLM paper", "20-26% slower", "needs a GPU: not measured on the machines this course was built on "
                  "(the kernel is proven correct under Triton's interpreter)", "not measured here",
                  "python -m minikv bench kernel", "04_triton_kernel")]


# ---- the slow rows: measured by their own commands, recorded with a date -----------------------------

def _run_json(args: list[str], timeout: float) -> dict:
    out = subprocess.run([sys.executable, "-m", "minikv", *args], capture_output=True, text=True, timeout=timeout)
    if out.returncode:
        raise RuntimeError(f"`python -m minikv {' '.join(args)}` failed: {out.stderr.strip()[-500:]}")
    return json.loads(out.stdout)


ENGINE_ARGS = ["bench", "engine", "--n", "16", "--json"]
WOBBLE_ARGS = ["bench", "wobble", "--seeds", "0,1,2", "--json"]


def _measure_engine() -> dict:
    r = _run_json(ENGINE_ARGS, timeout=3600)
    n = int(ENGINE_ARGS[ENGINE_ARGS.index("--n") + 1])
    return {"value": r["minikv_vs_static"],
            "ours": f"minikv {r['minikv_vs_static']:.2f}x transformers' static generate and "
                    f"{r['minikv_vs_continuous']:.2f}x its continuous batching (SmolLM2-135M, {n} requests, CPU); "
                    f"{r['identical_to_transformers']} of {n} outputs identical",
            "verdict": "reproduced" if r["minikv_vs_static"] >= 2 else "near"}


def _measure_wobble() -> dict:
    r = _run_json(WOBBLE_ARGS, timeout=3600)
    pre, pf = r["effects"]["preemptions"], r["effects"]["prefill"]
    hit = r["table"]["evicts / chunked"]          # the JSON's keys, as wobble records them: the preempting pool
    seen = [p for p in r["pairs"].values() if p["victims"]]
    victims = (f"each victim's own largest gap x{max(p['ratio'] for p in seen):.1f} the same request's on the roomy "
               "pool (median)" if seen else "no victim to pair")
    offered = r["offered"]
    return {"value": pre["chunked"],
            "ours": f"the same Poisson load ({r['setup']['n']} requests, {r['rate']:.2f}/s, "
                    f"{offered['load']:.0%} of the rate a burst was served at; seeds {r['seeds']}) on four servers "
                    f"with {r['setup']['max_seqs']} seats each: preemption multiplies the largest-gap p90 by "
                    f"{pre['chunked']:.1f} with chunked prefill and {pre['no chunking']:.1f} with whole prompts "
                    f"({hit['evictions'][0]:.0f} preemptions a run; {victims}); whole prompts multiply it by "
                    f"{pf['never evicts']:.1f} on a pool that never preempts (prefill interference, no preemption "
                    "at all); SmolLM2 through minikv serve, client-side timings",
            "verdict": r["verdict"]}


SLOW = {
    "engine_throughput": (
        Claim("engine_throughput", "continuous batching with paged memory multiplies throughput", "vLLM (2-4x)",
              "2-4x", "", "", "python -m minikv " + " ".join(ENGINE_ARGS[:-1]), "06_continuous_batching"),
        _measure_engine),
    "wobble_evictions": (
        Claim("wobble_evictions", "latency wobbles under load are often evictions (in this course's words, "
              "preemptions): someone's cache got reclaimed and must be recomputed", "a common rule of thumb",
              "(qualitative)", "", "",
              "python -m minikv " + " ".join(WOBBLE_ARGS[:-1]), "07_landlord"),
        _measure_wobble),
}


def slow_claims(measure: bool, only: str | None = None) -> tuple[list[Claim], dict]:
    recorded = json.loads(RECORDED.read_text()) if RECORDED.exists() else {}
    rows = []
    for key, (template, measure_fn) in SLOW.items():
        entry = recorded.get(key)
        if measure and only in (None, key):
            load = os.getloadavg()[0]  # timings move with what else runs: say how busy the machine was
            entry = measure_fn()
            entry = entry | {"ours": f"{entry['ours']}; load average {load:.1f} on {os.cpu_count()} CPUs",
                             "recorded": date.today().isoformat()}
            recorded[key] = entry
        if entry is None:
            rows.append(Claim(**{**asdict(template), "ours": "not recorded yet: run `python -m minikv claims --slow "
                                 "--record`", "verdict": "not measured here"}))
            continue
        rows.append(Claim(**{**asdict(template), "ours": f"{entry['ours']} (recorded {entry['recorded']})",
                             "verdict": entry["verdict"], "value": entry["value"]}))
    return rows, recorded


def all_claims(slow: bool = False, record: bool = False, only: str | None = None) -> list[Claim]:
    rows = _sizing_claims() + _memory_claims() + _prefix_claims() + _gpu_claims()
    slow_rows, recorded = slow_claims(slow, only)
    if record:
        RECORDED.write_text(json.dumps(recorded, indent=1) + "\n")
    return rows + slow_rows


def markdown(claims: list[Claim]) -> str:
    lines = ["| claim | source | published | ours | verdict | command | notebook |", "|---|---|---|---|---|---|---|"]
    for c in claims:
        lines.append(f"| {c.claim} | {c.source} | {c.published} | {c.ours} | {c.verdict} | `{c.command}` | "
                     f"`{c.notebook}` |")
    return "\n".join(lines)


def cli(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minikv claims", description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="one JSON list of claims")
    p.add_argument("--markdown", action="store_true", help="README's table")
    p.add_argument("--slow", action="store_true", help="also re-measure the rows that take minutes")
    p.add_argument("--record", action="store_true", help="with --slow: write those figures to recorded.json")
    p.add_argument("--only", choices=sorted(SLOW), help="with --slow: re-measure this row only")
    args = p.parse_args(argv)
    if args.record and not args.slow:
        p.error("--record writes what --slow measured: pass both")
    if args.only and not args.slow:
        p.error("--only picks which row --slow measures: pass both")
    claims = all_claims(slow=args.slow, record=args.record, only=args.only)
    if args.json:
        print(json.dumps([asdict(c) for c in claims], indent=1))
    elif args.markdown:
        print(markdown(claims))
    else:
        for c in claims:
            print(f"{c.claim}\n  {c.source}: {c.published}\n  ours: {c.ours}\n  [{c.verdict}] `{c.command}`, "
                  f"notebook {c.notebook}\n")
    return 0
