"""``python -m minikv bench prefix``: what sharing KV blocks saves, replayed through the real block manager.

Parallel sampling (n = 2, 4, 6) and beam search (width 2, 4, 6) on the Alpaca- and ShareGPT-shaped
traces share blocks by fork and copy-on-write; conversations behind one ~1,000-token system prompt,
few-shot prompts and multi-turn chats share them through the prefix cache. Prints memory saved
(block-steps saved / block-steps unshared), prefill tokens skipped, block hit rate, and hit rate
against pool size (the eviction curve). ``--json`` prints one JSON object instead. A few seconds
on a CPU. See ``minikv.sim.sharing`` for the models and what each number means.
"""

from __future__ import annotations

import argparse
import json
import sys

from minikv.sim.sharing import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_NUM_BLOCKS,
    PAPER,
    beam_trace,
    expected_system_prompt_skip,
    few_shot_trace,
    multi_turn_trace,
    parallel_trace,
    replay,
    system_prompt_trace,
)

WIDTHS = (2, 4, 6)
RATES = {"alpaca": 1.0, "sharegpt": 0.05}  # arrivals per step: busy (the pool fills) without endless preemption
EVICTION_POOLS = (256, 512, 768, 1024, 1536, 2048)
SYSTEM_LEN, QUESTION = 1000, (50, 200)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m minikv bench prefix", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=100,
                   help="Alpaca-shaped requests per fork run and system-prompt conversations (ShareGPT and "
                        "multi-turn chats: a fifth as many; few-shot: twice; default 100)")
    p.add_argument("--num-blocks", type=int, default=DEFAULT_NUM_BLOCKS,
                   help=f"pool size in blocks (default {DEFAULT_NUM_BLOCKS}: 12 GiB of OPT-13B KV)")
    p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="tokens per block (default 16)")
    p.add_argument("--spread", type=float, default=1.0,
                   help="beam model: spread of the per-step confidence scale (0: no parameter at all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = p.parse_args(argv)
    for name in ("requests", "num_blocks", "block_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.spread < 0:
        p.error(f"--spread must be >= 0, got {args.spread}")
    return args


def run(args: argparse.Namespace) -> dict:
    chats = max(2, args.requests // 5)
    kw = dict(num_blocks=args.num_blocks, block_size=args.block_size, seed=args.seed)
    rows, fork = [], {"parallel": {}, "beam": {}}
    for workload, requests in (("alpaca", args.requests), ("sharegpt", max(1, args.requests // 5))):
        rate = RATES[workload]
        for kind in ("parallel", "beam"):
            fork[kind][workload] = {}
            for w in WIDTHS:
                if kind == "parallel":
                    jobs, label = parallel_trace(workload, w, requests, seed=args.seed, rate=rate), f"parallel n={w}"
                else:
                    jobs, label = beam_trace(workload, w, requests, seed=args.seed, rate=rate), f"beam width {w}"
                r = replay(jobs, f"{workload} {label}", enable_prefix_caching=False, spread=args.spread, **kw)
                fork[kind][workload][str(w)] = r.memory_saved
                rows.append({**r.summary(), "sharing": "fork"})
    prefix = {
        "system_prompt": replay(system_prompt_trace(args.requests, system_len=SYSTEM_LEN, question=QUESTION,
                                                    seed=args.seed),
                                f"system prompt {SYSTEM_LEN:,} + question {QUESTION[0]}-{QUESTION[1]}", **kw),
        "few_shot": replay(few_shot_trace(2 * args.requests, seed=args.seed), "few-shot (4 blocks of 300-600)", **kw),
        "multi_turn": replay(multi_turn_trace(chats, seed=args.seed), f"multi-turn chat ({chats} chats)", **kw),
    }
    rows += [{**r.summary(), "sharing": "prefix cache"} for r in prefix.values()]
    curve = []
    for n in EVICTION_POOLS:
        r = replay(multi_turn_trace(chats, seed=args.seed), f"{n} blocks", num_blocks=n, block_size=args.block_size,
                   seed=args.seed)
        curve.append({"num_blocks": n, "hit_rate": r.hit_rate, "prefill_skipped": r.prefill_skipped,
                      "evictions": r.evictions, "preemptions": r.preemptions})
    sp = prefix["system_prompt"]
    return {
        "parallel_sampling_saving": fork["parallel"]["alpaca"]["4"],
        "beam_search_saving": fork["beam"]["alpaca"]["4"],
        "parallel_sampling_savings": fork["parallel"],  # workload -> n -> fraction of block-steps saved
        "beam_search_savings": fork["beam"],            # workload -> width -> fraction
        "system_prompt_prefill_skipped": sp.prefill_skipped,
        "system_prompt_expected_skip": expected_system_prompt_skip(SYSTEM_LEN, sum(QUESTION) / 2, args.block_size),
        "system_prompt_memory_saved": sp.memory_saved,
        "hit_rate": sp.hit_rate,  # of the system-prompt trace's full prompt blocks, the fraction hit
        "few_shot_prefill_skipped": prefix["few_shot"].prefill_skipped,
        "multi_turn_prefill_skipped": prefix["multi_turn"].prefill_skipped,
        "eviction_curve": curve,  # multi-turn chat: block hit rate against pool size
        "rows": rows,
        "paper": {"parallel_sampling": PAPER["parallel"], "beam_search": PAPER["beam"],
                  "source": "Kwon et al. 2023, Fig. 15: OPT-13B, Alpaca trace, n / width 2-6"},
        "settings": {"requests": args.requests, "num_blocks": args.num_blocks, "block_size": args.block_size,
                     "spread": args.spread, "seed": args.seed, "rates": RATES,
                     "memory_saved": "sum over steps of blocks saved / sum of blocks unshared (block-steps)"},
    }


def table(report: dict) -> str:
    s = report["settings"]
    lines = [f"pool {s['num_blocks']} blocks of {s['block_size']} tokens; memory saved = block-steps saved by "
             "sharing / block-steps the same sequences take unshared", ""]
    head = f"{'trace':<44} {'sharing':<12} {'mem saved':>9} {'peak':>6} {'skipped':>8} {'hit rate':>8} " \
           f"{'COW':>6} {'preempt':>7}"
    lines.append(head)
    for r in report["rows"]:
        skip = "" if r["sharing"] == "fork" else f"{r['prefill_skipped']:.1%}"
        hit = "" if r["sharing"] == "fork" else f"{r['hit_rate']:.1%}"
        lines.append(f"{r['trace']:<44} {r['sharing']:<12} {r['memory_saved']:>9.1%} {r['peak_saved']:>6.1%} "
                     f"{skip:>8} {hit:>8} {r['cow_copies']:>6} {r['preemptions']:>7}")
    lines += ["", "eviction curve (multi-turn chat): pool blocks -> block hit rate (evictions)"]
    lines.append("  " + "  ".join(f"{c['num_blocks']}: {c['hit_rate']:.0%} ({c['evictions']})"
                                  for c in report["eviction_curve"]))
    p = report["paper"]
    lines += ["", f"Alpaca, n = 4: {report['parallel_sampling_saving']:.1%} saved; beam width 4: "
                  f"{report['beam_search_saving']:.1%} saved",
              f"paper ({p['source']}): parallel sampling {p['parallel_sampling'][0]:.1%}-"
              f"{p['parallel_sampling'][1]:.1%}, beam search {p['beam_search'][0]:.1%}-{p['beam_search'][1]:.1%}",
              f"system prompt: {report['system_prompt_prefill_skipped']:.1%} of prompt tokens skipped (a warm cache "
              f"skips {report['system_prompt_expected_skip']:.1%}: the prompt's full blocks)"]
    return "\n".join(lines)


def cli(argv: list[str]) -> int:
    args = parse_args(argv)
    report = run(args)
    print(json.dumps(report, indent=2) if args.json else table(report))
    return 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
