"""The Triton paged-attention kernel (kernels/paged_attention.py) against the reference and plain attention.

Without a GPU every kernel test runs under Triton's CPU interpreter (exact semantics, slow);
with one, the same tests run the compiled kernel on CUDA tensors and the interpreter runs are
skipped. The sweep covers every listed block size, GQA ratio, head dim, dtype and both split
paths *pairwise* (each pair of values meets in at least one case, checked below) rather than
as a full product, which keeps the whole file within ~90 s on a 2-core CPU.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

# The interpreter switch must be set before the kernel module defines its kernels. The module
# does this itself too; doing it here also covers any Triton import that happens earlier.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="Triton is not installed: pip install -e '.[kernel]'")

import minikv_kernels.paged_attention as kernel_module  # noqa: E402
from minikv import dispatch  # noqa: E402
from minikv.attention import PagedInputs, gather_kv, paged_attention_ref, random_paged_inputs  # noqa: E402
from minikv_kernels.paged_attention import (  # noqa: E402
    INTERPRETED,
    MAX_SPLITS,
    MIN_TOKENS_PER_SPLIT,
    choose_num_splits,
    paged_attention,
)

REPO = Path(__file__).resolve().parents[1]

# Tolerances. float32: kernel and reference both compute in fp32 and differ only in summation
# order (~1e-7 relative per term). float16: both compute in fp32 and round the result to fp16
# once, so they may differ by one fp16 ulp: 2**-10 relative, ~2e-3 for the |x| < 4 seen here.
TOLERANCES = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}
LONG = 250  # "a few hundred" tokens: many blocks, scattered across the pool


@pytest.fixture(
    params=[pytest.param("cpu", id="interpreter"), pytest.param("cuda", id="cuda", marks=pytest.mark.cuda)]
)
def device(request: pytest.FixtureRequest) -> torch.device:
    if request.param == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("no CUDA GPU: compiled kernel not tested")
    elif not INTERPRETED:
        pytest.skip("Triton compiles for the GPU in this process; the cuda runs replace the interpreter runs")
    return torch.device(request.param)


def plain_attention(inputs: PagedInputs, scale: float) -> torch.Tensor:
    """Contiguous attention per sequence on gathered K/V, in float64: an independent answer."""
    rows = []
    for i, seq_len in enumerate(inputs.seq_lens.tolist()):
        keys, values = gather_kv(inputs.key_cache, inputs.value_cache, inputs.block_tables[i], seq_len)
        q = inputs.query[i].double()[:, None, :]  # [heads, 1, dim]
        k, v = keys.double().transpose(0, 1), values.double().transpose(0, 1)  # [kv_heads, seq_len, dim]
        rows.append(F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)[:, 0, :])
    return torch.stack(rows)


def lengths_around(block_size: int) -> list[int]:
    """1, block-1, block, block+1 and a long one (block-1 is dropped when it would be 0)."""
    return sorted({1, block_size - 1, block_size, block_size + 1, LONG} - {0})


# Pairwise covering array: (block_size, query heads per KV head, head_dim, dtype, num_splits, num_kv_heads).
# num_kv_heads = 1 is MQA; num_splits = 3 takes the split-KV path (with empty splits for the short sequences).
F32, F16 = torch.float32, torch.float16
SWEEP = [
    (1, 1, 64, F32, 1, 1), (1, 3, 80, F16, 1, 2), (1, 4, 128, F32, 3, 1), (1, 7, 64, F16, 3, 2),
    (8, 1, 80, F16, 3, 1), (8, 3, 128, F32, 3, 2), (8, 4, 64, F16, 1, 1), (8, 7, 80, F32, 1, 2),
    (16, 1, 128, F32, 1, 2), (16, 3, 64, F16, 1, 1), (16, 4, 80, F32, 3, 2), (16, 7, 128, F16, 3, 1),
    (32, 1, 64, F16, 3, 2), (32, 3, 80, F32, 3, 1), (32, 4, 128, F16, 1, 2), (32, 7, 64, F32, 1, 1),
]
SWEEP_VALUES = [(1, 8, 16, 32), (1, 3, 4, 7), (64, 80, 128), (F32, F16), (1, 3), (1, 2)]


def _case_id(case: tuple) -> str:
    block_size, group, head_dim, dtype, num_splits, num_kv_heads = case
    return f"bs{block_size}-g{group}-d{head_dim}-{str(dtype)[6:]}-split{num_splits}-kv{num_kv_heads}"


def test_sweep_covers_every_pair_of_values() -> None:
    for a, b in itertools.combinations(range(len(SWEEP_VALUES)), 2):
        wanted = set(itertools.product(SWEEP_VALUES[a], SWEEP_VALUES[b]))
        seen = {(case[a], case[b]) for case in SWEEP}
        assert wanted <= seen, f"factors {a}, {b}: missing {wanted - seen}"


@pytest.mark.parametrize("case", SWEEP, ids=_case_id)
def test_kernel_matches_reference_and_plain_attention(case: tuple, device: torch.device) -> None:
    block_size, group, head_dim, dtype, num_splits, num_kv_heads = case
    inputs = random_paged_inputs(
        lengths_around(block_size), num_heads=group * num_kv_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, block_size=block_size, dtype=dtype, device=device, spare_table_entries=2,
        seed=block_size * 100 + group,
    )
    scale = head_dim**-0.5
    got = paged_attention(*inputs, scale, num_splits=num_splits)
    assert got.shape == inputs.query.shape and got.dtype == dtype and got.device == inputs.query.device
    torch.testing.assert_close(got, paged_attention_ref(*inputs, scale), **TOLERANCES[dtype])
    torch.testing.assert_close(got.double(), plain_attention(inputs, scale), **TOLERANCES[dtype])


def test_split_kv_gives_empty_splits_zero_weight(device: torch.device) -> None:
    # Sequences of 1 and 5 tokens use 1 entry of an 18-entry table (130 tokens need 17 blocks, plus
    # a spare): with 2+ splits, whole splits hold none of their tokens. They must add nothing (and no
    # NaN) to the combined answer.
    inputs = random_paged_inputs(
        [1, 5, 130], num_heads=4, num_kv_heads=2, head_dim=32, block_size=8, device=device
    )
    unsplit = paged_attention(*inputs, 0.2, num_splits=1)
    torch.testing.assert_close(unsplit, paged_attention_ref(*inputs, 0.2), **TOLERANCES[torch.float32])
    for num_splits in (2, 5, 17, 1000):  # 1000 > table width: capped to one block per split
        got = paged_attention(*inputs, 0.2, num_splits=num_splits)
        assert torch.isfinite(got).all(), f"num_splits={num_splits} produced NaN/inf"
        torch.testing.assert_close(got, unsplit, **TOLERANCES[torch.float32])


def test_strided_views_and_int64_tables(device: torch.device) -> None:
    # Real callers pass views: a query sliced out of a fused QKV projection, K and V as halves of
    # one [blocks, 2, block_size, heads, dim] pool, a table that is a column slice of a wider one.
    base = random_paged_inputs(
        [3, 21, 40], num_heads=6, num_kv_heads=2, head_dim=48, block_size=8, device=device
    )
    qkv = torch.randn(3, 3 * 6, 48, generator=torch.Generator().manual_seed(1)).to(device)
    query = qkv[:, 6:12]
    kv_pool = torch.stack([base.key_cache, base.value_cache], dim=1)
    wide_table = torch.full((3, base.block_tables.shape[1] + 4), 7, dtype=torch.int64, device=device)
    wide_table[:, 2:-2] = base.block_tables
    views = PagedInputs(query, kv_pool[:, 0], kv_pool[:, 1], wide_table[:, 2:-2], base.seq_lens.long())
    assert not views.query.is_contiguous() and not views.key_cache.is_contiguous()
    expected = paged_attention_ref(query.contiguous(), *base[1:], 0.3)
    torch.testing.assert_close(paged_attention(*views, 0.3), expected, **TOLERANCES[torch.float32])
    torch.testing.assert_close(paged_attention(*views, 0.3, num_splits=2), expected, **TOLERANCES[torch.float32])


def test_block_size_that_is_not_a_power_of_two(device: torch.device) -> None:
    inputs = random_paged_inputs(
        [1, 11, 12, 13, 50], num_heads=4, num_kv_heads=4, head_dim=24, block_size=12, device=device
    )
    expected = paged_attention_ref(*inputs, 0.2)
    torch.testing.assert_close(paged_attention(*inputs, 0.2), expected, **TOLERANCES[torch.float32])


def test_dispatch_uses_the_kernel_when_asked(device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    inputs = random_paged_inputs([9, 33], num_heads=8, num_kv_heads=2, head_dim=16, block_size=16, device=device)
    kernel_out = paged_attention(*inputs, 0.25)
    torch.testing.assert_close(dispatch.decode_attention(*inputs, 0.25, use_kernel=True), kernel_out, atol=0, rtol=0)
    # On the GPU the default route is the kernel; on the CPU it is the reference, never the kernel.
    if device.type == "cuda":
        torch.testing.assert_close(dispatch.decode_attention(*inputs, 0.25), kernel_out, atol=0, rtol=0)
    else:
        def no_kernel(*args: object, **kwargs: object) -> torch.Tensor:
            raise AssertionError("use_kernel=None on CPU tensors must not call the kernel")

        monkeypatch.setattr(kernel_module, "paged_attention", no_kernel)
        torch.testing.assert_close(dispatch.decode_attention(*inputs, 0.25), paged_attention_ref(*inputs, 0.25))


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(seq_lens=torch.tensor([0, 9], dtype=torch.int32)), r"seq_lens\[0\] = 0 is out of range"),
        (dict(block_tables=torch.zeros(2, 4)), "block_tables must be an integer tensor"),
        (dict(query=torch.randn(2, 3, 8)), r"num_heads \(3\) must be a multiple of num_kv_heads \(2\)"),
    ],
)
def test_kernel_shares_the_reference_input_checks(changes: dict, message: str) -> None:
    inputs = random_paged_inputs([5, 9], num_heads=4, num_kv_heads=2, head_dim=8, block_size=4)._replace(**changes)
    with pytest.raises(ValueError, match=message):
        paged_attention(*inputs, 1.0)


def test_interpreter_rejects_bfloat16_clearly() -> None:
    if not INTERPRETED:
        pytest.skip("compiled kernel: bfloat16 is supported on the GPU")
    inputs = random_paged_inputs([4], num_heads=2, num_kv_heads=1, head_dim=8, block_size=4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="interpreter has no bfloat16: use float16 or float32"):
        paged_attention(*inputs, 1.0)


def test_interpreter_defaults_to_one_split(monkeypatch: pytest.MonkeyPatch) -> None:
    if not INTERPRETED:
        pytest.skip("compiled kernel: the split count comes from choose_num_splits")

    class NoCombine:
        def __getitem__(self, grid: object) -> None:
            raise AssertionError("num_splits=None under the interpreter must not launch the combine kernel")

    monkeypatch.setattr(kernel_module, "_combine_splits_kernel", NoCombine())
    inputs = random_paged_inputs([700], num_heads=1, num_kv_heads=1, head_dim=8, block_size=32)
    expected = paged_attention_ref(*inputs, 0.3)
    torch.testing.assert_close(paged_attention(*inputs, 0.3), expected, **TOLERANCES[torch.float32])


def test_choose_num_splits() -> None:
    sms = 132  # an H100/H200
    # Enough (sequence, KV head) programs to cover the SMs, or a short context: no split.
    assert choose_num_splits(64, 8, 2048, 16, sms) == 1
    assert choose_num_splits(1, 8, 16, 16, sms) == 1
    # One sequence, 8 KV heads, 32k tokens: about two programs per SM.
    assert choose_num_splits(1, 8, 2048, 16, sms) == 33
    # A medium context limits the split so each keeps MIN_TOKENS_PER_SPLIT tokens of work.
    assert choose_num_splits(1, 8, 64, 16, sms) == 1024 // MIN_TOKENS_PER_SPLIT
    # Never more than MAX_SPLITS, never more splits than table entries.
    assert choose_num_splits(1, 1, 100_000, 16, sms) == MAX_SPLITS
    assert choose_num_splits(1, 1, 40, 256, sms) == 40


def test_compiled_kernel_rejects_cpu_tensors() -> None:
    if INTERPRETED:
        pytest.skip("under the interpreter CPU tensors are the point")
    inputs = random_paged_inputs([4], num_heads=2, num_kv_heads=1, head_dim=8, block_size=4)
    with pytest.raises(ValueError, match="compiled kernel needs CUDA tensors"):
        paged_attention(*inputs, 1.0)


def _from(cwd: Path, script: str, pythonpath: str | None = None) -> dict:
    """Runs `python -c script` in cwd (the current folder first on sys.path, as `python -m pytest` has it) and
    returns the JSON its last line prints."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    done = subprocess.run([sys.executable, "-c", script], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_kernels_folder_does_not_fool_transformers(tmp_path: Path) -> None:
    # PyPI has an unrelated package imported as `kernels` (hub kernels), which transformers probes for and,
    # from 5.25 on, requires and imports with the model classes. Our folder is installed as `minikv_kernels`,
    # but wherever the repository root is on sys.path (the current folder here; Colab's sys.path.insert) it is
    # also `kernels`, found first. Imported under that name it must hand over to the real package further down
    # sys.path, or stay bare (no __version__: "not installed") where there is none; and importing it under
    # either name must not drag in torch or triton.
    ours = str(REPO / "kernels" / "__init__.py")
    # 1. A stand-in for PyPI's package after the repository root: `import kernels` gets it, submodules included.
    real = tmp_path / "site" / "kernels"
    real.mkdir(parents=True)
    (real / "__init__.py").write_text('__version__ = "0.0.1"\nfrom kernels.layer import NAME\n')
    (real / "layer.py").write_text('NAME = "the real one"\n')
    handed = _from(REPO, """
import importlib.util, json, os, sys
origin = os.path.realpath(importlib.util.find_spec("kernels").origin)
import minikv_kernels
light = "torch" not in sys.modules and "triton" not in sys.modules
import kernels
print(json.dumps({"origin": origin, "light": light, "file": os.path.realpath(kernels.__file__), "name": kernels.NAME,
                  "version": kernels.__version__, "held": sys.modules["kernels"] is kernels,
                  "still_light": "torch" not in sys.modules and "triton" not in sys.modules}))
""", pythonpath=str(tmp_path / "site"))
    assert handed["origin"] == ours, "the repository root was not first on sys.path: this checks nothing"
    assert handed["light"] and handed["still_light"], "importing kernels/ must not import torch or triton"
    assert handed["file"] == str((real / "__init__.py").resolve()) and handed["name"] == "the real one", handed
    assert handed["version"] == "0.0.1" and handed["held"]
    # 2. transformers as installed, from the repository root and from elsewhere: the same answer to its probe, the
    # real package (if any) or our bare folder behind `import kernels`, and a Llama model that builds and runs.
    script = """
import importlib.util, json, os
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.utils.import_utils import is_kernels_available
available = is_kernels_available()
spec = importlib.util.find_spec("kernels")
found = None if spec is None else spec.origin
if found is not None:
    import kernels
    found = os.path.realpath(kernels.__file__)
    found = found if getattr(kernels, "__version__", None) else "bare:" + found
torch.manual_seed(0)
config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
with torch.no_grad():
    logits = LlamaForCausalLM(config).eval()(torch.tensor([[1, 2, 3]])).logits
print(json.dumps({"available": available, "kernels": found, "logits": list(logits.shape)}))
"""
    at_root, elsewhere = _from(REPO, script), _from(tmp_path, script)
    assert at_root["logits"] == elsewhere["logits"] == [1, 3, 64]
    assert at_root["available"] == elsewhere["available"], (at_root, elsewhere)
    if elsewhere["kernels"] is None:  # PyPI's kernels is not installed: the probe sees our bare folder
        assert at_root == {**elsewhere, "kernels": "bare:" + ours}
    else:                             # it is: `import kernels` from the root gets it, not our folder
        assert at_root["kernels"] == elsewhere["kernels"] != ours, (at_root, elsewhere)


