"""Stage 1: byte arithmetic. How big is the KV cache, and how many conversations fit?

For every token it has seen, each attention layer keeps one key and one value vector per
KV head. So the cache costs, per token,

    2 (K and V) x layers x kv_heads x head_dim x bytes per element

and a conversation of N tokens costs N times that. Everything else in this module is
bookkeeping around that one line: reading the numbers out of any Hugging Face config
(each model family spells them differently), a table of real models and GPUs, and the
"bill": what is left for the cache once the weights are loaded, and how many sequences
of a given length it holds.

The bill follows vLLM's accounting: ``gpu_memory_utilization`` (0.9 by default) caps the
whole serving process, and the weights, the forward pass's activation peak and the runtime
(CUDA context, library workspaces, CUDA graphs) all come out of that cap before the KV
cache gets the rest. vLLM *measures* the activation peak by running one worst-case forward
pass; ``activation_bytes`` *estimates* it from the model's sizes (see its docstring), so a
real server's log line ("Available KV cache memory") is the number to trust.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch

# Bytes per element. fp8 caches (e4m3/e5m2) halve fp16's bill; int4 is listed for weights.
DTYPE_BYTES: dict[str, float] = {
    "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1, "int4": 0.5,
}
DTYPE_ALIASES = {
    "fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16",
    "bf16": "bfloat16", "fp8": "float8_e4m3fn", "float8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn", "float8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2",
}

# Each family names the same numbers differently; we try the names in this order.
LAYER_FIELDS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
HEAD_FIELDS = ("num_attention_heads", "n_head", "num_heads", "n_heads")
KV_HEAD_FIELDS = ("num_key_value_heads", "num_kv_heads", "n_head_kv", "n_kv_heads")
HIDDEN_FIELDS = ("hidden_size", "n_embd", "d_model", "dim")
# The MLP's inner width and the vocabulary size the activation estimate needs, and the context
# window (how many positions the model was trained for). GPT-2 and Falcon-7B state no inner
# width: theirs is 4 x hidden (from_config knows which families do that).
INTERMEDIATE_FIELDS = ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size")
VOCAB_FIELDS = ("vocab_size", "padded_vocab_size")
CONTEXT_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def dtype_name(dtype: str | torch.dtype) -> str:
    """The canonical name of a dtype ("fp16" and torch.float16 are both "float16")."""
    name = str(dtype).lower().removeprefix("torch.")
    return DTYPE_ALIASES.get(name, name)


def dtype_bytes(dtype: str | torch.dtype) -> float:
    """Bytes per element of a dtype given by name ("fp16", "bfloat16", "fp8") or torch dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype.itemsize
    name = dtype_name(dtype)
    if name not in DTYPE_BYTES:
        known = ", ".join(sorted(set(DTYPE_BYTES) | set(DTYPE_ALIASES)))
        raise ValueError(f"unknown dtype {dtype!r}; use one of: {known}")
    return DTYPE_BYTES[name]


def _field(cfg: Any, names: tuple[str, ...]) -> Any:
    """The first of `names` that the config (dict or PretrainedConfig) sets to a value."""
    for name in names:
        value = cfg.get(name) if isinstance(cfg, Mapping) else getattr(cfg, name, None)
        if value is not None:
            return value
    return None


