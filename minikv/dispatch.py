"""Which paged attention runs: the PyTorch reference of stage 3 or the Triton kernel of stage 4.

This is the one place that chooses. ``minikv.attention`` (the reference and the calling convention)
imports no kernel, ``kernels/paged_attention.py`` imports only the convention's check from it, and
everything that wants "the right attention for these tensors" asks here: notebooks through
``decode_attention``, the engine's runner through ``kernel_wanted``. So the import graph has no circle.
"""

from __future__ import annotations

import importlib.util

import torch

from minikv.attention import paged_attention_ref


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def kernel_wanted(device: torch.device | str, use_kernel: bool | None = None) -> bool:
    """Whether decode attention on ``device`` goes through the Triton kernel.

    ``None``: the compiled kernel on CUDA when Triton is installed, the PyTorch path otherwise.
    ``True`` forces the kernel, which on the CPU runs under Triton's interpreter: exact but slow,
    useful to check it, never to time it. ``False`` never uses it.
    """
    if use_kernel is None:
        return torch.device(device).type == "cuda" and triton_installed()
    if use_kernel and not triton_installed():
        raise ImportError("use_kernel=True needs Triton: pip install 'triton>=3.2' "
                          "(or pass use_kernel=None to use the PyTorch reference)")
    return bool(use_kernel)


def decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    use_kernel: bool | None = None,
) -> torch.Tensor:
    """Paged attention for one decode step (the calling convention of ``minikv.attention``), by the
    fastest correct route available: see ``kernel_wanted`` for ``use_kernel``."""
    if not kernel_wanted(query.device, use_kernel):
        return paged_attention_ref(query, key_cache, value_cache, block_tables, seq_lens, scale)
    # Imported here, not at the top: importing the kernel module imports Triton and, without a
    # GPU, switches it to interpreter mode; code that only wants the reference should not pay that.
    from kernels.paged_attention import paged_attention

    return paged_attention(query, key_cache, value_cache, block_tables, seq_lens, scale)
