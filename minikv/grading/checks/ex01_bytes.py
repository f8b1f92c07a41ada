"""Checks for exercise 01 (bytes): the learner's `kv_cache_bytes` and `conversations_that_fit`, for
models whose layers may keep only a sliding window of tokens (Mistral, Gemma-2, Gemma-3).

The reference is minikv's: `minikv.sizing.ModelShape` reads the config and `kv_bytes_per_token`
gives the bytes of one token in all layers; the check divides that by the layer count and adds up,
layer by layer, the tokens each layer keeps (a full layer all of them, a sliding layer at most its
window). Hypothesis draws many configs (MHA, GQA, MQA, explicit head_dim; no window, every layer
sliding, any mix of sliding and full layers; contexts on both sides of the window) and the failure
message shows the simplest config that disagrees.

Delegation: the graded functions may use `minikv.sizing.ModelShape` (reading a config is not the
exercise), and nothing else of `minikv.sizing`'s arithmetic: `kv_bytes_per_token`,
`kv_cache_bytes`, `kv_bill` and `max_sequences` are forbidden (`FORBIDDEN`).
"""

from hypothesis import given, settings
from hypothesis import strategies as st

from minikv.grading import call, learner
from minikv.sizing import MODEL_CONFIGS, ModelShape, kv_bytes_per_token

BYTES_TO_DTYPE = {4: "float32", 2: "float16", 1: "fp8"}
MANY = settings(max_examples=150, deadline=None, database=None, derandomize=True)

GRADED = ["kv_cache_bytes", "conversations_that_fit"]
FORBIDDEN = ["minikv.sizing.kv_bytes_per_token", "minikv.sizing.kv_cache_bytes", "minikv.sizing.kv_bill",
             "minikv.sizing.max_sequences"]

SLIDING, FULL = "sliding_attention", "full_attention"
# Published configs (the fields that size the cache), with windows.
MISTRAL_7B = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
              "sliding_window": 4096}
GEMMA_2_9B = {"num_hidden_layers": 42, "num_attention_heads": 16, "num_key_value_heads": 8, "hidden_size": 3584,
              "head_dim": 256, "sliding_window": 4096, "layer_types": [SLIDING, FULL] * 21}
GEMMA_3_27B = {"num_hidden_layers": 62, "num_attention_heads": 32, "num_key_value_heads": 16, "hidden_size": 5376,
               "head_dim": 128, "sliding_window": 1024,
               "layer_types": [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(62)]}


def reference_cache_bytes(cfg: dict, context_len: int, dtype_bytes: int) -> int:
    shape = ModelShape.from_config(cfg)
    per_layer = kv_bytes_per_token(shape, BYTES_TO_DTYPE[dtype_bytes]) // shape.num_layers
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types") or [SLIDING if window else FULL] * shape.num_layers
    return per_layer * sum(min(context_len, window) if t == SLIDING and window else context_len for t in types)


def reference_fit(cfg, params, gpu_bytes, context_len, dtype_bytes, reserve) -> int:
    budget = int(gpu_bytes * (1 - reserve)) - params * dtype_bytes
    return max(budget, 0) // reference_cache_bytes(cfg, context_len, dtype_bytes)


@st.composite
def configs(draw, window: str = "any"):
    """A config.json-like dict. window: 'none', 'all' (every layer slides), 'mixed' or 'any'."""
    kv_heads = draw(st.integers(1, 16))
    heads = kv_heads * draw(st.sampled_from([1, 1, 2, 3, 4, 8]))
    if draw(st.booleans()):
        kv_heads = heads if draw(st.booleans()) else 1  # MHA or MQA
    head_dim = draw(st.sampled_from([32, 64, 80, 128, 256]))
    layers = draw(st.integers(1, 64))
    cfg = {"num_hidden_layers": layers, "num_attention_heads": heads, "hidden_size": heads * head_dim}
    if kv_heads != heads or draw(st.booleans()):
        cfg["num_key_value_heads"] = kv_heads
    if draw(st.booleans()):  # some families (Gemma) state head_dim, and it need not be hidden/heads
        cfg["head_dim"] = draw(st.sampled_from([64, 128, 256]))
    kind = draw(st.sampled_from(["none", "all", "mixed"])) if window == "any" else window
    if kind == "none" and draw(st.booleans()):
        cfg["sliding_window"] = None
    if kind in ("all", "mixed"):
        cfg["sliding_window"] = draw(st.sampled_from([128, 512, 1000, 4096]))
    if kind == "all" and draw(st.booleans()):
        cfg["layer_types"] = [SLIDING] * layers
    if kind == "mixed":
        cfg["layer_types"] = draw(st.lists(st.sampled_from([SLIDING, FULL]), min_size=layers, max_size=layers))
    return cfg


