"""The engine's settings, in one validated dataclass, and the command-line flags that build it.

`LLM(model, block_size=8, num_blocks=64)`, `LLMEngine(model, tok, config=EngineConfig(...))`,
`python -m minikv serve --block-size 8 --num-blocks 64` and `python -m minikv bench serve
--block-size 8 ...` all end in the same `EngineConfig`, checked once here: a bad value raises
`minikv.validation.InvalidArgument` whose ``.param`` names it and whose message says what it must
be. The flags are made from the fields (`add_engine_args`), so a new setting is one new field.
"""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass, fields

from minikv.validation import (
    InvalidArgument,
    InvalidArgumentType,
    check_block_size,
    check_bool,
    check_int,
    check_long_prefill_token_threshold,
    check_number,
    check_preemption_mode,
)

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: int | float | str, param: str = "a memory size") -> int:
    """``2 * 2**30``, ``"2GiB"``, ``"512 MB"``, ``"1.5gib"`` -> bytes. `param` names the argument in errors."""
    must = "a positive number of bytes or a string like '2GiB' or '512MB'"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value > 0 and math.isfinite(value):
            return int(value)
        raise InvalidArgument(param, value, must)
    if not isinstance(value, str):
        raise InvalidArgumentType(param, value, must)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?b|b)?\s*", value.lower())
    if not m or float(m.group(1)) <= 0:
        raise InvalidArgument(param, value, must)
    return int(float(m.group(1)) * _UNITS[m.group(2) or ""])


@dataclass
class EngineConfig:
    """How the engine runs (vLLM's names). See `LLMEngine` for what each lever does."""

    block_size: int = 16                          # tokens per KV block
    num_blocks: int | None = None                 # KV pool size in blocks (wins over kv_cache_memory)
    kv_cache_memory: int | float | str | None = None   # KV pool size in bytes or like "2GiB"
    max_num_seqs: int = 64                        # sequences computing at once (seats)
    max_num_batched_tokens: int | None = None     # tokens per step (None: 2048, or the context without chunking)
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int | None = None   # one request's prefill chunk per step at most (None/0: no cap)
    preemption_mode: str = "recompute"            # or "swap"
    swap_space: int | float | str | None = None   # CPU swap in bytes or like "4GiB" (None: as big as the pool)
    watermark: float = 0.01                       # share of the pool kept free when admitting
    verbose: bool = True                          # print the pool's size at start
    prepack_linears: bool | None = None           # oneDNN weight prepacking (None: on the CPU in fp32)
    cpu_kernel: bool | None = None                # C++ attention kernels (None: on the CPU in fp32, when they build)
    compile: bool = False                         # torch.compile of every step of >= 2 tokens
    decode_graphs: bool = False                   # CUDA graphs for decode steps (one extra scratch block)

    def __post_init__(self) -> None:
        check_block_size(self.block_size)
        check_int("num_blocks", self.num_blocks, 1, "KV blocks in the pool", optional=True)
        check_int("max_num_seqs", self.max_num_seqs, 1, "sequences running at once")
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1, "tokens computed per step", optional=True)
        check_bool("enable_prefix_caching", self.enable_prefix_caching)
        check_bool("enable_chunked_prefill", self.enable_chunked_prefill)
        check_long_prefill_token_threshold(self.long_prefill_token_threshold, self.enable_chunked_prefill)
        check_preemption_mode(self.preemption_mode)
        for name in ("kv_cache_memory", "swap_space"):
            if getattr(self, name) is not None:
                parse_bytes(getattr(self, name), name)
        check_number("watermark", self.watermark, 0, 1, high_open=True,
                     what="share of the pool kept free when admitting")
        for name in ("verbose", "compile", "decode_graphs"):
            check_bool(name, getattr(self, name))
        for name in ("prepack_linears", "cpu_kernel"):
            if getattr(self, name) is not None:
                check_bool(name, getattr(self, name))

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineConfig:
        """`LLM(model, **kwargs)`'s keywords; an unknown one is named, with the ones there are."""
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(kwargs) - set(names))
        if unknown:
            raise TypeError(f"unknown engine argument(s) {', '.join(unknown)}; the engine takes model, tokenizer, "
                            f"runner and {', '.join(names)}")
        return cls(**kwargs)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, **overrides) -> EngineConfig:
        """The config of `add_engine_args`' flags: a flag left out keeps the field's default."""
        given = {f.name: getattr(args, f.name) for f in fields(cls)
                 if f.name in _FLAGS and getattr(args, f.name, None) is not None}
        return cls(**(given | overrides))


# field -> (argparse type, help); the booleans become --x / --no-x
_FLAGS = {
    "block_size": (int, "tokens per KV block (default 16)"),
    "num_blocks": (int, "KV pool size in blocks (overrides --kv-cache-memory)"),
    "kv_cache_memory": (str, "KV pool size in bytes or like '256MiB' (default: 1 GiB on the CPU, half the free "
                             "GPU memory on a GPU, capped by --max-num-seqs)"),
    "max_num_seqs": (int, "sequences in one batch at most (default 64)"),
    "max_num_batched_tokens": (int, "tokens per step at most (default 2048)"),
    "enable_prefix_caching": (bool, "share the KV blocks of repeated prompt prefixes (default on)"),
    "enable_chunked_prefill": (bool, "split long prompts over steps (default on)"),
    "long_prefill_token_threshold": (int, "one request's prompt tokens per step at most (default: no cap)"),
    "preemption_mode": (("recompute", "swap"), "what preemption does to a sequence's blocks (default recompute)"),
    "swap_space": (str, "CPU swap for --preemption-mode swap, bytes or like '4GiB' (default: the pool's size)"),
    "watermark": (float, "share of the pool kept free when admitting (default 0.01)"),
    "prepack_linears": (bool, "oneDNN weight prepacking (default: on the CPU in fp32)"),
    "cpu_kernel": (bool, "C++ attention kernels, decode and prompt (default: on the CPU in fp32, when they build)"),
    "compile": (bool, "torch.compile every step, attention outside the graph (default off: minutes of start-up)"),
    "decode_graphs": (bool, "CUDA graphs for decode steps (default off)"),
}


def add_engine_args(parser: argparse.ArgumentParser, help: dict[str, str] | None = None) -> None:
    """The engine's flags, one per `EngineConfig` field (`verbose` aside); each defaults to None: not given.
    `parser` may be an argument group; `help` replaces a flag's help where a command has defaults of its own."""
    for name, (kind, help_) in _FLAGS.items():
        help_ = (help or {}).get(name, help_)
        flag = "--" + name.replace("_", "-")
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_)
        elif isinstance(kind, tuple):
            parser.add_argument(flag, choices=kind, default=None, help=help_)
        else:
            parser.add_argument(flag, type=kind, default=None, help=help_)


def engine_flags(args: argparse.Namespace) -> list[str]:
    """The flags given to `add_engine_args`, spelled again for another command (bench serve -> serve)."""
    out = []
    for name, (kind, _) in _FLAGS.items():
        value = getattr(args, name, None)
        if value is None:
            continue
        flag = "--" + name.replace("_", "-")
        out += ([flag] if value else ["--no-" + flag[2:]]) if kind is bool else [flag, str(value)]
    return out
