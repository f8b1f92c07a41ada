"""`python -m minikv demo`: the engine serves chat prompts behind a shared system prompt, and the
landlord's report adds up: the measured KV bill is the formula's, the shared system prompt is
served from cached blocks, sharing saves blocks, and the speed figures are the tokens over the time."""

import pytest

from minikv.__main__ import main
from minikv.blocks import blocks_for


@pytest.fixture(scope="module")
def report():
    from minikv.demo import serve

    return serve(max_tokens=8, num_prompts=4, use_tqdm=False)


@pytest.mark.slow
def test_the_kv_bill_matches_the_formula(report):
    assert report.bill_matches
    assert report.measured_bytes == report.formula_bytes
    assert report.slot_bytes in (46080, 23040)  # SmolLM2: 45 KiB per token in fp32 on the CPU, half in fp16 on a GPU
    assert all(h == p + n - 1 for h, p, n in zip(report.held_tokens, report.prompt_tokens, report.output_tokens))


@pytest.mark.slow
def test_the_shared_system_prompt_is_served_from_cached_blocks(report):
    # Every conversation after the first finds the system prompt's full blocks in the cache
    # (they all start with the same chat-template header and system message).
    common, ids = 0, report.prompt_token_ids
    while all(len(i) > common and i[common] == ids[0][common] for i in ids):
        common += 1
    shared_blocks = common // report.block_size
    assert shared_blocks >= 2, "the system prompt should span full blocks, or the demo shows no sharing"
    assert report.cached_prompt_tokens[0] == 0
    assert all(c >= shared_blocks * report.block_size for c in report.cached_prompt_tokens[1:])
    assert report.prefix_tokens_hit == sum(report.cached_prompt_tokens)
    assert report.prefix_tokens_queried == sum(report.prompt_tokens)


@pytest.mark.slow
def test_occupancy_and_speed_add_up(report):
    assert report.preemptions == 0  # a 64 MiB pool holds these conversations easily
    assert report.peak_blocks_used <= report.blocks_without_sharing <= report.num_blocks
    assert report.blocks_without_sharing == sum(blocks_for(t, report.block_size) for t in report.held_tokens)
    assert report.blocks_cached_at_end >= 2   # the system prompt's blocks stay cached for the next request
    assert sum(report.output_tokens) == report.summary["generated_tokens"] == 4 * 8
    assert report.tokens_per_s == pytest.approx(sum(report.output_tokens) / report.seconds)
    assert all(0 < t <= report.seconds for t in report.ttft)
    assert all(a for a in report.answers)


@pytest.mark.slow
def test_demo_prints_the_landlords_report(capsys):
    assert main(["demo", "--max-tokens", "6", "--num-prompts", "2"]) == 0
    out = capsys.readouterr().out
    for line in ("Q: What is a KV cache?", "The landlord's report", "matches the formula, conversation by conversation",
                 "blocks used at the peak", "prefix hits", "preemptions", "tokens/s", "time to first token"):
        assert line in out, line


def test_demo_refuses_a_model_without_tokenizer(capsys):
    assert main(["demo", "--model", "tiny-random-llama"]) == 2
    assert "has no tokenizer" in capsys.readouterr().err