@dataclass(frozen=True)
class ModelShape:
    """The four numbers that size a KV cache (plus a name and, when known, the parameter count,
    the sizes the activation estimate needs and the context window)."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    name: str = ""
    num_params: int | None = None
    hidden_size: int | None = None
    intermediate_size: int | None = None
    vocab_size: int | None = None
    context_len: int | None = None  # max_position_embeddings: the longest sequence it was trained for

    def __post_init__(self):
        for field in ("num_layers", "num_heads", "num_kv_heads", "head_dim"):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelShape.{field} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads}): each KV head serves a group")

    @property
    def attention(self) -> str:
        if self.num_kv_heads == self.num_heads:
            return "MHA"
        return "MQA" if self.num_kv_heads == 1 else f"GQA ({self.num_heads // self.num_kv_heads} q heads per kv head)"

    @classmethod
    def from_config(cls, cfg: Any, name: str = "", num_params: int | None = None) -> "ModelShape":
        """Read a transformers ``PretrainedConfig`` or a plain dict (a config.json) of any common family."""
        if _field(cfg, ("text_config",)) is not None:  # multimodal wrappers keep the LM in text_config
            cfg = _field(cfg, ("text_config",))
        if _field(cfg, ("kv_lora_rank",)) is not None:
            raise ValueError("this config uses multi-head latent attention (MLA, e.g. DeepSeek-V2/V3): it caches "
                             "a compressed latent, not K/V per head, and minikv does not size it")
        name = name or next((v for v in (_field(cfg, (f,)) for f in ("_name_or_path", "name_or_path", "model_type"))
                             if v), "")
        layers, heads = _field(cfg, LAYER_FIELDS), _field(cfg, HEAD_FIELDS)
        missing = [what for what, value in (("number of layers", layers), ("number of attention heads", heads))
                   if value is None]
        if missing:
            raise ValueError(f"config {name!r} has no {' and no '.join(missing)} "
                             f"(looked for {LAYER_FIELDS if layers is None else HEAD_FIELDS}); "
                             "pass a ModelShape(num_layers=..., num_heads=..., num_kv_heads=..., head_dim=...) instead")

        # Multi-query models say so with a flag instead of a head count (Falcon-7B, GPTBigCode);
        # Falcon's "new decoder architecture" (40B/180B) uses num_kv_heads instead.
        if _field(cfg, ("new_decoder_architecture",)):
            kv_heads = _field(cfg, ("num_kv_heads",))
        elif _field(cfg, ("multi_query",)):
            kv_heads = 1
        elif _field(cfg, ("multi_query_attention",)):  # ChatGLM
            kv_heads = _field(cfg, ("multi_query_group_num",))
        else:
            kv_heads = _field(cfg, KV_HEAD_FIELDS)
        kv_heads = kv_heads or heads  # plain multi-head attention: every query head has its own K/V

        head_dim = _field(cfg, ("head_dim",))  # Gemma sets it explicitly, and not as hidden/heads
        if head_dim is None:
            hidden = _field(cfg, HIDDEN_FIELDS)
            if hidden is None:
                raise ValueError(f"config {name!r} has neither head_dim nor a hidden size "
                                 f"(looked for {HIDDEN_FIELDS}); add head_dim to it")
            head_dim = hidden // heads
        hidden = _field(cfg, HIDDEN_FIELDS)
        inner = _field(cfg, INTERMEDIATE_FIELDS)
        if inner is None and hidden is not None and (_field(cfg, ("model_type",)) in ("gpt2", "falcon")
                                                     or _field(cfg, ("n_embd",)) is not None):
            inner = 4 * hidden  # GPT-2 (n_inner: null) and Falcon-7B leave it out: 4 x hidden by convention
        vocab, context = _field(cfg, VOCAB_FIELDS), _field(cfg, CONTEXT_FIELDS)
        as_int = lambda v: None if v is None else int(v)
        return cls(int(layers), int(heads), int(kv_heads), int(head_dim), str(name), num_params,
                   as_int(hidden), as_int(inner), as_int(vocab), as_int(context))


def as_shape(shape_or_cfg: Any) -> ModelShape:
    """Accept a ModelShape, a config (object or dict), or the name of a model in MODEL_CONFIGS."""
    if isinstance(shape_or_cfg, ModelShape):
        return shape_or_cfg
    if isinstance(shape_or_cfg, str):
        return model_spec(shape_or_cfg)
    return ModelShape.from_config(shape_or_cfg)


def kv_bytes_per_token(shape_or_cfg: Any, dtype: str | torch.dtype = "float16") -> int:
    """2 (K and V) x layers x kv_heads x head_dim x bytes per element."""
    s = as_shape(shape_or_cfg)
    return math.ceil(2 * s.num_layers * s.num_kv_heads * s.head_dim * dtype_bytes(dtype))


def kv_bytes_per_block(shape_or_cfg: Any, block_size: int, dtype: str | torch.dtype = "float16") -> int:
    """What one block id of a paged pool holds: K and V of `block_size` tokens, every layer.

    The one rule for it: the engine sizes its pool with it, the model runner and ``PagedKVCache``
    report it."""
    return kv_bytes_per_token(shape_or_cfg, dtype) * block_size


def cache_shape(config) -> ModelShape:
    """The ModelShape of a config, for a cache that hands every cached token to attention.

    A sliding-window or chunked layer must see only its window, so caching and returning every
    token would silently compute something else: such models are refused here (stages 2, 3 and
    the engine's runner all build their caches from this)."""
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    layer_types = getattr(cfg, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types) or (
        not layer_types and (getattr(cfg, "sliding_window", None) or getattr(cfg, "attention_chunk_size", None))
    ):
        raise ValueError(
            "minikv's caches support full-attention models only (every layer attends to every "
            f"earlier token); this config has layer types {sorted(set(layer_types)) or 'with a sliding window'}. "
            "Use transformers' DynamicCache for it."
        )
    return ModelShape.from_config(cfg)


def kv_cache_bytes(shape_or_cfg: Any, num_tokens: int, dtype: str | torch.dtype = "float16") -> int:
    """Bytes of KV cache for `num_tokens` tokens (one long sequence or many short ones alike)."""
    if not isinstance(num_tokens, int) or num_tokens < 0:
        raise ValueError(f"num_tokens must be a non-negative integer, got {num_tokens!r}")
    return kv_bytes_per_token(shape_or_cfg, dtype) * num_tokens


def weight_bytes(num_params: int, dtype: str | torch.dtype = "float16") -> int:
    """Bytes to hold the weights: parameters x bytes per parameter."""
    if not isinstance(num_params, int) or num_params <= 0:
        raise ValueError(f"num_params must be a positive integer, got {num_params!r}")
    return math.ceil(num_params * dtype_bytes(dtype))


# --- real models and GPUs ------------------------------------------------------------------

# Each entry is the part of the model's published config.json that sizing reads, spelled the
# way that family spells it, so the table exercises from_config as a real config would.
# Keys are copied from the files; the one exception is marked where it occurs.
MODEL_CONFIGS: dict[str, tuple[dict, int]] = {
    "llama-2-7b": ({"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
                    "hidden_size": 4096, "intermediate_size": 11008, "vocab_size": 32000,
                    "max_position_embeddings": 4096}, 6_738_415_616),
    # Llama-3-8B's context is 8,192; Llama-3.1-8B has the same shape with 131,072.
    "llama-3-8b": ({"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                    "hidden_size": 4096, "intermediate_size": 14336, "vocab_size": 128256,
                    "max_position_embeddings": 8192}, 8_030_261_248),
    "llama-3-70b": ({"num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
                     "hidden_size": 8192, "intermediate_size": 28672, "vocab_size": 128256,
                     "max_position_embeddings": 8192}, 70_553_706_496),
    "mistral-7b": ({"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                    "hidden_size": 4096, "intermediate_size": 14336, "vocab_size": 32000,
                    "max_position_embeddings": 32768}, 7_241_732_096),
    "qwen2.5-7b": ({"num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
                    "hidden_size": 3584, "intermediate_size": 18944, "vocab_size": 152064,
                    "max_position_embeddings": 32768}, 7_615_616_512),
    "smollm2-135m": ({"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                      "hidden_size": 576, "intermediate_size": 1536, "vocab_size": 49152,
                      "max_position_embeddings": 8192}, 134_515_008),
    "gemma-7b": ({"num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 16,
                  "hidden_size": 3072, "head_dim": 256, "intermediate_size": 24576, "vocab_size": 256000,
                  "max_position_embeddings": 8192}, 8_537_680_896),
    # Falcon-7B's config.json has no context key (and no num_kv_heads): max_position_embeddings
    # here is the 2,048 of its model card, added so the table can mark it.
    "falcon-7b": ({"model_type": "falcon", "num_hidden_layers": 32, "num_attention_heads": 71, "hidden_size": 4544,
                   "multi_query": True, "new_decoder_architecture": False, "vocab_size": 65024,
                   "max_position_embeddings": 2048}, 6_921_720_704),
    "opt-13b": ({"num_hidden_layers": 40, "num_attention_heads": 40, "hidden_size": 5120, "ffn_dim": 20480,
                 "vocab_size": 50272, "max_position_embeddings": 2048}, 12_853_473_280),
    "gpt2": ({"model_type": "gpt2", "n_layer": 12, "n_head": 12, "n_embd": 768, "vocab_size": 50257,
              "n_positions": 1024}, 124_439_808),
}


def model_spec(name: str) -> ModelShape:
    key = name.lower()
    if key not in MODEL_CONFIGS:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(MODEL_CONFIGS)} "
                         "(or pass a config / ModelShape)")
    cfg, params = MODEL_CONFIGS[key]
    return ModelShape.from_config(cfg, name=key, num_params=params)


