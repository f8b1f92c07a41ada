"""The HTTP routes: OpenAI's completions and chat completions, models, health and metrics
(and, from `minikv.server.tokens`, vLLM's /tokenize, /detokenize and /version).

A request's path through a handler: API key -> body (size-limited) -> `protocol.parse` -> model
name -> the engine's input processor (`minikv.inputs`: tokenize or chat template, `SamplingParams`,
context / pool / seats) -> `EngineLoop.submit`
(or 429 when ``max_waiting`` requests already wait) -> await the request's outbox, sending each
update as server-sent-event chunks or collecting it into one response. If the client goes away
before its request finishes, the handler aborts it; the engine frees its blocks within a step.

``/debug/profile`` (POST ``{"on": true}`` / ``{"on": false}``, GET) switches the served-latency profile
on and off and reads it (`EngineLoop.profile`, read by `minikv.bench.profile`): while it is on, the event
loop measures its own lag (a callback every `LAG_EVERY` s, and how late it runs) and the time it spends
serialising stream chunks, and every streamed chunk carries ``minikv_profile``: the engine step that made
its tokens, when the engine thread posted it and when this loop picked it up (perf_counter seconds, one
clock with a client on the same machine).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
import uuid
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from minikv.server.engine_loop import EngineLoop, LoopProfile, ServerClosing, Update
from minikv.server.landlord import add_routes as add_landlord_routes
from minikv.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, parse
from minikv.server.responses import Choice, Envelope, extra, sse, usage
from minikv.server.tokens import add_routes as add_token_routes
from minikv.validation import InvalidArgument

log = logging.getLogger("minikv.server")
LAG_EVERY = 0.01   # seconds between the profile's event-loop lag probes


@dataclass
class ServerState:
    loop: EngineLoop
    tokenizer: object
    model_name: str
    max_waiting: int | None = None        # requests accepted but not started; past it: 429
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    metrics: object = None                # ServerMetrics
    landlord: object = None               # the live page's feed (minikv.server.landlord.Feed)

    @property
    def inputs(self):
        """The engine's input processor: the one piece of the engine a handler uses (it is stateless)."""
        return self.loop.inputs


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="minikv", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.minikv = state
    ids = itertools.count()

    @app.exception_handler(APIError)
    async def _api_error(request, err: APIError):
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, err):
        return JSONResponse(APIError(err.status_code, f"{err.detail}: {request.method} {request.url.path}; "
                                     "the API is under /v1 (completions, chat/completions, models)").body(),
                            status_code=err.status_code)

    @app.exception_handler(Exception)
    async def _bug(request, err):   # never a traceback to the client; the log has it
        log.exception("internal error on %s", request.url.path)
        # Starlette re-raises after this answer and uvicorn then closes the connection: say so, or a
        # keep-alive client reuses it for its next request, which is lost unanswered.
        return JSONResponse(APIError(500, f"internal error ({type(err).__name__}); the server log has the "
                                          "details").body(), status_code=500, headers={"Connection": "close"})

    @app.get("/health")
    async def health():
        ok = state.loop.alive and state.loop.accepting
        return Response(status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(state.metrics.render(), media_type="text/plain; version=0.0.4")

    if state.landlord is not None:
        add_landlord_routes(app, state)

    @app.get("/v1/models")
    async def models(request: Request):
        _check_key(request, state)
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": 0,
                                            "owned_by": "minikv", "root": state.model_name,
                                            "max_model_len": state.inputs.limits.max_model_len,
                                            "vocab_size": state.inputs.limits.vocab_size}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _serve(request, state, CompletionRequest, f"cmpl-{uuid.uuid4().hex[:16]}-{next(ids)}")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _serve(request, state, ChatCompletionRequest, f"chatcmpl-{uuid.uuid4().hex[:16]}-{next(ids)}")

    @app.get("/debug/profile")
    async def profile(request: Request):
        _check_key(request, state)
        prof = state.loop.profile
        return {"on": prof is not None, **(prof.as_dict() if prof is not None else {})}

    @app.post("/debug/profile")
    async def switch_profile(request: Request):
        _check_key(request, state)
        try:
            on = json.loads(await _read_body(request, 1024) or b"{}").get("on")
        except (ValueError, AttributeError):
            on = None
        if not isinstance(on, bool):
            raise APIError(400, 'send {"on": true} to start a profile (it starts empty) or {"on": false} to '
                                "stop it; GET /debug/profile reads it", "on")
        prof, state.loop.profile = state.loop.profile, None
        if prof is not None and prof.lag_task is not None:
            prof.lag_task.cancel()
        if on:
            prof = LoopProfile()
            prof.lag_task = asyncio.create_task(_watch_lag(prof))
            state.loop.profile = prof
        return {"on": on, **(prof.as_dict() if prof is not None else {})}

    add_token_routes(app, state, _check_key, _read_body)   # /tokenize, /detokenize, /version (vLLM's)
    return app


async def _watch_lag(prof: LoopProfile) -> None:
    """How late a callback scheduled every LAG_EVERY seconds runs (the time the event loop was busy elsewhere),
    and the event loop thread's CPU time so far (how much of a core it takes from the engine)."""
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + LAG_EVERY
        await asyncio.sleep(LAG_EVERY)
        now = loop.time()
        prof.lag.append((time.perf_counter(), max(0.0, now - due), time.thread_time()))


