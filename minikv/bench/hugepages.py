"""`python -m minikv bench hugepages`: what huge pages buy the packed weights on this host, with its control beside.

Two measurements, each in one process, the two sides taking turns so that both see the same machine:

* **the matmuls**: oneDNN's packed matmul over ``--copies`` packed copies of each of SmolLM2's large weight shapes
  (more than the L3 cache holds, so each call streams from memory as in a step), one set moved onto huge pages
  (``minikv.speed.hugepages.collapse``), the other left on 4 KiB pages; at 1, 8 and 32 rows;
* **the engine** (``--engine``): two engines on two copies of SmolLM2, built with ``MINIKV_HUGEPAGES=off``, then
  one's packed weights moved; each generates the same batch in turn, ``--rounds`` times, at batch 1 and 8. Its
  tokens must be the other's (the bytes did not change, only the pages under them).

It prints each side's median and the median of the per-round ratios (huge / 4 KiB: below 1 is faster).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

SHAPES = {"gate/up 3072x576": (3072, 576), "down 576x1536": (576, 1536), "lm_head 49152x576": (49152, 576)}


def ratio_line(label: str, small: list[float], huge: list[float], unit: float = 1e3, what: str = "ms") -> str:
    ratios = [h / s for s, h in zip(small, huge)]
    small_s, huge_s, mid = statistics.median(small) * unit, statistics.median(huge) * unit, statistics.median(ratios)
    return (f"{label:<28} 4 KiB {small_s:8.2f} {what}  huge {huge_s:8.2f} {what}  "
            f"huge/4k {mid:.3f} ({min(ratios):.3f}-{max(ratios):.3f})")


def matmuls(copies: int, rounds: int) -> None:
    from minikv.speed.hugepages import collapse

    run = torch.ops.mkldnn._linear_pointwise.default
    for name, shape in SHAPES.items():
        n = max(2, copies * 3072 * 576 // (shape[0] * shape[1]))   # as many bytes per set as `copies` gate/ups
        sets = [[torch.ops.mkldnn._reorder_linear_weight(torch.randn(*shape), None) for _ in range(n)]
                for _ in range(2)]
        moved = collapse(sets[1])
        if moved == 0:
            print("this kernel makes no huge pages on request (MADV_COLLAPSE needs Linux 6.1): nothing to compare")
            return
        for rows in (1, 8, 32):
            x = torch.randn(rows, shape[1])
            times: list[list[float]] = [[], []]
            for r in range(rounds + 1):
                for side in ((0, 1) if r % 2 else (1, 0)):
                    start = time.perf_counter()
                    for w in sets[side]:
                        run(x, w, None, "none", [], "")
                    if r:   # the first round warms both
                        times[side].append(time.perf_counter() - start)
            print(ratio_line(f"{name}, {rows:>2} rows x{n}", *times))


def engines(rounds: int) -> None:
    os.environ["MINIKV_HUGEPAGES"] = "off"   # both built on 4 KiB pages; one is moved below
    from minikv.engine import LLM
    from minikv.models import load_model
    from minikv.sampling import SamplingParams
    from minikv.speed.hugepages import collapse

    built = []
    for moved in (False, True):
        model, tokenizer = load_model("smollm2-135m", device="cpu", dtype=torch.float32)  # a copy each
        llm = LLM(model, tokenizer=tokenizer, verbose=False)
        if moved:
            copies = [c for p in llm.engine.runner.packed.packed for c in p.copies.values()]
            start = time.perf_counter()
            print(f"moved {collapse(copies) / 2**20:.0f} MiB of packed weights onto huge pages "
                  f"in {time.perf_counter() - start:.2f} s")
        built.append(llm)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    for batch in (1, 8):
        prompts = [{"prompt_token_ids": list(range(100 + i, 300 + i))} for i in range(batch)]
        times: list[list[float]] = [[], []]
        for r in range(rounds):
            tokens = {}
            for side in ((0, 1) if r % 2 else (1, 0)):
                start = time.perf_counter()
                outs = built[side].generate(prompts, params, use_tqdm=False)
                times[side].append(time.perf_counter() - start)
                tokens[side] = [o.outputs[0].token_ids for o in outs]
            if tokens[0] != tokens[1]:
                raise SystemExit("the engine on huge pages gave other tokens: the move changed bytes")
        print(ratio_line(f"engine, batch {batch} (200+48)", *times, unit=1, what="s"))
    print("tokens identical on both")


def cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minikv bench hugepages", description=__doc__.splitlines()[0])
    parser.add_argument("--copies", type=int, default=30, help="gate/up-sized copies per set (default 30)")
    parser.add_argument("--rounds", type=int, default=15, help="turns per figure (default 15)")
    parser.add_argument("--engine", action="store_true", help="also two engines on SmolLM2, taking turns")
    args = parser.parse_args(argv)
    from minikv.speed.choose import cpu_model

    print(f"{cpu_model()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    matmuls(args.copies, args.rounds)
    if args.engine:
        engines(max(2, args.rounds // 2))
    return 0
