"""The half-precision lane (`make test-half`): the MINIKV_DTYPE switch, and the rule for "the same tokens"
(asserted in float32, counted in half precision)."""

import pytest
import torch

from minikv.lessons.parity import HALF_PRECISION_NOTE, compare_tokens, count_flips
from minikv.models import DTYPE_ENV, default_dtype, load_model


@pytest.mark.parametrize("name, dtype", [("float32", torch.float32), ("float16", torch.float16),
                                         ("bfloat16", torch.bfloat16), (" float16 ", torch.float16)])
def test_the_switch_sets_the_dtype_on_every_device(monkeypatch, name, dtype):
    monkeypatch.setenv(DTYPE_ENV, name)
    assert default_dtype("cpu") == dtype
    assert default_dtype(torch.device("cuda")) == dtype   # honoured before the GPU is asked anything


def test_unset_or_empty_keeps_the_defaults(monkeypatch):
    monkeypatch.delenv(DTYPE_ENV, raising=False)
    assert default_dtype("cpu") == torch.float32
    monkeypatch.setenv(DTYPE_ENV, "")
    assert default_dtype("cpu") == torch.float32


@pytest.mark.parametrize("bad", ["fp16", "half", "float64", "Float16", "torch.float16"])
def test_a_bad_value_says_what_is_wrong_and_what_is_accepted(monkeypatch, bad):
    monkeypatch.setenv(DTYPE_ENV, bad)
    with pytest.raises(ValueError) as err:
        default_dtype("cpu")
    message = str(err.value)
    assert f"MINIKV_DTYPE={bad!r}" in message and "float32, float16, bfloat16" in message


def test_the_loader_follows_the_switch(monkeypatch):
    monkeypatch.setenv(DTYPE_ENV, "float16")
    model, _ = load_model("tiny-random-llama", device="cpu")
    assert model.dtype == torch.float16
    model, _ = load_model("tiny-random-llama", device="cpu", dtype=torch.float32)   # an explicit dtype wins
    assert model.dtype == torch.float32


def test_count_flips_counts_positions_and_finds_the_first():
    same = count_flips(torch.tensor([[1, 2, 3], [4, 5, 6]]), [[1, 2, 3], [4, 5, 6]])
    assert (same.flipped, same.total, same.first, same.sequences) == (0, 6, None, 2)
    two = count_flips([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 9, 7]])
    assert (two.flipped, two.total, two.first) == (2, 6, (1, 1))
    assert str(two) == "2 of 6 tokens flipped, the first at sequence 1, token 1"
    short = count_flips([7, 8], [7, 8, 9])          # one sequence of ids; a missing token counts
    assert (short.flipped, short.total, short.first) == (1, 3, (0, 2))
    with pytest.raises(ValueError, match="2 sequences to compare with 1"):
        count_flips([[1], [2]], [[1]])


def test_float32_asserts_and_half_precision_reports(capsys):
    assert compare_tokens([1, 2], [1, 2], torch.float32, "transformers").flipped == 0
    assert "token for token the same as transformers" in capsys.readouterr().out
    with pytest.raises(AssertionError, match="1 of 2 tokens flipped, the first at sequence 0, token 1"):
        compare_tokens([1, 2], [1, 3], torch.float32, "transformers")
    for half in (torch.float16, torch.bfloat16):
        assert compare_tokens([1, 2], [1, 3], half, "transformers").flipped == 1
        out = capsys.readouterr().out
        assert "1 of 2 tokens flipped, the first at sequence 0, token 1" in out and HALF_PRECISION_NOTE in out
