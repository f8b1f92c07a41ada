"""The Triton kernel compiled ahead of time for GPUs we do not have: it compiles, never spills,
and holds few enough registers per thread to keep a memory-bound kernel's loads in flight.

No GPU is needed: kernels/resources.py compiles for sm_75 (T4), sm_80 (A100) and sm_90 (H100)
with the ptxas that ships in the triton wheel and reads ptxas -v's report. A representative
subset runs with the fast tests (~30 s on 2 idle cores). ``slow``: every model shape in
minikv.sizing's table on every target, in two variants (~2 min). ``fullgrid`` (skipped unless
MINIKV_FULL_GRID=1 is set, ~8 min on 2 cores): every shape x block size 1, 16, 32 x fp16, bf16 x
split or not x the three GPUs, 288 kernels plus their combine kernels.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="Triton is not installed: pip install -e '.[kernel]'")

import triton  # noqa: E402

from minikv_kernels.resources import (  # noqa: E402
    MAX_REGISTERS,
    MIN_RESIDENT_WARPS,
    KernelConfig,
    KernelResources,
    full_grid,
    model_shapes,
    occupancy,
    slow_grid,
    static_resources,
)

PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
if not PTXAS.exists() and shutil.which("ptxas") is None:
    pytest.skip("this Triton build ships no ptxas: cannot compile for NVIDIA GPUs", allow_module_level=True)

C = KernelConfig
# One config per hard case, every GPU and both dtypes met at least once: the most-used shape,
# block size 1 (16 blocks gathered per tile), block size 32, MQA (71 heads on one KV head: two
# head tiles), head_dim 256, and the split path with its combine kernel.
SUBSET = [
    C("llama-3-8b", 32, 8, 128, 16, "float16", False, 90),
    C("llama-3-8b", 32, 8, 128, 16, "float16", True, 75),
    C("llama-3-70b", 64, 8, 128, 32, "bfloat16", False, 80),
    C("smollm2-135m", 9, 3, 64, 1, "bfloat16", False, 75),
    C("falcon-7b", 71, 1, 64, 16, "float16", True, 90),
    C("gemma-7b", 16, 16, 256, 32, "bfloat16", False, 75),
]


def assert_within_budget(results: list[KernelResources]) -> None:
    problems = []
    for r in results:
        what = f"{r.kernel} kernel, {r.config.label}"
        if r.spill_stores or r.spill_loads:
            problems.append(f"{what}: spills {r.spill_stores} B stored / {r.spill_loads} B loaded per thread")
        if r.registers > MAX_REGISTERS:
            problems.append(f"{what}: {r.registers} registers per thread > budget {MAX_REGISTERS}")
        if r.resident_warps < MIN_RESIDENT_WARPS:
            problems.append(f"{what}: only {r.resident_warps} warps resident per SM ({r.limited_by})")
    assert not problems, "\n".join(problems)


@pytest.fixture(scope="module")
def subset_results() -> list[KernelResources]:
    return static_resources(SUBSET)


def test_subset_compiles_for_every_target(subset_results: list[KernelResources]) -> None:
    compiled = {(r.config, r.kernel) for r in subset_results}
    wanted = {(c, "attention") for c in SUBSET} | {(c, "combine") for c in SUBSET if c.split}
    assert compiled == wanted
    assert {c.arch for c in SUBSET} == {75, 80, 90} and {c.dtype for c in SUBSET} == {"float16", "bfloat16"}


def test_subset_never_spills_and_keeps_warps_resident(subset_results: list[KernelResources]) -> None:
    assert_within_budget(subset_results)


def test_occupancy_arithmetic() -> None:
    # 64 registers x 4 warps: 65536 / (64*32) = 32 warps by registers = 8 programs; an H100 holds 64 warps.
    assert occupancy(90, 64, 4, 0) == (8, "registers")
    # A T4 holds at most 32 warps: 8 programs of 4 warps, whatever the registers.
    assert occupancy(75, 32, 4, 0) == (8, "warps")
    # Registers go out in chunks of 8 per thread: 121 counts as 128, so 4 programs of 4 warps.
    assert occupancy(90, 121, 4, 0) == (4, "registers")
    # 48 KiB of shared memory per program on a T4 (64 KiB per SM): one program.
    assert occupancy(75, 32, 4, 48 * 1024) == (1, "shared memory")


def test_grid_covers_every_table_shape() -> None:
    grid = full_grid()
    shapes = model_shapes()
    assert {"llama-3-8b", "llama-3-70b", "smollm2-135m", "falcon-7b", "gemma-7b"} <= set(shapes)
    assert len(grid) == len(shapes) * 3 * 2 * 2 * 3
    assert {c.block_size for c in grid} == {1, 16, 32}


@pytest.mark.slow
def test_every_shape_on_every_target_compiles_without_spills() -> None:
    grid = slow_grid()
    assert {(c.model, c.arch) for c in grid} == {(m, a) for m in model_shapes() for a in (75, 80, 90)}
    assert {c.block_size for c in grid} == {1, 16, 32} and {c.split for c in grid} == {False, True}
    results = static_resources(grid)
    assert len([r for r in results if r.kernel == "attention"]) == len(grid)
    assert_within_budget(results)


@pytest.mark.slow
@pytest.mark.fullgrid
@pytest.mark.skipif(os.environ.get("MINIKV_FULL_GRID") != "1", reason="the full compile grid (~8 min on 2 cores) "
                    "runs only with MINIKV_FULL_GRID=1; the slow test covers every shape on every target")
def test_full_grid_compiles_without_spills() -> None:
    results = static_resources(full_grid())
    assert len([r for r in results if r.kernel == "attention"]) == len(full_grid())
    assert_within_budget(results)


def test_bench_puts_static_numbers_beside_measured_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    # On a GPU, `bench kernel` adds the compiled kernel's registers and occupancy on that card to
    # each measured row; the card is faked here (a T4) so that this path runs without one.
    import torch

    from minikv.bench import kernel as bench

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    rows = [dict(dtype="float16", batch=1, context=512, num_splits=1, kernel_us=10.0),
            dict(dtype="float16", batch=1, context=4096, num_splits=4, kernel_us=20.0),
            dict(dtype="float16", batch=64, context=32768, status="skipped: needs 300 GB")]
    bench._add_static_numbers(rows, ["float16"], 16, torch.device("cpu"))
    assert rows[0]["arch"] == rows[1]["arch"] == 75 and "regs" not in rows[2]
    assert all(0 < r["regs"] <= MAX_REGISTERS and r["spill_bytes"] == 0 for r in rows[:2])
    assert all(r["resident_warps"] >= MIN_RESIDENT_WARPS for r in rows[:2])


def test_static_table_prints_before_and_after(capsys: pytest.CaptureFixture[str]) -> None:
    from minikv.bench import kernel as bench

    before = bench.before_rows()
    assert before, "kernels/resources_before.json is missing: the first kernel's numbers are kept there"
    row = next(r for r in before if r["model"] == "llama-3-8b" and r["arch"] == 90 and r["kernel"] == "attention"
               and not r["split"])
    bench.print_static_table([dict(row, registers=64, spill_stores=0, bytes=1 << 20,
                                   **{f"ideal_us_{g}": 1.0 for g in bench.IDEAL_GPUS})], before)
    lines = capsys.readouterr().out.splitlines()
    assert "before regs" in lines[0] and "ideal us H100" in lines[0]
    assert lines[1].split()[:2] == ["llama-3-8b", "sm_90"] and str(row["registers"]) in lines[1].split()
