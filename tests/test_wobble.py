"""`python -m minikv bench wobble`: the four servers differ in the pool and the prefill only, the controls do what
they claim (the roomy pool never evicts, chunks bound the step's prefill), and the verdict follows the table."""

import json
import math
import subprocess
import sys

import pytest

from minikv.bench import wobble as wb


def test_the_four_servers_differ_in_the_pool_and_the_prefill_only():
    w = wb.Wobble()
    f = {(p, c): wb.flags(w, p, c) for p in wb.POOLS for c in wb.PREFILLS}
    def split(v):   # (the pool's size, the prefill's flags, everything else)
        i, j = v.index("--num-blocks"), v.index("--threads") + 2
        return v[i + 1], v[j:], v[:i] + v[i + 2:j]
    parts = {k: split(v) for k, v in f.items()}
    assert len({tuple(rest) for _, _, rest in parts.values()}) == 1      # model, block size, seats, threads
    for c in wb.PREFILLS:
        assert parts["evicts", c][1] == parts["never evicts", c][1]       # the pools differ in size only
    for p in wb.POOLS:
        assert parts[p, "chunked"][0] == parts[p, "no chunking"][0]      # the prefills differ in the step only
    blocks = {k: int(v[v.index("--num-blocks") + 1]) for k, v in f.items()}
    assert blocks["evicts", "chunked"] == w.num_blocks
    # the roomy pool holds every request at its longest, all at once, with a block to spare each
    assert blocks["never evicts", "chunked"] * w.block_size >= w.n * (w.prompt + w.output)


def _table(p90):
    return {k: {"gap p90": (v, v, v)} for k, v in p90.items()}


@pytest.mark.parametrize("p90, expected", [
    ({("evicts", "no chunking"): 400, ("evicts", "chunked"): 400,
      ("never evicts", "no chunking"): 400, ("never evicts", "chunked"): 100}, "qualified"),   # both causes
    ({("evicts", "no chunking"): 400, ("evicts", "chunked"): 400,
      ("never evicts", "no chunking"): 110, ("never evicts", "chunked"): 100}, "reproduced"),  # evictions only
    ({("evicts", "no chunking"): 110, ("evicts", "chunked"): 100,
      ("never evicts", "no chunking"): 100, ("never evicts", "chunked"): 100}, "differs"),     # neither
])
def test_the_verdict_follows_the_ratios(p90, expected):
    assert wb.verdict(wb.effects(_table(p90))) == expected


def test_bench_wobble_on_the_tiny_model_keeps_its_controls():
    out = subprocess.run([sys.executable, "-m", "minikv", "bench", "wobble", "--model", "tiny-random-llama",
                          "--rate", "8", "--n", "8", "--prompt", "96", "--output", "16", "--num-blocks", "16",
                          "--chunk", "16", "--json"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout)
    assert set(r["runs"]) == {f"{p} / {c}" for p in wb.POOLS for c in wb.PREFILLS}
    for key, rows in r["runs"].items():
        (row,) = rows
        if key.startswith("never evicts"):
            assert row["evictions"] == 0, key               # the control that removes evictions removes them
        if key.endswith("/ chunked"):
            assert row["largest prefill"] <= 2 * 16, key    # the step budget: two chunks at most
        else:
            assert row["largest prefill"] > 16, key         # whole prompts: longer than a chunk in one step
        assert all(not isinstance(v, float) or not math.isinf(v) for v in row.values())
    assert r["verdict"] in ("qualified", "reproduced", "differs")
