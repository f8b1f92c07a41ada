"""What the paged-attention kernel costs a GPU besides arithmetic, read without a GPU.

Triton compiles ahead of time for a GPU it names: ``triton.compile(ASTSource(...),
target=GPUTarget("cuda", 75, 32))`` runs the whole pipeline down to a cubin on any machine, and
the triton wheel ships ``ptxas``, whose ``-v`` log says per kernel how many registers each thread
holds, how many bytes it spills to local memory (stack) and how much shared memory it uses. From
those numbers and the SM's limits follow how many copies of the kernel (and so how many warps)
an SM can keep resident: the *occupancy*. A memory-bound kernel hides DRAM latency only by
having many loads in flight, so too many registers per thread (few resident warps) or any spill
(extra memory traffic, inside the loop) costs real time even though no arithmetic changed.

``static_resources(configs)`` compiles a list of ``KernelConfig`` and returns one
``KernelResources`` per config. Triton decides when it is first imported whether kernels are
compiled or interpreted, so a process running the interpreter (any machine without CUDA) hands
the work to a child Python with ``TRITON_INTERPRET=0`` (``python -m minikv_kernels.resources``).
Nothing here runs the kernel: these numbers say it compiles and what it holds, not how fast it is.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass

# The GPUs a learner is likely to meet, by compute capability ("sm_XY"), with the SM limits that
# decide occupancy (CUDA C Programming Guide, "Features and Technical Specifications").
ARCHS = {75: "T4", 80: "A100", 90: "H100"}
SM_LIMITS = {  # registers per SM, max warps per SM, max programs (CTAs) per SM, shared memory per SM
    75: dict(regs=65536, warps=32, ctas=16, smem=64 * 1024),
    80: dict(regs=65536, warps=64, ctas=32, smem=164 * 1024),
    86: dict(regs=65536, warps=48, ctas=16, smem=100 * 1024),  # RTX 30xx, A10, A40
    89: dict(regs=65536, warps=48, ctas=24, smem=100 * 1024),  # L4, RTX 40xx
    90: dict(regs=65536, warps=64, ctas=32, smem=228 * 1024),
}


def sm_limits(arch: int) -> dict:
    """The SM limits of `arch`, or of the newest listed architecture older than it."""
    return SM_LIMITS[max((a for a in SM_LIMITS if a <= arch), default=75)]


# Budget the compile test holds the kernel to: with at most this many registers per thread an SM
# keeps at least 16 warps (a quarter of an A100/H100's 64, half of a T4's 32) of this kernel
# resident, enough independent K/V loads in flight to cover DRAM latency in a streaming kernel.
MAX_REGISTERS = 128
MIN_RESIDENT_WARPS = 16


@dataclass(frozen=True)
class KernelConfig:
    """One compile: a model's attention shape, a block size, a dtype, split or not, a target GPU."""

    model: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16
    dtype: str = "float16"  # of query, K/V cache and output
    split: bool = False  # split-KV: the kernel writes partial results and the combine kernel runs too
    arch: int = 90  # compute capability: 75 (T4), 80 (A100), 90 (H100)

    @property
    def label(self) -> str:
        split = "split" if self.split else "whole"
        return f"{self.model} bs{self.block_size} {self.dtype} {split} sm_{self.arch}"


@dataclass
class KernelResources:
    """ptxas's numbers for one compiled kernel, and the occupancy they allow on that SM."""

    config: KernelConfig
    kernel: str  # "attention" or "combine"
    num_warps: int
    num_stages: int
    registers: int  # per thread
    spill_stores: int  # bytes per thread written to local memory because registers ran out
    spill_loads: int
    stack: int  # bytes per thread of local-memory stack frame (spills, plus any call frame)
    shared: int  # bytes of shared memory per program (Triton's dynamic allocation)
    programs_per_sm: int = 0
    resident_warps: int = 0
    occupancy: float = 0.0  # resident warps / the SM's maximum
    limited_by: str = ""  # which SM limit binds first: registers, warps, programs or shared memory

    def as_row(self) -> dict:
        row = asdict(self)
        row.update(row.pop("config"))
        return row


