"""`bench roofline`: the host's ceilings and a step's floor, counted from the model's own shapes."""

from __future__ import annotations

import torch

from minikv.bench.roofline import Roofline, decode_bytes, linear_params, measure, prefill_flops
from minikv.models import tiny_random_llama
from minikv.sizing import kv_bytes_per_token


def test_the_floors_count_the_weights_the_cache_and_the_flops():
    model = tiny_random_llama(seed=0)
    c = model.config
    per_layer = (c.hidden_size * c.num_attention_heads * c.head_dim * 2            # q and o
                 + 2 * c.hidden_size * c.num_key_value_heads * c.head_dim          # k and v
                 + 3 * c.hidden_size * c.intermediate_size)                        # gate, up, down
    head = c.vocab_size * c.hidden_size
    assert linear_params(model) == c.num_hidden_layers * per_layer + head
    kv = kv_bytes_per_token(c, torch.float32)
    assert decode_bytes(model, 8, 100) == 4 * linear_params(model) + 8 * 100 * kv
    attention = 4 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * 10 * 11 // 2
    assert prefill_flops(model, 10) == 2 * (linear_params(model) - head) * 10 + 2 * head + attention
    roof = Roofline("a CPU", 2, read_bytes_per_s=1e9, flops_per_s=1e9)
    # a decode step: its bytes at 1 GB/s, or its FLOPs at 1 GFLOP/s where that is longer
    assert roof.decode_floor(model, 1, 100) == max(decode_bytes(model, 1, 100), 2 * linear_params(model)) / 1e9
    assert roof.decode_floor(model, 64, 100) == 2 * linear_params(model) * 64 / 1e9
    assert roof.prefill_floor(model, 10) == prefill_flops(model, 10) / 1e9


def test_the_ceilings_are_measured_here():
    roof = measure(buffer_mb=16, n=128, repeats=2)
    assert roof.read_bytes_per_s > 1e8 and roof.flops_per_s > 1e8 and roof.threads == torch.get_num_threads()