def test_kernel_bench_without_cuda_says_why_and_succeeds(capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the benchmark would run for real")
    from minikv.bench.kernel import cli

    assert cli(["--quick"]) == 0
    out = capsys.readouterr().out.strip()
    assert out == "no CUDA GPU: the kernel benchmark needs one; the interpreter proves correctness, not speed"


def test_kernel_bench_plot_draws_bandwidth_and_overhead() -> None:
    from minikv.bench.kernel import plot

    rows = [
        dict(dtype=dtype, batch=batch, context=ctx, kernel_us=10.0 * batch * ctx / 512, gbps=ctx / 10,
             copy_share=ctx / 40000, sdpa_us=8.0 * batch * ctx / 512, vs_sdpa=1.25, max_abs_err=1e-3,
             permuted_vs_identity=1.02)
        for dtype in ("float16", "bfloat16") for batch in (1, 8) for ctx in (512, 4096)
    ]
    fig = plot(rows)
    bandwidth, overhead = fig.get_axes()
    for ax in (bandwidth, overhead):  # one line per (dtype, batch), each over both contexts
        series = {line.get_label(): list(line.get_xdata()) for line in ax.get_lines()
                  if "batch" in line.get_label() and "in-order" not in line.get_label()}
        assert sorted(series) == ["bfloat16, batch 1", "bfloat16, batch 8", "float16, batch 1", "float16, batch 8"]
        assert all(xs == [512, 4096] for xs in series.values())
    assert "GB/s" in bandwidth.get_ylabel()
    dashed = [line for line in overhead.get_lines() if "in-order" in line.get_label()]
    assert len(dashed) == 4 and all(list(line.get_ydata()) == [1.02, 1.02] for line in dashed)


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU Triton compiles; no interpreter switch involved")
def test_the_kernel_module_chooses_the_interpreter_and_import_minikv_sets_nothing():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cwd = Path(__file__).resolve().parent.parent
    plain = subprocess.run([sys.executable, "-c", "import os, minikv; from minikv import LLM; "
                            "print(os.environ.get('TRITON_INTERPRET'))"],
                           env=env, capture_output=True, text=True, cwd=cwd)
    assert plain.returncode == 0 and plain.stdout.strip() == "None", plain.stderr or plain.stdout
    late = subprocess.run([sys.executable, "-c", "import torch._dynamo; import minikv_kernels.paged_attention"],
                          env=env, capture_output=True, text=True, cwd=cwd)
    assert late.returncode != 0
    assert "Import minikv_kernels.paged_attention before anything imports Triton" in late.stderr
    early = subprocess.run([sys.executable, "-c", "import minikv, minikv_kernels.paged_attention as k, torch._dynamo, "
                            "os; assert k.INTERPRETED and os.environ['TRITON_INTERPRET'] == '1'"], env=env,
                           capture_output=True, text=True, cwd=cwd)
    assert early.returncode == 0, early.stderr
