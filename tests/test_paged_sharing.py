"""PagedKVCache on shared blocks (stage 5) inside transformers' own generate.

Parity is the bar, as in test_caches: beam search, num_return_sequences and prompt reuse across
calls must give exactly the sequences DynamicCache gives, for block sizes that do and do not
divide the lengths; and the sharing must be real: fewer blocks than unshared, copies only of
partial blocks, prompt tokens not recomputed, every block back after reset.
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_caches import CHATS, left_padded_batch
from transformers import DynamicCache

from minikv.bench.paged import compare_prefix_reuse, sharing_report
from minikv.blocks import blocks_for
from minikv.paged import PagedKVCache
from minikv.prefix import BlockManager

pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")

BLOCK_SIZES = [1, 7, 16]  # 7 divides none of the lengths here


def generate(model, ids, mask=None, cache=None, new=8, **kwargs):
    if cache is not None:
        kwargs["past_key_values"] = cache
    if mask is not None:
        kwargs["attention_mask"] = mask
    with torch.inference_mode():
        return model.generate(ids, max_new_tokens=new, pad_token_id=0, **kwargs)


def assert_all_blocks_back(cache: PagedKVCache) -> None:
    """After reset every block is free or (prefix caching) cached and evictable; none is owned."""
    cache.reset()
    assert cache.num_free_blocks == cache.num_blocks
    assert cache.allocator.num_used == 0
    assert all(cache.allocator.refcount(b) == 0 for b in range(cache.num_blocks))


def count_model_tokens(model):
    """Tokens the model embeds per forward call (a forward hook on the embedding)."""
    seen = []
    handle = model.model.embed_tokens.register_forward_hook(lambda mod, inp, out: seen.append(inp[0].shape[1]))
    return seen, handle


# ---- beam search and num_return_sequences ------------------------------------------------

@pytest.mark.parametrize("told", [False, True], ids=["plain", "prefill_hits"])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_beam_search_matches_dynamic_cache(tiny_llama, block_size, told):
    ids, mask = left_padded_batch()
    expected = generate(tiny_llama, ids, mask, num_beams=4, do_sample=False)
    cache = PagedKVCache(tiny_llama.config, num_blocks=160, block_size=block_size)
    if told:  # the cache knows the prompts: the 4 beams share the prompt's blocks from the first step
        assert cache.prefill_hits(ids, mask) == 0
    out = generate(tiny_llama, ids, mask, cache, num_beams=4, do_sample=False)
    assert torch.equal(out, expected)

    history = cache.sharing_history
    assert [step for step, _, _ in history] == list(range(1, len(history) + 1))
    assert all(used <= unshared for _, used, unshared in history)
    if told or block_size < 16:  # beams share full blocks (one block of 16 holds the whole prompt here)
        assert any(used < unshared for _, used, unshared in history)
    if told:
        _, used, unshared = history[0]
        assert unshared == 4 * used == 4 * len(ids) * blocks_for(ids.shape[1], block_size)
    # Only partially filled blocks are ever copied: with one-token blocks, never.
    assert (cache.cow_copies == 0) == (block_size == 1)
    assert cache.cow_copies == cache.manager.stats.cow_copies
    assert_all_blocks_back(cache)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_num_return_sequences_match_dynamic_cache(tiny_llama, block_size):
    ids, mask = left_padded_batch()
    torch.manual_seed(0)
    expected = generate(tiny_llama, ids, mask, do_sample=True, num_return_sequences=3)
    cache = PagedKVCache(tiny_llama.config, num_blocks=160, block_size=block_size)
    cache.prefill_hits(ids, mask)
    torch.manual_seed(0)
    assert torch.equal(generate(tiny_llama, ids, mask, cache, do_sample=True, num_return_sequences=3), expected)
    # The 3 samples of a prompt share its blocks; each copies its partial last block on first write.
    prompt_blocks = blocks_for(ids.shape[1], block_size)
    assert cache.sharing_history[0][1:] == (3 * prompt_blocks, 9 * prompt_blocks)
    partial = ids.shape[1] % block_size != 0
    assert cache.cow_copies == (3 * 2 if partial else 0)  # 2 of 3 copies per prompt; the last writes in place
    assert_all_blocks_back(cache)


def test_beams_with_num_return_sequences(tiny_llama):
    ids, mask = left_padded_batch()
    expected = generate(tiny_llama, ids, mask, num_beams=4, num_return_sequences=2, do_sample=False)
    cache = PagedKVCache(tiny_llama.config, num_blocks=160, block_size=4)
    out = generate(tiny_llama, ids, mask, cache, num_beams=4, num_return_sequences=2, do_sample=False)
    assert torch.equal(out, expected)
    assert "blocks used" in sharing_report(cache)
    from minikv.viz import beam_sharing_plot

    assert beam_sharing_plot(cache.sharing_history).axes[0].get_ylabel() == "KV blocks"


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(block_size=st.sampled_from([1, 3, 4, 7]), data=st.data())
def test_random_reorders_read_what_dynamic_cache_reads(tiny_llama, block_size, data):
    """Random beam reorders, repeats and selections between steps: every step's logits equal
    DynamicCache's after the same reindexing (which copies whole histories; we share blocks)."""
    rows = 3
    prompt_len = data.draw(st.integers(1, 9), label="prompt")
    ids = torch.randint(3, 256, (rows, prompt_len), generator=torch.Generator().manual_seed(1))
    paged = PagedKVCache(tiny_llama.config, num_blocks=200, block_size=block_size)
    dynamic = DynamicCache(config=tiny_llama.config)
    with torch.inference_mode():
        for step in range(4):
            a = tiny_llama(ids, past_key_values=paged).logits
            b = tiny_llama(ids, past_key_values=dynamic).logits
            assert torch.equal(a, b), f"step {step}"
            op = data.draw(st.sampled_from(["reorder", "repeat", "select"]), label="op")
            n = len(paged.rows)
            if op == "reorder" or (op == "select" and n == 1):
                idx = torch.tensor(data.draw(st.lists(st.integers(0, n - 1), min_size=n, max_size=n), label="beam_idx"))
                paged.reorder_cache(idx)
                dynamic.reorder_cache(idx)
            elif op == "repeat" and n <= 4:
                paged.batch_repeat_interleave(2)
                dynamic.batch_repeat_interleave(2)
            else:
                keep = data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=n, unique=True).map(sorted))
                paged.batch_select_indices(torch.tensor(keep))
                dynamic.batch_select_indices(torch.tensor(keep))
            ids = torch.randint(3, 256, (len(paged.rows), data.draw(st.integers(1, 3), label="new")))
    used, unshared = paged.blocks_in_use_and_unshared()
    assert used <= unshared
    assert_all_blocks_back(paged)


