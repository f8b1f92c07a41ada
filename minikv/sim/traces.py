"""Request traces: who arrives when, with how long a prompt, wanting how long an answer.

The memory simulator (``minikv.sim.memory``) replays a trace against a fixed KV budget. What a
trace must get right is the *shape* of the length distributions, because that is what
decides the waste: a server that reserves 2,048 tokens per request wastes most of it when
the typical conversation is a few hundred tokens long, and the long tail decides how
often a big request blocks the queue.

Synthetic workloads (``make_trace("sharegpt" | "alpaca", n, seed=..., rate=...)``)

The PagedAttention paper (Kwon et al., SOSP 2023, §6.1 and Fig. 11) serves OPT models on
two workloads and reports their mean lengths:

* ShareGPT (real ChatGPT conversations):   mean input 161.31, mean output 337.99 tokens
* Alpaca (GPT-3.5-generated instructions): mean input  19.31, mean output  58.45 tokens

and says ShareGPT has 8.4x longer prompts, 5.8x longer outputs and a higher variance.
The paper publishes histograms, not a fitted shape, so the shape here is our choice:
**log-normal**, the usual model for text lengths (positive, right-skewed, a long tail:
most chats are short, a few paste in pages). ``sigma`` (the spread of the log) is 1.0 for
ShareGPT (std about 1.3x the mean: the heavy tail of Fig. 11) and 0.7 for Alpaca (std
about 0.8x the mean: short instructions, short answers, less spread). Prompt and output
lengths are drawn independently. A request whose prompt + output exceeds the model's
context (``max_seq_len``, 2,048 for OPT) is redrawn, so a trace holds only requests the
model can serve, as a dataset prepared for a 2,048-token model must. Redrawing trims the
tail, so the log-normals' own means are calibrated upward (for ShareGPT at 2,048: about
168 and 386) until the means *after* filtering equal the published ones;
``describe()`` prints what a trace actually holds.

Why the shape matters: with max-length slabs always busy, the share of a slab holding
tokens, averaged over time, is about (E[prompt] + E[output^2] / (2 E[output])) / max_seq_len
(a long answer holds its slab longer), so the tail, not just the mean, sets it. ``sigma`` is a
parameter of ``Workload``; try others.

Arrivals are a Poisson process at ``rate`` requests per decode step (exponential gaps,
floored to whole steps), as in the paper's experiments; ``rate=None`` puts every request
at step 0. Each workload's default rate exceeds what even paged serving can finish, so
the KV memory, not the arrivals, is what limits the run: the regime the simulator
measures.

Your own lengths: ``load_trace(path)`` reads a CSV (header row) or JSON Lines file with
``prompt_len`` and ``output_len`` per request and an optional ``arrival`` step.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace: arrives at decode step ``arrival`` with ``prompt_len`` tokens and will
    generate ``output_len`` more (the simulator knows this; a real server does not). Only lengths:
    the engine's own request, with token ids and sampling parameters, is ``minikv.sequence.Request``."""

    id: int
    arrival: int
    prompt_len: int
    output_len: int

    @property
    def total_len(self) -> int:
        return self.prompt_len + self.output_len


@dataclass(frozen=True)
class Workload:
    """Length model of a published workload: log-normal lengths with these means."""

    name: str
    mean_prompt: float
    mean_output: float
    sigma_prompt: float
    sigma_output: float
    rate: float  # default arrivals per step: more than even paging can serve, so queues form
    source: str


WORKLOADS = {
    # Paged serving of this trace on the default budget finishes about 0.09 requests a step.
    "sharegpt": Workload("sharegpt", 161.31, 337.99, 1.0, 1.0, 0.25,
                         "ShareGPT, Kwon et al. 2023 Fig. 11"),
    # Alpaca requests are ~7x shorter: ~6 finish a step when paged, so they must come faster.
    "alpaca": Workload("alpaca", 19.31, 58.45, 0.7, 0.7, 10.0,
                       "Alpaca, Kwon et al. 2023 Fig. 11"),
}


def _lognormal(rng: np.random.Generator, mean: float, sigma: float, n: int) -> np.ndarray:
    # A log-normal with parameters (mu, sigma) has mean exp(mu + sigma^2 / 2); solve for mu
    # so the mean is `mean`. Round to whole tokens, at least one.
    mu = math.log(mean) - sigma**2 / 2
    return np.maximum(1, np.rint(rng.lognormal(mu, sigma, n))).astype(np.int64)


@lru_cache(maxsize=None)
def _calibrated_means(w: Workload, max_seq_len: int) -> tuple[float, float]:
    """Log-normal means whose samples, filtered to prompt + output <= max_seq_len, have the
    published means. A few multiplicative corrections on a fixed large sample converge."""
    mp, mo = w.mean_prompt, w.mean_output
    for _ in range(12):
        rng = np.random.default_rng(0)  # the same sample every round: a smooth fixed point
        p, o = _lognormal(rng, mp, w.sigma_prompt, 200_000), _lognormal(rng, mo, w.sigma_output, 200_000)
        ok = p + o <= max_seq_len
        if ok.sum() < 1000:  # (checked before dividing: an empty selection has no mean)
            break
        mp *= w.mean_prompt / p[ok].mean()
        mo *= w.mean_output / o[ok].mean()
    else:
        if abs(p[ok].mean() / w.mean_prompt - 1) < 0.01 and abs(o[ok].mean() / w.mean_output - 1) < 0.01:
            return mp, mo
    # Too short a context squeezes the tail out: no length model keeps the published means.
    raise ValueError(f"max_seq_len={max_seq_len} is too short for {w.name}-shaped requests with their published "
                     f"means (prompt {w.mean_prompt}, output {w.mean_output} tokens); use a longer max_seq_len "
                     f"(the paper's models have 2,048) or your own lengths with load_trace(path)")


