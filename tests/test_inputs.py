"""One door in: the input processor's rules, the same for `LLM.generate`, `LLM.chat` and the server."""

from __future__ import annotations

import pytest

from minikv.engine import LLM
from minikv.inputs import EngineLimits, InputProcessor, Prompt, blocks_at_most
from minikv.models import byte_tokenizer
from minikv.sampling import SamplingParams
from minikv.validation import InvalidArgument

LIMITS = EngineLimits(vocab_size=256, max_model_len=64, num_blocks=6, block_size=8, max_num_seqs=4,
                      max_num_batched_tokens=2048, enable_chunked_prefill=True)


@pytest.fixture()
def inputs():
    return InputProcessor(byte_tokenizer(), LIMITS)


def test_the_last_sampled_token_holds_no_block():
    assert blocks_at_most(8, 1, 8) == 1       # 8 prompt tokens fill a block; the one sampled token is never cached
    assert blocks_at_most(8, 2, 8) == 2
    assert blocks_at_most(60, 100, 8, max_model_len=64) == 8   # nothing past the context


def test_default_max_tokens_is_what_the_context_and_the_pool_leave(inputs):
    assert inputs.default_max_tokens(10) == 39    # the pool: 48 tokens, the last sampled one needs no slot
    roomy = InputProcessor(None, EngineLimits(**{**LIMITS.__dict__, "num_blocks": 100}))
    assert roomy.default_max_tokens(10) == 54     # the context: 64 - 10
    for n in (10, 40):   # the default always passes the check it is made for
        prompt = Prompt(None, [5] * n)
        inputs.check(prompt, SamplingParams(max_tokens=inputs.default_max_tokens(n)), refuse_past_context=True)


@pytest.mark.parametrize("prompt, params, kwargs, param, words", [
    ([5] * 20, SamplingParams(max_tokens=50), dict(refuse_past_context=True), "max_tokens", "maximum context length"),
    ([5] * 50, SamplingParams(max_tokens=1), {}, "prompt", "whole KV cache pool holds 48"),
    ([5] * 30, SamplingParams(max_tokens=30), {}, "max_tokens", "cannot fit even alone"),
    ([5], SamplingParams(n=5), {}, "n", "max_num_seqs=4"),
    ([5] * 64, SamplingParams(max_tokens=1), dict(refuse_past_context=True, param="messages"), "messages",
     "maximum context length"),
])
def test_a_request_that_could_never_finish_is_refused_naming_the_field(inputs, prompt, params, kwargs, param, words):
    with pytest.raises(InvalidArgument, match=words) as err:
        inputs.check(Prompt(None, prompt), params, **kwargs)
    assert err.value.param == param


def test_offline_a_request_past_the_context_stops_there_the_server_refuses_it():
    roomy = InputProcessor(None, EngineLimits(**{**LIMITS.__dict__, "num_blocks": 100}))
    prompt, params = Prompt(None, [5] * 50), SamplingParams(max_tokens=30)
    roomy.check(prompt, params)   # LLM.generate: it finishes with "length" at the 64-token context
    with pytest.raises(InvalidArgument, match="maximum context length is 64 tokens"):
        roomy.check(prompt, params, refuse_past_context=True)


@pytest.mark.parametrize("prompt, words", [("", "empty prompt"), ([], "empty prompt"), ([5, 256], r"\[0, 256\)"),
                                           ([5] * 65, "longer than the model's context of 64")])
def test_bad_prompts_are_refused_before_anything_else(inputs, prompt, words):
    with pytest.raises(InvalidArgument, match=words) as err:
        inputs.tokenize(prompt)
    assert err.value.param == "prompt"


def test_the_chat_template_is_applied_once_for_llm_chat_and_the_server(tiny_llama, inputs):
    conv = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    chat = inputs.chat(conv)
    assert chat.text == "<|system|>be brief\n<|user|>hi\n<|assistant|>" and chat.token_ids == list(chat.text.encode())
    llm = LLM(tiny_llama, tokenizer=byte_tokenizer(), verbose=False, num_blocks=16)
    out = llm.chat(conv, SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)[0]
    assert out.prompt == chat.text and out.prompt_token_ids == chat.token_ids
