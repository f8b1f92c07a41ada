"""Argument checks, in one place: each says which argument is wrong, what it got, and what it must be.

A bad argument must fail where it is given, with a message that tells the caller how to fix it,
never halfway through a batch as ``'<' not supported between instances of 'str' and 'int'``. The
checks raise `InvalidArgument`, a ``ValueError`` that carries the argument's name (``.param``) and
value (``.value``), so a server can answer "400: temperature must be ..." without parsing text.
An argument of the wrong *type* raises `InvalidArgumentType`, which is also a ``TypeError``.

Every constructor of the engine's stages (`SamplingParams`, `LLMEngine`, the caches, the block
manager, the model runner) validates through these functions, so one rule reads the same everywhere.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from typing import Any

PREEMPTION_MODES = ("recompute", "swap")


class InvalidArgument(ValueError):
    """A bad argument: ``param`` names it, ``value`` is what was given; the message says what it must be
    (``"{param} must be {must}; got {value!r}"``, or `message` where a sentence of its own says it better)."""

    def __init__(self, param: str, value: Any, must: str = "", *, message: str | None = None):
        self.param, self.value = param, value
        if message is None:
            shown = repr(value)
            if len(shown) > 80:   # a model or a tokenizer prints hundreds of lines
                shown = f"{shown[:60]}... (a {type(value).__name__})"
            message = f"{param} must be {must}; got {shown}"
        super().__init__(message)


class InvalidArgumentType(InvalidArgument, TypeError):
    """An argument of the wrong type (a ``TypeError`` too, as Python raises for those)."""


def _is_int(value: Any) -> bool:
    """int or numpy's integers, not bool (True is an int to Python, never a count to us)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_int(param: str, value: Any, minimum: int | None = None, what: str = "", *,
              optional: bool = False) -> int | None:
    """An integer (not a bool) >= `minimum`; with `optional`, None too. `what` says what the number
    means, to guide the fix."""
    if optional and value is None:
        return None
    must = ("an integer" + (f" >= {minimum}" if minimum is not None else "") + (" or None" if optional else "")
            + (f" ({what})" if what else ""))
    if not _is_int(value):
        raise InvalidArgumentType(param, value, must)
    if minimum is not None and value < minimum:
        raise InvalidArgument(param, value, must)
    return value


def check_number(param: str, value: Any, low: float | None = None, high: float | None = None, *,
                 low_open: bool = False, high_open: bool = False, what: str = "") -> float:
    """A real number (int, float or numpy's, not a bool, not NaN) in the interval given; `*_open` excludes
    that end."""
    interval = ""
    if low is not None and high is not None:
        interval = f" in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    elif low is not None:
        interval = f" {'>' if low_open else '>='} {low}"
    elif high is not None:
        interval = f" {'<' if high_open else '<='} {high}"
    must = "a number" + interval + (f" ({what})" if what else "")
    if not isinstance(value, numbers.Real) or isinstance(value, bool):   # numpy's floats are Real too
        raise InvalidArgumentType(param, value, must)
    if math.isnan(value):
        raise InvalidArgument(param, value, must)
    if low is not None and (value <= low if low_open else value < low):
        raise InvalidArgument(param, value, must)
    if high is not None and (value >= high if high_open else value > high):
        raise InvalidArgument(param, value, must)
    return value


def check_bool(param: str, value: Any, what: str = "") -> bool:
    """True or False (not 0/1 or a string: "false" is truthy, a classic silent bug)."""
    if not isinstance(value, bool):
        raise InvalidArgumentType(param, value, "True or False" + (f" ({what})" if what else ""))
    return value


def check_choice(param: str, value: Any, choices: Iterable[str]) -> str:
    """One of `choices`."""
    choices = tuple(choices)
    if value not in choices:
        raise InvalidArgument(param, value, "one of " + ", ".join(repr(c) for c in choices))
    return value


def check_str_list(param: str, value: Any, what: str = "") -> list[str] | None:
    """None, a non-empty string, or a list/tuple of them; returns None or a list."""
    must = "a non-empty string or a list of non-empty strings" + (f" ({what})" if what else "")
    if value is None:
        return None
    if isinstance(value, str):
        value = [value]
    elif not isinstance(value, (list, tuple)):
        raise InvalidArgumentType(param, value, must)
    if not all(isinstance(s, str) for s in value):
        raise InvalidArgumentType(param, value, must)
    if not all(value):
        raise InvalidArgument(param, value, must)
    return list(value)


def check_int_list(param: str, value: Any, minimum: int | None = None, what: str = "") -> list[int] | None:
    """None, or a list/tuple of integers >= `minimum`; returns None or a list."""
    must = "a list of integers" + (f" >= {minimum}" if minimum is not None else "") + (f" ({what})" if what else "")
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not all(_is_int(t) for t in value):
        raise InvalidArgumentType(param, value, must)
    if minimum is not None and any(t < minimum for t in value):
        raise InvalidArgument(param, value, must)
    return list(value)


# -- the engine's shared arguments -------------------------------------------------------------

def check_block_size(value: Any) -> int:
    return check_int("block_size", value, 1, "tokens per KV block; 16 is the usual choice")


def check_num_blocks(value: Any) -> int:
    return check_int("num_blocks", value, 1, "KV blocks in the pool")


def check_preemption_mode(value: Any) -> str:
    return check_choice("preemption_mode", value, PREEMPTION_MODES)


def check_long_prefill_token_threshold(value: Any, enable_chunked_prefill: bool) -> int | None:
    """vLLM V1's cap on one request's prefill chunk per step (None or 0: no cap). A capped prefill is a
    partial one, so the cap needs chunked prefill (vLLM requires it for partial prefills too)."""
    check_int("long_prefill_token_threshold", value, 0, "the most prompt tokens of one request prefilled in "
              "one step; None or 0 for no cap", optional=True)
    if value and not enable_chunked_prefill:
        raise InvalidArgument("long_prefill_token_threshold", value, message=(
            f"long_prefill_token_threshold={value} cuts a prompt's prefill into chunks, which needs chunked "
            "prefill; set enable_chunked_prefill=True or leave long_prefill_token_threshold None"))
    return value


def check_model(value: Any) -> Any:
    """A loaded ``transformers`` causal LM: a config and parameters (`LLM` also takes a name)."""
    if not (hasattr(value, "config") and callable(getattr(value, "parameters", None))):
        raise InvalidArgumentType("model", value, "a loaded transformers causal LM (LLM(...) also takes a name "
                                  "such as 'smollm2-135m'; minikv.models.load_model loads one)")
    return value


def check_tokenizer(value: Any) -> Any:
    """None, or a tokenizer with ``encode`` and ``decode`` (a Hugging Face one)."""
    has = lambda name: callable(getattr(value, name, None))
    if value is not None and not (has("encode") and has("decode")):
        raise InvalidArgumentType("tokenizer", value, "None or a Hugging Face tokenizer (with encode and decode)")
    return value
