"""Checks for exercise 01 (bytes): the learner's `kv_bytes_per_token` and `conversations_that_fit`.

Each check draws many configs with hypothesis (MHA, GQA, MQA, explicit head_dim) and compares
the learner's answer with `minikv.sizing`; the failure message shows the first config that
disagrees, shrunk to the simplest one hypothesis can find."""

from hypothesis import given, settings, strategies as st

from minikv.grading import call, learner
from minikv.sizing import GPU, MODEL_CONFIGS, ModelShape, kv_bill, kv_bytes_per_token

BYTES_TO_DTYPE = {4: "float32", 2: "float16", 1: "fp8"}
MANY = settings(max_examples=150, deadline=None, database=None, derandomize=True)


@st.composite
def configs(draw, kind: str = "any"):
    """A config.json-like dict. kind: 'mha', 'gqa', 'mqa' or 'any'."""
    kv_heads = draw(st.integers(1, 16))
    group = draw(st.sampled_from([1, 2, 3, 4, 7, 8]))
    if kind == "mha":
        group = 1
    if kind == "mqa":
        kv_heads = 1
    heads = kv_heads * group
    head_dim = draw(st.sampled_from([32, 64, 80, 96, 128, 256]))
    cfg = {"num_hidden_layers": draw(st.integers(1, 96)), "num_attention_heads": heads,
           "hidden_size": heads * head_dim}
    if kind != "mha" or draw(st.booleans()):
        cfg["num_key_value_heads"] = kv_heads
    if draw(st.booleans()):  # some families (Gemma) state head_dim, and it need not be hidden/heads
        cfg["head_dim"] = draw(st.sampled_from([64, 128, 256]))
    return cfg


def _compare_bytes(ns, cfg, dtype_bytes):
    got = call(learner(ns, "kv_bytes_per_token"), dict(cfg), dtype_bytes)
    want = kv_bytes_per_token(ModelShape.from_config(cfg), BYTES_TO_DTYPE[dtype_bytes])
    assert got == want, f"kv_bytes_per_token({cfg}, {dtype_bytes}) returned {got}, expected {want}"


def check_bytes_per_token_multi_head(ns):
    MANY(given(configs("mha"), st.sampled_from([1, 2, 4]))(lambda cfg, b: _compare_bytes(ns, cfg, b)))()


def check_bytes_per_token_grouped_query(ns):
    MANY(given(configs("gqa"), st.sampled_from([1, 2, 4]))(lambda cfg, b: _compare_bytes(ns, cfg, b)))()


def check_bytes_per_token_multi_query(ns):
    MANY(given(configs("mqa"), st.sampled_from([1, 2, 4]))(lambda cfg, b: _compare_bytes(ns, cfg, b)))()


def check_bytes_per_token_real_models(ns):
    for name, (cfg, _) in MODEL_CONFIGS.items():
        if "num_attention_heads" in cfg and "multi_query" not in cfg:  # the fields the exercise names
            _compare_bytes(ns, cfg, 2)
    got = call(learner(ns, "kv_bytes_per_token"), dict(MODEL_CONFIGS["llama-2-7b"][0]), 2)
    assert got == 524_288, f"Llama-2-7B in fp16 should be 0.5 MiB (524,288 bytes) per token, got {got:,}"


def _compare_fit(ns, cfg, params, gpu_gib, context, dtype_bytes, reserve):
    args = (dict(cfg), params, gpu_gib * 2**30, context, dtype_bytes, reserve)
    got = call(learner(ns, "conversations_that_fit"), *args)
    dtype = BYTES_TO_DTYPE[dtype_bytes]
    want = kv_bill(ModelShape.from_config(cfg), context, GPU("gpu", gpu_gib * 2**30, 0, 0), dtype, dtype,
                   num_params=params, reserve_fraction=reserve).sequences_that_fit
    assert got == want, f"conversations_that_fit{args} returned {got}, expected {want}"


def check_conversations_that_fit(ns):
    MANY(given(configs(), st.integers(10**8, 2 * 10**10), st.sampled_from([16, 24, 40, 80, 141]),
               st.integers(1, 32_768), st.sampled_from([1, 2, 4]), st.sampled_from([0.0, 0.05, 0.1, 0.2]))(
        lambda cfg, params, gib, context, b, reserve: _compare_fit(ns, cfg, params, gib, context, b, reserve)))()


def check_weights_that_do_not_fit(ns):
    # a 70B model in fp16 (141 GB of weights) on a 40 GiB card: nothing fits, and the answer is 0
    _compare_fit(ns, MODEL_CONFIGS["llama-3-70b"][0], MODEL_CONFIGS["llama-3-70b"][1], 40, 4096, 2, 0.1)


CHECKS = [check_bytes_per_token_multi_head, check_bytes_per_token_grouped_query,
          check_bytes_per_token_multi_query, check_bytes_per_token_real_models,
          check_conversations_that_fit, check_weights_that_do_not_fit]
