"""Stage 5's measurements of the paged cache on a model: beams sharing blocks, and prompt reuse.

``sharing_report`` tabulates a ``PagedKVCache``'s per-step sharing; ``compare_prefix_reuse`` measures the
prefill tokens and the time to first token that a shared system prompt saves. Notebook 05 prints both;
``python -m minikv.bench.paged`` prints them on SmolLM2.
"""

from __future__ import annotations

import time
from statistics import median

import torch

from minikv.blocks import blocks_for
from minikv.paged import PagedKVCache


def sharing_report(cache: PagedKVCache) -> str:
    """The cache's ``sharing_history`` as a table: blocks in use vs unshared, per step."""
    lines = [f"{'step':>5} {'blocks used':>12} {'unshared':>9} {'saved':>7}"]
    for step, used, unshared in cache.sharing_history:
        lines.append(f"{step:>5} {used:>12} {unshared:>9} {1 - used / unshared if unshared else 0:>7.1%}")
    return "\n".join(lines)


@torch.inference_mode()
def compare_prefix_reuse(model, prompts, block_size: int = 16, runs: int = 5, verbose: bool = True) -> dict:
    """Prefill tokens computed and time to first token for ``prompts`` (1-D token id sequences that
    share a prefix, e.g. one system prompt and several questions), without and with prefix caching.

    Before each timed call the cache forgets what it holds and ``prompts[0]`` is sent, untimed (it
    warms the model up and, with caching, leaves only the shared prefix cached); then one of the
    other prompts is timed: a fresh ``generate`` of one new token, ``prefill_hits`` included.
    Every other prompt is timed ``runs`` times. Returns medians and token counts."""
    prompts = [torch.as_tensor(p, dtype=torch.long).reshape(1, -1).to(model.device) for p in prompts]
    if len(prompts) < 2:
        raise ValueError("give at least two prompts: the first fills the cache, the others are timed")
    num_blocks = 2 * blocks_for(max(p.shape[1] for p in prompts) + 1, block_size) + 1
    result = {"prompt_tokens": runs * sum(p.shape[1] for p in prompts[1:])}

    def first_token(cache, ids) -> tuple[float, int]:
        cache.reset()
        t0 = time.perf_counter()
        hit = cache.prefill_hits(ids)
        model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, do_sample=False,
                       max_new_tokens=1, pad_token_id=0)
        return time.perf_counter() - t0, ids.shape[1] - hit

    for caching in (False, True):
        cache = PagedKVCache(model.config, num_blocks, block_size, dtype=model.dtype, device=model.device,
                             enable_prefix_caching=caching)
        times, computed = [], 0
        for ids in prompts[1:] * runs:
            cache.reset()
            cache.manager.reset_prefix_cache()
            first_token(cache, prompts[0])
            seconds, tokens = first_token(cache, ids)
            times.append(seconds)
            computed += tokens
        key = "with" if caching else "without"
        result[f"computed_{key}"], result[f"ttft_{key}_s"] = computed, median(times)
    result["skipped_fraction"] = 1 - result["computed_with"] / result["prompt_tokens"]
    result["ttft_ratio"] = result["ttft_without_s"] / result["ttft_with_s"]
    if verbose:
        print(f"{'prefix caching':<15} {'prefill tokens computed':>24} {'median time to first token':>28}")
        for key in ("without", "with"):
            print(f"{key:<15} {result[f'computed_{key}']:>10,} of {result['prompt_tokens']:>11,} "
                  f"{result[f'ttft_{key}_s'] * 1e3:>25.1f} ms")
        print(f"skipped {result['skipped_fraction']:.1%} of prefill tokens; time to first token "
              f"{result['ttft_ratio']:.2f}x faster (median of {runs} runs per prompt; timings are noisy)")
    return result


def _smollm2_figures() -> None:  # pragma: no cover - prints the stage-5 figures on the real model
    from minikv.models import load_model

    model, tokenizer = load_model("smollm2-135m")
    chat = [{"role": "user", "content": "Explain, in two sentences, why a KV cache makes decoding faster."}]
    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)["input_ids"].to(model.device)
    cache = PagedKVCache(model.config, 256, 16, dtype=model.dtype, device=model.device)
    cache.prefill_hits(ids)
    with torch.inference_mode():
        model.generate(ids, past_key_values=cache, num_beams=4, do_sample=False, max_new_tokens=48)
    print(f"SmolLM2 beam search, num_beams=4, {ids.shape[1]}-token prompt, block 16:\n{sharing_report(cache)}")
    used, unshared = map(sum, zip(*((u, n) for _, u, n in cache.sharing_history)))
    print(f"block-steps used {used} of {unshared} unshared: {1 - used / unshared:.1%} saved; "
          f"{cache.cow_copies} copy-on-write block copies\n")

    system = ("You are a careful assistant for a course on serving language models. Answer briefly and "
              "precisely, name the data structure involved, and say what it costs in memory. ") * 8
    questions = ["What is a KV cache?", "Why are blocks of 16 tokens used?", "What does copy-on-write save?",
                 "How does beam search share memory?", "What is a prefix hit?"]
    prompts = [tokenizer.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": q}],
                                             add_generation_prompt=True, return_tensors="pt",
                                             return_dict=True)["input_ids"][0] for q in questions]
    print(f"a shared system prompt ({len(tokenizer(system).input_ids)} tokens) and {len(questions)} questions:")
    compare_prefix_reuse(model, prompts, runs=3)


if __name__ == "__main__":
    _smollm2_figures()
