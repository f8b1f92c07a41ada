"""The engine's settings, in one validated dataclass, and the command-line flags that build it.

`LLM(model, block_size=8, num_blocks=64)`, `LLMEngine(model, tok, config=EngineConfig(...))`,
`python -m minikv serve --block-size 8 --num-blocks 64` and `python -m minikv bench serve
--block-size 8 ...` all end in the same `EngineConfig`, checked once here: a bad value raises
`minikv.validation.InvalidArgument` whose ``.param`` names it and whose message says what it must
be. The flags are made from the fields' metadata (`setting`, `add_engine_args`), so a new setting is one
new field; the scheduler's and the input processor's views are derived here (`scheduler_config`, `limits`).
"""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass, field, fields

from minikv.inputs import EngineLimits
from minikv.scheduler import SchedulerConfig
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


def setting(default, help: str, kind=None, no_flag: str | None = None):
    """A field of `EngineConfig` with its command-line flag: ``kind`` is the flag's argparse type (``bool``:
    --x / --no-x; a tuple: choices; default: the default's type), ``help`` its help. A setting with no flag
    says why in ``no_flag`` (tests/test_seams.py fails on a field with neither)."""
    return field(default=default, metadata={"help": help, "kind": kind, "no_flag": no_flag})


@dataclass
class EngineConfig:
    """How the engine runs (vLLM's names). See `LLMEngine` for what each lever does.

    Every setting, its default, its check and its flag are here, once. The scheduler's and the input
    processor's views (`minikv.scheduler.SchedulerConfig`, `minikv.inputs.EngineLimits`) are derived from
    it by `scheduler_config` and `limits`, with the pool's size the engine measured."""

    block_size: int = setting(16, "tokens per KV block (default 16)")
    num_blocks: int | None = setting(None, "KV pool size in blocks (overrides --kv-cache-memory)", int)
    kv_cache_memory: int | float | str | None = setting(
        None, "KV pool size in bytes or like '256MiB' (default: 1 GiB on the CPU, half the free GPU memory on a "
              "GPU, capped by --max-num-seqs)", str)
    max_num_seqs: int = setting(64, "sequences in one batch at most (default 64)")
    max_num_batched_tokens: int | None = setting(
        None, "tokens per step at most (default 2048; without chunked prefill at least the context)", int)
    enable_prefix_caching: bool = setting(True, "share the KV blocks of repeated prompt prefixes (default on)")
    enable_chunked_prefill: bool = setting(True, "split long prompts over steps (default on)")
    long_prefill_token_threshold: int | None = setting(
        None, "one request's prompt tokens per step at most (default: no cap; needs chunked prefill)", int)
    preemption_mode: str = setting("recompute", "what preemption does to a sequence's blocks (default recompute)",
                                   ("recompute", "swap"))
    swap_space: int | float | str | None = setting(
        None, "CPU swap for --preemption-mode swap, bytes or like '4GiB' (default: the pool's size)", str)
    watermark: float = setting(0.01, "share of the pool kept free when admitting (default 0.01)")
    verbose: bool = setting(True, "print the pool's size at start", no_flag=(
        "a command decides what it prints: serve prints its own start-up line, bench serve its table"))
    prepack_linears: bool | None = setting(
        None, "prepack the linear weights for oneDNN and MKL (default: on the CPU in fp32)", bool)
    linears: str | None = setting(
        None, "the linears' path: measured fastest per shape and row count on this host, or one forced (default: "
              "$MINIKV_LINEAR, else measure)", ("measure", "eager", "onednn", "mkl"))
    cpu_kernel: bool | None = setting(
        None, "C++ attention kernels, decode and prompt (default: on the CPU in fp32, when they build)", bool)
    compile: bool = setting(False, "torch.compile every step, attention outside the graph (default off: minutes "
                                   "of start-up)")
    decode_graphs: bool = setting(False, "CUDA graphs for decode steps (default off)")

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
        if self.linears not in (None, "measure", "eager", "onednn", "mkl"):
            raise InvalidArgument("linears", self.linears, "None, 'measure', 'eager', 'onednn' or 'mkl'")

    # -- what the engine derives from it, once the model and the pool are known ------------------------
    def batched_tokens(self, max_model_len: int) -> int:
        """Tokens per step: as given, else 2048; without chunked prefill at least the context, since a
        whole prompt must then fit in one step."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return 2048 if self.enable_chunked_prefill else max(2048, max_model_len)

    def swap_blocks(self, num_blocks: int, bytes_per_block: int) -> int:
        """The CPU swap space in blocks: none unless preempting by swap; then `swap_space`, or the pool's size."""
        if self.preemption_mode != "swap":
            return 0
        if self.swap_space is None:
            return num_blocks
        return parse_bytes(self.swap_space, "swap_space") // bytes_per_block

    def scheduler_config(self, num_blocks: int, bytes_per_block: int, max_model_len: int) -> SchedulerConfig:
        """The scheduler's read-only view of these settings, for a pool of `num_blocks`."""
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.batched_tokens(max_model_len),
            enable_chunked_prefill=self.enable_chunked_prefill, preemption_mode=self.preemption_mode,
            watermark_blocks=max(1, int(self.watermark * num_blocks)) if self.watermark > 0 else 0,
            swap_blocks=self.swap_blocks(num_blocks, bytes_per_block),
            long_prefill_token_threshold=self.long_prefill_token_threshold)

    def limits(self, vocab_size: int, max_model_len: int, num_blocks: int) -> EngineLimits:
        """The input processor's read-only view: what every request is checked against."""
        return EngineLimits(vocab_size=vocab_size, max_model_len=max_model_len, num_blocks=num_blocks,
                            block_size=self.block_size, max_num_seqs=self.max_num_seqs,
                            max_num_batched_tokens=self.batched_tokens(max_model_len),
                            enable_chunked_prefill=self.enable_chunked_prefill)

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
        given = {f.name: getattr(args, f.name) for f in flag_fields() if getattr(args, f.name, None) is not None}
        return cls(**(given | overrides))


def flag_fields() -> list:
    """The `EngineConfig` fields that have a command-line flag."""
    return [f for f in fields(EngineConfig) if not f.metadata.get("no_flag")]


def flag_kind(f):
    """A field's argparse type: its metadata's, else its default's (bool, int, float, str)."""
    return f.metadata.get("kind") or type(f.default)


def add_engine_args(parser: argparse.ArgumentParser, help: dict[str, str] | None = None) -> None:
    """The engine's flags, one per `EngineConfig` field that has one; each defaults to None: not given.
    `parser` may be an argument group; `help` replaces a flag's help where a command has defaults of its own."""
    for f in flag_fields():
        kind, help_ = flag_kind(f), (help or {}).get(f.name, f.metadata["help"])
        flag = "--" + f.name.replace("_", "-")
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_)
        elif isinstance(kind, tuple):
            parser.add_argument(flag, choices=kind, default=None, help=help_)
        else:
            parser.add_argument(flag, type=kind, default=None, help=help_)


def engine_flags(args: argparse.Namespace) -> list[str]:
    """The flags given to `add_engine_args`, spelled again for another command (bench serve -> serve)."""
    out = []
    for f in flag_fields():
        value = getattr(args, f.name, None)
        if value is None:
            continue
        flag = "--" + f.name.replace("_", "-")
        out += ([flag] if value else ["--no-" + flag[2:]]) if flag_kind(f) is bool else [flag, str(value)]
    return out
