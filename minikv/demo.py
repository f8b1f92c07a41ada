"""`python -m minikv demo`: a real model answers a prompt, and we print what its memory cost.

The bill is computed twice: from the config with stage 1's formula, and by measuring the
bytes the cache actually holds after generation. They must agree; if they ever don't, the
formula (or the cache) is wrong.
"""

from __future__ import annotations

import time

import torch

from minikv.models import load_model
from minikv.sizing import ModelShape, fmt_bytes, kv_bill, kv_cache_bytes


def cache_tensor_bytes(cache) -> int:
    """Bytes held by the K/V tensors of a transformers cache (every layer, K and V)."""
    total = 0
    for layer in cache.layers:
        for t in (layer.keys, layer.values):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def run_demo(model_name: str = "smollm2-135m", prompt: str = "What is a KV cache, in one sentence?",
             max_tokens: int = 48) -> int:
    from transformers import DynamicCache

    t0 = time.perf_counter()
    model, tokenizer = load_model(model_name)
    print(f"loaded {model_name} on {model.device} ({model.dtype}) in {time.perf_counter() - t0:.1f} s")
    if tokenizer is None:
        raise ValueError(f"{model_name!r} has no tokenizer; the demo needs a real model such as smollm2-135m")

    chat = [{"role": "user", "content": prompt}]
    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)["input_ids"].to(model.device)
    cache = DynamicCache(config=model.config)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, cache=cache, max_new_tokens=max_tokens, do_sample=False)
    seconds = time.perf_counter() - t0
    new = out[0, ids.shape[1]:]
    print(f"\nprompt: {prompt}\nanswer: {tokenizer.decode(new, skip_special_tokens=True).strip()}")
    print(f"({ids.shape[1]} prompt tokens, {len(new)} new tokens, {len(new) / seconds:.1f} tokens/s)\n")

    shape = ModelShape.from_config(model.config, name=model_name)
    tokens_cached = cache.get_seq_length()
    measured = cache_tensor_bytes(cache)
    predicted = kv_cache_bytes(shape, tokens_cached, model.dtype)
    print("KV bill")
    print(kv_bill(shape, tokens_cached, dtype=model.dtype, num_params=model.num_parameters(),
                  weight_dtype=model.dtype))
    print(f"{'measured in the cache':<28} {fmt_bytes(measured)} for {tokens_cached} tokens "
          f"({'matches' if measured == predicted else 'DIFFERS FROM'} the formula: {fmt_bytes(predicted)})")
    fp16 = kv_bill(shape, 8192, "T4", dtype="float16", num_params=model.num_parameters())
    print(f"{'at full context on a T4':<28} {fmt_bytes(fp16.bytes_per_sequence)} per 8,192-token "
          f"conversation in fp16: {fp16.sequences_that_fit:,} fit beside the weights")
    return 0 if measured == predicted else 1
