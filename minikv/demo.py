"""`python -m minikv demo`: the engine's main job. SmolLM2 serves a batch of chat prompts behind one
shared system prompt through `LLM.chat`, then the landlord's report says what the tenants cost.

The report:

* **the KV bill**, computed twice: from the config with stage 1's formula, and from the engine's
  block pools: the bytes of one token slot read off the runner's pool tensors, times the tokens
  each conversation held. They must agree (the command exits 1 if not); so must the pool's
  tensors and the formula for its size. Beside it: stage 1's bill for one conversation and what a
  T4 could hold;
* **occupancy**: blocks used at the peak step and blocks still cached (free but holding a prefix)
  at the end, against what the conversations would have needed with no sharing;
* **prefix hits**: prompt tokens served from cached blocks (the shared system prompt), preemptions;
* **speed**: useful tokens/s and time to first token (noisy on a busy machine).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from minikv.blocks import blocks_for
from minikv.sizing import ModelShape, fmt_bytes, format_rows, kv_bill, kv_cache_bytes

BLOCK_SIZE = 16
SYSTEM_PROMPT = ("You are the landlord of a language-model server. You explain, in one or two plain sentences, "
                 "how serving works: memory, batching, caching and who gets evicted.")
QUESTIONS = ["What is a KV cache?", "Why do servers batch requests?", "What is a block table?",
             "Why does memory fragment?", "What happens when memory runs out?", "What is a shared prefix?",
             "Why is decoding slower than reading the prompt?", "What does a GPU do?"]


@dataclass
class DemoReport:
    """What the demo measured; `run_demo` prints it, tests check that its numbers agree."""
    model: str
    dtype: torch.dtype
    shape: ModelShape
    num_params: int
    questions: list[str]
    answers: list[str]
    prompt_token_ids: list[list[int]]
    prompt_tokens: list[int]
    output_tokens: list[int]
    held_tokens: list[int]          # K/V slots each conversation filled: prompt + output - 1
    slot_bytes: int                 # one token's K/V, all layers, read off the pool tensors
    formula_bytes: list[int]        # stage 1's formula for each conversation's held tokens
    pool_bytes: int                 # the runner's pool tensors, all of them
    pool_formula_bytes: int         # the formula for num_blocks * block_size tokens
    num_blocks: int
    block_size: int
    peak_blocks_used: int
    blocks_cached_at_end: int
    blocks_without_sharing: int     # peak if nothing were shared: every conversation's own blocks
    prefix_tokens_hit: int
    prefix_tokens_queried: int
    cached_prompt_tokens: list[int]  # per conversation, at its first admission
    preemptions: int
    seconds: float
    ttft: list[float]
    summary: dict = field(default_factory=dict)

    @property
    def measured_bytes(self) -> list[int]:
        return [self.slot_bytes * t for t in self.held_tokens]

    @property
    def bill_matches(self) -> bool:
        return self.measured_bytes == self.formula_bytes and self.pool_bytes == self.pool_formula_bytes

    @property
    def tokens_per_s(self) -> float:
        return sum(self.output_tokens) / self.seconds


def serve(model_name: str = "smollm2-135m", max_tokens: int = 48, num_prompts: int = len(QUESTIONS),
          kv_cache_memory: str = "64MiB", use_tqdm: bool = True) -> DemoReport:
    """Load the model, serve `num_prompts` chat prompts (one shared system prompt), measure."""
    from minikv.engine import LLM
    from minikv.models import load_model
    from minikv.sampling import SamplingParams

    if not 1 <= num_prompts <= len(QUESTIONS):
        raise ValueError(f"num_prompts must be between 1 and {len(QUESTIONS)}, got {num_prompts}")
    t0 = time.perf_counter()
    model, tokenizer = load_model(model_name)
    print(f"loaded {model_name} on {model.device} ({model.dtype}) in {time.perf_counter() - t0:.1f} s")
    if tokenizer is None:
        raise ValueError(f"{model_name!r} has no tokenizer; the demo needs a real model such as smollm2-135m")
    llm = LLM(model, tokenizer, block_size=BLOCK_SIZE, kv_cache_memory=kv_cache_memory)
    engine = llm.engine
    questions = QUESTIONS[:num_prompts]
    chats = [[{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q}] for q in questions]
    with torch.inference_mode():
        outs = llm.chat(chats, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=use_tqdm)

    from minikv.metrics import summarize

    snap = engine.stats(history=None)   # the engine's read-only view: every step it kept, its prefix counters
    summary = summarize(outs, snap.steps)
    summary["prefix_hit_rate"] = snap.prefix_hit_rate
    pool_bytes = engine.pool_view().kv_bytes   # the pool's tensors as allocated, measured
    slots = engine.num_blocks * engine.block_size
    shape = ModelShape.from_config(model.config, name=model_name)
    prompt = [len(o.prompt_token_ids) for o in outs]
    output = [len(o.outputs[0].token_ids) for o in outs]
    held = [p + n - 1 for p, n in zip(prompt, output)]   # the last sampled token is never fed back
    return DemoReport(
        model=model_name, dtype=model.dtype, shape=shape, num_params=model.num_parameters(), questions=questions,
        answers=[o.outputs[0].text.strip() for o in outs],
        prompt_token_ids=[list(o.prompt_token_ids) for o in outs], prompt_tokens=prompt, output_tokens=output,
        held_tokens=held, slot_bytes=pool_bytes // slots,
        formula_bytes=[kv_cache_bytes(shape, t, model.dtype) for t in held],
        pool_bytes=pool_bytes, pool_formula_bytes=kv_cache_bytes(shape, slots, model.dtype),
        num_blocks=engine.num_blocks, block_size=engine.block_size,
        peak_blocks_used=max(s.blocks_used for s in snap.steps),
        blocks_cached_at_end=snap.blocks_cached,   # every request is done: each cached block is free (evictable)
        blocks_without_sharing=sum(blocks_for(t, engine.block_size) for t in held),
        prefix_tokens_hit=snap.prefix_tokens_hit, prefix_tokens_queried=snap.prefix_tokens_queried,
        cached_prompt_tokens=[o.metrics.cached_prompt_tokens for o in outs],
        preemptions=sum(o.metrics.preemptions for o in outs), seconds=summary["seconds"],
        ttft=[o.metrics.ttft for o in outs], summary=summary)


def print_report(r: DemoReport) -> None:
    for q, a in zip(r.questions, r.answers):
        print(f"\nQ: {q}\nA: {a}")
    n = len(r.questions)
    total_measured = sum(r.measured_bytes)
    rows = [
        ("conversations", f"{n}, one shared system prompt; {sum(r.prompt_tokens)} prompt + "
                          f"{sum(r.output_tokens)} generated tokens"),
        ("KV per token (pool tensors)",
         f"{fmt_bytes(r.slot_bytes)} ({str(r.dtype).removeprefix('torch.')}, K and V, all layers)"),
        ("KV bill, measured", f"{fmt_bytes(total_measured)} in {sum(r.held_tokens)} token slots "
                              f"({'matches' if r.measured_bytes == r.formula_bytes else 'DIFFERS FROM'} the formula, "
                              f"conversation by conversation)"),
        ("the pool", f"{r.num_blocks} blocks x {r.block_size} tokens = {fmt_bytes(r.pool_bytes)} "
                     f"({'matches' if r.pool_bytes == r.pool_formula_bytes else 'DIFFERS FROM'} the formula)"),
        ("blocks used at the peak", f"{r.peak_blocks_used} of {r.num_blocks}; without sharing the conversations "
                                    f"would hold {r.blocks_without_sharing}"),
        ("blocks cached at the end",
         f"{r.blocks_cached_at_end} (free, still holding prefixes a next request can reuse)"),
        ("prefix hits", f"{r.prefix_tokens_hit} of {r.prefix_tokens_queried} prompt tokens served from cached blocks "
                        f"({r.prefix_tokens_hit / max(r.prefix_tokens_queried, 1):.0%})"),
        ("preemptions", str(r.preemptions)),
        ("speed", f"{sum(r.output_tokens)} tokens in {r.seconds:.1f} s = {r.tokens_per_s:.1f} tokens/s; time to first "
                  f"token {min(r.ttft):.2f}-{max(r.ttft):.2f} s"),
    ]
    print("\nThe landlord's report\n" + format_rows(rows))


def run_demo(model_name: str = "smollm2-135m", max_tokens: int = 48, num_prompts: int = len(QUESTIONS),
             kv_cache_memory: str = "64MiB") -> int:
    report = serve(model_name, max_tokens, num_prompts, kv_cache_memory)
    print_report(report)
    # Stage 1's view of one of these conversations, and what a T4 could hold of them.
    longest = max(report.held_tokens)
    bill = kv_bill(report.shape, longest, dtype=report.dtype, num_params=report.num_params, weight_dtype=report.dtype)
    print(f"\nKV bill of the longest conversation ({longest} tokens)\n" + format_rows(bill.rows()))
    t4 = kv_bill(report.shape, 8192, "T4", dtype="float16", num_params=report.num_params)
    print(f"on a T4, fp16, 8k context: {fmt_bytes(t4.bytes_per_sequence)} per conversation, "
          f"{t4.sequences_that_fit:,} fit beside the weights")
    return 0 if report.bill_matches else 1
