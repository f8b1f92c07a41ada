"""The C++ attention kernels (kernels/paged_attention_cpu.cpp): paged decode against stage 3's reference, and a
prompt's causal attention against its definition.

The kernel is built on first use (torch.utils.cpp_extension; `make install` builds it once). Where it
cannot be built the runner falls back to its gather path, and these tests say why they skip.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from minikv.attention import paged_attention_ref, random_paged_inputs
from minikv_kernels import paged_attention_cpu

if paged_attention_cpu.load() is None:
    pytest.skip(f"the CPU kernel could not be built here: {paged_attention_cpu.why_not}", allow_module_level=True)


def head_major(cache: torch.Tensor) -> torch.Tensor:
    """The course's pool layout [blocks, block_size, KVH, D] as the runner stores it: [KVH, blocks, block_size, D]."""
    return cache.permute(2, 0, 1, 3).contiguous()


# Block sizes 1 (every token its own block), 7 (blocks that do not divide the lengths), 16 and 32;
# MHA, GQA and MQA, with 1, 3, 4, 8 and 12 query heads per KV head (an AVX-512 build has a path for 1-8 at
# head dims 64 and 128, its generic loop takes the rest); head dims a multiple of 16 lanes and ones that are not.
SHAPES = [(bs, heads, kv_heads, d) for bs, (heads, kv_heads), d in
          itertools.product([1, 7, 16, 32], [(4, 4), (9, 3), (8, 2), (8, 1), (12, 1)], [64, 128, 24, 80, 13])]


@pytest.mark.parametrize("block_size,num_heads,num_kv_heads,head_dim", SHAPES)
def test_matches_the_reference(block_size, num_heads, num_kv_heads, head_dim):
    lens = [1, 2, block_size, block_size + 1, 3 * block_size - 1, 97]
    q, k, v, tables, seq_lens = random_paged_inputs(lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                                    head_dim=head_dim, block_size=block_size, seed=block_size)
    expected = paged_attention_ref(q, k, v, tables, seq_lens, head_dim**-0.5)
    got = paged_attention_cpu.paged_decode(q, head_major(k), head_major(v), tables, seq_lens, head_dim**-0.5)
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=2e-5)


def test_reads_only_the_blocks_in_the_table():
    """Poisoning every block no sequence owns changes nothing: the kernel never strays outside the tables."""
    q, k, v, tables, seq_lens = random_paged_inputs([5, 40, 17], num_heads=6, num_kv_heads=2, head_dim=32,
                                                    block_size=8, seed=1)
    before = paged_attention_cpu.paged_decode(q, head_major(k), head_major(v), tables, seq_lens, 0.2)
    owned = {int(b) for row, n in zip(tables, seq_lens) for b in row[: (int(n) + 7) // 8]}
    for b in set(range(k.shape[0])) - owned:
        k[b], v[b] = float("nan"), float("nan")
    after = paged_attention_cpu.paged_decode(q, head_major(k), head_major(v), tables, seq_lens, 0.2)
    assert torch.equal(before, after)


def test_long_context_and_extreme_scores_stay_finite():
    q, k, v, tables, seq_lens = random_paged_inputs([4096], num_heads=2, num_kv_heads=1, head_dim=64,
                                                    block_size=16, seed=2)
    q = q * 50  # scores in the hundreds: exp would overflow without the max subtracted first
    expected = paged_attention_ref(q, k, v, tables, seq_lens, 0.125)
    got = paged_attention_cpu.paged_decode(q, head_major(k), head_major(v), tables, seq_lens, 0.125)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("change,words", [
    ("block", "outside the pool"),
    ("length", "block table cannot hold"),
    ("dtype", "float32 only"),
    ("table dtype", "int32"),
])
def test_bad_inputs_are_refused_with_the_reason(change, words):
    q, k, v, tables, seq_lens = random_paged_inputs([5, 9], num_heads=2, num_kv_heads=1, head_dim=16,
                                                    block_size=4, seed=3)
    k, v = head_major(k), head_major(v)
    if change == "block":
        tables[1, 0] = k.shape[1]
    elif change == "length":
        seq_lens[0] = 4 * tables.shape[1] + 1
    elif change == "dtype":
        q, k, v = q.half(), k.half(), v.half()
    else:
        tables = tables.long()
    with pytest.raises(RuntimeError, match=words):
        paged_attention_cpu.paged_decode(q, k, v, tables, seq_lens, 1.0)


def test_is_an_operator_torch_compile_can_trace():
    """Registered with a fake implementation: torch.compile sees one opaque call, not a graph break."""
    q, k, v, tables, seq_lens = random_paged_inputs([3, 20], num_heads=4, num_kv_heads=2, head_dim=16,
                                                    block_size=4, seed=4)
    k, v = head_major(k), head_major(v)
    op = torch.ops.minikv_cpu.paged_decode
    torch.library.opcheck(op, (q, k, v, tables, seq_lens, 0.25), test_utils=("test_schema", "test_faketensor"))


# -- the prompt kernel: a prompt's first chunk attending causally to itself ----------------------------------
def causal_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale) v over keys 0..i for query i, in float64: q [T, H, D], k/v [T, KVH, D] -> [T, H, D]."""
    group = q.shape[1] // k.shape[1]
    keys, values = (x.double().repeat_interleave(group, 1) for x in (k, v))
    scores = torch.einsum("thd,shd->hts", q.double(), keys) * scale
    scores = scores.masked_fill(torch.ones(len(q), len(q), dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(-1), values).float()


# Lengths below, at and across the kernel's 16-position tiles and its 32-key blocks; the heads and head dims of
# the decode kernel's sweep (64 and 128 take the AVX-512 path on such a build, the others its generic loop).
PROMPTS = list(itertools.product([1, 2, 15, 16, 17, 33, 100, 257], [(4, 4), (9, 3), (8, 2), (8, 1), (12, 1)],
                                 [64, 128, 24, 13]))


@pytest.mark.parametrize("tokens,heads,head_dim", PROMPTS)
def test_prompt_attention_matches_the_definition(tokens, heads, head_dim):
    gen = torch.Generator().manual_seed(tokens * head_dim)
    num_heads, num_kv_heads = heads
    q = torch.randn(tokens, num_heads, head_dim, generator=gen)
    k, v = (torch.randn(tokens, num_kv_heads, head_dim, generator=gen) for _ in range(2))
    got = paged_attention_cpu.prompt_attention(q, k, v, head_dim**-0.5)
    torch.testing.assert_close(got, causal_reference(q, k, v, head_dim**-0.5), atol=2e-6, rtol=2e-5)


def test_prompt_attention_no_later_token_changes_an_earlier_output():
    """Causal: changing the last token's key and value leaves every earlier output bit for bit as it was (the
    kernel multiplies a later token's V row by a probability of exactly 0 where a register block of query rows
    spans positions: a finite row, however large, adds exactly nothing)."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(50, 9, 64, generator=gen), torch.randn(50, 3, 64, generator=gen), \
        torch.randn(50, 3, 64, generator=gen)
    before = paged_attention_cpu.prompt_attention(q, k, v, 0.125)
    k[-1], v[-1] = 1e3, 1e30
    after = paged_attention_cpu.prompt_attention(q, k, v, 0.125)
    assert torch.equal(before[:-1], after[:-1]) and not torch.equal(before[-1], after[-1])


