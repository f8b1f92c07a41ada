"""`minikv serve` with the real SmolLM2 (slow): the official client's chat answers are LLM.chat's, word for word."""

from __future__ import annotations

import openai
import pytest
import torch

from minikv.bench.serve import start_server, stop_server
from minikv.engine import LLM
from minikv.sampling import SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2_server():
    proc, url = start_server(["--model", "smollm2-135m", "--threads", "1", "--kv-cache-memory", "64MiB"], wait=300)
    yield url
    log = stop_server(proc)
    assert proc.returncode == 0, log


def test_smollm2_chat_equals_llm_chat_and_reuses_the_system_prompt(smollm2_server, smollm2):
    model, tokenizer = smollm2
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref = LLM(model, tokenizer, kv_cache_memory="64MiB", verbose=False)
        client = openai.OpenAI(base_url=f"{smollm2_server}/v1", api_key="unused", max_retries=0, timeout=300)
        system = {"role": "system", "content": "You are a landlord who answers in one short sentence. " * 4}
        cached = []
        for question in ("How full is the building?", "Who is being evicted?"):
            conv = [system, {"role": "user", "content": question}]
            want = ref.chat(conv, SamplingParams(max_tokens=24, temperature=0), use_tqdm=False)[0].outputs[0]
            r = client.chat.completions.create(model="smollm2-135m", messages=conv, max_tokens=24, temperature=0)
            assert r.choices[0].message.content == want.text
            streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
                model="smollm2-135m", messages=conv, max_tokens=24, temperature=0, stream=True) if c.choices)
            assert streamed == want.text
            cached.append(r.usage.prompt_tokens_details.cached_tokens)
        assert cached[1] >= 48, f"the second question should reuse the system prompt's blocks: {cached}"
    finally:
        torch.set_num_threads(threads)
