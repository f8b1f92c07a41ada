"""Which paged attention runs: the one place that chooses, for the notebooks and for the engine.

Three backends read K/V from a block pool, under one name each (an ``AttentionBackend``):

* ``"triton"``: the Triton kernel of stage 4 (``kernels/paged_attention.py``), on CUDA; forced on
  the CPU it runs under Triton's interpreter (exact but slow: to check it, never to time it);
* ``"cpu"``: the C++ kernel of ``kernels/paged_attention_cpu.cpp`` (CPU, float32), built on first use;
* ``"gather"``: PyTorch, gathering each sequence's blocks and attending with batched matmuls (the
  runner's vectorized path; in the notebooks, stage 3's reference ``paged_attention_ref``).

`choose_backend` makes the choice from the device, the dtype and the two switches (``use_kernel``
for Triton, ``cpu_kernel`` for the C++ one); the runner asks once, at start, and `kernel_decode` runs
a kernel backend on the runner's step layout, and `attend_layer` is one layer's attention over a planned
step (``minikv.step``), routing each group to its backend: the engine's one entry into attention.
Notebooks ask through `decode_attention`. The gather path's arithmetic is ``minikv.attention``'s.

``minikv.attention`` (the reference and the calling convention) imports no kernel, and
``kernels/paged_attention.py`` imports only the convention's check from it: no import circle.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

from minikv.attention import attend_gathered, paged_attention_ref
from minikv.step import CPU_KERNEL, GATHER, TRITON, AttentionBackend, AttnGroup, StepPlan


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


def cpu_kernel_wanted(device: torch.device | str, dtype: torch.dtype, cpu_kernel: bool | None = None) -> bool:
    """Whether decode attention goes through the C++ kernel. ``None``: on the CPU in float32 when it
    builds; ``True`` insists (and says why it cannot); ``False`` never."""
    if cpu_kernel is False:
        return False
    possible = torch.device(device).type == "cpu" and dtype == torch.float32
    if cpu_kernel and not possible:
        raise ValueError(f"cpu_kernel=True needs a float32 model on the CPU; this one is {dtype} on "
                         f"{torch.device(device).type} (pass cpu_kernel=None to use it only where it applies)")
    if not possible:
        return False
    from minikv_kernels import paged_attention_cpu

    if paged_attention_cpu.load() is None:
        if cpu_kernel:
            raise RuntimeError(f"cpu_kernel=True but the CPU attention kernel could not be built: "
                               f"{paged_attention_cpu.why_not}")
        return False
    return True


def choose_backend(device: torch.device | str, dtype: torch.dtype, use_kernel: bool | None = None,
                   cpu_kernel: bool | None = None) -> AttentionBackend:
    """The decode attention for tensors on ``device`` in ``dtype``: Triton if `kernel_wanted`, else the
    C++ kernel if `cpu_kernel_wanted`, else the gather path. Triton wins when both are asked for."""
    if kernel_wanted(device, use_kernel):
        return TRITON
    return CPU_KERNEL if cpu_kernel_wanted(device, dtype, cpu_kernel) else GATHER


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
    fastest correct route available: see ``kernel_wanted`` for ``use_kernel``. (The C++ kernel is the
    engine's; here the alternative to Triton is the reference, exact to the last bit.)"""
    if choose_backend(query.device, query.dtype, use_kernel, cpu_kernel=False) == GATHER:
        return paged_attention_ref(query, key_cache, value_cache, block_tables, seq_lens, scale)
    # Imported here, not at the top: importing the kernel module imports Triton and, without a
    # GPU, switches it to interpreter mode; code that only wants the reference should not pay that.
    from minikv_kernels.paged_attention import paged_attention

    return paged_attention(query, key_cache, value_cache, block_tables, seq_lens, scale)


def prompt_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
                     backend: AttentionBackend = GATHER) -> torch.Tensor:
    """A prompt's first chunk attending causally to itself: query [1, H, T, D], key/value [1, KVH, T, D], as
    the model passes them; returns [T, H, D]. The C++ kernel where the runner's backend is ``CPU_KERNEL``
    (``python -m minikv bench ops`` times both against vLLM's); under any other backend PyTorch's SDPA (its
    flash kernel on the CPU, FlashAttention's on a GPU), which is what transformers' own prefill runs."""
    if backend == CPU_KERNEL:
        from minikv_kernels.paged_attention_cpu import prompt_attention as kernel

        return kernel(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), scaling)
    return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling,
                                          enable_gqa=True)[0].transpose(0, 1)


def kernel_decode(q: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor, group: AttnGroup,
                  scaling: float) -> torch.Tensor:
    """A kernel group's decode tokens, by its backend's kernel reading K/V where it lies in the
    head-major store [KVH, blocks, block_size, D]. q [S, H, D] -> [S, H, D]."""
    if group.backend == CPU_KERNEL:
        from minikv_kernels.paged_attention_cpu import paged_decode

        return paged_decode(q, k_store, v_store, group.block_tables, group.seq_lens, scaling)
    from minikv_kernels.paged_attention import paged_attention as kernel

    # The kernel's layout, [blocks, block_size, KVH, D], as a view of the head-major store (it
    # reads through strides). Inputs were checked when the step was planned; re-checking in every
    # layer would read seq_lens back from the GPU thirty times a step.
    return kernel(q.contiguous(), k_store.permute(1, 2, 0, 3), v_store.permute(1, 2, 0, 3),
                  group.block_tables, group.seq_lens, scaling, check_inputs=False)


def attend_layer(plan: StepPlan, layer: int, query, key, value, scaling: float) -> torch.Tensor:
    """One layer's attention over a planned step: store the new K/V, then attend. Returns [1, T, H, D]."""
    k_store, v_store = plan.k_stores[layer], plan.v_stores[layer]
    kv_heads, _, _, head_dim = k_store.shape
    num_heads, num_tokens = query.shape[1], query.shape[2]
    # 1. Store this step's keys and values at their slots (prefill chunks and decode tokens alike).
    k_store.view(kv_heads, -1, head_dim).index_copy_(1, plan.slots, key[0].to(k_store.dtype))
    v_store.view(kv_heads, -1, head_dim).index_copy_(1, plan.slots, value[0].to(v_store.dtype))
    # 2. Attend through the block tables. Query head h reads KV head h // G.
    grouped = query[0].view(kv_heads, num_heads // kv_heads, num_tokens, head_dim)
    if len(plan.groups) == 1 and plan.groups[0].identity and not plan.kernel_groups and not plan.fresh:
        out = attend_gathered(grouped, k_store, v_store, plan.groups[0], scaling)
    elif len(plan.kernel_groups) == 1 and plan.kernel_groups[0].identity and not plan.groups and not plan.fresh:
        out = kernel_decode(query[0].transpose(0, 1), k_store, v_store, plan.kernel_groups[0], scaling)
    else:
        out = query.new_empty(num_tokens, num_heads, head_dim)
        for start, n in plan.fresh:  # a prompt's first chunk sees only itself: causal attention, no cache read
            rows = slice(start, start + n)
            out[rows] = prompt_attention(query[:, :, rows], key[:, :, rows], value[:, :, rows], scaling,
                                         plan.fresh_backend)
        for group in plan.groups:  # at most six: decodes and prefill chunks, each split by length
            out[group.out_index] = attend_gathered(grouped, k_store, v_store, group, scaling)
        for group in plan.kernel_groups:
            q = query[0, :, group.out_index].transpose(0, 1)  # [S, H, D]
            out[group.out_index] = kernel_decode(q, k_store, v_store, group, scaling)
    return out.unsqueeze(0)
