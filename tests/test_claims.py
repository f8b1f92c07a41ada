"""README's claims table is what `python -m minikv claims --markdown` prints: the two cannot drift apart."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from minikv.bench import claims

README = Path(__file__).resolve().parent.parent / "README.md"
BEGIN, END = "<!-- claims:begin (python -m minikv claims --markdown) -->", "<!-- claims:end -->"


@pytest.fixture(scope="module")
def measured():
    return claims.all_claims()


def test_readme_table_is_the_commands_output(measured):
    text = README.read_text()
    assert BEGIN in text and END in text, f"README.md lacks the claims table between {BEGIN} and {END}"
    table = text.split(BEGIN, 1)[1].split(END, 1)[0].strip()
    assert table == claims.markdown(measured), ("README's claims table differs from `python -m minikv claims "
                                                "--markdown`: paste the command's output between the markers")


def test_every_contract_claim_has_a_row_and_a_command(measured):
    keys = {c.key for c in measured}
    assert {"kv_per_token_7b", "prior_utilization", "paged_waste", "paging_throughput", "kernel_overhead",
            "parallel_sampling_saving", "beam_search_saving", "batch_is_throughput", "shared_walls",
            "long_context_tenants", "engine_throughput"} <= keys
    for c in measured:
        assert re.fullmatch(r"python -m minikv [a-z].*", c.command), c
        assert (README.parent / "notebooks" / f"{c.notebook}.ipynb").exists(), c


def test_the_figures_are_the_benchmarks_figures(measured):
    from minikv.sizing import kv_bytes_per_token, model_spec

    by_key = {c.key: c for c in measured}
    assert by_key["kv_per_token_7b"].value == kv_bytes_per_token(model_spec("llama-2-7b")) == 524288
    assert 0.204 <= by_key["prior_utilization"].value <= 0.382
    assert by_key["paged_waste"].value > 0.96
    assert 1 < by_key["batch_is_throughput"].value < 32
    assert by_key["kernel_overhead"].verdict == "not measured here" and by_key["kernel_overhead"].value is None
