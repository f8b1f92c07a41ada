"""One door out: the output processor's deltas are the text, offline and served alike.

The byte tokenizer makes every byte a token, so a stop string of two characters always straddles
a token boundary and a character of two or more UTF-8 bytes is always split over tokens. The
served side is the real FastAPI app driven in process (httpx's ASGI transport) over a real
engine loop thread; the offline side is `LLM.generate` on the same weights.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import torch

from minikv.detokenizer import REPLACEMENT, IncrementalDetokenizer
from minikv.engine import LLM, LLMEngine
from minikv.models import byte_tokenizer, tiny_random_llama
from minikv.sampling import SamplingParams
from minikv.server.app import ServerState, create_app
from minikv.server.engine_loop import EngineLoop

PROMPTS = ["Le café est prêt: ", "naïve façade 😀 "]


def ids_of(text: str) -> list[int]:
    return list(text.encode())


# -- the detokenizer alone ------------------------------------------------------------------------------
def test_split_characters_come_out_whole_and_the_deltas_add_up():
    tok, text = byte_tokenizer(), "naïve 😀 façade €5"
    detok = IncrementalDetokenizer(tok, ids_of("> "))
    deltas = []
    for b in ids_of(text):
        assert detok.push([b]) is False
        deltas.append(detok.take(finished=False))
    deltas.append(detok.take(finished=True))
    assert "".join(deltas) == text
    assert not any(REPLACEMENT in d for d in deltas), "half a character must wait for its other bytes"
    assert deltas[ids_of(text).index(0xF0) + 3] == "😀", "the emoji arrives with its fourth byte, whole"


def test_a_stop_string_over_several_tokens_is_cut_and_its_start_is_held_back():
    tok = byte_tokenizer()
    detok = IncrementalDetokenizer(tok, ids_of("> "), stop=["é!", "xyz"])
    shown = []
    for b in ids_of("caf"):
        detok.push([b])
        shown.append(detok.take(finished=False))
    assert "".join(shown) == "c", "the last len('xyz') - 1 characters may start a stop string: held back"
    hit = [detok.push([b]) for b in ids_of("é!tail")]
    assert hit == [False, False, True, False, False, False, False], "found at the byte that completes 'é!'"
    assert "".join(shown) + detok.take(finished=True) == "caf" and detok.text == "caf"


def test_a_held_back_start_that_was_no_stop_string_is_released_at_the_end():
    detok = IncrementalDetokenizer(byte_tokenizer(), ids_of("> "), stop=["xyz"])
    for b in ids_of("axy"):
        detok.push([b])
    assert detok.take(finished=False) == "a"
    assert detok.take(finished=True) == "xy"


# -- offline text equals served text ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def weights():
    torch.manual_seed(0)
    return tiny_random_llama(seed=0)


@pytest.fixture(scope="module")
def offline(weights):
    return LLM(weights, tokenizer=byte_tokenizer(), verbose=False)


def stop_over_a_split_character(text: str) -> str | None:
    """Two characters of `text`, the first one of several UTF-8 bytes (so of several tokens); None if none."""
    return next((text[i:i + 2] for i, ch in enumerate(text[:-1]) if len(ch.encode()) > 1 and ch != REPLACEMENT
                 and text[i + 1] != REPLACEMENT), None)


def cases(offline) -> list[tuple[str, dict]]:
    """(prompt, request fields): stop strings found in the model's own text, and n = 3 with a seed."""
    greedy = dict(max_tokens=48, temperature=0, ignore_eos=True)
    full = offline.generate(PROMPTS, SamplingParams(**greedy), use_tqdm=False)
    out = []
    for prompt, o in zip(PROMPTS, full):
        text = o.outputs[0].text
        if stop := stop_over_a_split_character(text):
            out.append((prompt, greedy | {"stop": [stop]}))
        out.append((prompt, greedy | {"stop": [text[10:13], "never seen"]}))
        out.append((prompt, dict(max_tokens=40, temperature=1.0, seed=3, n=3, ignore_eos=True,
                                 stop=[text[20:22]])))
    return out


async def serve(app, prompt: str, fields: dict, stream: bool) -> list[tuple[list[int], str, str]]:
    body = {"model": "tiny", "prompt": prompt, "return_token_ids": True, "stream": stream} | fields
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://minikv") as client:
        r = await client.post("/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    if not stream:
        return [(c["token_ids"], c["text"], c["finish_reason"]) for c in r.json()["choices"]]
    got = [([], "", None) for _ in range(fields.get("n", 1))]
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            for c in json.loads(line[6:])["choices"]:
                ids, text, reason = got[c["index"]]
                got[c["index"]] = (ids + c.get("token_ids", []), text + c["text"], reason or c["finish_reason"])
    return got


def test_offline_and_served_text_are_the_same_deltas(weights, offline):
    todo = cases(offline)
    engine = LLMEngine(weights, byte_tokenizer(), verbose=False)
    loop = EngineLoop(engine)
    app = create_app(ServerState(loop, engine.tokenizer, "tiny"))
    loop.start()
    try:
        for prompt, fields in todo:
            want = offline.generate(prompt, SamplingParams(**fields), use_tqdm=False)[0].outputs
            want = [(c.token_ids, c.text, c.finish_reason) for c in want]
            for stream in (False, True):
                got = asyncio.run(serve(app, prompt, fields, stream))
                assert got == want, (prompt, fields, stream)
            if fields.get("n", 1) == 1:   # the cut is where the stop string first appears in the uncut text
                stop = fields["stop"][0]
                assert want[0][2] == "stop" and stop not in want[0][1]
        assert any(len(ch.encode()) > 1 for _, f in todo for s in f["stop"] for ch in s)
    finally:
        loop.shutdown()
        loop.join(10)
