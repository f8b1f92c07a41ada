"""Shared fixtures. The real model is loaded once per session (seconds once its conversion is cached)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach for a hub

import matplotlib
import pytest

# No windows from this process. Set here, not through MPLBACKEND, so the notebook kernels that
# nbval starts keep Jupyter's inline backend, exactly as a learner's do.
matplotlib.use("Agg")

import minikv  # noqa: F401  first, so Triton's interpreter switch is set before anything imports triton


@pytest.fixture(scope="session")
def smollm2():
    from minikv.models import load_model

    model, tokenizer = load_model("smollm2-135m", device="cpu")
    return model, tokenizer


@pytest.fixture()
def tiny_llama():
    from minikv.models import tiny_random_llama

    return tiny_random_llama(seed=0)
