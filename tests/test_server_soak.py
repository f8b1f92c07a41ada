"""A hostile mix against the real server: every request gets an HTTP answer, never a 5xx, and nothing is left.

Twelve kinds of request (480 in all), 24 clients at a time, one shared keep-alive connection pool (as a real
client has) against `minikv serve --num-blocks 64 --max-num-seqs 8 --max-waiting 16` on the tiny
model: plain, streamed, streamed and dropped after the first chunk, n=2, stop strings, malformed
JSON, wrong types, max_tokens of 10^9, unknown fields, invalid UTF-8, an empty chat, and a JSON
body nested 5,000 deep. Afterwards the pool's blocks are all free, nothing runs or waits, and the
server still serves.

Why the shared pool matters: an answer that leaves the server's connection unusable (uvicorn closes
a connection after an application error) is invisible to a client that opens one connection per
request, and a dropped request to the next client that reuses that connection.

Run more of it by hand: ``python tests/test_server_soak.py --requests 1200`` (loopback only).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import sys
import time

import httpx
import pytest

from minikv.bench.serve import launch_server, parse_metrics, stop_server, wait_healthy

SERVER = ["--model", "tiny-random-llama", "--threads", "1", "--num-blocks", "64", "--max-num-seqs", "8",
          "--max-waiting", "16"]
CONCURRENCY = 24
DEEP = 5000


def _post(path: str, body: dict | None = None, raw: bytes | None = None, stream: bool = False,
          drop: bool = False) -> dict:
    return {"path": path, "raw": raw if raw is not None else json.dumps(body).encode(), "stream": stream,
            "drop": drop}


# kind -> the request, and the statuses it may get (429 whenever the queue is full)
KINDS = {
    "plain": (_post("/v1/completions", {"prompt": "hello there", "max_tokens": 8}), {200, 429}),
    "streamed": (_post("/v1/completions", {"prompt": "a stream", "max_tokens": 8, "stream": True},
                       stream=True), {200, 429}),
    "dropped": (_post("/v1/completions", {"prompt": "gone soon", "max_tokens": 64, "stream": True,
                                          "ignore_eos": True}, stream=True, drop=True), {200, 429}),
    "n2": (_post("/v1/completions", {"prompt": "twice", "max_tokens": 8, "n": 2, "temperature": 1, "seed": 3}),
           {200, 429}),
    "stop": (_post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 16,
                                            "stop": ["e", "a"]}), {200, 429}),
    "malformed": (_post("/v1/completions", raw=b'{"prompt": "x", "max_tokens": 4,'), {400}),
    "wrong_types": (_post("/v1/completions", {"prompt": "x", "max_tokens": "four", "temperature": [1]}), {400}),
    "huge_max_tokens": (_post("/v1/completions", {"prompt": "x", "max_tokens": 10 ** 9}), {400}),
    "unknown_fields": (_post("/v1/completions", {"prompt": "extra", "max_tokens": 4, "frobnicate": {"a": 1},
                                                 "best_of_luck": True}), {200, 429}),
    "invalid_utf8": (_post("/v1/completions", raw=b'{"prompt": "\xff\xfe\xc3", "max_tokens": 4}'), {400}),
    "empty_chat": (_post("/v1/chat/completions", {"messages": [], "max_tokens": 4}), {400}),
    "deep": (_post("/v1/completions", raw=b'{"prompt": ' + b"[" * DEEP + b"]" * DEEP + b', "max_tokens": 4}'),
             {400}),
}


async def _one(client: httpx.AsyncClient, url: str, kind: str) -> tuple[str, int | str]:
    req, _ = KINDS[kind]
    try:
        if req["stream"]:
            async with client.stream("POST", url + req["path"], content=req["raw"],
                                     headers={"content-type": "application/json"}) as resp:
                async for line in resp.aiter_lines():
                    if req["drop"] and line.startswith("data: "):
                        break        # leaving the block closes the connection mid-stream
                return kind, resp.status_code
        resp = await client.post(url + req["path"], content=req["raw"], headers={"content-type": "application/json"})
        return kind, resp.status_code
    except httpx.HTTPError as err:   # no HTTP answer at all: what this test exists to catch
        return kind, f"{type(err).__name__}: {err}"


async def soak(url: str, requests: int, concurrency: int = CONCURRENCY, timeout: float = 120) -> list:
    """Send `requests` requests, the kinds in turn, `concurrency` at a time; return (kind, status or error)."""
    names = list(KINDS)
    todo = iter(range(requests))
    results = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        async def worker():
            for i in todo:
                results.append(await _one(client, url, names[i % len(names)]))
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


def problems(results: list) -> list[str]:
    """Every request that got no HTTP answer, or a status its kind may not get."""
    return [f"{kind}: {status}" for kind, status in results
            if not isinstance(status, int) or status not in KINDS[kind][1]]


def settle(url: str, wait: float = 30) -> dict:
    """/metrics once the engine has nothing left: aborted streams end within a step."""
    deadline = time.monotonic() + wait
    while True:
        row = parse_metrics(httpx.get(f"{url}/metrics", timeout=10).text)
        if (row["running"], row["waiting"], row["blocks_used"]) == (0, 0, 0) or time.monotonic() > deadline:
            return row
        time.sleep(0.2)


@pytest.fixture(scope="module")
def server():
    proc, url = launch_server(SERVER)
    try:
        wait_healthy(proc, url, wait=180)
        yield url
    finally:
        log = stop_server(proc)
    assert proc.returncode == 0, log[-3000:]


@pytest.mark.parametrize("depth", [300, DEEP])   # past pydantic's limit (200); past Python's stack (~1,000)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_deeply_nested_body_is_a_400_with_a_message(server, path, depth):
    field = b'"prompt"' if path == "/v1/completions" else b'"messages"'
    resp = httpx.post(server + path, content=b"{" + field + b": " + b"[" * depth + b"]" * depth + b"}", timeout=60)
    assert resp.status_code == 400, resp.text
    assert "nests" in resp.json()["error"]["message"]


def test_hostile_mix_every_request_answered_nothing_left(server):
    results = asyncio.run(soak(server, requests=480))   # 40 of each kind
    assert len(results) == 480
    assert problems(results) == []
    counts = collections.Counter(s for _, s in results)
    assert counts[200] >= 24 and counts[400] >= 24 * 5, counts   # work was done and refusals were refusals
    after = settle(server)
    assert (after["running"], after["waiting"], after["blocks_used"]) == (0, 0, 0), after
    again = httpx.post(f"{server}/v1/completions", json={"prompt": "still here", "max_tokens": 4}, timeout=60)
    assert again.status_code == 200 and again.json()["choices"][0]["finish_reason"] in ("length", "stop")


def test_an_internal_error_answers_500_and_closes_the_connection_so_no_next_request_is_lost():
    """In-process: an engine loop that fails on submit (a bug) gets the client a 500 that says Connection: close."""
    from types import SimpleNamespace

    from minikv.inputs import EngineLimits, InputProcessor
    from minikv.models import byte_tokenizer
    from minikv.server.app import ServerState, create_app

    def broken_submit(*args, **kwargs):
        raise RuntimeError("a bug")

    tokenizer = byte_tokenizer()
    limits = EngineLimits(vocab_size=256, max_model_len=512, num_blocks=64, block_size=16, max_num_seqs=8,
                          max_num_batched_tokens=512, enable_chunked_prefill=True)
    loop = SimpleNamespace(inputs=InputProcessor(tokenizer, limits), submit=broken_submit)
    app = create_app(ServerState(loop, tokenizer, "m"))

    async def ask():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})

    resp = asyncio.run(ask())
    assert resp.status_code == 500 and "RuntimeError" in resp.json()["error"]["message"]
    assert resp.headers["connection"] == "close"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=1200)
    p.add_argument("--url", help="a running server on loopback (default: start one with the soak's flags)")
    args = p.parse_args(argv)
    proc, url = (None, args.url) if args.url else launch_server(SERVER)
    try:
        if proc is not None:
            wait_healthy(proc, url, wait=180)
        t0 = time.perf_counter()
        results = asyncio.run(soak(url, args.requests))
        took = time.perf_counter() - t0
        bad = problems(results)
        print(f"{len(results)} requests in {took:.1f} s; statuses "
              f"{dict(collections.Counter(s if isinstance(s, int) else 'no answer' for _, s in results))}")
        print(f"problems: {len(bad)}", *bad[:20], sep="\n  ")
        print("after:", settle(url))
    finally:
        if proc is not None:
            log = stop_server(proc)
            errors = [line for line in log.splitlines() if "Error" in line or "Exception" in line]
            print(f"server exit {proc.returncode}; log lines naming an error: {len(errors)}", *errors[:10],
                  sep="\n  ")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
