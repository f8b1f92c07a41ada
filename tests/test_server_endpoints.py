"""vLLM's small endpoints on the real server process: /tokenize, /detokenize and /version.

A count from /tokenize must be the count the engine sees: its ids are checked against the prompt ids
the completion and chat endpoints themselves report (``return_token_ids``), and the token strings
against the tokenizer run here. The same API key guards them as /v1.
"""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

import minikv
from minikv.bench.serve import launch_server, stop_server, wait_healthy
from minikv.models import byte_tokenizer
from minikv.server.cli import CPU_PREFILL_CAP, CPU_STEP_BUDGET

KEY = {"Authorization": "Bearer k3y"}
SERVER = ["--model", "tiny-random-llama", "--threads", "1", "--api-key", "k3y", "--max-request-bytes", "16384"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo ✓"}]


@pytest.fixture(scope="module")
def running():
    proc, url = launch_server(SERVER)
    try:
        wait_healthy(proc, url, wait=180)
        yield proc, url
    finally:
        log = stop_server(proc)
    assert proc.returncode == 0, log[-3000:]


@pytest.fixture(scope="module")
def server(running):
    return running[1]


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def post(url, path, body=None, headers=KEY, **kw):
    return httpx.post(url + path, json=body, headers=headers, timeout=60, **kw)


def test_tokenize_a_prompt_gives_the_ids_the_completion_endpoint_runs(server, tok):
    prompt = "The cache, in blocks: héllo ✓"
    got = post(server, "/tokenize", {"prompt": prompt})
    assert got.status_code == 200, got.text
    body = got.json()
    assert set(body) == {"count", "max_model_len", "tokens", "token_strs"}   # vLLM's TokenizeResponse
    ran = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 1, "return_token_ids": True}).json()
    assert body["tokens"] == ran["prompt_token_ids"]
    assert body["count"] == len(body["tokens"]) == ran["usage"]["prompt_tokens"]
    models = httpx.get(f"{server}/v1/models", headers=KEY).json()["data"][0]
    assert body["max_model_len"] == models["max_model_len"]
    assert body["token_strs"] is None


def test_tokenize_a_chat_gives_the_ids_the_chat_endpoint_runs(server, tok):
    body = post(server, "/tokenize", {"messages": CHAT, "return_token_strs": True}).json()
    ran = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1, "return_token_ids": True}).json()
    assert body["tokens"] == ran["prompt_token_ids"]
    assert body["token_strs"] == tok.convert_ids_to_tokens(body["tokens"])


def test_tokenize_options_change_what_they_say(server, tok):
    plain = post(server, "/tokenize", {"prompt": "abc"}).json()["tokens"]
    bare = post(server, "/tokenize", {"prompt": "abc", "add_special_tokens": False}).json()["tokens"]
    # the byte tokenizer adds no special token to text, so the flag is passed through, not seen to differ
    assert plain == tok.encode("abc") and bare == tok.encode("abc", add_special_tokens=False)
    ask = post(server, "/tokenize", {"messages": CHAT}).json()["tokens"]
    go_on = post(server, "/tokenize", {"messages": CHAT, "add_generation_prompt": False,
                                       "continue_final_message": True}).json()["tokens"]
    assert tok.decode(go_on).endswith("héllo ✓")        # the last message left open
    assert not tok.decode(ask).endswith("héllo ✓")      # the assistant's turn opened after it
    both = post(server, "/tokenize", {"messages": CHAT, "continue_final_message": True})
    assert both.status_code == 400 and "add_generation_prompt" in both.json()["error"]["message"]


def test_detokenize_inverts_tokenize(server):
    text = "Paged attention: héllo ✓ ünïcode"
    ids = post(server, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()["tokens"]
    got = post(server, "/detokenize", {"tokens": ids})
    assert got.status_code == 200 and got.json() == {"prompt": text}


@pytest.mark.parametrize("path, body, status, param", [
    ("/detokenize", {"tokens": [5, 256]}, 400, "tokens"),           # outside the tiny model's 256 ids
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("/detokenize", {}, 400, "tokens"),
    ("/tokenize", {"prompt": 7}, 400, "prompt"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ("/tokenize", [1, 2], 400, None),
])
def test_bad_requests_are_answered_with_what_to_fix(server, path, body, status, param):
    got = post(server, path, body)
    assert got.status_code == status, got.text
    err = got.json()["error"]
    assert err["code"] == status and err["param"] == param and err["message"]


@pytest.mark.parametrize("raw, status", [(b'{"prompt": "x"', 400), (b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",
                                                                        400), (b"x" * 20000, 413)])
def test_unreadable_bodies_are_client_errors(server, raw, status):
    got = httpx.post(f"{server}/tokenize", content=raw, headers=KEY, timeout=60)
    assert got.status_code == status, got.text


def test_version(server):
    got = httpx.get(f"{server}/version", headers=KEY)
    assert got.status_code == 200 and got.json() == {"version": minikv.__version__}


@pytest.mark.parametrize("method, path, body", [("POST", "/tokenize", {"prompt": "x"}),
                                                 ("POST", "/detokenize", {"tokens": [5]}), ("GET", "/version", None)])
def test_the_api_key_guards_them_as_it_guards_v1(server, method, path, body):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        got = httpx.request(method, server + path, json=body, headers=headers, timeout=60)
        assert got.status_code == 401 and "--api-key" in got.json()["error"]["message"]
    assert httpx.request(method, server + path, json=body, headers=KEY, timeout=60).status_code == 200
    assert httpx.get(f"{server}/health").status_code == 200   # health stays open, as before


def test_serve_starts_with_the_interactive_cpu_step_budget_and_prefill_cap(running):
    proc, _ = running
    banner = os.pread(proc.log.fileno(), 1 << 16, 0).decode()   # pread: the server's write offset stays put
    assert f"step budget {CPU_STEP_BUDGET} tokens, a prompt's prefill chunk at most {CPU_PREFILL_CAP} tokens" \
        in banner, banner


@pytest.mark.parametrize("flag, value, must", [("--long-prefill-token-threshold", "-1", "an integer >= 0"),
                                                ("--max-num-batched-tokens", "0", "an integer >= 1")])
def test_a_bad_step_flag_is_one_clear_line(flag, value, must):
    out = subprocess.run([sys.executable, "-m", "minikv", "serve", "--model", "tiny-random-llama", flag, value],
                         capture_output=True, text=True, timeout=120)
    field = flag[2:].replace("-", "_")   # EngineConfig's own check, the one LLM(...) gives too
    assert out.returncode != 0 and f"{field} must be {must}" in out.stderr and f"got {value}" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
