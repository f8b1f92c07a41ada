"""Command line: `python -m minikv demo | size | serve | bench | grade | exercises | claims`.

Each command is a thin shell over a module the course builds; see README for what each prints.
"""

from __future__ import annotations

import argparse
import signal
import sys

BENCHES = {  # name -> module in minikv.bench exposing cli(argv) -> int
    "memory": "Replay a request trace: KV memory utilization, contiguous slabs vs paged blocks.",
    "prefix": "Shared blocks: memory saved by parallel sampling, beam search and prefix caching; "
              "hit rate vs pool size.",
    "engine": "minikv's engine vs transformers generate and its continuous batching, same workload.",
    "serve": "Load test a running `minikv serve` (or one it starts): TTFT, TPOT, ITL, throughput, goodput, "
             "occupancy, preemptions and their latency wobble.",
    "wobble": "What stalls a served stream: the same Poisson load on four servers, a pool that preempts or never "
              "does x whole or chunked prefill; the largest gaps, victims paired, and a verdict in words.",
    "steps": "One step's cost, minikv vs vLLM's CPU build (--vllm), shape by shape: a prefill, decode at "
             "batches 1..8; --model depth30 for the fixed cost per step.",
    "hugepages": "Packed weights on huge pages against 4 KiB ones, in one process taking turns: oneDNN's matmuls "
                 "at 1/8/32 rows, and (--engine) two SmolLM2 engines, one moved.",
    "roofline": "This host's read bandwidth and fp32 matmul peak, measured in-process, and SmolLM2's step floors.",
    "sampling": "Drawing a step's sampled tokens: minikv's draw (one uniform number per row, walked along the "
                "cumulative distribution) vs torch.multinomial, rows 1..64.",
    "linear": "One matmul on SmolLM2's shapes: eager F.linear vs a oneDNN-prepacked weight, M = 1..2048 rows.",
    "ops": "A step's heavy operators, minikv's vs vLLM's CPU build's on the same tensors: each linear and a "
           "prompt's attention, summed over a forward.",
    "gpu_check": "Everything a lent GPU should confirm (kernel tests, parity, kernel and engine benches), one JSON.",
    "kernel": "The Triton paged-attention kernel: on a GPU its bandwidth vs peak and vs contiguous attention; "
              "--static on any machine: registers, spills and occupancy compiled for T4/A100/H100.",
    "notebooks": "Seconds each notebook takes top to bottom on this machine (nbclient, fresh kernel); --cells N.",
}


def cmd_size(args) -> int:
    from minikv.sizing import kv_bill, model_spec

    shape = model_spec(args.model)
    print(kv_bill(shape, args.context, args.gpu, dtype=args.dtype, weight_dtype=args.weight_dtype))
    return 0


def cmd_demo(args) -> int:
    from minikv.demo import run_demo

    return run_demo(args.model, args.max_tokens, args.num_prompts, args.kv_cache_memory)


def cmd_serve(args) -> int:
    from minikv.server.cli import exit_now, run_server

    exit_now(run_server(args))


def cmd_bench(args) -> int:
    import importlib

    which = args.which
    if which == "serve" and any(a == "--against" or a.startswith("--against=") for a in args.rest):
        which = "against"   # the same load against a peer's server: minikv.bench.against
    module = importlib.import_module(f"minikv.bench.{which}")
    # A bench starts servers and workers (minikv's, vLLM's, in sessions of their own): stopped with SIGTERM,
    # it must stop them as Ctrl-C does, through the `finally` blocks that started them, not leave them running.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    return module.cli(args.rest)


def cmd_grade(args) -> int:
    """Grade notebooks (or folders of them) in sandboxes; exit 0 only if every one scores 100%."""
    import csv
    import json
    from pathlib import Path

    from minikv.grading import print_report
    from minikv.grading.batch import grade_all

    paths = []
    for given in args.paths:
        p = Path(given)
        if p.is_dir():
            paths += sorted(q for q in p.rglob("*.ipynb") if ".ipynb_checkpoints" not in q.parts)
        elif p.exists():
            paths.append(p)
        else:
            raise OSError(f"{given}: no such file or folder")
    if not paths:
        raise ValueError(f"no notebooks found in {' '.join(args.paths)}")
    limits = {"timeout": args.timeout, "memory_gb": args.memory or None}
    reports = grade_all(paths, limits, args.jobs, progress=len(paths) > 1 and not args.quiet)
    if args.json:
        print(json.dumps([r.row() | {"results": [vars(c) for c in r.results], "notes": r.notes}
                          for r in reports], indent=1))
    elif len(reports) == 1:
        print_report(reports[0])
    else:
        width = max(len(r.path) for r in reports)
        print(next((r.isolation for r in reports if r.isolation), ""))
        for r in reports:
            row = r.row()
            print(f"{r.path:<{width}}  {r.exercise or '--':>2}  {row['score']:>5} ({row['percent']:>3}%)  "
                  f"{r.seconds:6.1f} s  {r.reason}")
    if args.csv:
        checks = list(dict.fromkeys(f"{r.exercise}: {c.name}" for r in reports for c in r.results))
        with open(args.csv, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["path", "exercise", "score", "passed", "total", "percent", "seconds", "reason", "notes",
                             *checks])
            for r in reports:  # notes: cells that raised, processes left running (a grader reads why)
                row, verdicts = r.row(), {f"{r.exercise}: {c.name}": c for c in r.results}
                writer.writerow([row[k] for k in ("path", "exercise", "score", "passed", "total", "percent",
                                                  "seconds", "reason")] + ["; ".join(r.notes)]
                                + [("PASS" if verdicts[c].passed else "FAIL") if c in verdicts else "" for c in checks])
    full = sum(r.full_marks for r in reports)
    if len(reports) > 1 and not args.json:
        print(f"{full}/{len(reports)} submissions with full marks")
    return 0 if full == len(reports) else 1


