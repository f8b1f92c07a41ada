"""`minikv serve` as a client sees it: the real server process on a loopback port, the tiny random Llama
(with the byte tokenizer, so text and chat work), the official `openai` client (sync and async) and httpx.

Every answer is checked against `LLM.generate` / `LLM.chat` run in this process on the same weights:
the server must return exactly the tokens the offline engine returns, streamed or not, alone or among
sixteen concurrent clients, with or without a prefix-cache hit, preempted or not.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import httpx
import openai
import pytest
import torch

from minikv.bench.serve import launch_server, parse_metrics, stop_server, wait_healthy
from minikv.engine import LLM
from minikv.models import byte_tokenizer
from minikv.sampling import SamplingParams

MODEL = "tiny-random-llama"
# A small pool (48 blocks of 8 = 384 tokens, under the 512-token context) so that sixteen clients
# preempt each other and a 400-token prompt fits the context but not the pool.
SERVER = ["--model", MODEL, "--threads", "1", "--block-size", "8", "--num-blocks", "48", "--max-num-seqs", "16"]
# One seat, two places in the queue, a key: for back-pressure, auth and SIGTERM (the module's last test).
SMALL = ["--model", MODEL, "--threads", "1", "--max-num-seqs", "1", "--max-waiting", "2", "--api-key", "s3cret"]
KEY = {"Authorization": "Bearer s3cret"}


@pytest.fixture(scope="module")
def servers():
    """Both server processes, started together (each takes a while to import torch and load)."""
    procs = {name: launch_server(args) for name, args in (("main", SERVER), ("small", SMALL))}
    try:
        for proc, url in procs.values():
            wait_healthy(proc, url, wait=180)
        yield procs
    finally:
        logs = {name: stop_server(proc) for name, (proc, _) in procs.items()}
    for name, (proc, _) in procs.items():
        assert proc.returncode == 0, logs[name]


@pytest.fixture(scope="module")
def server(servers):
    return servers["main"][1]


@pytest.fixture(scope="module")
def small(servers):
    return servers["small"]


@pytest.fixture(scope="module")
def ref():
    """The offline engine on the same weights and tokenizer: the tokens the server must reproduce."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # two threads that wait for each other crawl on a busy machine
    yield LLM(MODEL, tokenizer=byte_tokenizer(), verbose=False)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


def greedy(max_tokens, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0, **kw)


def blocks_used(url) -> float:
    return parse_metrics(httpx.get(f"{url}/metrics").text)["blocks_used"]


def wait_for_baseline(url, timeout=10.0) -> float:
    deadline = time.monotonic() + timeout
    while (used := blocks_used(url)) != 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    return used


# -- the same tokens as the offline engine ----------------------------------------------------------
@pytest.mark.parametrize("prompt", ["The landlord asks: how full is the building?", [7, 44, 42, 99, 5, 17]])
def test_completion_equals_llm_generate_streamed_and_not(client, ref, prompt):
    want = ref.generate(prompt, greedy(24), use_tqdm=False)[0].outputs[0]
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                      extra_body={"return_token_ids": True})
    c = whole.choices[0]
    assert c.token_ids == want.token_ids
    assert c.text == want.text and c.finish_reason == want.finish_reason
    assert whole.usage.completion_tokens == len(want.token_ids)
    assert whole.usage.prompt_tokens == (len(prompt) if isinstance(prompt, list) else len(ref.tokenizer.encode(prompt)))

    ids, text, reasons = [], "", []
    for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stream=True,
                                           extra_body={"return_token_ids": True}):
        for ch in chunk.choices:
            ids += ch.token_ids or []
            text += ch.text
            reasons.append(ch.finish_reason)
    assert ids == want.token_ids
    assert text == c.text, "the streamed deltas must concatenate to the non-streamed text"
    assert reasons[-1] == c.finish_reason and all(r is None for r in reasons[:-1])


def test_chat_equals_llm_chat_sync_and_async(client, server, ref):
    conv = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Who is being evicted?"}]
    want = ref.chat(conv, greedy(20), use_tqdm=False)[0].outputs[0]
    whole = client.chat.completions.create(model=MODEL, messages=conv, max_completion_tokens=20, temperature=0,
                                           extra_body={"return_token_ids": True})
    assert whole.choices[0].token_ids == want.token_ids
    assert whole.choices[0].message.content == want.text and whole.choices[0].message.role == "assistant"
    assert whole.object == "chat.completion" and whole.model == MODEL and whole.id.startswith("chatcmpl-")

    async def streamed():
        aclient = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
        text, ids, roles = "", [], []
        stream = await aclient.chat.completions.create(model=MODEL, messages=conv, max_tokens=20, temperature=0,
                                                       stream=True, stream_options={"include_usage": True},
                                                       extra_body={"return_token_ids": True})
        last = None
        async for chunk in stream:
            for ch in chunk.choices:
                text += ch.delta.content or ""
                ids += getattr(ch, "token_ids", None) or []   # the first chunk (the role) has none
                roles.append(ch.delta.role)
            last = chunk
        await aclient.close()
        return text, ids, roles, last

    text, ids, roles, last = asyncio.run(streamed())
    assert ids == want.token_ids and text == whole.choices[0].message.content
    assert roles[0] == "assistant"
    assert last.choices == [] and last.usage.completion_tokens == len(want.token_ids)
    assert last.usage.prompt_tokens_details.cached_tokens >= 0
    assert last.model_extra["minikv"]["preemptions"] >= 0


