"""minikv.speed.malloc: with glibc's thresholds fixed, a step's freed buffers stay mapped and the next step
reuses them without a page fault; without (the control, as MINIKV_MALLOC=default leaves it) they fault."""

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="glibc's malloc only")

# A model loaded, then a layer's worth of buffers, six 16 MiB ones live at once (96 MiB: more than glibc's trim
# threshold grows to) and freed, ten times over after a warm-up: the page faults of the last ten, with the
# thresholds fixed first or not.
STEPS = r"""
import resource, sys, torch
from minikv.models import tiny_random_llama
from minikv.speed.malloc import keep_freed_memory
tiny_random_llama()
kept = keep_freed_memory() if sys.argv[1] == "keep" else False
def step():
    xs = [torch.ones(4 << 20) for _ in range(6)]
    del xs
for _ in range(5):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(mode: str, **env) -> tuple[str, int]:
    done = subprocess.run([sys.executable, "-c", STEPS, mode], capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if k != "MINIKV_MALLOC"} | env)
    assert done.returncode == 0, done.stderr[-2000:]
    kept, count = done.stdout.split()[-2:]
    return kept, int(count)


def test_freed_buffers_stay_mapped_from_step_to_step():
    pages = 10 * 6 * (16 << 20) // 4096   # what the ten steps fault if every buffer is new pages
    assert faults("keep") == ("True", 0)
    assert faults("keep", MINIKV_MALLOC="default")[0] == "False"
    # The control, glibc's defaults: whether they give the buffers back depends on what else sits at the top
    # of the heap (in about 5 runs of 8 here they do), so it is run until it shows, at most 8 times.
    controls = []
    while len(controls) < 8 and not any(count > pages // 4 for _, count in controls):
        controls.append(faults("control"))
    assert any(count > pages // 4 for _, count in controls), controls


def test_a_cpu_runner_keeps_them(monkeypatch):
    import minikv.runner as runner
    from minikv.models import tiny_random_llama

    calls = []
    monkeypatch.setattr(runner, "keep_freed_memory", lambda: calls.append(1) or True)
    runner.ModelRunner(tiny_random_llama(), num_blocks=4, block_size=4)
    assert calls == [1]
