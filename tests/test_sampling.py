"""Sampling: parameter validation, greedy = argmax, top-k/top-p masks, seeded draws independent of the batch."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minikv.sampling import SamplingParams, apply_top_k_top_p, make_generator, sample


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n must"),
        ({"top_k": -1}, "top_k"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": ["x"]}, "stop_token_ids"),
    ],
)
def test_bad_params_name_the_fix(kwargs, words):
    with pytest.raises(ValueError, match=words):
        SamplingParams(**kwargs)


def test_defaults_match_vllm_and_stop_string_becomes_list():
    p = SamplingParams(stop="###")
    assert (p.n, p.temperature, p.top_p, p.top_k, p.max_tokens) == (1, 1.0, 1.0, 0, 16)
    assert p.stop == ["###"] and not p.greedy and SamplingParams(temperature=0).greedy


def test_greedy_is_argmax():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    assert sample(logits, [SamplingParams(temperature=0)] * 5) == logits.argmax(-1).tolist()


def test_one_param_per_row_is_checked():
    with pytest.raises(ValueError, match="one per row"):
        sample(torch.zeros(2, 4), [SamplingParams()])


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    top_k=st.integers(0, 12),
    top_p=st.floats(0.05, 1.0),
)
def test_top_k_top_p_mask_keeps_exactly_the_nucleus(seed, top_k, top_p):
    vocab = 10
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(seed))
    masked = apply_top_k_top_p(logits, torch.tensor([top_k]), torch.tensor([top_p]))[0]
    kept = set(torch.isfinite(masked).nonzero().flatten().tolist())
    # The reference, one token at a time: walk tokens by falling probability.
    order = logits[0].argsort(descending=True, stable=True).tolist()
    candidates = order[: top_k or vocab]
    probs = logits[0, candidates].softmax(-1).tolist()
    expected, mass = set(), 0.0
    for token, p in zip(candidates, probs):
        if expected and mass >= top_p:
            break
        expected.add(token)
        mass += p
    assert kept == expected
    assert torch.equal(masked[list(kept)], logits[0, list(kept)])


def test_top_k_one_is_greedy_even_with_temperature():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=2.0, top_k=1)] * 4
    assert sample(logits, params) == logits.argmax(-1).tolist()


def test_seeded_rows_do_not_depend_on_the_batch():
    gen = torch.Generator().manual_seed(3)
    target = torch.randn(1, 100, generator=gen)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=42)

    def run(batch_size: int, position: int, steps: int = 20) -> list[int]:
        g = make_generator(seeded.seed)
        out = []
        for step in range(steps):
            others = torch.randn(batch_size - 1, 100, generator=torch.Generator().manual_seed(step))
            logits = torch.cat([others[:position], target, others[position:]])
            params = [SamplingParams(temperature=1.0, top_k=5)] * (batch_size - 1)
            params.insert(position, seeded)
            gens = [None] * (batch_size - 1)
            gens.insert(position, g)
            out.append(sample(logits, params, gens)[position])
        return out

    alone = run(1, 0)
    assert run(7, 3) == alone and run(4, 0) == alone
    assert len(set(alone)) > 1  # it really samples


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0])
    logits = probs.log().expand(4000, -1)
    torch.manual_seed(0)
    counts = torch.bincount(torch.tensor(sample(logits, [SamplingParams()] * 4000)), minlength=4) / 4000
    assert torch.allclose(counts, probs, atol=0.03)


def test_draw_never_takes_a_token_of_probability_zero_and_stays_in_the_vocabulary():
    """The walk along the cumulative distribution: zero-probability tokens (top-k/top-p cuts, the first and last
    token included) are never drawn, and every draw is a token of the row, over many draws."""
    from minikv.sampling import draw

    probs = torch.zeros(3, 50)
    probs[0, [1, 48]] = torch.tensor([0.25, 0.75])     # the first and last tokens have probability 0
    probs[1, 0] = 1.0                                   # all mass on token 0
    probs[2, 49] = 2.0                                  # all mass on the last token, unnormalized
    torch.manual_seed(1)
    got = torch.stack([draw(probs, [None] * 3) for _ in range(2000)])
    assert set(got[:, 0].tolist()) == {1, 48} and (got[:, 1] == 0).all() and (got[:, 2] == 49).all()
    assert abs((got[:, 0] == 48).float().mean().item() - 0.75) < 0.04


def test_bench_sampling_prints_one_row_per_batch_size(capsys):
    """`python -m minikv bench sampling`: both ways timed, turn about, for each row count asked for."""
    from minikv.bench.sampling import cli

    assert cli(["--vocab", "300", "--rows", "1,3", "--repeat", "2"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert [r[0] for r in rows] == ["1", "3"]
    assert all(float(r[1]) > 0 and float(r[2]) > 0 and r[3].endswith("x") for r in rows)