def poisson_arrivals(n: int, rate: float | None, rng: np.random.Generator) -> np.ndarray:
    """Arrival steps of ``n`` requests at ``rate`` per step (``None``: all at step 0)."""
    if rate is None:
        return np.zeros(n, dtype=np.int64)
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests per step (or None for all at once), got {rate}")
    return np.floor(np.cumsum(rng.exponential(1.0 / rate, n))).astype(np.int64)


def make_trace(workload: str = "sharegpt", n: int = 1000, *, seed: int = 0,
               rate: float | str | None = "default", max_seq_len: int = 2048) -> list[TraceRequest]:
    """A seeded synthetic trace of ``n`` requests shaped like ``workload`` (see module doc).
    ``rate`` is in requests per decode step; "default" takes the workload's, which is high
    enough that requests queue up under every policy; None: all arrive at step 0."""
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; choose one of {sorted(WORKLOADS)} "
                         f"or load your own lengths with load_trace(path)")
    if n < 1 or max_seq_len < 2:
        raise ValueError(f"need n >= 1 and max_seq_len >= 2, got n={n}, max_seq_len={max_seq_len}")
    w, rng = WORKLOADS[workload], np.random.default_rng(seed)
    mp, mo = _calibrated_means(w, max_seq_len)
    prompts = _lognormal(rng, mp, w.sigma_prompt, n)
    outputs = _lognormal(rng, mo, w.sigma_output, n)
    # Redraw the pairs the model could not serve; the tail is thin, so this ends quickly.
    while (bad := np.flatnonzero(prompts + outputs > max_seq_len)).size:
        prompts[bad] = _lognormal(rng, mp, w.sigma_prompt, bad.size)
        outputs[bad] = _lognormal(rng, mo, w.sigma_output, bad.size)
    arrivals = poisson_arrivals(n, w.rate if rate == "default" else rate, rng)
    return [TraceRequest(i, int(a), int(p), int(o))
            for i, (a, p, o) in enumerate(zip(arrivals, prompts, outputs))]


def describe(trace: list[TraceRequest]) -> str:
    """One line: how many requests, mean and p50/p99 lengths, the arrival span."""
    def stats(x: np.ndarray) -> str:
        return f"mean {x.mean():.1f}, p50 {np.percentile(x, 50):.0f}, p99 {np.percentile(x, 99):.0f}"

    p = np.array([r.prompt_len for r in trace])
    o = np.array([r.output_len for r in trace])
    return (f"{len(trace)} requests; prompt {stats(p)}; output {stats(o)}; "
            f"arrivals over steps 0..{max(r.arrival for r in trace)}")


REQUIRED = ("prompt_len", "output_len")


def _rows(path: Path):
    """Yield (line number, dict) from a CSV with a header or a JSON Lines file."""
    if path.suffix.lower() == ".csv":
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            missing = [c for c in REQUIRED if c not in (reader.fieldnames or [])]
            if missing:
                raise ValueError(f"{path}: missing column(s) {missing}; the header must name "
                                 f"{list(REQUIRED)} (and optionally 'arrival'), found {reader.fieldnames}")
            for row in reader:
                yield reader.line_num, row
    elif path.suffix.lower() in (".jsonl", ".ndjson", ".json"):
        with path.open() as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg}); "
                                     "expected one object per line") from None
                if not isinstance(row, dict):
                    raise ValueError(f"{path}:{lineno}: expected a JSON object per line, got {row!r}")
                yield lineno, row
    else:
        raise ValueError(f"{path}: unknown trace format {path.suffix!r}; use .csv or .jsonl")


def _int(value, name: str, where: str, minimum: int) -> int:
    try:
        as_float = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: {name}={value!r} is not a number") from None
    if not as_float.is_integer() or as_float < minimum:
        raise ValueError(f"{where}: {name}={value!r} must be a whole number >= {minimum}")
    return int(as_float)


def load_trace(path: str | Path, *, rate: float | None = None, seed: int = 0) -> list[TraceRequest]:
    """Read your own request lengths (CSV or JSONL; keys ``prompt_len``, ``output_len``,
    optional ``arrival``). Rows without an arrival get Poisson arrivals at ``rate`` (or
    step 0 when ``rate`` is None). Requests are returned in arrival order."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no trace file at {path}")
    rows = []
    for lineno, row in _rows(path):
        where = f"{path}:{lineno}"
        missing = [k for k in REQUIRED if row.get(k) in (None, "")]
        if missing:
            raise ValueError(f"{where}: missing {missing}; every request needs {list(REQUIRED)}")
        arrival = row.get("arrival")
        rows.append((_int(row["prompt_len"], "prompt_len", where, 1),
                     _int(row["output_len"], "output_len", where, 1),
                     None if arrival in (None, "") else _int(arrival, "arrival", where, 0)))
    if not rows:
        raise ValueError(f"{path}: no requests in the file")
    fill = poisson_arrivals(len(rows), rate, np.random.default_rng(seed))
    trace = [TraceRequest(i, a if a is not None else int(fill[i]), p, o) for i, (p, o, a) in enumerate(rows)]
    return sorted(trace, key=lambda r: (r.arrival, r.id))
