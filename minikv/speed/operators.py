"""Opaque operators for compiled graphs, at the least cost a call from a graph can have.

A compiled step calls our own operators about 150 times (every matmul, ``minikv.speed.linears``; every layer's
attention, ``minikv.runner``): to the compiler each is one opaque call whose fake implementation gives only its
output's shape, at run time a few lines of Python. ``@torch.library.custom_op`` wraps that Python in checks made
at every call (that no output aliases an input, among others); registered with ``torch.library.Library``
directly, the same function runs behind the dispatcher alone. Measured on this course's 2-core AMD EPYC machine
(torch 2.13): a function that returns a fresh empty tensor (1.4 µs called directly) costs 4.4 µs a call as a
``custom_op``, 2.7 µs registered here; a packed linear of 8 rows on a 64x64 weight (oneDNN's call alone: 11.7
µs) 17.4-17.9 µs before, 15.0-15.3 µs with this and the lookups of ``minikv.speed.linears`` trimmed. Over a
step's 150 calls that is about 0.4 ms, on decode steps of 20-30 ms: small, and paid on every step.
What the wrapper checked is ours to keep: each of these operators returns a new tensor, never one of its
inputs or a view of one, and changes none of its inputs (the attention operator writes its layer's K/V store,
which is not an argument, see ``minikv.runner.paged_attention_op``).
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["operator"]

NAMESPACE = "minikv_speed"
_LIBRARY = torch.library.Library(NAMESPACE, "FRAGMENT")
# Each operator's implementation, by name. A module that defines one may be loaded twice in a process (`bench ops`
# loads minikv.speed.linears by path, and then the package may import it again): the later definition takes over,
# as it does with @custom_op, while torch allows a schema only one definition.
_IMPLS: dict[str, Callable] = {}


def operator(schema: str, impl: Callable, fake: Callable) -> torch._ops.OpOverload:
    """Define ``minikv_speed::<schema>`` running `impl` on every device (the compiler keeps it whole: no
    decomposition, no autograd formula), with `fake` for the compiler; returns the operator to call."""
    name = schema.split("(", 1)[0]
    if name not in _IMPLS:
        _LIBRARY.define(schema)
        _LIBRARY.impl(name, lambda *args, **kwargs: _IMPLS[name](*args, **kwargs), "CompositeExplicitAutograd")
        torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=_LIBRARY)
    _IMPLS[name] = impl
    return getattr(getattr(torch.ops, NAMESPACE), name).default