def test_reorder_is_bookkeeping_not_copying(tiny_llama):
    """Reordering beams moves no K/V: the pools are untouched; only refcounts change."""
    ids = torch.randint(3, 256, (2, 10), generator=torch.Generator().manual_seed(0))
    cache = PagedKVCache(tiny_llama.config, num_blocks=32, block_size=4)
    with torch.inference_mode():
        tiny_llama(ids, past_key_values=cache)
    pools = [layer.key_cache.clone() for layer in cache.layers]
    free = cache.num_free_blocks
    cache.reorder_cache(torch.tensor([1, 1]))  # both rows continue row 1
    assert all(torch.equal(p, layer.key_cache) for p, layer in zip(pools, cache.layers))
    assert cache.num_free_blocks == free + 3  # row 0's 3 blocks came back
    assert cache.block_tables[0].tolist() == cache.block_tables[1].tolist()
    assert all(cache.allocator.refcount(b) == 2 for b in cache.block_tables[0].tolist())
    with torch.inference_mode():  # both write into the shared partial block: one copy, the other in place
        tiny_llama(torch.tensor([[5], [6]]), past_key_values=cache)
    assert cache.cow_copies == 1 and cache.num_free_blocks == free + 2
    first, second = cache.block_tables.tolist()
    assert first[:2] == second[:2] and first[2] != second[2]


def test_manager_hook_runs_another_block_manager(tiny_llama):
    ids, mask = left_padded_batch()
    expected = generate(tiny_llama, ids, mask, num_beams=3, do_sample=False)
    manager = BlockManager(num_blocks=120, block_size=5)
    cache = PagedKVCache(tiny_llama.config, num_blocks=120, block_size=5, manager=manager)
    assert torch.equal(generate(tiny_llama, ids, mask, cache, num_beams=3, do_sample=False), expected)
    assert cache.manager is manager and manager.stats.cow_copies == cache.cow_copies > 0
    with pytest.raises(ValueError, match="same num_blocks"):
        PagedKVCache(tiny_llama.config, num_blocks=64, block_size=5, manager=manager)
    with pytest.raises(ValueError, match="not both"):
        PagedKVCache(tiny_llama.config, num_blocks=120, block_size=5, manager=manager, enable_prefix_caching=True)


