"""vLLM's small endpoints beside the API: ``POST /tokenize``, ``POST /detokenize``, ``GET /version``.

Clients call them before they send work: a load generator tokenizes its prompts to size them, a
chat front end counts a conversation's tokens against ``max_model_len``. The shapes are vLLM's
(``vllm/entrypoints/openai`` protocol), so a client written for vLLM reads ours unchanged:

* ``/tokenize`` takes ``{"prompt": str, "add_special_tokens": true}`` or ``{"messages": [...],
  "add_generation_prompt": true, "continue_final_message": false, "add_special_tokens": false}``,
  either with ``"return_token_strs"``, and answers ``{"count", "max_model_len", "tokens", "token_strs"}``;
* ``/detokenize`` takes ``{"tokens": [int]}`` and answers ``{"prompt": str}``;
* ``/version`` answers ``{"version": ...}`` (minikv's).

The defaults give exactly the ids ``/v1/completions`` and ``/v1/chat/completions`` feed the engine,
so a count taken here is the count the engine sees. The same API key guards them as ``/v1`` (vLLM
guards ``/v1`` only; these read the tokenizer on the server's CPU, so a key holder's work), and the
same body-size limit and JSON reading apply: bad input is a 400 that names the field.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from minikv import __version__
from minikv.server.protocol import APIError, ChatMessage, load_json
from minikv.validation import InvalidArgument


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")   # as the API: strict types, unknown fields ignored
    model: str | None = None


class TokenizeCompletionRequest(_Body):
    prompt: str
    add_special_tokens: bool = True          # as /v1/completions encodes a text prompt
    return_token_strs: bool | None = False


class TokenizeChatRequest(_Body):
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True       # as /v1/chat/completions renders a conversation
    continue_final_message: bool = False
    add_special_tokens: bool = False         # the chat template writes the special tokens it wants
    return_token_strs: bool | None = False

    @model_validator(mode="after")
    def _one_ending(self):
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true: set "
                             "add_generation_prompt to false to continue the last message")
        return self


class DetokenizeRequest(_Body):
    tokens: list[int]


def read(kind: type[_Body], raw: bytes) -> _Body:
    """JSON bytes -> a validated body, or an APIError(400) naming the field."""
    data = load_json(raw)
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    if kind is TokenizeCompletionRequest and "messages" in data:   # /tokenize takes a conversation too
        kind = TokenizeChatRequest
    try:
        return kind.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        msg = first["msg"].removeprefix("Value error, ")
        raise APIError(400, f"{param}: {msg}" if param else msg, param.split(".")[0] if param else None) from None


def tokenize(req: TokenizeCompletionRequest | TokenizeChatRequest, inputs) -> dict:
    """/tokenize, through the engine's input processor (`minikv.inputs`): its chat template, its tokenizer.
    The ids are counted, not checked against the context: a client asks in order to know the length."""
    tokenizer = inputs.tokenizer
    if isinstance(req, TokenizeChatRequest):
        conversation = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            text = inputs.render_chat(conversation, add_generation_prompt=req.add_generation_prompt,
                                      continue_final_message=req.continue_final_message)
        except InvalidArgument as err:
            raise APIError(400, str(err), "messages") from None
    else:
        text = req.prompt
    ids = tokenizer.encode(text, add_special_tokens=req.add_special_tokens)
    return {"count": len(ids), "max_model_len": inputs.limits.max_model_len, "tokens": ids,
            "token_strs": tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None}


def detokenize(req: DetokenizeRequest, tokenizer, vocab_size: int) -> dict:
    bad = [t for t in req.tokens if not 0 <= t < vocab_size]
    if bad:
        raise APIError(400, f"tokens must lie in [0, {vocab_size}) (the model's vocabulary); got {bad[:5]}",
                       "tokens")
    return {"prompt": tokenizer.decode(req.tokens)}


def add_routes(app: FastAPI, state, check_key: Callable[[Request, object], None],
               read_body: Callable[[Request, int], Awaitable[bytes]]) -> None:
    """Register the three routes on `app`, with the API's key check and body reader."""

    async def body(request: Request, kind: type[_Body]) -> _Body:
        check_key(request, state)
        req = read(kind, await read_body(request, state.max_body_bytes))
        if req.model is not None and req.model != state.model_name:
            raise APIError(404, f"the model {req.model!r} does not exist here; this server serves "
                                f"{state.model_name!r} (GET /v1/models lists it)", "model")
        return req

    @app.post("/tokenize")
    async def tokenize_route(request: Request):
        return tokenize(await body(request, TokenizeCompletionRequest), state.inputs)

    @app.post("/detokenize")
    async def detokenize_route(request: Request):
        return detokenize(await body(request, DetokenizeRequest), state.tokenizer, state.inputs.limits.vocab_size)

    @app.get("/version")
    async def version(request: Request):
        check_key(request, state)
        return {"version": __version__}
