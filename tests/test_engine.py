"""The engine end to end on real (tiny and SmolLM2) models: transformers' tokens, under every policy.

Gold reference: ``transformers`` ``generate``, greedy, one prompt at a time, EOS not stopping it.
"""

from __future__ import annotations

import random

import pytest
import torch
from test_runner import tiny  # the runner's tiny Llama / Qwen2 / Mistral (GQA, Qwen2 with biases)

from minikv import LLM, SamplingParams
from minikv.engine import LLMEngine, kv_pool_blocks, parse_bytes

MODELS = ("llama", "qwen2", "mistral")
GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module", params=MODELS)
def model(request):
    return tiny(request.param)


def reference(model, prompt: list[int], max_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def prompts(k: int, seed: int, shared: list[int] | None = None, lo=1, hi=40) -> list[list[int]]:
    rng = random.Random(seed)
    return [(shared or []) + [rng.randrange(3, 256) for _ in range(rng.randint(lo, hi))] for _ in range(k)]


SYSTEM = list(range(100, 135))   # a 35-token "system prompt": two full blocks of 16, then a partial one
SCENARIOS = {
    "plain": (dict(enable_prefix_caching=False), prompts(5, 0), 0),
    "prefix cached": (dict(), prompts(5, 1, shared=SYSTEM, hi=12), 0),
    "chunked, budget 8": (dict(max_num_batched_tokens=8), prompts(5, 2), 0),
    "budget 64, chunks capped at 8": (dict(max_num_batched_tokens=64, long_prefill_token_threshold=8),
                                      prompts(5, 2), 0),
    "pressure, recompute": (dict(num_blocks=12, block_size=4, max_num_batched_tokens=16), prompts(6, 3, hi=20), 1),
    "pressure, swap": (dict(num_blocks=12, block_size=4, preemption_mode="swap"), prompts(6, 3, hi=20), 1),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_parity_with_transformers(model, scenario):
    kw, ps, min_preemptions = SCENARIOS[scenario]
    if kw.get("long_prefill_token_threshold"):   # the cap must cut some prompt, or it tests nothing
        assert max(map(len, ps)) > kw["long_prefill_token_threshold"]
    llm = LLM(model, verbose=False, **kw)
    outs = llm.generate(ps, SamplingParams(max_tokens=12, **GREEDY), use_tqdm=False)
    for p, o in zip(ps, outs):
        assert o.prompt_token_ids == p
        assert o.outputs[0].token_ids == reference(model, p, 12), f"{scenario}: prompt of {len(p)} tokens differs"
        assert o.outputs[0].finish_reason == "length"
    eng = llm.engine
    preempted = eng.scheduler.num_preemptions
    print(f"{scenario}: {preempted} preemptions, {len(eng.step_stats)} steps, prefix hit rate "
          f"{eng.bm.stats.hit_rate:.2f}")
    assert preempted >= min_preemptions
    if scenario == "prefix cached":
        assert sum(o.metrics.cached_prompt_tokens for o in outs) >= 4 * 32   # all but the first hit 2 blocks
    assert not eng.bm.tables and eng.bm.num_free_blocks == eng.num_blocks


def test_seeded_samples_reproducible_whatever_the_batch():
    model = tiny("llama")
    p = SamplingParams(n=3, temperature=1.0, top_p=0.9, max_tokens=8, seed=1234, ignore_eos=True)
    alone = LLM(model, verbose=False).generate([[5, 6, 7, 8, 9]], p, use_tqdm=False)[0]
    crowd = LLM(model, verbose=False, num_blocks=10, block_size=4)
    others = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    outs = crowd.generate([[9, 9, 9], [5, 6, 7, 8, 9], [3] * 20], [others, p, others], use_tqdm=False)
    assert [c.token_ids for c in outs[1].outputs] == [c.token_ids for c in alone.outputs]
    assert len({tuple(c.token_ids) for c in alone.outputs}) > 1   # three different samples
    # sample i is what n=1 with seed + i gives
    one = LLM(model, verbose=False).generate([[5, 6, 7, 8, 9]], SamplingParams(
        temperature=1.0, top_p=0.9, max_tokens=8, seed=1235, ignore_eos=True), use_tqdm=False)[0]
    assert one.outputs[0].token_ids == alone.outputs[1].token_ids


def test_stop_conditions():
    model = tiny("llama")
    llm = LLM(model, verbose=False)
    prompt = [5, 6, 7, 8]
    ref = reference(model, prompt, 12)
    stop_tok = ref[3]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_tok],
                                                ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids == ref[:ref.index(stop_tok) + 1]
    # EOS stops unless ignore_eos: make EOS the 3rd greedy token
    eng = LLMEngine(model, verbose=False)
    eng.eos_token_ids = {ref[2]}
    eng.add_request("a", prompt, SamplingParams(temperature=0, max_tokens=12))
    while eng.has_unfinished_requests():
        done = [o for o in eng.step() if o.finished]
    assert done[0].outputs[0].token_ids == ref[:ref.index(ref[2]) + 1] and done[0].outputs[0].finish_reason == "stop"


def test_step_api_streams_and_aborts():
    eng = LLMEngine(tiny("llama"), verbose=False, num_blocks=20, block_size=4)
    eng.add_request("a", [5, 6, 7], SamplingParams(max_tokens=50, **GREEDY))
    eng.add_request("b", list(range(3, 30)), SamplingParams(max_tokens=50, **GREEDY))
    seen = eng.step()
    assert {o.request_id for o in seen} == {"a", "b"} and all(len(o.outputs[0].token_ids) == 1 for o in seen)
    eng.step()
    out = eng.abort_request("b")
    assert out.outputs[0].finish_reason == "abort" and out.finished
    assert eng.abort_request("no such id") is None
    assert [o.request_id for o in eng.step() if o.finished] == ["b"]   # the abort is reported once, by step
    eng.abort_request("a")
    assert not eng.has_unfinished_requests() and not eng.bm.tables and eng.bm.num_free_blocks == 20


def test_triton_kernel_path_under_the_interpreter():
    """Decode attention through the Triton kernel (CUDA's code path) gives transformers' tokens."""
    from minikv.runner import ModelRunner

    model = tiny("llama")
    ps = prompts(2, 5, hi=10)
    eng = LLMEngine(model, verbose=False, num_blocks=16, block_size=4,
                    runner=ModelRunner(model, 16, 4, use_kernel=True))
    for i, p in enumerate(ps):
        eng.add_request(str(i), p, SamplingParams(max_tokens=4, **GREEDY))
    outs = {}
    while eng.has_unfinished_requests():
        outs.update({o.request_id: o for o in eng.step() if o.finished})
    for i, p in enumerate(ps):
        assert outs[str(i)].outputs[0].token_ids == reference(model, p, 4)


# ---- bad input ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llm():
    return LLM(tiny("llama"), verbose=False, num_blocks=16, block_size=4)


@pytest.mark.parametrize("prompt, params, match", [
    ([[]], SamplingParams(), "empty prompt"),
    ({"prompt_token_ids": []}, SamplingParams(), "empty prompt"),
    ([5] * 600, SamplingParams(), "600 tokens is longer than the model's context of 512"),
    ([5] * 40, SamplingParams(max_tokens=40), r"cannot fit even alone.*20 blocks of 4.*pool has 16"),
    ("some text", SamplingParams(), "needs a tokenizer"),
    ([5, 999], SamplingParams(), r"lie in \[0, 256\)"),
    ([5], SamplingParams(n=100), "max_num_seqs"),
    ([5], SamplingParams(stop="x"), "stop strings need a tokenizer"),
])
def test_bad_requests_are_refused_clearly(llm, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(prompt, params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests() and llm.engine.bm.num_free_blocks == 16


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"),
    (dict(top_p=1.5), "top_p"), (dict(n=0), "n must"),
])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_bad_engine_arguments():
    model = tiny("llama")
    with pytest.raises(ValueError, match="unknown model name 'no-such-model'"):
        LLM("no-such-model")
    with pytest.raises(ValueError, match="preemption_mode"):
        LLM(model, preemption_mode="drop")
    with pytest.raises(ValueError, match="2GiB"):
        LLM(model, kv_cache_memory="lots")
    with pytest.raises(ValueError, match="one per prompt"):
        LLM(model, verbose=False, num_blocks=8).generate([[5], [6]], [SamplingParams()] * 3, use_tqdm=False)


def test_pool_sizing(capsys):
    model = tiny("llama")   # 2 layers x 2 KV heads x 16 dims x K,V x fp32 = 512 B per token
    assert parse_bytes("2GiB") == 2 << 30 and parse_bytes("1.5 MB") == 1_500_000 and parse_bytes(4096) == 4096
    assert kv_pool_blocks(model, 16, None, "1MiB", 64, 512) == (128, 8192)
    assert kv_pool_blocks(model, 16, 7, None, 64, 512) == (7, 8192)
    # the CPU default (1 GiB) is capped at max_num_seqs full contexts: 4 x 512 tokens = 128 blocks
    assert kv_pool_blocks(model, 16, None, None, 4, 512) == (128, 8192)
    LLM(model, kv_cache_memory="1MiB")
    assert "128 blocks x 16 tokens = 2048 tokens, 1.00 MiB" in capsys.readouterr().out


# ---- SmolLM2 -----------------------------------------------------------------------------------

@pytest.mark.slow
def test_smollm2_parity_prefix_and_pressure(smollm2):
    model, tok = smollm2
    system = ("You are a helpful assistant. You answer every question in one short, friendly sentence, "
              "and you never make up facts you do not know. ")   # > 16 tokens: at least one full block
    texts = [system + q for q in ("What is the capital of France?", "Name a prime number.", "Why is the sky blue?")]
    ps = [tok.encode(t) for t in texts]
    refs = [reference(model, p, 6) for p in ps]
    for kw in (dict(), dict(num_blocks=12, block_size=4, max_num_batched_tokens=16)):
        llm = LLM(model, tok, verbose=False, **kw)
        outs = llm.generate(texts, SamplingParams(max_tokens=6, **GREEDY), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == refs
        assert outs[0].outputs[0].text == tok.decode(refs[0], skip_special_tokens=True)
        if kw:
            print(f"SmolLM2 under pressure: {llm.engine.scheduler.num_preemptions} preemptions")
            assert llm.engine.scheduler.num_preemptions > 0
        else:
            assert outs[2].metrics.cached_prompt_tokens > 0


@pytest.mark.slow
def test_smollm2_stop_strings_and_chat(smollm2):
    model, tok = smollm2
    llm = LLM(model, tok, verbose=False)
    full = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    text = full.outputs[0].text
    word = text.split()[1]                         # stop at the second word of the greedy answer
    cut = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=12, stop=word),
                       use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.text == text[:text.index(word)] and word not in cut.text
    chat = llm.chat([{"role": "user", "content": "Say hello."}], SamplingParams(temperature=0, max_tokens=20),
                    use_tqdm=False)[0]
    assert chat.outputs[0].text and chat.prompt.startswith("<|im_start|>")