def test_prompt_attention_takes_the_models_strided_views():
    """The runner passes [T, H, D] views of the model's [1, H, T, D] tensors, v a slice of merged q/k/v rows."""
    gen = torch.Generator().manual_seed(6)
    qkv = torch.randn(40, (9 + 2 * 3) * 64, generator=gen)
    q, k, v = (part.view(40, -1, 64) for part in qkv.split([9 * 64, 3 * 64, 3 * 64], dim=-1))
    assert not v.is_contiguous()
    got = paged_attention_cpu.prompt_attention(q, k, v, 0.125)
    torch.testing.assert_close(got, causal_reference(q, k, v, 0.125), atol=2e-6, rtol=2e-5)


def test_prompt_attention_with_extreme_scores_stays_finite():
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(300, 4, 64, generator=gen) * 50
    k, v = torch.randn(300, 1, 64, generator=gen), torch.randn(300, 1, 64, generator=gen)
    got = paged_attention_cpu.prompt_attention(q, k, v, 0.125)
    assert torch.isfinite(got).all()
    # scores in the hundreds carry fp32 rounding of ~1e-5 into the exponentials: PyTorch's own fp32 attention
    # is no closer to the float64 definition; the kernel must be about as close as it is
    exact = causal_reference(q, k, v, 0.125)
    sdpa = torch.nn.functional.scaled_dot_product_attention(*(x.transpose(0, 1)[None] for x in (q, k, v)), scale=0.125,
                                                            is_causal=True, enable_gqa=True)[0].transpose(0, 1)
    assert (got - exact).abs().max() <= max(2 * (sdpa - exact).abs().max(), 1e-5)


@pytest.mark.parametrize("change,words", [("dtype", "float32 only"), ("heads", "shapes disagree"),
                                          ("length", "shapes disagree"), ("rank", r"query \[T, H, D\]")])
def test_prompt_attention_refuses_bad_inputs_with_the_reason(change, words):
    q, k, v = torch.randn(8, 6, 16), torch.randn(8, 2, 16), torch.randn(8, 2, 16)
    if change == "dtype":
        q, k, v = q.double(), k.double(), v.double()
    elif change == "heads":
        k, v = torch.randn(8, 4, 16), torch.randn(8, 4, 16)
    elif change == "length":
        k, v = k[:7], v[:7]
    else:
        q = q[None]
    with pytest.raises(RuntimeError, match=words):
        paged_attention_cpu.prompt_attention(q, k, v, 1.0)


def test_prompt_attention_is_an_operator_torch_compile_can_trace():
    q, k, v = torch.randn(20, 4, 16), torch.randn(20, 2, 16), torch.randn(20, 2, 16)
    torch.library.opcheck(torch.ops.minikv_cpu.prompt_attention, (q, k, v, 0.25),
                          test_utils=("test_schema", "test_faketensor"))
