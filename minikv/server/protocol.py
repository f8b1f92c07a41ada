"""The request bodies the server accepts (OpenAI's names, vLLM's extras) and the errors it answers.

Every check happens here, before a request reaches the engine, and every failure becomes an
`APIError`: an HTTP status and OpenAI's error body ``{"error": {"message", "type", "param",
"code"}}`` (vLLM's shape: ``type`` is ``BadRequestError`` / ``NotFoundError``, ``code`` the
status). The message says what is wrong and what to do. A bad input is never a 500.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from minikv.blocks import blocks_for
from minikv.sampling import SamplingParams
from minikv.validation import InvalidArgument

ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 413: "BadRequestError",
               429: "RateLimitError", 500: "InternalServerError", 503: "ServiceUnavailableError"}


class APIError(Exception):
    """An answer other than 200: status, a message that says what to do, the offending field."""

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "APIError"),
                          "param": self.param, "code": self.status}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    """Fields both endpoints share. Strict types: "0.5" is not a temperature. Unknown fields are ignored."""

    model_config = ConfigDict(strict=True, extra="ignore")

    # null means "the default", as OpenAI's and vLLM's servers read it (some clients send every field)
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = 1.0
    top_p: float | None = 1.0
    top_k: int | None = 0              # vLLM's extra; -1 or 0 keeps every token
    n: int | None = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = False    # vLLM's extra
    return_token_ids: bool | None = False   # vLLM's extra: the prompt's and each choice's token ids
    logprobs: Any = None               # not served: refused below rather than silently ignored
    echo: bool = False

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, v):
        if v is not None and v < 1:
            raise ValueError(f"max_tokens must be at least 1, got {v}; ask for one token or more")
        return v

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v):
        if v is None:
            return 1.0
        if v < 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {v}")
        return v

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, v):
        if v is None:
            return 1.0
        if not 0 < v <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 keeps every token), got {v}")
        return v

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v):
        if v is None:
            return 0
        if v < -1:
            raise ValueError(f"top_k must be -1 or 0 (every token) or a positive count, got {v}")
        return max(v, 0)

    @field_validator("n")
    @classmethod
    def _n(cls, v):
        if v is None:
            return 1
        if v < 1:
            raise ValueError(f"n must be at least 1 (samples per prompt), got {v}")
        return v

    @field_validator("stream", "ignore_eos", "return_token_ids")
    @classmethod
    def _flag(cls, v):
        return bool(v)

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else v or []
        if len(stops) > 4 or not all(stops):
            raise ValueError(f"stop is up to 4 non-empty strings, got {v!r}")
        return stops or None

    def check_supported(self) -> None:
        if self.logprobs not in (None, False, 0):
            raise APIError(400, "logprobs are not served by minikv; leave logprobs out", "logprobs")
        if self.echo:
            raise APIError(400, "echo is not served by minikv; leave echo out (the prompt is yours already)", "echo")

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        # The engine's own checks have the last word (a NaN temperature passes JSON parsing, not them):
        # what they refuse is the client's input, so a 400 naming the field, never a 500.
        try:
            return SamplingParams(n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                                  max_tokens=self.requested_max_tokens or default_max_tokens, stop=self.stop,
                                  seed=self.seed, ignore_eos=self.ignore_eos)
        except InvalidArgument as err:
            raise APIError(400, str(err), err.param) from None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    prompt: str | list[int]

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if not v:
            raise ValueError("prompt is empty: give some text or a list of token ids")
        return v


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict] | None = None

    def text(self) -> str:
        """String content, or the text parts of a list of content parts."""
        if isinstance(self.content, list):
            parts = []
            for part in self.content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(400, f"minikv reads text content only; got a {part.get('type')!r} part",
                                   "messages")
                parts.append(part["text"])
            return "".join(parts)
        return self.content or ""


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None

    @field_validator("max_completion_tokens")
    @classmethod
    def _max_completion_tokens(cls, v):
        if v is not None and v < 1:
            raise ValueError(f"max_completion_tokens must be at least 1, got {v}; ask for one token or more")
        return v

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


# json.loads stops near 1,000 levels (Python's stack), pydantic's parser at 200: either way, a 400
TOO_DEEP = ("the request body nests arrays or objects too deeply to read; send a flat JSON object (a prompt is "
            "a string or a list of token ids)")


def load_json(raw: bytes) -> Any:
    """JSON bytes -> Python objects, or an APIError(400): every route reads its body through this."""
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise APIError(400, f"the request body is not valid JSON ({err}); send a JSON object") from None
    except RecursionError:   # a body nested thousands deep outruns Python's stack: the client's error, not ours
        raise APIError(400, TOO_DEEP) from None


def parse(kind: type[_Common], raw: bytes) -> _Common:
    """JSON bytes -> a validated request, or an APIError(400) naming the field and what to send."""
    data = load_json(raw)
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    missing = "prompt" if kind is CompletionRequest else "messages"
    if missing not in data:
        other = "/v1/chat/completions takes 'messages'" if kind is CompletionRequest else \
            "/v1/completions takes 'prompt'"
        raise APIError(400, f"'{missing}' is required ({other})", missing)
    try:   # from the JSON text: strict mode then still takes 0 for a float and an object for a sub-model
        req = kind.model_validate_json(raw)
    except ValidationError as err:
        errors = err.errors()
        if errors[0]["type"] == "json_invalid":   # json.loads read it, so only pydantic's depth limit is left
            raise APIError(400, TOO_DEEP) from None
        param = str(errors[0]["loc"][0]) if errors[0]["loc"] else None
        same = [e for e in errors if e["loc"] and str(e["loc"][0]) == param]   # a union reports each member
        if errors[0]["type"] == "value_error":
            msg = errors[0]["msg"].removeprefix("Value error, ")
        else:
            where = ".".join(str(p) for p in errors[0]["loc"][1:] if not isinstance(p, str) or p.isidentifier()
                             and p not in ("str", "int", "float", "bool", "list", "dict"))
            said = " or ".join(dict.fromkeys(e["msg"].removeprefix("Input should be ").removeprefix("Value error, ")
                                             for e in same))
            msg = (f"{param}{'.' + where if where else ''}: should be {said}; got "
                   f"{json.dumps(errors[0].get('input'))[:80]}")
        raise APIError(400, msg, param) from None
    req.check_supported()
    return req


def check_fits(prompt_len: int, max_tokens: int | None, *, context: int, num_blocks: int, block_size: int,
               param: str) -> int:
    """The engine's admission limits, checked before queueing; returns the max_tokens to use.

    Without max_tokens a request may generate up to the context (vLLM's default), capped to what
    the pool can hold for it alone.
    """
    if prompt_len >= context:
        raise APIError(400, f"this model's maximum context length is {context} tokens, but the prompt has "
                            f"{prompt_len}; shorten the prompt", param)
    pool_tokens = num_blocks * block_size
    if prompt_len > pool_tokens:
        raise APIError(400, f"the prompt has {prompt_len} tokens but the whole KV cache pool holds {pool_tokens} "
                            f"({num_blocks} blocks of {block_size}); shorten the prompt or start the server with "
                            f"more KV cache (--num-blocks / --kv-cache-memory)", param)
    if max_tokens is None:
        return max(1, min(context - prompt_len, pool_tokens - prompt_len + 1))
    if prompt_len + max_tokens > context:
        raise APIError(400, f"this model's maximum context length is {context} tokens; you asked for "
                            f"{prompt_len + max_tokens} ({prompt_len} in the prompt, {max_tokens} to generate); "
                            f"lower max_tokens or shorten the prompt", "max_tokens")
    if blocks_for(prompt_len + max_tokens - 1, block_size) > num_blocks:
        raise APIError(400, f"{prompt_len} prompt + {max_tokens} max_tokens cannot fit even alone in the KV cache "
                            f"pool of {pool_tokens} tokens; lower max_tokens or give the server more KV cache",
                       "max_tokens")
    return max_tokens