def contexts(cfg):
    w = cfg.get("sliding_window") or 4096
    return st.one_of(st.integers(1, 3 * w), st.sampled_from([w - 1, w, w + 1]).filter(lambda n: n > 0))


def _compare_bytes(ns, cfg, context_len, dtype_bytes):
    got = call(learner(ns, "kv_cache_bytes"), dict(cfg), context_len, dtype_bytes)
    want = reference_cache_bytes(cfg, context_len, dtype_bytes)
    assert got == want, f"kv_cache_bytes({cfg}, {context_len}, {dtype_bytes}) returned {got!r}, expected {want}"


def _many_bytes(ns, window: str):
    @MANY
    @given(st.data(), configs(window), st.sampled_from([1, 2, 4]))
    def test(data, cfg, dtype_bytes):
        _compare_bytes(ns, cfg, data.draw(contexts(cfg), label="context_len"), dtype_bytes)
    test()


def check_cache_bytes_without_a_window(ns):
    _compare_bytes(ns, MODEL_CONFIGS["llama-2-7b"][0], 2000, 2)  # a stub stops here, quickly
    _many_bytes(ns, "none")


def check_cache_bytes_every_layer_sliding(ns):
    _compare_bytes(ns, MISTRAL_7B, 5000, 2)
    _many_bytes(ns, "all")


def check_cache_bytes_sliding_and_full_layers(ns):
    _compare_bytes(ns, GEMMA_2_9B, 5000, 2)
    _many_bytes(ns, "mixed")


def check_cache_bytes_real_models(ns):
    for name, (cfg, _) in MODEL_CONFIGS.items():
        if "num_attention_heads" in cfg and "multi_query" not in cfg and "sliding_window" not in cfg:
            _compare_bytes(ns, cfg, 4096, 2)
    for cfg in (MISTRAL_7B, GEMMA_2_9B, GEMMA_3_27B):
        for context_len in (100, 4096, 32_768):
            _compare_bytes(ns, cfg, context_len, 2)
    got = call(learner(ns, "kv_cache_bytes"), dict(MISTRAL_7B), 32_768, 2)
    assert got == 512 * 2**20, (f"Mistral-7B's 32 layers each keep their last 4,096 tokens: 512 MiB in fp16 at "
                                f"32,768 tokens, not {got!r} bytes")


def _compare_fit(ns, cfg, params, gpu_gib, context_len, dtype_bytes, reserve):
    args = (dict(cfg), params, gpu_gib * 2**30, context_len, dtype_bytes, reserve)
    got = call(learner(ns, "conversations_that_fit"), *args)
    want = reference_fit(cfg, params, gpu_gib * 2**30, context_len, dtype_bytes, reserve)
    assert got == want, f"conversations_that_fit{args} returned {got!r}, expected {want}"


def check_conversations_that_fit(ns):
    _compare_fit(ns, MISTRAL_7B, 7_241_732_096, 80, 32_768, 2, 0.1)

    @MANY
    @given(st.data(), configs(), st.integers(10**8, 2 * 10**10), st.sampled_from([16, 24, 40, 80, 141]),
           st.sampled_from([1, 2, 4]), st.sampled_from([0.0, 0.05, 0.1, 0.2]))
    def test(data, cfg, params, gib, dtype_bytes, reserve):
        _compare_fit(ns, cfg, params, gib, data.draw(contexts(cfg), label="context_len"), dtype_bytes, reserve)
    test()


def check_weights_that_do_not_fit(ns):
    # a 70B model in fp16 (141 GB of weights) on a 40 GiB card: nothing fits, and the answer is 0
    _compare_fit(ns, MODEL_CONFIGS["llama-3-70b"][0], MODEL_CONFIGS["llama-3-70b"][1], 40, 4096, 2, 0.1)


CHECKS = [check_cache_bytes_without_a_window, check_cache_bytes_every_layer_sliding,
          check_cache_bytes_sliding_and_full_layers, check_cache_bytes_real_models,
          check_conversations_that_fit, check_weights_that_do_not_fit]

# The exercise's parts and their points (its first cell states the same; the grader's score is out of 100).
PARTS = {"1. `kv_cache_bytes`": (70, [check_cache_bytes_without_a_window, check_cache_bytes_every_layer_sliding,
                                      check_cache_bytes_sliding_and_full_layers, check_cache_bytes_real_models]),
         "2. `conversations_that_fit`": (30, [check_conversations_that_fit, check_weights_that_do_not_fit])}
