"""`python -m minikv bench ops`: minikv's operators against a peer's on the same tensors, in the peer's process.

vLLM's CPU build is not installed here (nor in CI): the command runs with ``--peer torch``, a stand-in in
plain PyTorch, through the same subprocess, protocol and table; the parts that are minikv's (its linears'
routing, its prompt attention) are checked against definitions."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from minikv.bench import ops
from minikv.bench.ops import TorchOps, cli, minikv_decode_attention, minikv_linears, minikv_prompt_attention, totals


def test_the_command_with_a_stand_in_peer(capsys):
    assert cli(["--peer", "torch", "--model", "depth30", "--repeat", "2", "--prompts", "40,70", "--batches", "1,8",
                "--context", "50", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["peer"] == "torch" and report["torch"] == torch.__version__
    results = report["results"]
    layer = {"q/k/v 320x192", "o 192x192", "gate/up 512x192", "down 192x256"}
    for name in layer:   # each layer's linear at every prompt length and batch; 30 layers' worth a call
        assert sorted(r["rows"] for r in results if r["name"] == name) == [1, 8, 40, 70]
        assert all(r["calls"] == 30 for r in results if r["name"] == name)
    assert sorted(r["rows"] for r in results if r["name"].startswith("lm_head")) == [1, 8]
    # the prompt's attention minikv runs (its C++ kernel where it builds), and SDPA timed beside it, not summed
    kernel = ops.cpu_kernels() is not None
    ran = [(r["name"], r["rows"]) for r in results if r["op"] == "attention" and r["runs"]]
    # and a decode step's attention at each batch, sequences of --context tokens and the new one, where the kernel
    # runs it (without the kernel, minikv's gather path needs a step's plan: not timed here)
    assert ran == [(f"prompt of {n}, {'C++ kernel' if kernel else 'SDPA'}", n) for n in (40, 70)] + \
        ([("decode, context 51", b) for b in (1, 8)] if kernel else [])
    assert [r["name"] for r in results if r["op"] == "attention" and not r["runs"]] == \
        ([f"prompt of {n}, SDPA" for n in (40, 70)] if kernel else [])
    for r in results:   # the same arithmetic, up to summation order; real timings
        assert r["max_abs_diff"] < 1e-4, r
        assert r["minikv_ms"] > 0 and r["peer_ms"] > 0 and r["ratio"] > 0, r
    spec = {"prompts": [40, 70], "batches": [1, 8]}
    expected = totals(results, spec)
    assert set(report["totals"]) == set(expected)
    assert all(report["totals"][k] == pytest.approx(v) for k, v in expected.items())
    # a prefill of 40: each layer linear and the attention at 40 rows, the lm_head on the last row
    prefill = [r for r in results if r["rows"] == 40 and r["runs"] and not r["name"].startswith("lm_head")] + \
        [r for r in results if r["name"].startswith("lm_head") and r["rows"] == 1]
    assert len(prefill) == 6 and report["totals"]["prefill of 40"][0] == pytest.approx(
        sum(r["minikv_ms"] for r in prefill))
    # a decode step at batch 8: every layer's linear and the lm_head at 8 rows, and the decode's attention
    decode = [r for r in results if r["rows"] == 8 and (r["op"] == "linear" or r["name"].startswith("decode"))]
    assert len(decode) == 5 + kernel
    label = "decode step at batch 8, " + ("linears and attention" if kernel else "linears")
    assert report["totals"][label][1] == pytest.approx(sum(r["peer_ms"] for r in decode))


def test_the_table(capsys):
    assert cli(["--peer", "torch", "--model", "depth30", "--repeat", "1", "--prompts", "16", "--batches", "2"]) == 0
    out = capsys.readouterr().out
    assert "minikv/stand-in" in out and "attention prompt of 16, " in out and "prefill of 16" in out
    assert "decode step at batch 2, linears" in out


def test_minikvs_linears_route_as_the_engine_does():
    """The bench times minikv.speed.linears' own forwards (merged siblings, each call on the path chosen for its
    rows): the siblings' outputs, whatever the path, are F.linear's at a decode's and a prefill's rows."""
    gen = torch.Generator().manual_seed(0)
    layers = [[torch.randn(n, 48, generator=gen) for n in (32, 16, 16)] for _ in range(3)]
    forwards = minikv_linears(layers)
    assert len(forwards) == 3
    with torch.inference_mode():
        for rows in (1, 3, 40):
            x = torch.randn(rows, 48, generator=gen)
            for forward, weights in zip(forwards, layers):   # each layer's callable computes its own weights
                out = forward(x)
                assert [tuple(o.shape) for o in out] == [(rows, n) for n in (32, 16, 16)]
                torch.testing.assert_close(torch.cat(out, -1), F.linear(x, torch.cat(weights)), rtol=1e-5, atol=1e-5)


def test_minikvs_prompt_attention_is_causal_attention():
    gen = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(37, 6, 16, generator=gen), torch.randn(37, 2, 16, generator=gen), \
        torch.randn(37, 2, 16, generator=gen)
    reference = TorchOps().prompt_attention(q, k, v, 0.25)()
    for kernel in [False] + ([True] if ops.cpu_kernels() is not None else []):
        with torch.inference_mode():
            mine = minikv_prompt_attention(q, k, v, 0.25, kernel)()
        assert mine.shape == (37, 6, 16)
        torch.testing.assert_close(mine, reference, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(mine[0], v[0].repeat_interleave(3, 0))   # the first token sees only itself


@pytest.mark.skipif(ops.cpu_kernels() is None, reason="minikv's C++ kernels do not build here")
def test_minikvs_decode_attention_reads_each_sequence_through_its_block_table():
    """Scattered blocks, sequences spanning a partial last block, the new token written by the call itself: the
    last layer's output is attention by its definition over every position, the new one included."""
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(5, 6, 16, generator=gen)
    keys, values = torch.randn(5, 37, 2, 16, generator=gen), torch.randn(5, 37, 2, 16, generator=gen)
    reference = TorchOps().decode_attention(q, keys, values, 0.25, 1, gen)()
    changed = values.clone()
    changed[:, -1] += 1   # the new token's value
    with torch.inference_mode():   # as the bench calls it
        call = minikv_decode_attention(q, keys, values, 0.25, 3, gen)
        mine, again = call(), call()   # a second step writes the same token again
        moved = minikv_decode_attention(q, keys, changed, 0.25, 1, gen)()
    assert mine.shape == (5, 6, 16)
    torch.testing.assert_close(mine, reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(again, mine)
    assert not torch.allclose(moved, mine)   # the new token's value is read: the output moves


def test_without_vllm_it_says_how_to_get_it(capsys):
    assert cli(["--vllm-venv", "/nonexistent/venv", "--model", "depth30"]) == 2
    assert "make vllm" in capsys.readouterr().out


def test_another_torch_build_is_refused(monkeypatch, capsys):
    """minikv's operators timed on another PyTorch would not be minikv's: the command says so."""
    monkeypatch.setattr(ops.torch.__config__, "show", lambda: "some other build")
    assert cli(["--peer", "torch", "--model", "depth30", "--repeat", "1", "--prompts", "8", "--batches", "1"]) == 1
    assert "another PyTorch build" in capsys.readouterr().out


@pytest.mark.parametrize("bad", [["--batches", "0"], ["--prompts", "two"], ["--repeat", "0"], ["--context", "0"]])
def test_bad_options_say_what_is_wrong(bad, capsys):
    with pytest.raises(SystemExit) as stop:
        cli(bad)
    assert stop.value.code == 2 and bad[0] in capsys.readouterr().err