@dataclass(frozen=True)
class GPU:
    name: str
    memory_bytes: int
    bandwidth_gb_s: float  # peak HBM/GDDR bandwidth from the datasheet (GB/s, 1e9)
    fp16_tflops: float     # dense fp16 tensor-core peak from the datasheet


GiB = 1024**3
# Datasheet sizes ("80 GB") are read as GiB, which is close to what nvidia-smi reports
# (an H200 shows about 140 GiB of its "141 GB"). The T4 is the exception: its ECC memory
# leaves 15 GiB of the 16 GB on the datasheet, and that is what Colab gives you.
GPUS: dict[str, GPU] = {g.name.lower(): g for g in (
    GPU("T4", 15 * GiB, 320, 65),
    GPU("RTX-4090", 24 * GiB, 1008, 165),
    GPU("A100-40GB", 40 * GiB, 1555, 312),
    GPU("A100-80GB", 80 * GiB, 2039, 312),
    GPU("H100", 80 * GiB, 3350, 989),
    GPU("H200", 141 * GiB, 4800, 989),
)}


def gpu_spec(name: str) -> GPU:
    key = name.lower().replace("_", "-").replace(" ", "-")
    if key not in GPUS:
        raise ValueError(f"unknown GPU {name!r}; known GPUs: {', '.join(g.name for g in GPUS.values())}")
    return GPUS[key]


