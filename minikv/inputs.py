"""The one door in: a prompt (text, token ids, or a chat) and its `SamplingParams` become a request
the engine can always finish, or an error that says what to change.

vLLM v1 draws an *input processor* in front of the engine core; minikv's `InputProcessor` is that
box. `LLM.generate`, `LLM.chat`, `LLMEngine.add_request` and the HTTP server all go through it, so
each rule below is written once:

* tokenization, and the chat template (the template writes its own special tokens: none are added);
* the vocabulary range and the model's context;
* the KV pool: a request must fit *alone* (`blocks_at_most`), or it could never run and would
  wait forever; the server's default ``max_tokens`` is what the context and the pool leave;
* ``n`` against the seats (``max_num_seqs``): a request's n samples run together;
* stop strings need a tokenizer (text is how they are found).

Sampling values themselves (temperature, top_p, ...) are `SamplingParams`' own rules.
Every refusal is a `minikv.validation.InvalidArgument` (a ValueError) whose ``.param`` names the
field; the server answers it as a 400 with that ``param``.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

from minikv.blocks import blocks_for
from minikv.sampling import SamplingParams
from minikv.validation import InvalidArgument, InvalidArgumentType


def longest_sequence(prompt_tokens: int, max_tokens: int, max_model_len: int | None = None) -> int:
    """The most tokens one sequence ever has in the KV cache: every token but the last one sampled (the
    last is sampled, never fed back), and nothing past the context."""
    longest = prompt_tokens + max_tokens - 1
    return longest if max_model_len is None else min(longest, max_model_len)


def blocks_at_most(prompt_tokens: int, max_tokens: int, block_size: int, max_model_len: int | None = None,
                   n: int = 1) -> int:
    """The most KV blocks a request of ``n`` samples ever holds: each sample's longest sequence, in blocks.

    The one budget rule: the engine's reserved total (`LLMEngine.stats`), the input checks and an admission
    policy's ``request["blocks_at_most"]`` all come from here, in this one unit. (Samples share their
    prompt's full blocks, so this is an upper bound for n > 1, the one admission can count on.)"""
    return n * blocks_for(longest_sequence(prompt_tokens, max_tokens, max_model_len), block_size)


@dataclass(frozen=True)
class EngineLimits:
    """What a running engine can hold: the numbers every request is checked against."""
    vocab_size: int
    max_model_len: int                 # the model's context (max_position_embeddings)
    num_blocks: int                    # the KV pool
    block_size: int
    max_num_seqs: int                  # seats: sequences computing at once
    max_num_batched_tokens: int
    enable_chunked_prefill: bool


@dataclass
class Prompt:
    """A tokenized prompt: its text when it had one, and its token ids."""
    text: str | None
    token_ids: list[int]


