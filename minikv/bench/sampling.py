"""`python -m minikv bench sampling`: what drawing a step's tokens costs, minikv's draw vs `torch.multinomial`.

A sampled request (temperature > 0, vLLM's default) needs one token drawn per running sequence per step, over
the whole vocabulary (SmolLM2: 49,152 tokens). `minikv.sampling.draw` walks one uniform number along each row's
cumulative distribution; the control draws the same rows with ``torch.multinomial``, the textbook call, which
on the CPU generates a random number per token. Both take the same probabilities, in one process, the calls
alternating; the table gives each one's best of `--repeat` calls (the least disturbed) and their ratio, with a
check that both follow the distribution (the share of draws that land on the row's most likely token).
The process keeps its freed memory as the engine's does (`minikv.speed.malloc`): else a float64 copy of many
rows is fresh pages at every call, and the page faults, not the draw, are what gets timed.
"""

from __future__ import annotations

import argparse

import torch

from minikv.bench.linear import alternate
from minikv.sampling import draw
from minikv.speed.malloc import keep_freed_memory


def cli(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minikv bench sampling", description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=49152, help="tokens per row (default 49152: SmolLM2's)")
    p.add_argument("--rows", default="1,8,16,64", help="sequences drawn per step (default 1,8,16,64)")
    p.add_argument("--repeat", type=int, default=20, help="calls per figure, the fastest kept (default 20)")
    args = p.parse_args(argv)
    keep_freed_memory()
    gen = torch.Generator().manual_seed(0)
    print(f"one token per row over {args.vocab} tokens, {torch.get_num_threads()} torch threads; best of "
          f"{args.repeat} calls")
    print(f"{'rows':>6}{'draw ms':>10}{'multinomial ms':>16}{'ratio':>8}   top token drawn (draw / multinomial)")
    for rows in (int(r) for r in args.rows.split(",")):
        probs = (torch.randn(rows, args.vocab, generator=gen) * 3).softmax(-1)
        ways = (lambda: draw(probs, [None] * rows), lambda: torch.multinomial(probs, 1).squeeze(1))
        ours, theirs = (1e3 * min(times) for times in alternate(*ways, args.repeat, warmup=1))
        top, n = probs.argmax(-1), 200   # both must land on each row's likeliest token about as often as it weighs
        share = [sum((f() == top).float().mean().item() for _ in range(n)) / n for f in ways]
        print(f"{rows:>6}{ours:>10.3f}{theirs:>16.3f}{theirs / ours:>7.1f}x   {share[0]:.3f} / {share[1]:.3f} "
              f"(expected {probs.max(-1).values.mean().item():.3f})")
    return 0
