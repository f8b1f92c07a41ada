"""`python -m minikv demo`: a real model answers a prompt through minikv's paged KV cache,
and we print what its memory cost.

The bill is computed twice: from the config with stage 1's formula, and from the paged cache
(stage 3) after generation: the bytes of one slot read off its pool tensors, times the slots
its block tables hold. They must agree; if they ever don't, the formula (or the cache) is wrong. Beside it: what a stage-2 server would have
reserved for the same conversation (one slab for the model's whole context).
"""

from __future__ import annotations

import time

import torch

from minikv.blocks import blocks_for
from minikv.models import load_model
from minikv.paged import PagedKVCache
from minikv.sizing import ModelShape, fmt_bytes, format_rows, kv_bill, kv_cache_bytes

BLOCK_SIZE = 16


def run_demo(model_name: str = "smollm2-135m", prompt: str = "What is a KV cache, in one sentence?",
             max_tokens: int = 48) -> int:
    t0 = time.perf_counter()
    model, tokenizer = load_model(model_name)
    print(f"loaded {model_name} on {model.device} ({model.dtype}) in {time.perf_counter() - t0:.1f} s")
    if tokenizer is None:
        raise ValueError(f"{model_name!r} has no tokenizer; the demo needs a real model such as smollm2-135m")

    chat = [{"role": "user", "content": prompt}]
    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)["input_ids"].to(model.device)
    # A pool just big enough for this conversation, in blocks of 16 tokens.
    num_blocks = blocks_for(ids.shape[1] + max_tokens, BLOCK_SIZE)
    cache = PagedKVCache(model.config, num_blocks=num_blocks, block_size=BLOCK_SIZE,
                         dtype=model.dtype, device=model.device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, cache=cache, max_new_tokens=max_tokens, do_sample=False)
    seconds = time.perf_counter() - t0
    new = out[0, ids.shape[1]:]
    print(f"\nprompt: {prompt}\nanswer: {tokenizer.decode(new, skip_special_tokens=True).strip()}")
    print(f"({ids.shape[1]} prompt tokens, {len(new)} new tokens, {len(new) / seconds:.1f} tokens/s)\n")

    shape = ModelShape.from_config(model.config, name=model_name)
    tokens = cache.get_seq_length()
    predicted = kv_cache_bytes(shape, tokens, model.dtype)
    measured = cache.used_bytes()
    slab = kv_cache_bytes(shape, model.config.max_position_embeddings, model.dtype)
    blocks = cache.block_tables[0].tolist()
    bill = kv_bill(shape, tokens, dtype=model.dtype, num_params=model.num_parameters(), weight_dtype=model.dtype)
    rows = bill.rows() + [
        ("measured in the paged cache", f"{fmt_bytes(measured)} in {tokens} token slots "
                                        f"({'matches' if measured == predicted else 'DIFFERS FROM'} the formula)"),
        ("blocks held", f"{len(blocks)} blocks x {BLOCK_SIZE} tokens = {fmt_bytes(cache.allocated_bytes())}; "
                        f"waste {fmt_bytes(cache.allocated_bytes() - measured)}, all in the last block"),
        ("block table", " ".join(map(str, blocks))),
        ("a stage-2 slab would hold", f"{fmt_bytes(slab)} ({model.config.max_position_embeddings:,}-token context): "
                                      f"{measured / slab:.1%} of it used"),
    ]
    t4 = kv_bill(shape, 8192, "T4", dtype="float16", num_params=model.num_parameters())
    rows.append(("on a T4, fp16, 8k context", f"{fmt_bytes(t4.bytes_per_sequence)} per conversation: "
                                              f"{t4.sequences_that_fit:,} fit beside the weights"))
    print("KV bill\n" + format_rows(rows))
    return 0 if measured == predicted else 1
