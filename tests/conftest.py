"""Shared fixtures. The real model is loaded once per session (seconds once its conversion is cached)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach for a hub

import matplotlib
import pytest

# No windows from this process. Set here, not through MPLBACKEND, so the notebook kernels that
# nbval starts keep Jupyter's inline backend, exactly as a learner's do.
matplotlib.use("Agg")

import torch  # noqa: E402

# Without a CUDA GPU Triton's kernels run only under its interpreter, which Triton chooses once, when it is
# imported. The test processes make that choice here, before any test imports Triton (torch.compile and
# transformers' generate do), since which test runs first in a worker is not known. `import minikv` itself sets
# nothing (tests/test_kernel.py checks that); minikv_kernels/paged_attention.py sets it where its kernels are
# defined, and says so when Triton came first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def smollm2():
    from minikv.models import load_model

    model, tokenizer = load_model("smollm2-135m", device="cpu")
    return model, tokenizer


@pytest.fixture()
def tiny_llama():
    from minikv.models import tiny_random_llama

    return tiny_random_llama(seed=0)