def test_out_of_blocks_during_beam_search_says_so_and_frees(tiny_llama):
    from minikv.blocks import OutOfBlocks

    ids, mask = left_padded_batch()
    cache = PagedKVCache(tiny_llama.config, num_blocks=12, block_size=4)
    with pytest.raises(OutOfBlocks, match="needed"):
        generate(tiny_llama, ids, mask, cache, num_beams=4, new=16, do_sample=False)
    cache.reset()
    assert cache.num_free_blocks == 12


# ---- prompt reuse across calls -----------------------------------------------------------

def system_and_questions(system_len=37, lengths=(5, 9, 12), seed=0):
    gen = torch.Generator().manual_seed(seed)
    system = torch.randint(3, 256, (system_len,), generator=gen)
    return [torch.cat([system, torch.randint(3, 256, (n,), generator=gen)])[None] for n in lengths]


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_prefix_reuse_skips_the_cached_tokens_and_changes_nothing(tiny_llama, block_size):
    cache = PagedKVCache(tiny_llama.config, num_blocks=64, block_size=block_size, enable_prefix_caching=True)
    seen, hook = count_model_tokens(tiny_llama)
    try:
        for call, ids in enumerate(system_and_questions()):
            seen.clear()
            expected = generate(tiny_llama, ids, do_sample=False)
            assert seen[0] == ids.shape[1]  # DynamicCache computes the whole prompt
            cache.reset()
            hit = cache.prefill_hits(ids)
            assert hit == (0 if call == 0 else 37 // block_size * block_size)  # the system prompt's full blocks
            seen.clear()
            assert torch.equal(generate(tiny_llama, ids, cache=cache, do_sample=False), expected)
            assert seen[0] == ids.shape[1] - hit  # the model computed only the uncached tokens
            assert cache.get_seq_length() == expected.shape[1] - 1
    finally:
        hook.remove()
    assert cache.manager.stats.tokens_hit == 2 * (37 // block_size * block_size)
    assert_all_blocks_back(cache)
    assert cache.manager.num_cached_blocks > 0  # ... and the cached ones are still there, evictable


def test_prefix_reuse_in_a_batch_takes_the_smallest_hit(tiny_llama):
    block_size = 4
    prompts = system_and_questions(lengths=(6, 6, 6))
    cache = PagedKVCache(tiny_llama.config, num_blocks=80, block_size=block_size, enable_prefix_caching=True)
    cache.prefill_hits(prompts[0])
    generate(tiny_llama, prompts[0], cache=cache, new=2, do_sample=False)
    cache.reset()
    # Row 0 is the same prompt again (40 of 43 tokens cached), row 1 shares only the system prompt (36).
    batch = torch.cat([prompts[0], prompts[1]])
    assert cache.prefill_hits(batch) == 36
    assert cache.seq_lens.tolist() == [36, 36]
    expected = generate(tiny_llama, batch, do_sample=False)
    assert torch.equal(generate(tiny_llama, batch, cache=cache, do_sample=False), expected)
    assert_all_blocks_back(cache)


def test_prompt_at_an_exact_block_multiple_still_computes_its_last_token(tiny_llama):
    ids = system_and_questions(system_len=16, lengths=(0,))[0]  # 16 tokens: 4 full blocks of 4
    cache = PagedKVCache(tiny_llama.config, num_blocks=32, block_size=4, enable_prefix_caching=True)
    expected = generate(tiny_llama, ids, do_sample=False)
    for _ in range(2):
        cache.reset()
        hit = cache.prefill_hits(ids)
        assert torch.equal(generate(tiny_llama, ids, cache=cache, do_sample=False), expected)
    assert hit == 12  # three blocks hit; the fourth holds the last token, whose logits the model needs


def test_left_padding_never_gives_a_false_hit(tiny_llama):
    """A padded row's blocks hold pads at masked positions: a prompt with the same ids unpadded
    (the pad id as a real token) must not hit them; the same padded batch again may, and agrees."""
    ids, mask = left_padded_batch(lengths=(9, 5, 2))
    cache = PagedKVCache(tiny_llama.config, num_blocks=96, block_size=2, enable_prefix_caching=True)
    expected = generate(tiny_llama, ids, mask, do_sample=False)
    assert cache.prefill_hits(ids, mask) == 0
    assert torch.equal(generate(tiny_llama, ids, mask, cache, do_sample=False), expected)
    for row in (1, 2):  # the padded rows, unpadded: zeros as real tokens
        cache.reset()
        assert cache.prefill_hits(ids[row:row + 1]) == 0
    cache.reset()
    hit = cache.prefill_hits(ids, mask)  # the very same padded batch: each row keyed by its padding
    assert hit == 8
    assert torch.equal(generate(tiny_llama, ids, mask, cache, do_sample=False), expected)
    assert_all_blocks_back(cache)


def test_prefill_hits_refuses_what_it_cannot_do(tiny_llama):
    cache = PagedKVCache(tiny_llama.config, num_blocks=32, block_size=4, enable_prefix_caching=True)
    ids = torch.randint(3, 256, (2, 6))
    with pytest.raises(ValueError, match="left padding only"):
        cache.prefill_hits(ids, torch.tensor([[1, 1, 1, 1, 1, 0], [1] * 6]))
    cache.prefill_hits(ids)
    with pytest.raises(ValueError, match="reset"):
        cache.prefill_hits(ids)
    with pytest.raises(ValueError, match="same full input_ids"):  # told 6 tokens per row, given 4
        generate(tiny_llama, ids[:, :4], cache=cache, do_sample=False)
    assert cache.num_free_blocks == 32 and cache.rows == []  # the failed call left nothing behind


def test_compare_prefix_reuse_reports_tokens_skipped(tiny_llama, capsys):
    prompts = [p[0] for p in system_and_questions(system_len=40, lengths=(3, 4, 5))]
    result = compare_prefix_reuse(tiny_llama, prompts, block_size=8, runs=1)
    assert result["computed_without"] == result["prompt_tokens"] == 44 + 45
    assert result["computed_with"] == 4 + 5
    assert "time to first token" in capsys.readouterr().out


# ---- the real model ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2_chats(smollm2):
    model, tokenizer = smollm2
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                           add_generation_prompt=True) for q in CHATS[:2]]
    enc = tokenizer(texts, padding=True, padding_side="left", return_tensors="pt")
    return model, tokenizer, enc


