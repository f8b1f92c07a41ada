"""The contiguous and paged caches inside transformers' generate: parity, layout, errors, bytes.

Parity is the bar: with either cache, greedy generation must give exactly the tokens that
transformers' default DynamicCache gives, on a left-padded batch of prompts of different
lengths, for block sizes that do and do not divide the lengths.
"""

import math

import pytest
import torch
from transformers import DynamicCache

from minikv.attention import gather_kv, paged_attention_ref
from minikv.blocks import OutOfBlocks
from minikv.contiguous import ContiguousKVCache
from minikv.models import tiny_llama_config
from minikv.paged import PagedKVCache
from minikv.sizing import cache_shape

# transformers 5.x renamed generate's `past_key_values=` to `cache=` and warns (FutureWarning)
# until 6.0. The course's public API spells `past_key_values=`, so we test that.
pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")

LENGTHS = (9, 5, 2)  # three prompts, left-padded to 9 tokens
NEW_TOKENS = 16


def left_padded_batch(lengths=LENGTHS, seed=0, pad_id=0):
    """Random prompts (ids 3.., clear of pad 0 / bos 1 / eos 2), padded on the left."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = torch.randint(3, 256, (n,), generator=gen)
        mask[row, width - n:] = 1
    return ids, mask


def greedy(model, ids, mask, cache=None, new=NEW_TOKENS, **kwargs):
    if cache is not None:
        kwargs["past_key_values"] = cache
    return model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new, **kwargs)


def make_cache(kind, config, block_size=16, num_blocks=96):
    if kind == "contiguous":
        return ContiguousKVCache(config, max_batch_size=4, max_seq_len=32)
    return PagedKVCache(config, num_blocks=num_blocks, block_size=block_size)


CACHES = [("contiguous", None), ("paged", 1), ("paged", 16), ("paged", 7)]


def pools(cache):
    return [(layer.key_cache.clone(), layer.value_cache.clone()) for layer in cache.layers]


# ---- parity on the tiny model ------------------------------------------------------------

@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("kind,block_size", CACHES, ids=["contiguous", "paged-bs1", "paged-bs16", "paged-bs7"])
def test_generate_matches_dynamic_cache(tiny_llama, kind, block_size, attn):
    tiny_llama.config._attn_implementation = attn
    ids, mask = left_padded_batch()
    expected = greedy(tiny_llama, ids, mask)
    assert expected.shape[1] > ids.shape[1] + 4  # it really generated something
    cache = make_cache(kind, tiny_llama.config, block_size)
    assert torch.equal(greedy(tiny_llama, ids, mask, cache), expected)
    # The last generated token is never fed back, so the cache holds prompt + new - 1 tokens.
    assert cache.get_seq_length() == expected.shape[1] - 1
    if kind == "paged":
        seq = expected.shape[1] - 1
        assert cache.seq_lens.tolist() == [seq] * len(LENGTHS)
        assert cache.num_free_blocks == 96 - len(LENGTHS) * math.ceil(seq / block_size)


def test_parity_test_has_teeth(tiny_llama):
    """A cache that reads a neighbour's blocks must change the tokens, or parity proves nothing."""

    class Miswired(PagedKVCache):
        def _reserve_slots(self, rows, new):
            super()._reserve_slots(rows, new)
            self.token_slots = self.token_slots.roll(1, dims=0)  # row b reads row b-1's K/V

    ids, mask = left_padded_batch(lengths=(9, 9, 9))
    expected = greedy(tiny_llama, ids, mask)
    assert not torch.equal(greedy(tiny_llama, ids, mask, Miswired(tiny_llama.config, 64, 4)), expected)


def test_beam_search_reorders_the_slabs(tiny_llama):
    ids, mask = left_padded_batch()
    expected = greedy(tiny_llama, ids, mask, num_beams=3, new=8)
    cache = ContiguousKVCache(tiny_llama.config, max_batch_size=9, max_seq_len=32)
    assert torch.equal(greedy(tiny_llama, ids, mask, cache, num_beams=3, new=8), expected)


def test_stage3_allocator_and_table_refuse_beam_search_clearly(tiny_llama):
    """Exercise 03's hook (a stage-3 allocator and table) cannot share blocks: beam search says so."""
    from minikv.blocks import BlockAllocator, BlockTable

    ids, mask = left_padded_batch()
    cache = PagedKVCache(tiny_llama.config, 64, 4, allocator=BlockAllocator(64), table_cls=BlockTable)
    with pytest.raises(NotImplementedError, match="stage-5 block manager"):
        greedy(tiny_llama, ids, mask, cache, num_beams=2, new=4)


