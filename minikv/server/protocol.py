"""The request bodies the server accepts (OpenAI's names, vLLM's extras) and the errors it answers.

This module only parses: JSON, field types (strict: "0.5" is not a temperature), OpenAI's own
limits, what minikv does not serve. The values' rules are the engine's, checked once for offline
and served requests alike (`SamplingParams`; `minikv.inputs` for prompt, context, pool and seats).
Every failure becomes an `APIError`: an HTTP status and OpenAI's error body ``{"error":
{"message", "type", "param", "code"}}`` (vLLM's shape: ``type`` is ``BadRequestError`` /
``NotFoundError``, ``code`` the status). The message says what is wrong and what to do. A bad
input is never a 500.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from minikv.sampling import SamplingParams

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

    @field_validator("stream", "ignore_eos", "return_token_ids")
    @classmethod
    def _flag(cls, v):
        return bool(v)

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):   # OpenAI's API takes up to 4 (a limit of the API, not of sampling)
        stops = [v] if isinstance(v, str) else v or []
        if len(stops) > 4:
            raise ValueError(f"stop is up to 4 strings, got {len(stops)}")
        return stops or None

    def check_supported(self) -> None:
        if self.logprobs not in (None, False, 0):
            raise APIError(400, "logprobs are not served by minikv; leave logprobs out", "logprobs")
        if self.echo:
            raise APIError(400, "echo is not served by minikv; leave echo out (the prompt is yours already)", "echo")

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """The body's sampling fields as `SamplingParams`, which alone judges their values: what it
        refuses raises `InvalidArgument` naming the field (the handler answers 400 with it)."""
        default = lambda value, when_null: when_null if value is None else value   # null: the default
        top_k = default(self.top_k, 0)
        return SamplingParams(n=default(self.n, 1), temperature=default(self.temperature, 1.0),
                              top_p=default(self.top_p, 1.0), top_k=0 if top_k == -1 else top_k,   # vLLM: -1 is all
                              max_tokens=max_tokens, stop=self.stop, seed=self.seed, ignore_eos=self.ignore_eos)

    def field_name(self, param: str | None) -> str | None:
        """The body's name for an engine parameter (chat spells max_tokens max_completion_tokens)."""
        return param

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    prompt: str | list[int]


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

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens if self.max_completion_tokens is None else self.max_completion_tokens

    def field_name(self, param: str | None) -> str | None:
        if param == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return param


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
