"""The CPU attention kernels (``paged_attention_cpu.cpp``): paged decode and a prompt's causal attention.

On the CPU the engine's PyTorch path gathers every decoding sequence's K/V blocks into a copy, in
every layer of every step, before it multiplies. The C++ kernel beside this file reads them where
they lie, through the block table, as stage 4's Triton kernel does on a GPU. It is compiled on first
use with PyTorch's own extension builder (a C++ compiler and ``ninja`` are needed; about a minute
once, then the build is reused from ``~/.cache/torch_extensions``) and registered as the operator
``torch.ops.minikv_cpu.paged_decode``, with a fake implementation so ``torch.compile`` can treat it
as one opaque call. The same build holds ``torch.ops.minikv_cpu.prompt_attention``: a prompt's first
chunk attending to itself, causally (what the runner otherwise hands to PyTorch's SDPA).

:func:`load` never raises: if the build fails (no compiler, say), it returns None with the reason in
:data:`why_not`, and the runner keeps its PyTorch path, which computes the same thing.
"""

from __future__ import annotations

import os
import platform
import threading
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("paged_attention_cpu.cpp")
_lock = threading.Lock()
_op = None
why_not: str | None = None  # why the kernel is unavailable, once load() has tried


def _flags() -> tuple[list[str], list[str]]:
    """Compiler and linker flags. ATen's parallel_for is a header template: it runs on PyTorch's OpenMP
    threads only if this file is compiled with OpenMP, else on one thread. On Linux the extension's
    libgomp.so.1 is the one torch already loaded (same soname), so there is one thread pool, not two."""
    cflags, ldflags = ["-O3"], []
    if platform.machine() in ("x86_64", "AMD64"):
        cflags.append("-march=native")  # the build is cached per machine; AVX-512 where the CPU has it
    if platform.system() == "Linux":
        cflags.append("-fopenmp")
        ldflags.append("-fopenmp")
    return cflags, ldflags


def load(verbose: bool = False):
    """The compiled operator, building it on first call; None (and :data:`why_not`) if it cannot be built."""
    global _op, why_not
    with _lock:
        if _op is not None or why_not is not None:
            return _op
        if os.environ.get("MINIKV_CPU_KERNEL") == "0":
            why_not = "switched off by MINIKV_CPU_KERNEL=0"
            return None
        try:
            from torch.utils.cpp_extension import load as build

            cflags, ldflags = _flags()
            build(name="minikv_paged_attention_cpu", sources=[str(SOURCE)], extra_cflags=cflags,
                  extra_ldflags=ldflags, is_python_module=False, verbose=verbose)
            op = torch.ops.minikv_cpu.paged_decode

            @torch.library.register_fake("minikv_cpu::paged_decode")
            def _fake(query, k_store, v_store, block_tables, seq_lens, scale):
                return torch.empty_like(query)

            @torch.library.register_fake("minikv_cpu::prompt_attention")
            def _fake_prompt(query, key, value, scale):
                return torch.empty_like(query)

            _op = op
        except Exception as error:  # a missing compiler or ninja: say so and let the caller fall back
            why_not = f"{type(error).__name__}: {str(error).strip().splitlines()[-1] if str(error).strip() else ''}"
        return _op


def paged_decode(query: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Decode attention: query [S, H, D] over head-major stores [KVH, blocks, block_size, D]; returns [S, H, D].

    fp32 CPU tensors; block_tables [S, W] and seq_lens [S] int32. Raises if the kernel cannot be built.
    """
    op = _op if _op is not None else load()  # no lock once loaded (torch.compile cannot trace one)
    if op is None:
        raise RuntimeError(f"the CPU paged-attention kernel could not be built ({why_not})")
    return op(query.contiguous(), k_store, v_store, block_tables, seq_lens, float(scale))


def prompt_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of T fresh tokens over themselves: query [T, H, D], key/value [T, KVH, D] (the H query
    heads in KVH groups); returns [T, H, D]. fp32 CPU tensors. Raises if the kernel cannot be built."""
    if _op is None and load() is None:
        raise RuntimeError(f"the CPU attention kernels could not be built ({why_not})")
    return torch.ops.minikv_cpu.prompt_attention(query.contiguous(), key.contiguous(), value.contiguous(),
                                                 float(scale))