def test_cache_is_reusable_after_reset(tiny_llama):
    ids, mask = left_padded_batch()
    expected = greedy(tiny_llama, ids, mask)
    for cache in (PagedKVCache(tiny_llama.config, 64, 7), ContiguousKVCache(tiny_llama.config, 4, 32)):
        greedy(tiny_llama, ids, mask, cache)
        cache.reset()
        assert cache.get_seq_length() == 0
        assert torch.equal(greedy(tiny_llama, ids, mask, cache), expected)


def test_caches_follow_the_model_dtype(tiny_llama):
    """Built with the wrong dtype, an empty cache re-allocates on the model's first write."""
    ids, mask = left_padded_batch()
    expected = greedy(tiny_llama, ids, mask)
    for cache in (PagedKVCache(tiny_llama.config, 64, 4, dtype=torch.float16),
                  ContiguousKVCache(tiny_llama.config, 4, 32, dtype=torch.float16)):
        assert torch.equal(greedy(tiny_llama, ids, mask, cache), expected)
        pool = cache.layers[0].key_cache if isinstance(cache, PagedKVCache) else cache.layers[0].keys
        assert pool.dtype == torch.float32


# ---- the paged layout: pools, block tables, slot mapping --------------------------------

@pytest.mark.parametrize("block_size", [1, 7, 16])
def test_every_token_sits_where_the_block_table_says(tiny_llama, block_size):
    ids, mask = left_padded_batch()
    dynamic = DynamicCache(config=tiny_llama.config)
    expected = greedy(tiny_llama, ids, mask, dynamic)
    paged = PagedKVCache(tiny_llama.config, num_blocks=96, block_size=block_size)
    assert torch.equal(greedy(tiny_llama, ids, mask, paged), expected)

    cfg = tiny_llama.config
    seq = expected.shape[1] - 1
    tables, lens, bs = paged.block_tables, paged.seq_lens, block_size
    assert tables.dtype == lens.dtype == torch.int32
    assert tables.shape == (len(LENGTHS), math.ceil(seq / bs))
    assert len(set(tables.flatten().tolist())) == tables.numel()  # no block owned twice
    for layer, dyn in zip(paged.layers, dynamic.layers):
        assert layer.key_cache.shape == (96, bs, cfg.num_key_value_heads, cfg.head_dim)
        assert layer.value_cache.shape == layer.key_cache.shape
        for b in range(len(LENGTHS)):
            for t in range(seq):  # the kernel's convention, token by token
                block, offset = int(tables[b, t // bs]), t % bs
                assert torch.equal(layer.key_cache[block, offset], dyn.keys[b, :, t])
                assert torch.equal(layer.value_cache[block, offset], dyn.values[b, :, t])
            keys, values = gather_kv(layer.key_cache, layer.value_cache, tables[b], int(lens[b]))
            assert torch.equal(keys, dyn.keys[b].transpose(0, 1))
            assert torch.equal(values, dyn.values[b].transpose(0, 1))

    # The last step wrote one token per row, at position seq - 1.
    last = seq - 1
    assert paged.slot_mapping.tolist() == [int(tables[b, last // bs]) * bs + last % bs for b in range(len(LENGTHS))]


def test_reference_paged_attention_reads_the_pool(tiny_llama):
    """The pool and tables we fill are exactly what minikv.attention's reference reads."""
    ids, mask = left_padded_batch()
    dynamic = DynamicCache(config=tiny_llama.config)
    greedy(tiny_llama, ids, mask, dynamic)
    paged = PagedKVCache(tiny_llama.config, num_blocks=64, block_size=5)
    greedy(tiny_llama, ids, mask, paged)

    cfg = tiny_llama.config
    query = torch.randn(len(LENGTHS), cfg.num_attention_heads, cfg.head_dim, generator=torch.Generator().manual_seed(0))
    scale = cfg.head_dim ** -0.5
    for layer, dyn in zip(paged.layers, dynamic.layers):
        out = paged_attention_ref(query, layer.key_cache, layer.value_cache, paged.block_tables, paged.seq_lens, scale)
        expected = torch.nn.functional.scaled_dot_product_attention(
            query[:, :, None], dyn.keys, dyn.values, scale=scale, enable_gqa=True)[:, :, 0]
        torch.testing.assert_close(out, expected)


def test_layer0_allocates_once_per_step_for_all_layers(tiny_llama):
    cache = PagedKVCache(tiny_llama.config, num_blocks=16, block_size=4)
    ids, mask = left_padded_batch(lengths=(6, 6, 3))
    tiny_llama(ids, attention_mask=mask, past_key_values=cache)
    assert cache.num_free_blocks == 16 - 3 * 2  # 6 tokens per row (padding included), 2 blocks each
    assert cache.slot_mapping.shape == (3 * 6,)
    assert len(set(cache.slot_mapping.tolist())) == 18


# ---- errors: a full pool, a full slab -----------------------------------------------------

def test_pool_exhausted_names_the_numbers_and_touches_nothing(tiny_llama):
    cache = PagedKVCache(tiny_llama.config, num_blocks=10, block_size=4)
    ids, mask = left_padded_batch(lengths=(12, 10, 8))
    out = tiny_llama(ids, attention_mask=mask, past_key_values=cache)  # 3 rows x 3 blocks: 1 block left
    assert cache.num_free_blocks == 1
    before = pools(cache), cache.block_tables.clone(), cache.seq_lens.clone()

    next_ids = out.logits[:, -1].argmax(-1, keepdim=True)
    mask = torch.cat([mask, torch.ones_like(next_ids)], dim=1)
    with pytest.raises(OutOfBlocks, match=r"needed 3 block.*only 1 free") as err:
        tiny_llama(next_ids, attention_mask=mask, past_key_values=cache)  # each row needs a 4th block
    assert (err.value.needed, err.value.free) == (3, 1)

    after = pools(cache), cache.block_tables, cache.seq_lens
    for (k0, v0), (k1, v1) in zip(before[0], after[0]):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)  # no sequence's K/V was overwritten
    assert torch.equal(before[1], after[1]) and torch.equal(before[2], after[2])
    assert cache.num_free_blocks == 1


def test_request_larger_than_the_pool_fails_at_once(tiny_llama):
    cache = PagedKVCache(tiny_llama.config, num_blocks=4, block_size=4)
    ids, mask = left_padded_batch(lengths=(40, 30, 20))
    with pytest.raises(OutOfBlocks, match=r"needed 30 block.*only 4 free"):
        greedy(tiny_llama, ids, mask, cache)
    assert cache.num_free_blocks == 4
    assert all(not layer.key_cache.any() for layer in cache.layers)
    # Nothing was lost: the same cache still serves a request that fits (2 + 4 tokens, 2 blocks).
    ids, mask = left_padded_batch(lengths=(2,))
    assert torch.equal(greedy(tiny_llama, ids, mask, cache, new=5), greedy(tiny_llama, ids, mask, new=5))


def test_free_and_reset_return_blocks(tiny_llama):
    cache = PagedKVCache(tiny_llama.config, num_blocks=32, block_size=4)
    ids, mask = left_padded_batch()
    greedy(tiny_llama, ids, mask, cache)
    per_row = math.ceil(cache.get_seq_length() / 4)
    assert cache.num_free_blocks == 32 - 3 * per_row
    cache.free(1)
    assert cache.num_free_blocks == 32 - 2 * per_row and cache.seq_lens.tolist()[1] == 0
    cache.reset()
    assert cache.num_free_blocks == 32 and cache.block_tables.shape == (0, 0)


def test_slab_too_short_or_too_narrow(tiny_llama):
    ids, mask = left_padded_batch()  # 9 prompt tokens
    with pytest.raises(ValueError, match=r"max_seq_len=12.*PagedKVCache"):
        greedy(tiny_llama, ids, mask, ContiguousKVCache(tiny_llama.config, max_batch_size=3, max_seq_len=12))
    with pytest.raises(ValueError, match=r"max_batch_size=2.*>= 3"):
        greedy(tiny_llama, ids, mask, ContiguousKVCache(tiny_llama.config, max_batch_size=2, max_seq_len=64))


@pytest.mark.parametrize("build", [
    lambda cfg: ContiguousKVCache(cfg, max_batch_size=0, max_seq_len=8),
    lambda cfg: ContiguousKVCache(cfg, max_batch_size=1, max_seq_len=0),
    lambda cfg: PagedKVCache(cfg, num_blocks=0),
    lambda cfg: PagedKVCache(cfg, num_blocks=8, block_size=0),
], ids=["batch0", "seq0", "blocks0", "blocksize0"])
def test_bad_sizes_are_refused(build):
    with pytest.raises(ValueError):
        build(tiny_llama_config())


def test_sliding_window_models_are_refused():
    with pytest.raises(ValueError, match="full-attention"):
        PagedKVCache(tiny_llama_config(layer_types=["full_attention", "sliding_attention"], sliding_window=4), 8)


# ---- bytes: what each cache holds back and what it fills ---------------------------------

def test_slab_reserves_the_worst_case_and_uses_the_tokens(tiny_llama):
    cfg = tiny_llama.config
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4  # K+V, fp32
    shape = cache_shape(cfg)
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim) == (cfg.num_hidden_layers, cfg.num_key_value_heads,
                                                                      cfg.head_dim)
    cache = ContiguousKVCache(cfg, max_batch_size=4, max_seq_len=32, dtype=torch.float32)
    assert cache.reserved_bytes() == 4 * 32 * per_token
    assert cache.used_bytes() == 0  # reserved before a single token arrives
    ids, mask = left_padded_batch()
    out = greedy(tiny_llama, ids, mask, cache)
    tokens = out.shape[1] - 1
    assert cache.used_bytes() == 3 * tokens * per_token
    assert cache.reserved_bytes() == 4 * 32 * per_token  # unchanged: the slab never grows or shrinks


def test_paged_bytes_waste_only_the_last_block(tiny_llama):
    cfg = tiny_llama.config
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4
    cache = PagedKVCache(cfg, num_blocks=40, block_size=7, dtype=torch.float32)
    assert cache.reserved_bytes() == 40 * 7 * per_token and cache.used_bytes() == 0
    ids, mask = left_padded_batch()
    tokens = greedy(tiny_llama, ids, mask, cache).shape[1] - 1
    assert cache.used_bytes() == 3 * tokens * per_token
    assert cache.allocated_bytes() == 3 * math.ceil(tokens / 7) * 7 * per_token
    assert 0 <= cache.allocated_bytes() - cache.used_bytes() < 3 * 7 * per_token


# ---- parity on the real model -------------------------------------------------------------

CHATS = [
    "What is the capital of France?",
    "Write a short haiku about memory.",
    "Explain, in one sentence for a beginner who knows some Python, what a KV cache in a language model does.",
]


@pytest.fixture(scope="module")
def smollm2_batch(smollm2):
    model, tokenizer = smollm2
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                           add_generation_prompt=True) for q in CHATS]
    enc = tokenizer(texts, padding=True, padding_side="left", return_tensors="pt")
    assert len(set(enc.attention_mask.sum(1).tolist())) == len(CHATS)  # three different lengths
    expected = greedy(model, enc.input_ids, enc.attention_mask, new=20)
    return model, tokenizer, enc, expected


@pytest.mark.slow
@pytest.mark.parametrize("kind,block_size", CACHES, ids=["contiguous", "paged-bs1", "paged-bs16", "paged-bs7"])
def test_smollm2_generate_matches_dynamic_cache(smollm2_batch, kind, block_size):
    model, tokenizer, enc, expected = smollm2_batch
    if kind == "contiguous":
        cache = ContiguousKVCache(model.config, max_batch_size=len(CHATS), max_seq_len=enc.input_ids.shape[1] + 20)
    else:
        cache = PagedKVCache(model.config, num_blocks=3 * 80, block_size=block_size)
    out = greedy(model, enc.input_ids, enc.attention_mask, cache, new=20)
    assert torch.equal(out, expected), tokenizer.batch_decode(out[:, enc.input_ids.shape[1]:])
    assert "Paris" in tokenizer.decode(out[0, enc.input_ids.shape[1]:])  # a real model, really answering


def test_allocator_and_pool_sizes_must_agree(tiny_llama):
    from minikv.blocks import BlockAllocator

    with pytest.raises(ValueError, match="same num_blocks"):
        PagedKVCache(tiny_llama.config, num_blocks=2, block_size=4, allocator=BlockAllocator(64))


def test_a_cache_built_for_another_model_says_so(tiny_llama):
    other = tiny_llama_config(num_key_value_heads=4)  # pools for 4 KV heads; the model gives 2
    cache = PagedKVCache(other, num_blocks=8, block_size=4, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="build the cache from this model's config"):
        tiny_llama(torch.tensor([[5, 6, 7]]), past_key_values=cache)