class InputProcessor:
    """Prompts in, checked `Prompt`s out (see the module docstring for the rules).

    Stateless: it holds the tokenizer and the frozen `EngineLimits`, and changes neither, so it is safe to
    call from any thread (the server's handlers call it on the event loop while the engine thread steps)."""

    def __init__(self, tokenizer, limits: EngineLimits):
        self.tokenizer, self.limits = tokenizer, limits

    # -- prompts -----------------------------------------------------------------------------------
    def tokenize(self, prompt, param: str = "prompt") -> Prompt:
        """A str, a list of token ids, or ``{"prompt_token_ids": [...], "prompt": text}`` -> a `Prompt`
        whose ids are non-empty, in the vocabulary and within the context."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise InvalidArgument(param, prompt, message=f"a dict {param} needs the key 'prompt_token_ids'; "
                                      f"got keys {sorted(prompt)}")
            try:   # a list, a tuple, an array or a tensor of integers
                ids = [operator.index(t) for t in prompt["prompt_token_ids"]]
            except TypeError:
                raise InvalidArgumentType("prompt_token_ids", prompt["prompt_token_ids"],
                                          "a list of integer token ids") from None
            return self._checked(Prompt(prompt.get("prompt"), ids), prompt, param)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidArgument(param, prompt, message=f"a text {param} needs a tokenizer: pass tokenizer=... "
                                      "or give token ids ({'prompt_token_ids': [...]})")
            return self._checked(Prompt(prompt, self.tokenizer.encode(prompt) if prompt else []), prompt, param)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return self._checked(Prompt(None, list(prompt)), prompt, param)
        raise InvalidArgumentType(param, prompt, "a str, a list of token ids or {'prompt_token_ids': [...]}")

    def render_chat(self, conversation: list[dict], add_generation_prompt: bool = True, **template_kwargs) -> str:
        """A conversation (a list of {"role", "content"}) as text, through the tokenizer's chat template."""
        if self.tokenizer is None:
            raise InvalidArgument("tokenizer", None, message="chat needs a tokenizer with a chat template: "
                                  "pass tokenizer=...")
        try:
            return self.tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                                      tokenize=False, **template_kwargs)
        except Exception as err:  # a template may refuse a conversation (e.g. roles out of order)
            raise InvalidArgument("messages", conversation, message=f"the chat template refused these messages: "
                                  f"{err}") from None

    def chat(self, conversation: list[dict], **template_kwargs) -> Prompt:
        """A conversation through the chat template (`render_chat`), tokenized and checked."""
        text = self.render_chat(conversation, **template_kwargs)
        # the template already wrote any special tokens it wants: do not add them again
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return self._checked(Prompt(text, ids), conversation, "messages")

    def _checked(self, prompt: Prompt, given, param: str) -> Prompt:
        lim, ids = self.limits, prompt.token_ids
        if not ids:
            raise InvalidArgument(param, given, message=f"empty {param}: give at least one token (a text prompt "
                                  "must tokenize to something)")
        if not all(0 <= t < lim.vocab_size for t in ids):
            raise InvalidArgument(param, given, message=f"prompt token ids must lie in [0, {lim.vocab_size}) "
                                  "(the model's vocabulary)")
        if len(ids) > lim.max_model_len:
            raise InvalidArgument(param, given, message=f"prompt of {len(ids)} tokens is longer than the model's "
                                  f"context of {lim.max_model_len} tokens (max_position_embeddings); shorten it")
        return prompt

    # -- the request as a whole ----------------------------------------------------------------------
    def default_max_tokens(self, prompt_tokens: int) -> int:
        """Without max_tokens a request may generate up to the context (vLLM's default), capped at what
        the pool can hold for it alone."""
        lim = self.limits
        pool_tokens = lim.num_blocks * lim.block_size
        return max(1, min(lim.max_model_len - prompt_tokens, pool_tokens - prompt_tokens + 1))

    def check(self, prompt: Prompt, params: SamplingParams, *, param: str = "prompt",
              refuse_past_context: bool = False) -> None:
        """Can this request ever finish here? Raises `InvalidArgument` naming the field to change.

        Offline, a request whose ``max_tokens`` reaches past the context stops there ("length");
        `refuse_past_context` refuses it instead, as OpenAI's and vLLM's servers do."""
        lim, n_prompt = self.limits, len(prompt.token_ids)
        if params.stop and self.tokenizer is None:
            raise InvalidArgument("stop", params.stop, message="stop strings need a tokenizer to detokenize; use "
                                  "stop_token_ids instead")
        if params.n > lim.max_num_seqs:
            raise InvalidArgument("n", params.n, message=f"n={params.n} samples cannot run together: the engine "
                                  f"runs at most max_num_seqs={lim.max_num_seqs} sequences at once "
                                  "(--max-num-seqs); lower n or raise max_num_seqs")
        if refuse_past_context and n_prompt >= lim.max_model_len:
            raise InvalidArgument(param, n_prompt, message=f"this model's maximum context length is "
                                  f"{lim.max_model_len} tokens, but the prompt has {n_prompt}; shorten the prompt")
        if refuse_past_context and n_prompt + params.max_tokens > lim.max_model_len:
            raise InvalidArgument("max_tokens", params.max_tokens, message=(
                f"this model's maximum context length is {lim.max_model_len} tokens; you asked for "
                f"{n_prompt + params.max_tokens} ({n_prompt} in the prompt, {params.max_tokens} to generate); "
                "lower max_tokens or shorten the prompt"))
        pool_tokens = lim.num_blocks * lim.block_size
        if blocks_for(n_prompt, lim.block_size) > lim.num_blocks:
            raise InvalidArgument(param, n_prompt, message=(
                f"the prompt has {n_prompt} tokens but the whole KV cache pool holds {pool_tokens} "
                f"({lim.num_blocks} blocks of {lim.block_size}); shorten the prompt or give the cache more memory "
                "(num_blocks / kv_cache_memory; --num-blocks / --kv-cache-memory)"))
        # One sample must fit alone; a request's other samples may wait for it (preemption serializes them).
        need = blocks_at_most(n_prompt, params.max_tokens, lim.block_size, lim.max_model_len, n=1)
        if need > lim.num_blocks:
            raise InvalidArgument("max_tokens", params.max_tokens, message=(
                f"this request cannot fit even alone: {n_prompt} prompt + {params.max_tokens} max_tokens need up "
                f"to {need} blocks of {lim.block_size} tokens, but the pool has {lim.num_blocks}; give the cache "
                "more memory or lower max_tokens"))
        longest = longest_sequence(n_prompt, params.max_tokens, lim.max_model_len)
        if not lim.enable_chunked_prefill and longest > lim.max_num_batched_tokens:
            raise InvalidArgument("max_tokens", params.max_tokens, message=(
                f"without chunked prefill a sequence of up to {longest} tokens must fit in one step, but "
                f"max_num_batched_tokens={lim.max_num_batched_tokens}; raise it or enable chunked prefill"))

    def process(self, prompt, params: SamplingParams) -> Prompt:
        """`tokenize` then `check`: what `LLMEngine.add_request` runs for every request."""
        if not isinstance(params, SamplingParams):
            raise InvalidArgumentType("params", params, "a SamplingParams")
        tokenized = self.tokenize(prompt)
        self.check(tokenized, params)
        return tokenized