def cmd_claims(args) -> int:
    from minikv.bench.claims import cli

    return cli([f"--{k}" for k in ("json", "markdown", "slow", "record") if getattr(args, k)]
               + (["--only", args.only] if args.only else []))


def cmd_exercises(args) -> int:
    from minikv.grading import generate_exercises
    from minikv.lessons.build import generate_lessons

    stale = generate_exercises(check=args.check) + generate_lessons(check=args.check)
    for path in stale:
        print(("out of date: " if args.check else "wrote ") + str(path))
    if args.check and stale:
        print("exercises/ or a lesson is out of date with its source (solutions/, notebooks/answers/): "
              "run `make exercises`")
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    from minikv.sizing import GPUS, MODEL_CONFIGS

    parser = argparse.ArgumentParser(prog="python -m minikv", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="the engine serves chat prompts with SmolLM2 (offline); the landlord's report")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--max-tokens", type=int, default=48, help="tokens per answer (default 48)")
    p.add_argument("--num-prompts", type=int, default=8, help="conversations to serve, 1-8 (default 8)")
    p.add_argument("--kv-cache-memory", default="64MiB", help="the KV pool's size (default 64MiB)")
    p.set_defaults(fn=cmd_demo)

    p = sub.add_parser("size", help="the KV bill of a model at a context length, and what fits on a GPU")
    p.add_argument("model", help=f"one of: {', '.join(MODEL_CONFIGS)}")
    p.add_argument("--context", type=int, required=True, help="tokens per conversation")
    p.add_argument("--gpu", help=f"one of: {', '.join(g.name for g in GPUS.values())}")
    p.add_argument("--dtype", default="float16", help="KV cache dtype (float16, bfloat16, fp8, float32)")
    p.add_argument("--weight-dtype", default="float16", help="weight dtype (float16, fp8, int4, ...)")
    p.set_defaults(fn=cmd_size)

    from minikv.server.cli import SERVE_HELP, add_arguments

    p = sub.add_parser("serve", help=SERVE_HELP)
    add_arguments(p)
    p.set_defaults(fn=cmd_serve)

    p = sub.add_parser("bench", help="benchmarks: " + "; ".join(f"{k}: {v}" for k, v in BENCHES.items()))
    p.add_argument("which", choices=sorted(BENCHES))
    p.add_argument("rest", nargs=argparse.REMAINDER, help="options of that benchmark (--help lists them)")
    p.set_defaults(fn=cmd_bench)

    p = sub.add_parser("grade", help="grade exercise notebooks, each in a sandbox: a line per check and a score "
                                     "(one notebook) or a gradebook row per notebook")
    p.add_argument("paths", nargs="+", metavar="PATH", help="notebooks, or folders searched for *.ipynb")
    p.add_argument("--jobs", type=int, default=1, help="submissions graded at the same time (default 1)")
    p.add_argument("--csv", metavar="FILE", help="write the gradebook: a row per submission, a column per check")
    p.add_argument("--json", action="store_true", help="print the gradebook as JSON instead")
    p.add_argument("--timeout", type=float, default=300,
                   help="wall-clock seconds one submission may take, checks included (default 300)")
    p.add_argument("--memory", type=float, default=4,
                   help="GB of address space the submission may use beyond what Python needs after importing torch "
                        "and minikv (measured in its process; default 4; 0: no limit)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(fn=cmd_grade)

    p = sub.add_parser("claims", help="every claim the course checks: the published figure, ours, the command")
    for flag, text in (("--json", "one JSON list of claims"), ("--markdown", "README's claims table"),
                       ("--slow", "also re-measure the rows that take minutes"),
                       ("--record", "with --slow: write those figures to minikv/bench/recorded.json")):
        p.add_argument(flag, action="store_true", help=text)
    p.add_argument("--only", metavar="ROW", help="with --slow: re-measure this row only (engine_throughput, "
                                                 "wobble_evictions)")
    p.set_defaults(fn=cmd_claims)

    p = sub.add_parser("exercises", help="regenerate exercises/ from solutions/ and the lessons in notebooks/ from "
                                         "notebooks/answers/ (--check: only report)")
    p.add_argument("--check", action="store_true")
    p.set_defaults(fn=cmd_exercises)

    args = parser.parse_args(argv)
    from minikv.models import ModelNotAvailable

    try:
        return args.fn(args)
    except (ValueError, OSError, ModelNotAvailable) as err:  # bad input: one clear line, not a traceback
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
