"""Stage 1: the sizing functions give published figures through real config classes and plain dicts."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers import FalconConfig, GemmaConfig, GPT2Config, LlamaConfig, MistralConfig, OPTConfig, Qwen2Config

from minikv.sizing import (
    GPUS,
    MODEL_CONFIGS,
    ModelShape,
    activation_bytes,
    dtype_bytes,
    gpu_spec,
    kv_bill,
    kv_bytes_per_token,
    kv_cache_bytes,
    max_sequences,
    model_spec,
    weight_bytes,
)

# bytes per token in fp16 = 2 * layers * kv_heads * head_dim * 2, from each model's published config
PUBLISHED_FP16 = {
    "llama-2-7b": 2 * 32 * 32 * 128 * 2,   # 512 KiB: the seed's "about half a megabyte"
    "llama-3-8b": 2 * 32 * 8 * 128 * 2,    # GQA, 8 kv heads: 128 KiB
    "llama-3-70b": 2 * 80 * 8 * 128 * 2,   # 320 KiB
    "mistral-7b": 2 * 32 * 8 * 128 * 2,
    "qwen2.5-7b": 2 * 28 * 4 * 128 * 2,    # 56 KiB
    "smollm2-135m": 2 * 30 * 3 * 64 * 2,   # 22.5 KiB
    "gemma-7b": 2 * 28 * 16 * 256 * 2,     # head_dim 256 though hidden/heads = 192
    "falcon-7b": 2 * 32 * 1 * 64 * 2,      # MQA: one kv head
    "opt-13b": 2 * 40 * 40 * 128 * 2,      # 800 KB: the PagedAttention paper's figure
    "gpt2": 2 * 12 * 12 * 64 * 2,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_FP16))
def test_table_matches_published_bytes_per_token(name):
    assert kv_bytes_per_token(model_spec(name)) == PUBLISHED_FP16[name]
    assert kv_bytes_per_token(MODEL_CONFIGS[name][0]) == PUBLISHED_FP16[name]  # the plain dict too


def test_seed_claims():
    assert kv_bytes_per_token("llama-2-7b") == 512 * 1024                       # ~0.5 MB per token
    assert 0.95e9 < kv_cache_bytes("llama-2-7b", 2000) < 1.1e9                  # 2,000 tokens ~ 1 GB


# The same numbers through transformers' own config classes (built offline from published fields).
HF_CONFIGS = {
    "llama-2-7b": lambda: LlamaConfig(num_hidden_layers=32, num_attention_heads=32, hidden_size=4096),
    "llama-3-8b": lambda: LlamaConfig(num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                      hidden_size=4096),
    "llama-3-70b": lambda: LlamaConfig(num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                                       hidden_size=8192),
    "mistral-7b": lambda: MistralConfig(num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                        hidden_size=4096),
    "qwen2.5-7b": lambda: Qwen2Config(num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                                      hidden_size=3584),
    "smollm2-135m": lambda: LlamaConfig(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                                        hidden_size=576),
    "gemma-7b": lambda: GemmaConfig(num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=16,
                                    hidden_size=3072, head_dim=256),
    "falcon-7b": lambda: FalconConfig(num_hidden_layers=32, num_attention_heads=71, hidden_size=4544,
                                      multi_query=True, new_decoder_architecture=False),
    "opt-13b": lambda: OPTConfig(num_hidden_layers=40, num_attention_heads=40, hidden_size=5120),
    "gpt2": lambda: GPT2Config(n_layer=12, n_head=12, n_embd=768),
}


@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_transformers_config_classes(name):
    assert kv_bytes_per_token(HF_CONFIGS[name]()) == PUBLISHED_FP16[name]


def test_falcon_new_architecture_uses_num_kv_heads():
    cfg = FalconConfig(num_hidden_layers=60, num_attention_heads=128, num_kv_heads=8, hidden_size=8192,
                       new_decoder_architecture=True)
    assert ModelShape.from_config(cfg).num_kv_heads == 8


def test_multimodal_config_reads_text_config():
    cfg = {"model_type": "llava", "text_config": MODEL_CONFIGS["llama-2-7b"][0]}
    assert kv_bytes_per_token(cfg) == PUBLISHED_FP16["llama-2-7b"]


@pytest.mark.parametrize("dtype,factor", [("float32", 2), ("fp32", 2), (torch.float32, 2), ("bf16", 1),
                                          (torch.bfloat16, 1), ("fp8", 0.5), ("float8_e5m2", 0.5),
                                          (torch.float8_e4m3fn, 0.5)])
def test_dtypes(dtype, factor):
    assert kv_bytes_per_token("llama-3-8b", dtype) == PUBLISHED_FP16["llama-3-8b"] * factor


@given(st.integers(1, 128), st.integers(1, 64), st.integers(1, 8), st.integers(1, 512), st.integers(0, 10**6))
def test_formula_property(layers, kv_heads, group, head_dim, tokens):
    shape = ModelShape(layers, kv_heads * group, kv_heads, head_dim)
    assert kv_cache_bytes(shape, tokens) == 2 * layers * kv_heads * head_dim * 2 * tokens


def test_sequences_that_fit():
    # Llama-2-7B fp16 on an A100-80GB: 90% of 80 GiB minus 12.55 GiB of weights minus the activation
    # estimate, 1,000 MiB per sequence
    bill = kv_bill("llama-2-7b", 2000, "A100-80GB")
    act = activation_bytes("llama-2-7b")
    assert bill.activation_bytes == act
    assert bill.kv_budget_bytes == int(80 * 2**30 * 0.9) - 6_738_415_616 * 2 - act
    assert bill.sequences_that_fit == bill.kv_budget_bytes // (512 * 1024 * 2000) == 59
    assert kv_bill("llama-2-7b", 2000, "A100-80GB", activations=0).sequences_that_fit == 60  # ignoring them
    assert max_sequences("llama-3-70b", "A100-40GB", 4096) == 0  # weights alone do not fit
    assert max_sequences("llama-3-8b", "H200", 8192) > max_sequences("llama-2-7b", "H200", 8192) * 3
    assert "sequences that fit" in str(bill) and "activations + runtime" in str(bill)
    assert {g.name for g in GPUS.values()} >= {"T4", "RTX-4090", "A100-40GB", "A100-80GB", "H100", "H200"}


def test_activation_estimate_is_the_documented_sum():
    # Llama-3-8B: 8,192 tokens x (2 x 4096 + 3 x 14336) fp16 numbers in the MLP, fp32 logits and
    # probabilities for 256 sequences over 128,256 tokens, and 1 GiB of runtime.
    want = 8192 * (2 * 4096 + 3 * 14336) * 2 + 256 * 128256 * 4 * 2 + 2**30
    assert activation_bytes("llama-3-8b") == want
    assert 1.9 * 2**30 < want < 2.1 * 2**30
    assert activation_bytes("llama-3-8b", runtime_bytes=0, max_num_batched_tokens=1, max_num_seqs=1) == \
        (2 * 4096 + 3 * 14336) * 2 + 128256 * 8
    # A bare shape, or a config without the MLP and vocabulary sizes, cannot be estimated: the bill says so
    assert activation_bytes(ModelShape(2, 2, 2, 2)) is None
    bill = kv_bill({"num_hidden_layers": 32, "num_attention_heads": 32, "hidden_size": 4096}, 4096, "H100",
                   num_params=6_738_415_616)
    assert bill.activation_bytes is None and "not modeled" in str(bill)
    assert bill.kv_budget_bytes == int(80 * 2**30 * 0.9) - 6_738_415_616 * 2
    with pytest.raises(ValueError, match="activations must be"):
        kv_bill("gpt2", 10, "T4", activations=-1)


@pytest.mark.parametrize("name,context,inner", [("llama-2-7b", 4096, 11008), ("llama-3-8b", 8192, 14336),
                                                 ("smollm2-135m", 8192, 1536), ("falcon-7b", 2048, 4 * 4544),
                                                 ("gpt2", 1024, 4 * 768), ("opt-13b", 2048, 20480)])
def test_context_and_mlp_sizes_from_the_config(name, context, inner):
    s = model_spec(name)
    assert (s.context_len, s.intermediate_size) == (context, inner)


def test_a_context_past_the_window_is_flagged():
    assert "past the model's 8,192-token context" in str(kv_bill("llama-3-8b", 16384))
    assert "warning" not in str(kv_bill("llama-3-8b", 8192))


@pytest.mark.parametrize("bad,match", [
    ({"num_attention_heads": 8, "hidden_size": 512}, "number of layers"),
    ({"num_hidden_layers": 8, "hidden_size": 512}, "number of attention heads"),
    ({"num_hidden_layers": 8, "num_attention_heads": 8}, "head_dim"),
    ({"num_hidden_layers": 0, "num_attention_heads": 8, "hidden_size": 512}, "num_layers must be a positive"),
    ({"num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": 4, "hidden_size": 384},
     "multiple of num_kv_heads"),
    ({"num_hidden_layers": 2, "num_attention_heads": 8, "hidden_size": 512, "kv_lora_rank": 512}, "MLA"),
])
def test_bad_configs_name_the_problem(bad, match):
    with pytest.raises(ValueError, match=match):
        ModelShape.from_config(bad)


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown dtype 'fp7'"):
        dtype_bytes("fp7")
    with pytest.raises(ValueError, match="unknown GPU 'V100'"):
        gpu_spec("V100")
    with pytest.raises(ValueError, match="unknown model"):
        model_spec("llama-9")
    with pytest.raises(ValueError, match="num_tokens"):
        kv_cache_bytes("gpt2", -1)
    with pytest.raises(ValueError, match="context_len"):
        kv_bill("gpt2", 0)
    with pytest.raises(ValueError, match="num_params"):
        weight_bytes(0)
    with pytest.raises(ValueError, match="parameter count"):
        kv_bill(ModelShape(2, 2, 2, 2), 10, "T4")


def test_size_command(capsys):
    from minikv.__main__ import main

    assert main(["size", "llama-2-7b", "--context", "2000", "--gpu", "A100-80GB"]) == 0
    out = capsys.readouterr().out
    assert "512.00 KiB" in out and "1,000.00 MiB" in out and "sequences that fit           59" in out
    assert main(["size", "llama-2-7b", "--context", "2000", "--gpu", "V100"]) == 2
    assert "unknown GPU" in capsys.readouterr().err