@pytest.mark.slow
@pytest.mark.parametrize("block_size", [16, 7])
def test_smollm2_beam_search_matches_dynamic_cache(smollm2_chats, block_size):
    model, tokenizer, enc = smollm2_chats
    kwargs = dict(num_beams=4, do_sample=False, new=16)
    expected = generate(model, enc.input_ids, enc.attention_mask, **kwargs)
    cache = PagedKVCache(model.config, num_blocks=200, block_size=block_size)
    cache.prefill_hits(enc.input_ids, enc.attention_mask)
    out = generate(model, enc.input_ids, enc.attention_mask, cache, **kwargs)
    assert torch.equal(out, expected), tokenizer.batch_decode(out[:, enc.input_ids.shape[1]:])
    assert any(used < unshared for _, used, unshared in cache.sharing_history)
    assert_all_blocks_back(cache)


@pytest.mark.slow
def test_smollm2_num_return_sequences_match_dynamic_cache(smollm2_chats):
    model, tokenizer, enc = smollm2_chats
    kwargs = dict(num_beams=4, num_return_sequences=2, do_sample=False, new=12)
    expected = generate(model, enc.input_ids, enc.attention_mask, **kwargs)
    cache = PagedKVCache(model.config, num_blocks=200, block_size=16)
    out = generate(model, enc.input_ids, enc.attention_mask, cache, **kwargs)
    assert torch.equal(out, expected)


@pytest.mark.slow
def test_smollm2_system_prompt_reuse(smollm2):
    model, tokenizer = smollm2
    system = "You are a patient teacher. Explain ideas about computer memory with one concrete example each. " * 3
    cache = PagedKVCache(model.config, num_blocks=64, block_size=16, enable_prefix_caching=True)
    seen, hook = count_model_tokens(model)
    try:
        for call, q in enumerate(["What is a page table?", "What is a cache line?"]):
            ids = tokenizer.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": q}],
                                                add_generation_prompt=True, return_tensors="pt",
                                                return_dict=True)["input_ids"]
            expected = generate(model, ids, new=12, do_sample=False)
            cache.reset()
            hit = cache.prefill_hits(ids)
            seen.clear()
            assert torch.equal(generate(model, ids, cache=cache, new=12, do_sample=False), expected)
            assert seen[0] == ids.shape[1] - hit
            assert (hit == 0) == (call == 0)
    finally:
        hook.remove()
    assert hit >= 48  # the system prompt's full blocks
