"""Sampling: how a request asks for tokens (`SamplingParams`) and how one is drawn from logits (`sample`).

`SamplingParams` uses vLLM's names and defaults, so a learner can move to vLLM without relearning.
Bad values fail when the request is made, with a message that names the field, the value and what
it must be (`minikv.validation.InvalidArgument`, a ``ValueError`` with ``.param``), never halfway
through a batch.

`sample(logits, params, generators)` draws one token per row of a step's logits:

* ``temperature == 0`` is greedy: the argmax, exactly what ``transformers`` ``generate`` picks.
* otherwise the logits are divided by the temperature, cut to the ``top_k`` largest (0 = all) and
  to the smallest set whose probability reaches ``top_p`` (1.0 = all), and one token is drawn.
* a row with a ``torch.Generator`` (a request with a ``seed``) draws from that generator alone, one
  draw per step, so its tokens do not depend on which other requests share the batch. Rows
  without one share torch's global generator.

**How a token is drawn: one uniform number, walked along the cumulative distribution.** Draw u in [0, 1),
and take the first token whose cumulative probability exceeds u times the total: token i is taken for a u
in a stretch of length p_i, so with probability p_i, and a token of probability 0 has a stretch of length 0.
The sums run in float64, so rounding moves a boundary by far less than any probability a model gives.
``torch.multinomial`` draws the same distribution, but on the CPU it took 0.86 ms a row over SmolLM2's
49,152 tokens (it draws a random number per token): 16 ms of a batch-16 decode step that takes 34 ms.
Served with sampling (temperature 1.0 is the default, and `vllm bench serve` leaves it in place) every
step paid almost a millisecond per running request; the walk takes 0.18 ms for 8 rows
(``python -m minikv bench sampling`` prints both).

The masking and the draws are vectorized over the whole batch; only seeded rows draw their number one
at a time, each from its own generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minikv.validation import InvalidArgument, check_bool, check_int, check_int_list, check_number, check_str_list

__all__ = ["SamplingParams", "apply_top_k_top_p", "draw", "make_generator", "sample"]


@dataclass
class SamplingParams:
    """How to sample one request's output (vLLM's names and defaults).

    n: how many independent samples to return for the prompt (they share its KV blocks).
    temperature: 0 for greedy; higher is more random.
    top_p: keep the smallest set of tokens whose probability reaches top_p (1.0 keeps all).
    top_k: keep the k most likely tokens (0 keeps all).
    max_tokens: stop after this many generated tokens.
    stop / stop_token_ids: stop when the text contains a stop string, or a stop token is generated.
    ignore_eos: keep generating past the tokenizer's end-of-sequence token.
    seed: make this request's sampling reproducible whatever else is in the batch.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        # Each check names the field, the value and what it must be (minikv.validation), so a
        # server can turn a bad request into a 400 that says which parameter to fix.
        check_int("n", self.n, 1, "samples per prompt")
        check_number("temperature", self.temperature, 0, what="0 means greedy")
        check_number("top_p", self.top_p, 0.0, 1.0, low_open=True, what="1.0 keeps every token")
        check_int("top_k", self.top_k, 0, "0 keeps every token")
        check_int("max_tokens", self.max_tokens, 1, "tokens to generate")
        self.stop = check_str_list("stop", self.stop, "the text stops before the first one it contains")
        self.stop_token_ids = check_int_list("stop_token_ids", self.stop_token_ids, 0, "token ids")
        check_bool("ignore_eos", self.ignore_eos)
        check_int("seed", self.seed, what="the request's own random seed", optional=True)
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:  # what torch.Generator.manual_seed takes
            raise InvalidArgument("seed", self.seed, "an integer in [-2**63, 2**64) (the request's own random seed)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A generator for a seeded request (None for an unseeded one): one per request, kept across steps."""
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(seed)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf every logit outside each row's top-k and top-p set (rows: top_k 0 / top_p 1 = keep all).

    logits [rows, vocab] float; top_k [rows] int; top_p [rows] float. One sort for the whole batch.
    The most likely token always survives, so every row keeps at least one candidate.
    """
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=logits.device).expand_as(sorted_logits)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).clamp(max=vocab)
    drop = rank >= k[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # A token is dropped when the tokens ranked above it already reach top_p.
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= top_p[:, None]
    drop[:, 0] = False
    return logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None] | None = None,
) -> list[int]:
    """One token id per row of `logits` [rows, vocab], row i sampled by `params[i]` with `generators[i]`."""
    rows = logits.shape[0]
    if len(params) != rows:
        raise ValueError(f"{rows} rows of logits but {len(params)} SamplingParams: pass one per row")
    generators = generators if generators is not None else [None] * rows
    if len(generators) != rows:
        raise ValueError(f"{rows} rows of logits but {len(generators)} generators: pass one (or None) per row")
    logits = logits.float()
    tokens = logits.argmax(dim=-1)  # greedy rows keep this
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if random_rows:
        index = torch.tensor(random_rows, device=logits.device)
        chosen = [params[i] for i in random_rows]
        temperature = torch.tensor([p.temperature for p in chosen], device=logits.device)
        scaled = logits[index] / temperature[:, None]
        if any(p.top_k > 0 or p.top_p < 1.0 for p in chosen):
            top_k = torch.tensor([p.top_k for p in chosen], device=logits.device)
            top_p = torch.tensor([p.top_p for p in chosen], device=logits.device)
            scaled = apply_top_k_top_p(scaled, top_k, top_p)
        probs = scaled.softmax(dim=-1)
        tokens[index] = draw(probs, [generators[i] for i in random_rows])
    return tokens.tolist()


def draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of `probs` [rows, vocab], token i with probability probs[row, i] / the row's sum: one
    uniform number per row, found in the row's cumulative distribution (see the module's docstring). A row
    with a generator takes its number from it alone."""
    rows = probs.shape[0]
    u = torch.empty(rows, 1, dtype=torch.float64, device=probs.device)
    unseeded = [j for j, g in enumerate(generators) if g is None]
    if unseeded:
        u[unseeded] = torch.rand(len(unseeded), 1, dtype=torch.float64, device=probs.device)
    for j, g in enumerate(generators):
        if g is not None:
            u[j] = torch.rand(1, dtype=torch.float64, generator=g, device=probs.device)
    cdf = probs.double().cumsum(dim=-1)
    # The first token whose cumulative sum exceeds u x total; u < 1 keeps it inside the vocabulary.
    return torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1)
