"""compile=True pays its compilation once per host: the artifacts a start saves in $MINIKV_CACHE make the next
start's compile a cache hit, even when torch's own cache folder is empty (a reboot, a fresh Colab runtime).

Each start is a fresh process (torch keeps compiled graphs in memory too), with its own empty
TORCHINDUCTOR_CACHE_DIR: what the second one finds, it found in minikv's file. Counted, not timed: inductor's
graph-cache hits and misses."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

CHILD = r"""
import json, sys
import torch._dynamo.utils
from minikv.engine import LLM
from minikv.models import tiny_random_llama
from minikv.sampling import SamplingParams
from minikv_kernels import paged_attention_cpu

if paged_attention_cpu.load() is None:
    print(json.dumps({"skip": f"compile=True needs the CPU kernel: {paged_attention_cpu.why_not}"}))
    sys.exit()
llm = LLM(tiny_random_llama(seed=3), compile=True, verbose=False)
params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
outs = llm.generate([{"prompt_token_ids": [5, 9, 17, 33, 2 + i]} for i in range(3)], params, use_tqdm=False)
compiled = llm.engine.runner.compiled
counts = torch._dynamo.utils.counters["inductor"]
print(json.dumps({"cache": compiled.cache, "file": str(compiled.artifacts), "hits": counts["fxgraph_cache_hit"],
                  "misses": counts["fxgraph_cache_miss"], "levers": llm.engine.speed_levers(),
                  "tokens": [o.outputs[0].token_ids for o in outs]}))
"""


def start(cache, inductor) -> dict:
    env = dict(os.environ, MINIKV_CACHE=str(cache), TORCHINDUCTOR_CACHE_DIR=str(inductor), MINIKV_LINEAR="onednn")
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    if "skip" in got:
        pytest.skip(got["skip"])
    return got


def test_a_second_start_loads_what_the_first_compiled(tmp_path):
    first = start(tmp_path / "minikv", tmp_path / "inductor-1")
    assert first["cache"].startswith("saved"), first["cache"]
    assert os.path.getsize(first["file"]) > 0
    assert first["misses"] >= 1            # it compiled: inductor generated code
    assert "compiled forward" in first["levers"] and "saved" in first["levers"]

    second = start(tmp_path / "minikv", tmp_path / "inductor-2")   # torch's own cache folder empty again
    assert second["cache"].startswith("loaded"), second["cache"]
    assert second["misses"] == 0 and second["hits"] >= 1, second   # every graph from minikv's file
    assert second["tokens"] == first["tokens"]


def test_an_unreadable_file_compiles_anew(tmp_path):
    first = start(tmp_path / "minikv", tmp_path / "inductor-1")
    with open(first["file"], "wb") as f:
        f.write(b"not torch's artifacts")
    again = start(tmp_path / "minikv", tmp_path / "inductor-2")
    assert "unreadable" in again["cache"] and "saved" in again["cache"], again["cache"]
    assert again["misses"] >= 1 and again["tokens"] == first["tokens"]


def test_guards_are_kept_where_asked_or_where_torch_cannot_skip_them(monkeypatch):
    """Steps skip Dynamo's guards after the warm-up (minikv.speed.compile) unless MINIKV_COMPILE_GUARDS=1 asks to
    keep them, or this torch has no set_stance(skip_guard_eval_unsafe=...) (before 2.6; the package allows 2.5).
    Building a CompiledForward compiles nothing: that waits for its first step."""
    import torch

    from minikv.models import tiny_random_llama
    from minikv.speed import compile as compiled

    model = tiny_random_llama(seed=3)
    monkeypatch.delenv("MINIKV_COMPILE_GUARDS", raising=False)
    assert compiled.CompiledForward(model).skip_guards == compiled._can_skip_guards()
    monkeypatch.setenv("MINIKV_COMPILE_GUARDS", "1")
    assert not compiled.CompiledForward(model).skip_guards
    monkeypatch.delenv("MINIKV_COMPILE_GUARDS")
    monkeypatch.setattr(torch.compiler, "set_stance", lambda stance="default", *, force_backend=None: None)
    assert not compiled._can_skip_guards() and not compiled.CompiledForward(model).skip_guards
    monkeypatch.delattr(torch.compiler, "set_stance")
    assert not compiled._can_skip_guards()


def test_only_a_graph_the_warm_up_compiled_skips_its_guards(monkeypatch):
    """The warm-up step's sizes are all distinct; a graph first compiled on another step (a pool too small to warm
    up) may have tied two, and needs its guards to recompile when a step tells them apart. So steps skip the guards
    only after warm_up's step, never during it, and never without it."""
    from contextlib import contextmanager

    import torch

    from minikv.models import tiny_random_llama
    from minikv.speed.compile import CompiledForward

    monkeypatch.delenv("MINIKV_COMPILE_GUARDS", raising=False)
    forward = CompiledForward(tiny_random_llama(seed=3))
    if not forward.skip_guards:
        pytest.skip("this torch cannot skip guards")
    forward.artifacts = None   # nothing to load or save: this test compiles nothing
    skipped = []

    @contextmanager
    def stance(stance="default", *, skip_guard_eval_unsafe=False, force_backend=None):
        skipped.append(skip_guard_eval_unsafe)
        yield

    monkeypatch.setattr(torch.compiler, "set_stance", stance)
    forward.forward = lambda **inputs: skipped.append("step")
    forward(input_ids=None)                           # a first step that was not warm_up's
    assert skipped == ["step"] and not forward.warm
    forward.warm_up(lambda: forward(input_ids=None))   # warm_up's own step keeps them
    assert skipped == ["step", "step"] and forward.warm
    forward(input_ids=None)
    forward(input_ids=None)
    assert skipped == ["step", "step", True, "step", True, "step"] and forward.steps == 4
