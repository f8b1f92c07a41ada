"""Command line: `python -m minikv demo | size | bench | grade | exercises`.

Each command is a thin shell over a module the course builds; see README for what each prints.
"""

from __future__ import annotations

import argparse
import sys

BENCHES = {  # name -> module in minikv.bench exposing cli(argv) -> int
    "memory": "Replay a request trace: KV memory utilization, contiguous slabs vs paged blocks.",
    "engine": "minikv's engine vs transformers generate and its continuous batching, same workload.",
    "kernel": "GPU: the Triton paged-attention kernel's bandwidth vs the card's peak and vs contiguous attention.",
}


def cmd_size(args) -> int:
    from minikv.sizing import kv_bill, model_spec

    shape = model_spec(args.model)
    print(kv_bill(shape, args.context, args.gpu, dtype=args.dtype, weight_dtype=args.weight_dtype))
    return 0


def cmd_demo(args) -> int:
    from minikv.demo import run_demo

    return run_demo(args.model, args.max_tokens, args.num_prompts, args.kv_cache_memory)


def cmd_bench(args) -> int:
    import importlib

    module = importlib.import_module(f"minikv.bench.{args.which}")
    return module.cli(args.rest)


def cmd_grade(args) -> int:
    from minikv.grading import grade_notebook

    results = grade_notebook(args.notebook)
    return 0 if all(r.passed for r in results) else 1


def cmd_exercises(args) -> int:
    from minikv.grading import generate_exercises

    stale = generate_exercises(check=args.check)
    for path in stale:
        print(("out of date: " if args.check else "wrote ") + str(path))
    if args.check and stale:
        print("exercises/ is out of date with solutions/: run `make exercises`")
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

    p = sub.add_parser("bench", help="benchmarks: " + "; ".join(f"{k}: {v}" for k, v in BENCHES.items()))
    p.add_argument("which", choices=sorted(BENCHES))
    p.add_argument("rest", nargs=argparse.REMAINDER, help="options of that benchmark (--help lists them)")
    p.set_defaults(fn=cmd_bench)

    p = sub.add_parser("grade", help="run an exercise notebook and its checks: one line per check and a score")
    p.add_argument("notebook")
    p.set_defaults(fn=cmd_grade)

    p = sub.add_parser("exercises", help="regenerate exercises/ from solutions/ (--check: only report)")
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