def _check_key(request: Request, state: ServerState) -> None:
    if state.api_key and request.headers.get("authorization") != f"Bearer {state.api_key}":
        raise APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>' with the "
                            "key the server was started with (--api-key / MINIKV_API_KEY)")


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body has {declared} bytes; this server takes at most {limit}")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise APIError(413, f"the request body is larger than {limit} bytes; send a shorter prompt")
    return bytes(body)


async def _serve(request: Request, state: ServerState, kind, request_id: str):
    arrival = time.perf_counter()
    _check_key(request, state)
    req = parse(kind, await _read_body(request, state.max_body_bytes))
    if req.model is not None and req.model != state.model_name:
        raise APIError(404, f"the model {req.model!r} does not exist here; this server serves "
                            f"{state.model_name!r} (GET /v1/models lists it)", "model")
    inputs = state.inputs   # the engine's own door: the same rules as LLM.generate
    chat = isinstance(req, ChatCompletionRequest)
    try:
        if chat:
            prompt = inputs.chat([{"role": m.role, "content": m.text()} for m in req.messages])
        else:
            prompt = inputs.tokenize(req.prompt)
        requested = req.requested_max_tokens
        params = req.sampling_params(requested if requested is not None
                                     else inputs.default_max_tokens(len(prompt.token_ids)))
        inputs.check(prompt, params, param="messages" if chat else "prompt", refuse_past_context=True)
    except InvalidArgument as err:   # the client's input: a 400 naming the field, never a 500
        raise APIError(400, str(err), req.field_name(err.param)) from None
    text, ids = prompt.text, prompt.token_ids
    try:
        outbox = state.loop.submit(request_id, {"prompt": text, "prompt_token_ids": ids}, params,
                                   max_queued=state.max_waiting, arrival_time=arrival)
    except OverflowError as err:
        why = err.args[0] if err.args and isinstance(err.args[0], str) else \
            f"{state.max_waiting} requests are already waiting to start (--max-waiting)"
        raise APIError(429, f"the server is full: {why}; retry after a moment", headers={"Retry-After": "1"}) \
            from None
    except ServerClosing:
        raise APIError(503, "the server is shutting down; send the request to another server or retry later") \
            from None
    choices = [Choice(i) for i in range(params.n)]
    env = Envelope(request_id, state.model_name, chat=isinstance(req, ChatCompletionRequest),
                   prompt_token_ids=ids)
    if req.stream:
        return StreamingResponse(_stream(state, request_id, outbox, env, choices, req, len(ids)),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    return await _collect(request, state, request_id, outbox, env, choices, req, len(ids))


async def _stream(state, request_id, outbox, env: Envelope, choices, req, prompt_len):
    finished = False
    try:
        if env.chat:
            for c in choices:
                yield sse(env.chunk(c, "", None, role=True))
        info = None
        while not finished:
            update: Update = await outbox.get()
            prof, picked = state.loop.profile, time.perf_counter()
            finished = update.finished
            if update.error:
                yield sse(APIError(update.error_status, update.error).body())
                break
            chunks = []
            for d in update.deltas:
                c = choices[d.index]
                c.add(d)
                if d.text or d.finish_reason or (req.return_token_ids and d.token_ids):
                    chunks.append(env.chunk(c, d.text, d.finish_reason, d.token_ids if req.return_token_ids else None))
            if finished:
                info = update.info
                if chunks and not req.include_usage:
                    chunks[-1]["minikv"] = extra(info)
            if prof is not None:   # profile: stamp each chunk, and time the serialising
                for chunk in chunks:
                    chunk["minikv_profile"] = {"step": update.step, "posted": update.posted, "picked": picked}
            events = [sse(chunk) for chunk in chunks]
            if prof is not None:
                prof.serialise_s += time.perf_counter() - picked   # building the chunks and their JSON
                prof.chunks += len(events)
            for event in events:
                yield event
        if req.include_usage and finished and info is not None:
            yield sse(env.usage_chunk(usage(info, choices, prompt_len)) | {"minikv": extra(info)})
        yield sse("[DONE]")
    finally:
        if not finished:   # the client went away (or the server is stopping): free its blocks now
            state.loop.abort(request_id)


async def _collect(request: Request, state, request_id, outbox, env: Envelope, choices, req, prompt_len):
    async def run() -> Update:
        while True:
            update = await outbox.get()
            if update.error:
                raise APIError(update.error_status, update.error,
                               headers={"Retry-After": "1"} if update.error_status == 429 else None)
            for d in update.deltas:
                choices[d.index].add(d)
            if update.finished:
                return update

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work, watch = asyncio.create_task(run()), asyncio.create_task(disconnected())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():   # the client went away before its answer: abort it, free its blocks
            work.cancel()
            state.loop.abort(request_id)
    if not work.done() or work.cancelled():
        return Response(status_code=499)
    update = work.result()
    return env.response(choices, usage(update.info, choices, prompt_len), update.info, req.return_token_ids)
