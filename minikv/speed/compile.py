"""``compile=True``: the model's forward through ``torch.compile``, one graph for every step.

A step is one flattened row of T tokens (prefill chunks and decode tokens side by side, see
``minikv.runner``); its shape differs from another step's only in T and in the number of rows that
sample, so one graph compiled with those sizes symbolic (``dynamic=True``) serves them all. Inside it,
inductor fuses what eager PyTorch runs op by op (RMSNorm, rotary embeddings, SiLU times the up
projection, residual adds), and the Python of the model's layers runs once, when it is traced.

Two operators stay opaque, each registered with a fake implementation that tells the compiler only its
output's shape, as vLLM's piecewise compilation keeps its attention out of the graph:

* attention, ``minikv_speed::paged_attention`` (``minikv.runner.paged_attention_op``): it reads the
  step's plan (groups, masks, block tables, the kernel) from beside the graph, so a step of a new
  structure reuses the graph instead of recompiling it;
* every matmul, ``minikv_speed::packed_linear`` (``minikv.speed.linears``), which runs oneDNN on the
  weights the runner packed at start; sibling linears on one input (q/k/v, gate/up) are one
  ``minikv_speed::merged_linear`` on their merged packed copy, as in the eager path.
  Inductor cannot lower a packed weight itself, and its own
  prepacking (``freezing``) needs a static row count, so without that operator ``dynamic=True`` sent
  every matmul to sgemm on the raw weights, slower than the eager packed path. ``freezing`` is used
  only when the runner has no packed weights (``prepack_linears=False``).

Steps of a single token (a decode step of one sequence) keep the eager forward: ``dynamic=True``
specializes sizes 0 and 1, and compiling a second graph for them costs more than it saves.

**Guards, checked once.** Before running a compiled graph, Dynamo checks its *guards*: every assumption the
graph was traced under (each parameter's identity, shape and strides, the inputs' dtypes, the grad mode ...),
about two hundred and seventy tensors for SmolLM2, at every call. Here they can only pass: the engine calls the
graph with the same model, dtypes and modes at every step, and every size symbolic (T and the logit rows, both 2
or more). So once the warm-up step has compiled it, each step runs under ``torch.compiler.set_stance(
skip_guard_eval_unsafe=True)``, as vLLM's compiled models skip Dynamo's dispatch after their warm-up. What makes
that safe is what ``tests/test_runner.py`` checks with the guards kept: one graph serves prefill chunks, decodes
of every batch and mixed steps, with no recompilation, and the tokens are the same with and without them.
A graph first compiled on another step (a pool too small for the warm-up) may have tied two sizes, so it keeps
its guards. ``MINIKV_COMPILE_GUARDS=1`` keeps them too (the control), and so does a torch without that stance
(before 2.6). Measured on this course's 2-core AMD EPYC machine, in one process, blocks of ten decode steps with and
without them taking turns, eight blocks each: at batch 8, 30.4 against 28.3 ms a step (the median of the paired
ratios 0.94; 0.91 in a second process); at batch 32, 57.9 against 55.0 ms (0.94).

The cost is start-up: the first compilation takes one to four minutes on two busy cores (inductor
writes and builds C++), which is why it is off by default (``make demo`` and the notebooks build
engines in seconds).

**Kept for the next start.** After its warm-up step compiles, the forward saves what torch compiled
(``torch.compiler.save_cache_artifacts``: inductor's graphs and their generated code) to
``$MINIKV_CACHE/compiled/<key>.bin``, the key naming the host (:func:`minikv.speed.choose.host_key`: CPU,
torch, threads), the model's config and the freezing switch. The next start loads that file into torch's
caches before it compiles (``load_cache_artifacts``): inductor's graph is then a cache hit, not generated
again. torch keeps the same caches in its own folder (``/tmp/torchinductor_<user>`` by default), which a
reboot or a fresh Colab runtime empties; ``$MINIKV_CACHE`` is where the converted model already lives.
It saves part of the start, not all: Dynamo still traces the model at every start (the rest was not taken
apart; Dynamo's own precompile cache, tried, saved nothing more). Measured on this course's 2-core AMD EPYC
machine (SmolLM2, each start a fresh process with an empty torch cache folder): 47.9 s to compile cold,
34.2 s with the file loaded; about 20 s when torch's folder survives too. A file that cannot be read or written is not
an error: the forward then compiles as if it were not there. ``startup_s`` records what this process paid,
``cache`` what it did with the file.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from minikv.speed.choose import host_key, write_atomic

__all__ = ["CompiledForward", "WARM_UP_DECODES", "WARM_UP_PREFILL"]

# The step that compiles the graph: WARM_UP_DECODES decodes and a first chunk of WARM_UP_PREFILL tokens, so
# T = 11 tokens and 6 logit rows. Distinct from each other and from the model's fixed sizes: torch gives equal
# sizes one symbol at the first compilation ("duck sizing"), which would tie them for every later step.
WARM_UP_DECODES, WARM_UP_PREFILL = 5, 6


class CompiledForward:
    """``torch.compile(model.forward, dynamic=True)`` and the rule for which steps it runs."""

    def __init__(self, model: torch.nn.Module, freezing: bool = True):
        # freezing: weights are constants of the graph, so inductor can prepack them (inference only).
        # With our packed linears (the runner's default) the graph's matmuls are the packed_linear
        # operator, which finds each weight's packed copy by the parameter itself: no freezing then.
        self.forward = torch.compile(model.forward, dynamic=True, options={"freezing": freezing})
        self.startup_s = 0.0  # seconds spent compiling (the warm-up step), recorded by warm_up
        self.steps = 0  # steps run compiled
        # once warm_up's step has compiled the graph, steps skip Dynamo's guards (see the module's docstring)
        self.skip_guards = os.environ.get("MINIKV_COMPILE_GUARDS", "0") != "1" and _can_skip_guards()
        self.warm = False
        self.artifacts = artifacts_path(model, freezing)
        self.cache = "not kept"  # what warm_up did with the artifacts file: "loaded", "saved" or why neither

    def __call__(self, **inputs):
        """One step through the graph, skipping the guards once warm_up's step has compiled it. Only that step's
        sizes are known to be all distinct: a graph first compiled on another step (a pool too small to warm up)
        may have tied two sizes that a later step needs apart, so its guards stay, to recompile it then."""
        self.steps += 1
        skip = self.skip_guards and self.warm
        with torch.compiler.set_stance(skip_guard_eval_unsafe=True) if skip else nullcontext():
            return self.forward(**inputs)

    @staticmethod
    def applies(plan) -> bool:
        """Every step of two tokens or more."""
        return plan.num_tokens >= 2

    def warm_up(self, run_step) -> None:
        """Compile now, by running one step (``run_step()``), and record how long that took: with the artifacts
        of an earlier start loaded first if there are any, else saving this start's for the next."""
        start = time.perf_counter()
        loaded = self._load()
        run_step()
        self.warm = True
        self.startup_s = time.perf_counter() - start
        if not loaded:
            self._save()

    def _load(self) -> bool:
        if self.artifacts is None or not self.artifacts.exists():
            return False
        try:   # torch returns None for bytes it cannot read (another torch's, a torn file)
            info = torch.compiler.load_cache_artifacts(self.artifacts.read_bytes())
            why = "torch could not read it" if info is None else None
        except Exception as err:
            why = f"{type(err).__name__}: {err}"
        if why is not None:   # compile from scratch, and save anew
            self.cache = f"{self.artifacts} unreadable ({why}): compiled anew"
            return False
        self.cache = f"loaded {self.artifacts}"
        return True

    def _save(self) -> None:
        if self.artifacts is None:
            return
        try:
            saved = torch.compiler.save_cache_artifacts()
            if saved is None:
                self.cache = "torch returned no artifacts to keep"
                return
            write_atomic(self.artifacts, saved[0])   # two processes compiling at once each leave a whole file
            # after an unreadable file, say so and that it was replaced
            self.cache = ("" if self.cache == "not kept" else self.cache + "; ") + f"saved {self.artifacts}"
        except OSError as err:
            self.cache = f"not kept ({err})"


def _can_skip_guards() -> bool:
    """Whether this torch has ``set_stance(skip_guard_eval_unsafe=...)`` (2.6 on; the package allows 2.5)."""
    stance = getattr(torch.compiler, "set_stance", None)
    return stance is not None and "skip_guard_eval_unsafe" in inspect.signature(stance).parameters


def artifacts_path(model: torch.nn.Module, freezing: bool) -> Path | None:
    """Where this host's compiled artifacts of this model are kept (None: minikv.models is not importable)."""
    try:
        from minikv.models import cache_dir
    except ImportError:
        return None
    config = getattr(model, "config", None)
    spec = config.to_json_string(use_diff=False) if hasattr(config, "to_json_string") else type(model).__name__
    key = hashlib.sha256(f"{host_key()}|{spec}|freezing={freezing}".encode()).hexdigest()[:16]
    return cache_dir() / "compiled" / f"{key}.bin"