# What one forward pass may carry, as vLLM sizes it by default: ``max_num_batched_tokens``
# tokens at once (8,192 for its offline ``LLM`` class with chunked prefill), ``max_num_seqs``
# sequences (256) sampled at the end.
MAX_NUM_BATCHED_TOKENS = 8192
MAX_NUM_SEQS = 256
# CUDA context, cuBLAS/NCCL workspaces and the CUDA-graph memory pool: none of it is in the
# weights or activations. It depends on the driver, the versions and how many batch sizes
# are captured; 1 GiB is a round figure, not a measurement.
RUNTIME_BYTES = 2**30


def activation_bytes(shape_or_cfg: Any, max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS,
                     max_num_seqs: int = MAX_NUM_SEQS, dtype: str | torch.dtype = "float16",
                     runtime_bytes: int = RUNTIME_BYTES) -> int | None:
    """An estimate of the serving process's memory besides weights and KV cache, or None when
    the shape lacks the sizes it needs (hidden, MLP inner width, vocabulary).

    A forward pass of T = ``max_num_batched_tokens`` tokens frees each layer's activations
    before the next layer runs, so its peak is inside one layer, in the MLP: the residual
    stream and its normalised copy (2 x hidden per token) are alive while the gate-and-up
    projection (2 x inner) and its activated product (inner) are made: T x (2 hidden + 3 inner)
    numbers. Then the sampler: fp32 logits and probabilities for each of ``max_num_seqs``
    sequences over the vocabulary. Then ``runtime_bytes`` for everything that is not a
    tensor (see RUNTIME_BYTES). vLLM measures this sum instead; the estimate tells you its size."""
    s = as_shape(shape_or_cfg)
    if None in (s.hidden_size, s.intermediate_size, s.vocab_size):
        return None
    if max_num_batched_tokens < 1 or max_num_seqs < 1:
        raise ValueError(f"max_num_batched_tokens and max_num_seqs must be >= 1, got "
                         f"{max_num_batched_tokens} and {max_num_seqs}")
    layer_peak = max_num_batched_tokens * (2 * s.hidden_size + 3 * s.intermediate_size) * dtype_bytes(dtype)
    logits = min(max_num_seqs, max_num_batched_tokens) * s.vocab_size * 4 * 2
    return math.ceil(layer_peak + logits + runtime_bytes)


