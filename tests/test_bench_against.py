"""`bench serve --against vllm` without vLLM: its flags are checked, a missing .venv-vllm says what to run,
and the side-by-side table prints both columns and their ratio. (The run itself needs `make vllm`.)"""

import pytest

from minikv.bench import against
from minikv.bench.serve import parse_args


def test_vllm_url_must_be_loopback():
    with pytest.raises(ValueError, match="--vllm-url must be a loopback address"):
        parse_args(["--against", "vllm", "--vllm-url", "http://10.1.2.3:8000"])
    args, rates = parse_args(["--against", "vllm", "--rates", "1,2"])
    assert args.against == "vllm" and rates == [1.0, 2.0]


def test_a_missing_vllm_venv_says_what_to_run(tmp_path, monkeypatch):
    monkeypatch.setattr(against, "VLLM_PYTHON", tmp_path / "nope" / "python")
    with pytest.raises(RuntimeError, match="run `make vllm` first"):
        against.start_vllm(tmp_path, wait=1)


def test_side_by_side_prints_both_and_the_ratio(capsys):
    rep = {"completed": 8, "refused_429": 0, "request_throughput": 2.0, "output_throughput": 100.0,
           "ttft_ms": {"p50": 50.0, "p99": 90.0}, "tpot_ms": {"p50": 10.0, "p99": 12.0},
           "itl_ms": {"p99": 20.0}, "e2e_ms": {"p50": 500.0}, "goodput": {"fraction": 1.0},
           "peak_kv_usage": None}
    against.side_by_side(2.0, {"minikv": rep, "vllm": rep | {"output_throughput": 200.0}})
    out = capsys.readouterr().out
    assert "minikv" in out and "vllm" in out and "0.50x" in out


def test_rounds_print_each_ratio_and_their_median(capsys):
    def rep(tpot):
        return {"output_throughput": 100.0, "ttft_ms": {"p50": 50.0}, "tpot_ms": {"p50": tpot},
                "itl_ms": {"p99": 20.0}, "goodput": {"fraction": 0.0}}
    rounds = [{"minikv": rep(30.0), "vllm": rep(20.0)}, {"minikv": rep(10.0), "vllm": rep(20.0)},
              {"minikv": rep(40.0), "vllm": rep(20.0)}]
    ratios = against.round_ratios(rounds)
    assert ratios["TPOT p50"] == [1.5, 0.5, 2.0] and ratios["goodput"] == [None, None, None]
    against.print_rounds(1.0, rounds)
    out = capsys.readouterr().out
    assert "1.50  0.50  2.00   median 1.50x" in out and "median -" in out


def test_rounds_are_bounded():
    with pytest.raises(ValueError, match="--rounds must be in"):
        parse_args(["--against", "vllm", "--rounds", "0"])


def test_vllm_client_rounds_end_with_the_median_of_their_ratios(monkeypatch, capsys):
    """With vLLM's client, several rounds at a rate end with each round's ratio and their median, as --rounds
    promises (this path once printed the rounds' tables and no summary)."""
    import argparse
    import types

    import httpx

    from minikv.bench import vllm_peer

    monkeypatch.setattr(vllm_peer, "settle", lambda *a, **k: None)
    monkeypatch.setattr(httpx, "get", lambda url, **k: types.SimpleNamespace(
        json=lambda: {"data": [{"id": url.split("/")[2]}]}))
    tpot = iter([30.0, 20.0, 20.0, 20.0, 40.0, 20.0])   # minikv's, vLLM's, by turns: round 2 runs vLLM first

    def fake_client(url, model, tokenizer, rate, args, seed):
        return {"completed": 8, "request_throughput": 2.0, "output_throughput": 100.0, "p50_ttft_ms": 50.0,
                "p50_tpot_ms": next(tpot), "p99_itl_ms": 20.0, "request_goodput": 2.0}

    monkeypatch.setattr(against, "vllm_client", fake_client)
    args = argparse.Namespace(rho=None, rounds=3, seed=0, input_len=200, max_output_len=64, num_requests=8,
                              slo_ttft=1.0, slo_tpot=0.1)
    assert against.run_vllm_client(args, [2.0], {"minikv": "http://minikv", "vllm": "http://vllm"}, None) == 0
    out = capsys.readouterr().out
    assert "minikv / vLLM over 3 rounds" in out
    assert "1.50  1.00  2.00   median 1.50x" in out and "1.00  1.00  1.00   median 1.00x" in out