def test_stop_string_cuts_the_text_streamed_and_not(client, ref):
    prompt = [12, 34, 56, 78]
    text = ref.generate(prompt, greedy(40), use_tqdm=False)[0].outputs[0].text
    stop = next((ch for ch in text[4:] if ch.isascii() and ch.isprintable()), None)
    if stop is None:
        pytest.skip("the tiny model's answer holds no printable ASCII character to stop on")
    want = ref.generate(prompt, greedy(40, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert want.finish_reason == "stop" and stop not in want.text
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stop=[stop])
    assert whole.choices[0].text == want.text and whole.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stop=stop, stream=True) if c.choices)
    assert streamed == want.text


def test_n2_with_seed_is_reproducible(client):
    def ask():
        r = client.completions.create(model=MODEL, prompt="Roll the dice", max_tokens=12, n=2, temperature=1.0,
                                      seed=1234, extra_body={"return_token_ids": True})
        return [(c.index, c.token_ids, c.text) for c in r.choices]

    first, again = ask(), ask()
    assert [i for i, _, _ in first] == [0, 1]
    assert first == again, "n=2 with a seed must give the same two samples every time"
    assert first[0][1] != first[1][1], "the two samples draw from their own generators (seed and seed + 1)"


def test_sixteen_concurrent_streams_get_their_own_tokens(server, ref):
    prompts = [[10 + i, 20 + 3 * i, 30 + 5 * i, 7, 11 + i] * (1 + i % 4) for i in range(16)]
    lengths = [8 + (5 * i) % 23 for i in range(16)]
    want = [o.outputs[0].token_ids for o in ref.generate(prompts, [greedy(n) for n in lengths], use_tqdm=False)]

    async def one(aclient, p, n):
        ids, reason = [], None
        stream = await aclient.completions.create(model=MODEL, prompt=p, max_tokens=n, temperature=0, stream=True,
                                                  extra_body={"return_token_ids": True})
        async for chunk in stream:
            for ch in chunk.choices:
                ids += ch.token_ids or []
                reason = ch.finish_reason or reason
        return ids, reason

    async def all_at_once():
        aclient = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)
        try:
            return await asyncio.gather(*(one(aclient, p, n) for p, n in zip(prompts, lengths)))
        finally:
            await aclient.close()

    got = asyncio.run(all_at_once())
    for i, ((ids, reason), w) in enumerate(zip(got, want)):
        assert ids == w, f"client {i} got someone else's tokens or lost some"
        assert reason in ("length", "stop")
    assert wait_for_baseline(server) == 0


def test_a_request_joins_a_running_batch_at_the_next_step(server, ref):
    """Continuous batching from outside: a short request sent while a long one streams finishes first."""
    body = {"model": MODEL, "prompt": [4, 5, 6], "max_tokens": 350, "temperature": 0, "stream": True,
            "ignore_eos": True}
    want = ref.generate([8, 9], greedy(4), use_tqdm=False)[0].outputs[0].token_ids
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200, resp.read()
        lines = resp.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))   # the long one is decoding
        short = httpx.post(f"{server}/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": [8, 9], "max_tokens": 4, "temperature": 0, "return_token_ids": True}).json()
        long = [json.loads(line[6:]) for line in lines if line.startswith("data: {")][-1]["minikv"]
    assert short["choices"][0]["token_ids"] == want
    s = short["minikv"]
    if s["arrival_s"] > long["finished_s"]:
        pytest.skip("the machine was too slow to overlap the two requests")
    assert s["finished_s"] < long["finished_s"], "the short request finished while the long one was generating"
    assert s["ttft_s"] < 0.25 * long["e2e_s"], "it was admitted at once, not after the long one"