@dataclass(frozen=True)
class KVBill:
    """What one deployment costs in memory: the numbers `python -m minikv size` prints."""

    model: ModelShape
    context_len: int
    dtype: str
    bytes_per_token: int
    bytes_per_sequence: int
    weight_bytes: int | None
    gpu: GPU | None = None
    kv_budget_bytes: int | None = None   # what is left for the cache after weights, activations and headroom
    sequences_that_fit: int | None = None
    utilization_cap: float = 0.9         # share of the card the process may use (vLLM's gpu_memory_utilization)
    activation_bytes: int | None = None  # activation peak + runtime, estimated; None: not modeled

    def rows(self) -> list[tuple[str, str]]:
        """The bill as (label, value) rows, for printing beside other rows."""
        rows = [("model", f"{self.model.name or 'custom'}: {self.model.num_layers} layers, "
                          f"{self.model.num_heads} heads, {self.model.num_kv_heads} kv heads "
                          f"[{self.model.attention}], head_dim {self.model.head_dim}"),
                ("KV per token", f"{fmt_bytes(self.bytes_per_token)} ({self.dtype})"),
                (f"KV per {self.context_len:,}-token sequence", fmt_bytes(self.bytes_per_sequence))]
        if self.model.context_len and self.context_len > self.model.context_len:
            rows.append(("warning", f"{self.context_len:,} tokens is past the model's "
                                    f"{self.model.context_len:,}-token context"))
        if self.weight_bytes is not None:
            rows.append(("weights", fmt_bytes(self.weight_bytes)))
        if self.gpu is not None:
            cap = self.gpu.memory_bytes * self.utilization_cap
            rows.append(("GPU", f"{self.gpu.name} ({fmt_bytes(self.gpu.memory_bytes)}), the process may use "
                               f"{self.utilization_cap:.0%}: {fmt_bytes(cap)}"))
            rows.append(("activations + runtime", "not modeled (the config lacks hidden, inner or vocabulary "
                                                  "size): the budget below overstates" if self.activation_bytes is None
                         else f"{fmt_bytes(self.activation_bytes)} (estimate; a server measures it)"))
            if self.kv_budget_bytes <= 0:
                rows.append(("sequences that fit", f"0: the weights and activations alone exceed the "
                                                   f"{fmt_bytes(self.gpu.memory_bytes * self.utilization_cap)} "
                                                   "the process may use"))
            else:
                rows += [("left for the KV cache", fmt_bytes(self.kv_budget_bytes)),
                         ("sequences that fit", f"{self.sequences_that_fit:,}")]
        return rows

    def __str__(self) -> str:
        return format_rows(self.rows())


def max_sequences(shape_or_cfg: Any, gpu: GPU | str, context_len: int, dtype="float16",
                  weight_dtype="float16", num_params: int | None = None,
                  reserve_fraction: float = 0.10, activations: int | None | str = "estimate") -> int:
    """How many sequences of `context_len` tokens fit beside the weights (see kv_bill)."""
    return kv_bill(shape_or_cfg, context_len, gpu, dtype, weight_dtype, num_params,
                   reserve_fraction, activations).sequences_that_fit


def kv_bill(shape_or_cfg: Any, context_len: int, gpu: GPU | str | None = None, dtype="float16",
            weight_dtype="float16", num_params: int | None = None,
            reserve_fraction: float = 0.10, activations: int | None | str = "estimate") -> KVBill:
    """The KV bill of serving `context_len`-token sequences, and on a `gpu` how many fit.

    As in vLLM, the process may use ``1 - reserve_fraction`` of the card (its
    gpu_memory_utilization, 0.9 by default); the weights, then the activation peak and the
    runtime come out of that, and the KV cache gets the rest:

        budget = memory x (1 - reserve_fraction) - weights - activations

    ``activations``: "estimate" (default) uses ``activation_bytes(shape)``, which is 0 when the
    config lacks the sizes it needs (the bill then says so); an int gives the bytes (0 ignores them)."""
    shape = as_shape(shape_or_cfg)
    if not isinstance(context_len, int) or context_len <= 0:
        raise ValueError(f"context_len must be a positive integer, got {context_len!r}")
    if not 0 <= reserve_fraction < 1:
        raise ValueError(f"reserve_fraction must be in [0, 1), got {reserve_fraction!r}")
    if activations == "estimate":
        act = activation_bytes(shape, dtype=weight_dtype if dtype_bytes(weight_dtype) >= 2 else "float16")
    elif isinstance(activations, int) and activations >= 0:
        act = activations
    else:
        raise ValueError(f"activations must be 'estimate' or a number of bytes >= 0, got {activations!r}")
    params = num_params or shape.num_params
    weights = weight_bytes(params, weight_dtype) if params else None
    per_token = kv_bytes_per_token(shape, dtype)
    per_seq = per_token * context_len
    if gpu is None:
        return KVBill(shape, context_len, dtype_name(dtype), per_token, per_seq, weights)
    gpu = gpu_spec(gpu) if isinstance(gpu, str) else gpu
    if weights is None:
        raise ValueError(f"to fit {shape.name or 'this model'} on a GPU the parameter count is needed: "
                         "pass num_params=")
    budget = int(gpu.memory_bytes * (1 - reserve_fraction)) - weights - (act or 0)
    return KVBill(shape, context_len, dtype_name(dtype), per_token, per_seq, weights, gpu, budget,
                  max(budget, 0) // per_seq, 1 - reserve_fraction, act)


def format_rows(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def fmt_bytes(n: float) -> str:
    """Human-readable bytes in powers of 1024 (KiB, MiB, GiB), as memory is sold to programs."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1024
