"""Speed levers chosen by measurement (minikv.speed.choose, minikv.speed.linears' plans): the chooser never keeps
the slower path, a choice is remembered per host and shape, a forced path is obeyed, and every path computes
the same tokens."""

from __future__ import annotations

import json
import time

import pytest
import torch

from minikv.speed import choose, linears
from minikv.speed.choose import Choices, fastest, forced_path, host_key


def sleeper(seconds: float):
    return lambda: time.sleep(seconds)


@pytest.mark.parametrize("order", [("slow", "fast", "middle"), ("fast", "slow", "middle"), ("middle", "slow", "fast")])
def test_the_chooser_never_keeps_the_slower_path(order):
    delays = {"fast": 0.001, "middle": 0.004, "slow": 0.008}
    best, ms = fastest({name: sleeper(delays[name]) for name in order}, repeats=3)
    assert best == "fast"
    assert ms["fast"] < ms["middle"] < ms["slow"]


def test_a_path_disturbed_once_is_judged_by_its_undisturbed_rounds():
    """Other load only adds time: one interrupted round (here the fast path's first) does not make it lose."""
    calls = []

    def fast():
        calls.append(1)
        time.sleep(0.05 if len(calls) == 2 else 0.001)   # its first timed round hit by a neighbour

    best, _ = fastest({"fast": fast, "slow": sleeper(0.006)}, repeats=5)
    assert best == "fast"


def fake_model(layers: int = 3) -> torch.nn.Module:
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList()
    for _ in range(layers):
        block = torch.nn.Module()
        block.gate_proj, block.up_proj = torch.nn.Linear(64, 96, bias=False), torch.nn.Linear(64, 96, bias=False)
        block.down_proj = torch.nn.Linear(96, 64, bias=False)
        blocks.append(block)
    model = torch.nn.Module()
    model.layers = blocks
    return model


def test_a_deliberately_slow_path_is_never_chosen(monkeypatch, tmp_path):
    """Make the oneDNN path 20 ms slower per call: no shape, at no row count, may choose it. (One torch thread:
    on a loaded machine a thread pool can stall a tiny matmul for a scheduler tick, the size of a real gap.)"""
    monkeypatch.setattr(choose, "_CHOICES", Choices(tmp_path / "choices.json"))
    monkeypatch.delenv(choose.ENV, raising=False)
    real_run = linears.Packed.run

    def run(self, path, x, bias):
        if path == "onednn":
            time.sleep(0.02)
        return real_run(self, path, x, bias)

    monkeypatch.setattr(linears.Packed, "run", run)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        packed = linears.PackedLinears(fake_model(layers=1))
    finally:
        torch.set_num_threads(threads)
    assert {p.how for p in packed.plans.values()} == {"measured"}
    for plan in packed.plans.values():
        assert "onednn" not in plan.by_bucket.values(), plan.describe()


def test_a_choice_is_remembered_on_disk_per_host_and_shape(monkeypatch, tmp_path):
    store = tmp_path / "choices.json"
    monkeypatch.setattr(choose, "_CHOICES", Choices(store))
    monkeypatch.delenv(choose.ENV, raising=False)
    first = linears.PackedLinears(fake_model())
    assert {p.how for p in first.plans.values()} == {"measured"}
    saved = json.loads(store.read_text())
    assert all(key.startswith(host_key()) for key in saved) and len(saved) == 2   # the merged gate/up, and down
    # A new process (a fresh in-memory store on the same file) measures nothing: every timing would now fail.
    monkeypatch.setattr(choose, "_CHOICES", Choices(store))
    monkeypatch.setattr(linears, "measure_plan", lambda *a: pytest.fail("a remembered choice was measured again"))
    second = linears.PackedLinears(fake_model())
    assert {p.how for p in second.plans.values()} == {"remembered"}
    assert {s: p.by_bucket for s, p in second.plans.items()} == {s: p.by_bucket for s, p in first.plans.items()}
    # Another thread count is another host as far as speed goes: measured again.
    monkeypatch.setattr(choose, "host_key", lambda: "another CPU | torch x | 1 threads")
    with pytest.raises(pytest.fail.Exception):
        linears.PackedLinears(fake_model())


def test_an_unwritable_store_is_not_an_error(tmp_path):
    (tmp_path / "ro").write_text("not a folder")
    store = Choices(tmp_path / "ro" / "choices.json")
    store.put({"q": {"by_bucket": {}}})
    assert store.get("q") == {"by_bucket": {}}   # kept in memory for this process


def test_a_forced_path_is_obeyed_and_a_bad_one_says_what_is_allowed(monkeypatch):
    monkeypatch.setenv(choose.ENV, "eager")
    packed = linears.PackedLinears(fake_model())
    assert all(set(p.by_bucket.values()) == {"eager"} and p.how == "forced" for p in packed.plans.values())
    assert forced_path("onednn") == "onednn"   # an argument beats the environment
    assert forced_path("measure") is None
    monkeypatch.setenv(choose.ENV, "fastest")
    with pytest.raises(ValueError, match="must be one of measure, eager, onednn, mkl, not 'fastest'"):
        forced_path()


def test_a_plan_reads_as_row_ranges():
    plan = linears.Plan({1: "eager", 2: "eager", 4: "mkl", 8: "mkl", 16: "mkl", 32: "onednn", 64: "onednn",
                         128: "onednn", 256: "onednn"})
    assert plan.describe() == "1-3 eager, 4-31 mkl, 32+ onednn"
    assert [plan.path(r) for r in (1, 3, 4, 31, 32, 5000)] == ["eager", "eager", "mkl", "mkl", "onednn", "onednn"]


@pytest.mark.parametrize("path", ["eager", "onednn"])
def test_packed_copies_no_path_uses_are_dropped(monkeypatch, path):
    monkeypatch.setenv(choose.ENV, path)
    packed = linears.PackedLinears(fake_model())
    assert packed.packed and all(set(p.copies) == ({"onednn"} if path == "onednn" else set()) for p in packed.packed)


@pytest.mark.slow
def test_every_linear_path_generates_the_same_tokens(smollm2):
    """fp32 on every path, in another summation order: greedy tokens identical across the three paths, and
    transformers' own on the same prompts."""
    from minikv import LLM, SamplingParams

    model, tokenizer = smollm2
    prompts = [tokenizer.encode(p) for p in ("The capital of France is", "def fibonacci(n):",
                                             "Paged attention stores the KV cache in")]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    paths = ["eager", "onednn"] + (["mkl"] if linears.mkl_packing() else [])
    outputs = {}
    for path in paths:
        llm = LLM(model, tokenizer, num_blocks=64, linears=path, verbose=False)
        outputs[path] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with torch.no_grad():
        reference = [model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                    max_new_tokens=24, do_sample=False, eos_token_id=None,
                                    pad_token_id=0)[0, len(p):].tolist()
                     for p in prompts]
    for path in paths:
        assert outputs[path] == reference, path


def test_measure_measures_again_and_replaces_the_remembered_choice(monkeypatch, tmp_path):
    monkeypatch.setattr(choose, "_CHOICES", Choices(tmp_path / "choices.json"))
    monkeypatch.delenv(choose.ENV, raising=False)
    linears.PackedLinears(fake_model())
    again = linears.PackedLinears(fake_model(), path="measure")
    assert {p.how for p in again.plans.values()} == {"measured"}
    assert {p.how for p in linears.PackedLinears(fake_model()).plans.values()} == {"remembered"}