# -- a vanished client frees everything it held --------------------------------------------------------
@pytest.mark.parametrize("when", ["mid-stream", "before its first token", "not streamed"])
def test_disconnect_frees_the_requests_blocks(server, when):
    assert wait_for_baseline(server) == 0
    body = {"model": MODEL, "prompt": list(range(3, 100)), "max_tokens": 250, "temperature": 0, "stream": True,
            "ignore_eos": True}
    if when == "not streamed":   # the client gives up waiting for the whole answer
        # 250 engine steps cannot finish in 50 ms, however quiet the machine (0.5 s was not always enough)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server}/v1/completions", json=body | {"stream": False}, timeout=httpx.Timeout(60, read=0.05))
        assert wait_for_baseline(server) == 0, "the abandoned request's blocks were not freed"
        return
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{server}/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            if when == "mid-stream":
                lines = resp.iter_lines()
                got = 0
                while got < 3:
                    got += next(lines).startswith("data: {")
                assert blocks_used(server) > 0, "a running request holds blocks"
        # leaving the block closes the connection
    assert wait_for_baseline(server) == 0, "the aborted request's blocks were not freed"
    m = parse_metrics(httpx.get(f"{server}/metrics").text)
    assert m["running"] == 0 and m["waiting"] == 0


# -- bad requests: a status, OpenAI's error body, and the server keeps serving ---------------------------
BAD = [
    ("completions", b'{"model": "tiny-random-llama", "prompt": "hi"', 400, None),
    ("completions", b"[1, 2, 3]", 400, None),
    ("completions", {"model": MODEL}, 400, "prompt"),
    ("chat/completions", {"model": MODEL, "prompt": "hi"}, 400, "messages"),
    ("chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("chat/completions", {"model": MODEL, "messages": "hi"}, 400, "messages"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "pirate", "content": "arr"}]}, 400, "messages"),
    ("completions", {"model": MODEL, "prompt": 5}, 400, "prompt"),
    ("completions", {"model": MODEL, "prompt": ""}, 400, "prompt"),
    ("completions", {"model": MODEL, "prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    ("completions", {"model": MODEL, "prompt": "hi", "n": 1.5}, 400, "n"),
    ("completions", {"model": MODEL, "prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                          "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("completions", {"model": MODEL, "prompt": [5] * 600}, 400, "prompt"),          # past the 512-token context
    ("completions", {"model": MODEL, "prompt": [5] * 400}, 400, "prompt"),          # past the 384-token pool
    ("completions", {"model": MODEL, "prompt": [5] * 100, "max_tokens": 500}, 400, "max_tokens"),
    ("completions", {"model": MODEL, "prompt": [300]}, 400, "prompt"),               # outside the vocabulary
    ("completions", {"model": MODEL, "prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ("completions", b'{"model": "tiny-random-llama", "prompt": "hi", "temperature": NaN}', 400, "temperature"),
    ("completions", {"model": MODEL, "prompt": "hi", "seed": 2**64}, 400, "seed"),    # past torch's generator
    ("completions", {"model": MODEL, "prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("completions", {"model": MODEL, "prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("completions", {"model": MODEL, "prompt": "hi", "n": 0}, 400, "n"),
    ("completions", {"model": MODEL, "prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("completions", {"model": MODEL, "prompt": "hi", "n": 17}, 400, "n"),           # more than --max-num-seqs
    ("completions", {"model": MODEL, "prompt": "hi", "logprobs": 3}, 400, "logprobs"),
    ("completions", {"model": "gpt-4o", "prompt": "hi"}, 404, "model"),
    ("chat/completions", {"model": "../../etc/passwd", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
    ("completions", {"model": MODEL, "prompt": "x" * (2 << 20)}, 413, None),
]


@pytest.mark.parametrize("path, body, status, param", BAD, ids=[f"{i}-{b[2]}-{b[3]}" for i, b in enumerate(BAD)])
def test_bad_request_gets_status_and_openai_error_body(server, path, body, status, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{server}/v1/{path}", content=content, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status and err["param"] == param
    assert err["type"] == {400: "BadRequestError", 404: "NotFoundError", 413: "BadRequestError"}[status]
    assert len(err["message"]) > 20 and "Traceback" not in err["message"]


def test_bad_requests_through_the_openai_client_then_serves_correctly(client, ref):
    with pytest.raises(openai.BadRequestError, match="max_tokens must be an integer >= 1"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=0)
    with pytest.raises(openai.NotFoundError, match="does not exist here"):
        client.completions.create(model="nope", prompt="hi", max_tokens=3)
    r = client.completions.create(model=MODEL, prompt=[9, 8, 7], max_tokens=6, temperature=0,
                                  extra_body={"return_token_ids": True})
    assert r.choices[0].token_ids == ref.generate([9, 8, 7], greedy(6), use_tqdm=False)[0].outputs[0].token_ids
    assert [m.id for m in client.models.list()] == [MODEL]
    assert httpx.get(str(client.base_url).replace("/v1/", "/health")).status_code == 200


def test_null_fields_mean_the_defaults(server, ref):
    body = {"model": MODEL, "prompt": [9, 8, 7], "max_tokens": 5, "temperature": 0, "top_p": None, "top_k": None,
            "n": None, "stop": None, "seed": None, "stream": None, "stream_options": None, "return_token_ids": True}
    r = httpx.post(f"{server}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    want = ref.generate([9, 8, 7], greedy(5), use_tqdm=False)[0].outputs[0].token_ids
    assert r.json()["choices"][0]["token_ids"] == want


# -- the shared wall: a repeated system prompt is served from the prefix cache --------------------------
def test_repeated_system_prompt_reports_cached_tokens_and_same_tokens(client, ref):
    system = "You are the landlord of a building of KV blocks. " * 3     # 147 bytes: 18 blocks of 8
    answers = []
    uncached = LLM(ref.engine.model, ref.tokenizer, enable_prefix_caching=False, verbose=False)
    for question in ("How full is the building?", "Who is being evicted?", "How full is the building?"):
        conv = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        r = client.chat.completions.create(model=MODEL, messages=conv, max_tokens=10, temperature=0,
                                           extra_body={"return_token_ids": True})
        want = uncached.chat(conv, greedy(10), use_tqdm=False)[0].outputs[0].token_ids
        assert r.choices[0].token_ids == want, "a prefix-cache hit must not change the tokens"
        answers.append(r)
    cached = [a.usage.prompt_tokens_details.cached_tokens for a in answers]
    assert cached[1] >= 8 * (len(system) // 8) - 8, f"the second request should reuse the system prompt: {cached}"
    assert cached[2] > cached[1], "the same conversation again reuses its question's blocks too"
    assert all(c % 8 == 0 for c in cached), "the prefix cache serves whole blocks"


# -- back-pressure, keys, and stopping: servers of their own ---------------------------------------------
def test_overload_gets_429_and_no_request_is_lost(small):
    _, url = small
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hi"})
    assert r.status_code == 401 and r.json()["error"]["code"] == 401
    assert httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(f"{url}/health").status_code == 200, "health and metrics need no key"

    async def fire(n=10):
        async with httpx.AsyncClient(timeout=120, headers=KEY) as http:
            body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 40, "temperature": 0, "ignore_eos": True}
            return await asyncio.gather(*(http.post(f"{url}/v1/completions", json=body) for _ in range(n)))

    answers = asyncio.run(fire())
    codes = sorted(a.status_code for a in answers)
    assert set(codes) == {200, 429}, codes
    assert codes.count(200) >= 2 and codes.count(429) >= 1   # two may wait; the rest are refused
    for a in answers:
        if a.status_code == 429:
            assert a.headers["retry-after"].isdigit()
            assert a.json()["error"]["type"] == "RateLimitError"
        else:
            c = a.json()["choices"][0]
            assert c["finish_reason"] == "length" and a.json()["usage"]["completion_tokens"] == 40
    assert wait_for_baseline(url) == 0


def test_sigterm_during_load_finishes_every_request_and_exits_0(small):
    """The module's last test: it stops the small server. One request runs, two wait; all three must end.

    The first request must hold the seat before the other two arrive: until its first token it counts as
    waiting, and three waiting requests exceed --max-waiting 2 (the server would rightly answer 429)."""
    proc, url = small
    ends: list = [None] * 3
    statuses: list = [None] * 3
    running = threading.Event()   # request 0 has streamed a token: it holds the one seat
    started = threading.Barrier(3, timeout=120)   # requests 1 and 2 are taken (headers sent), and the test

    def stream(i):
        body = {"model": MODEL, "prompt": [3 + i, 9, 9], "max_tokens": 450, "temperature": 0, "stream": True,
                "ignore_eos": True}
        reasons, done, first = [], False, True
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=KEY, timeout=120) as resp:
                statuses[i] = resp.status_code
                first = False
                if i:
                    started.wait()    # the server has taken the request (headers come before the first token)
                for line in resp.iter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        reasons += [c["finish_reason"] for c in json.loads(line[6:]).get("choices", [])]
                        running.set()
        finally:
            if first and i:
                started.abort()
            running.set()
        ends[i] = (reasons[-1] if reasons else None, done)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
    threads[0].start()
    assert running.wait(120)
    for t in threads[1:]:
        t.start()
    started.wait()
    time.sleep(0.5)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.wait(20)
    stopped_in = time.monotonic() - t0
    for t in threads:
        t.join(30)
    assert statuses == [200, 200, 200], statuses
    assert proc.returncode == 0
    assert stopped_in < 10
    assert all(e is not None and e[0] in ("abort", "length") and e[1] for e in ends), ends
    assert [e[0] for e in ends].count("abort") >= 2, "with one seat, 450 tokens each cannot all finish first"