def model_shapes() -> dict[str, tuple[int, int, int]]:
    """(num_heads, num_kv_heads, head_dim) of every model in minikv.sizing's table, one model per
    distinct (query heads per KV head, head_dim): the two numbers that change the compiled code."""
    from minikv.sizing import MODEL_CONFIGS, model_spec

    shapes: dict[str, tuple[int, int, int]] = {}
    seen = set()
    for name in MODEL_CONFIGS:
        s = model_spec(name)
        key = (s.num_heads // s.num_kv_heads, s.head_dim)
        if key not in seen:
            seen.add(key)
            shapes[name] = (s.num_heads, s.num_kv_heads, s.head_dim)
    return shapes


def full_grid() -> list[KernelConfig]:
    """Every table shape x block size 1, 16, 32 x fp16, bf16 x split or not x sm_75, sm_80, sm_90."""
    return [KernelConfig(name, *shape, block_size=bs, dtype=dt, split=split, arch=arch)
            for name, shape in model_shapes().items() for bs in (1, 16, 32) for dt in ("float16", "bfloat16")
            for split in (False, True) for arch in ARCHS]


def slow_grid() -> list[KernelConfig]:
    """Every table shape on every target, twice: fp16 with blocks of 16 unsplit, and bf16 split
    with blocks of 1 (sm_75, sm_90) or 32 (sm_80). A sixth of full_grid, every value of each
    factor still met; the slow tests run it."""
    return [KernelConfig(name, *shape, block_size=bs, dtype=dt, split=split, arch=arch)
            for name, shape in model_shapes().items() for arch in ARCHS
            for bs, dt, split in ((16, "float16", False), (32 if arch == 80 else 1, "bfloat16", True))]


def model_shapes_all() -> dict[str, tuple[int, int, int]]:
    """(num_heads, num_kv_heads, head_dim) of every model in minikv.sizing's table, by name."""
    from minikv.sizing import MODEL_CONFIGS, model_spec

    return {name: (s.num_heads, s.num_kv_heads, s.head_dim) for name in MODEL_CONFIGS for s in [model_spec(name)]}


# The closing note's rows: before/after numbers for these shapes on a T4 and an H100.
HEADLINE_MODELS = ("llama-3-8b", "llama-3-70b", "smollm2-135m")


def headline_grid(archs: tuple[int, ...] = (75, 80, 90)) -> list[KernelConfig]:
    """HEADLINE_MODELS at fp16, blocks of 16, unsplit, on each target: `bench kernel --static`."""
    shapes = {name: model_shapes_all()[name] for name in HEADLINE_MODELS}
    return [KernelConfig(name, *shape, arch=arch) for name, shape in shapes.items() for arch in archs]


def occupancy(arch: int, registers: int, num_warps: int, shared: int) -> tuple[int, str]:
    """Programs of `num_warps` warps one SM can hold at once, and which limit binds first.

    Registers are handed out per warp in chunks of 256 (8 per thread); shared memory per program.
    """
    sm = sm_limits(arch)
    regs_per_warp = -(-registers * 32 // 256) * 256
    limits = {
        "registers": (sm["regs"] // max(regs_per_warp, 1)) // num_warps,
        "warps": sm["warps"] // num_warps,
        "programs": sm["ctas"],
        "shared memory": sm["smem"] // shared if shared else sm["ctas"],
    }
    binding = min(limits, key=lambda k: limits[k])
    return limits[binding], binding


_PTXAS_LINE = re.compile(r"Compiling entry function '(?P<name>\w+)'.*?"
                         r"(?P<stack>\d+) bytes stack frame, (?P<stores>\d+) bytes spill stores, "
                         r"(?P<loads>\d+) bytes spill loads.*?Used (?P<regs>\d+) registers", re.S)


def _parse_ptxas(log: str) -> dict:
    found = _PTXAS_LINE.search(log)
    if found is None:
        raise RuntimeError(f"could not read ptxas -v output:\n{log[-2000:]}")
    return dict(stack=int(found["stack"]), spill_stores=int(found["stores"]), spill_loads=int(found["loads"]),
                registers=int(found["regs"]))


def _compile(fn, arch: int, signature: dict, constexprs: dict, num_warps: int, num_stages: int) -> dict:
    """Compile one Triton kernel for sm_`arch` and read ptxas -v's report of it."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    # Pointers are 16-byte aligned (torch's allocator) and so are strides that are multiples of
    # 16: tell the compiler, as a real launch would, so that loads vectorise the same way.
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]]
             for name, kind in signature.items() if kind.startswith("*")}
    attrs.update({(fn.arg_names.index(name),): [["tt.divisibility", 16]]
                  for name, value in constexprs.pop("_divisible_by_16", {}).items() if value})
    full_sig = {name: "constexpr" if name in constexprs else signature[name] for name in fn.arg_names}
    src = ASTSource(fn, full_sig, constexprs, attrs)
    log = io.StringIO()
    # ptxas's -v report is printed only when it actually runs: never take a compile from the cache.
    with knobs.nvidia.scope(), knobs.compilation.scope(), contextlib.redirect_stdout(log):
        knobs.nvidia.dump_ptxas_log = True
        knobs.compilation.always_compile = True
        compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                                  options=dict(num_warps=num_warps, num_stages=num_stages))
    numbers = _parse_ptxas(log.getvalue())
    numbers["shared"] = int(compiled.metadata.shared)
    return numbers


_COMBINE_CACHE: dict[tuple, dict] = {}


def _measure(config: KernelConfig) -> list[KernelResources]:
    import minikv_kernels.paged_attention as pa

    if pa.INTERPRETED:
        raise RuntimeError("minikv_kernels.paged_attention was imported in interpreter mode; "
                           "compile in a process started with TRITON_INTERPRET=0")
    dt = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}[config.dtype]
    results = []
    for kind, fn, signature, constexprs, warps, stages in pa.compile_specs(
            config.num_heads, config.num_kv_heads, config.head_dim, config.block_size, config.split, dt):
        # The combine kernel depends only on head_dim, dtype and target: compile it once for each.
        key = (config.arch, dt, config.head_dim) if kind == "combine" else None
        if key is not None and key in _COMBINE_CACHE:
            numbers = _COMBINE_CACHE[key]
        else:
            numbers = _compile(fn, config.arch, signature, constexprs, warps, stages)
            if key is not None:
                _COMBINE_CACHE[key] = numbers
        res = KernelResources(config, kind, warps, stages, **numbers)
        res.programs_per_sm, res.limited_by = occupancy(config.arch, res.registers, warps, res.shared)
        res.resident_warps = res.programs_per_sm * warps
        res.occupancy = res.resident_warps / sm_limits(config.arch)["warps"]
        results.append(res)
    return results


def _compiles_here() -> bool:
    """Would minikv_kernels.paged_attention, imported (or already imported) in this process, be compiled?"""
    if "minikv_kernels.paged_attention" in sys.modules:
        return not sys.modules["minikv_kernels.paged_attention"].INTERPRETED
    if os.environ.get("TRITON_INTERPRET") in ("0", "1"):
        return os.environ["TRITON_INTERPRET"] == "0"
    import torch

    return torch.cuda.is_available()


def static_resources(configs: list[KernelConfig], jobs: int | None = None) -> list[KernelResources]:
    """Compile every config (and, when split, its combine kernel) and return their resources.

    In a process that runs the interpreter, the compiles happen in `jobs` child processes
    (default: one per CPU, at most 4), each taking a share of the configs.
    """
    if _compiles_here():
        return [r for c in configs for r in _measure(c)]
    jobs = max(1, min(jobs or min(os.cpu_count() or 1, 4), len(configs) // 2 or 1))
    env = dict(os.environ, TRITON_INTERPRET="0")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (repo, env.get("PYTHONPATH")) if p)
    shares = [configs[i::jobs] for i in range(jobs)]
    children = []
    for share in shares:  # start them all before waiting for any, so that they compile side by side
        with tempfile.TemporaryFile("w+") as request:
            request.write(json.dumps([asdict(c) for c in share]))
            request.seek(0)
            children.append(subprocess.Popen([sys.executable, "-m", "minikv_kernels.resources"], stdin=request,
                                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                             env=env, cwd=repo))
    by_config: dict[KernelConfig, list[KernelResources]] = {}
    for child in children:
        out, err = child.communicate()
        if child.returncode != 0:
            raise RuntimeError(f"compiling in a child process (TRITON_INTERPRET=0) failed:\n{err[-4000:]}")
        for row in json.loads(out.strip().splitlines()[-1]):
            res = KernelResources(config=KernelConfig(**row.pop("config")), **row)
            by_config.setdefault(res.config, []).append(res)
    return [r for c in configs for r in by_config[c]]  # in the order asked


def _main() -> int:
    configs = [KernelConfig(**c) for c in json.loads(sys.stdin.read())]
    print(json.dumps([asdict(r) for c in configs for r in _measure(c)]))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
