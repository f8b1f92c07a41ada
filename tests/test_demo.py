"""`python -m minikv demo`: the main job runs end to end and its measured bill matches the formula."""

import pytest

from minikv.__main__ import main


@pytest.mark.slow
def test_demo_serves_smollm2_through_the_paged_cache(capsys):
    assert main(["demo", "--max-tokens", "12"]) == 0
    out = capsys.readouterr().out
    assert "answer:" in out and "matches the formula" in out and "all in the last block" in out
    assert "22.50 KiB" in out or "45.00 KiB" in out  # fp16 on a GPU, fp32 on the CPU


def test_demo_refuses_a_model_without_tokenizer(capsys):
    assert main(["demo", "--model", "tiny-random-llama"]) == 2
    assert "has no tokenizer" in capsys.readouterr().err
