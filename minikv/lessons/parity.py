"""Token for token the same: asserted in float32, counted in half precision.

Greedy decoding (and beam search) picks the largest logit. In float32 on the CPU the course's caches and
engine compute what ``transformers`` computes, so their tokens are equal and a lesson asserts it. In float16
or bfloat16 (a Colab T4, or ``MINIKV_DTYPE=float16``) two computations that add the same numbers in another
order round differently; where two logits nearly tie, the pick can flip, and from there the continuations
part. So half precision may flip a near-tie: the count is reported, not required.

`count_flips` does the counting; `compare_tokens` is the rule a lesson's cell calls.
"""

from __future__ import annotations

from dataclasses import dataclass

HALF_PRECISION_NOTE = "half precision may flip a near-tie: the count is reported, not required"
EXACT_DTYPES = ("torch.float32", "torch.float64")   # by name: importing this module imports no torch


@dataclass(frozen=True)
class Flips:
    """How two sets of token sequences differ: `flipped` of `total` positions, the first at `first`."""

    flipped: int                      # positions whose tokens differ; a token only one side has counts too
    total: int                        # positions compared: the longer side's length, summed over sequences
    first: tuple[int, int] | None     # (sequence, position) of the first difference in the first sequence
    sequences: int                    # sequences compared

    def __str__(self) -> str:
        if not self.flipped:
            return f"0 of {self.total} tokens flipped"
        seq, pos = self.first
        return f"{self.flipped} of {self.total} tokens flipped, the first at sequence {seq}, token {pos}"


def _rows(tokens) -> list[list[int]]:
    """A tensor [n] or [sequences, n], a list of ids or a list of lists of ids, as lists of ints."""
    if hasattr(tokens, "tolist"):   # a torch tensor or a numpy array
        tokens = tokens.tolist()
    tokens = list(tokens)
    if tokens and not isinstance(tokens[0], (list, tuple)):
        return [[int(t) for t in tokens]]
    return [[int(t) for t in row] for row in tokens]


def count_flips(got, want) -> Flips:
    """Compare `got` with `want` position by position (tensors, lists of ids, or lists of such sequences)."""
    a, b = _rows(got), _rows(want)
    if len(a) != len(b):
        raise ValueError(f"{len(a)} sequences to compare with {len(b)}")
    flipped = total = 0
    first = None
    for i, (x, y) in enumerate(zip(a, b)):
        n = max(len(x), len(y))
        differ = [t for t in range(n) if t >= len(x) or t >= len(y) or x[t] != y[t]]
        flipped, total = flipped + len(differ), total + n
        if differ and first is None:
            first = (i, differ[0])
    return Flips(flipped, total, first, len(a))


def compare_tokens(got, want, dtype, against: str = "the reference") -> Flips:
    """The course's rule for "the same tokens as `against`": in float32 (float64) assert it; in half precision
    print how many tokens flipped and where the first did, and go on. Returns the count either way."""
    flips = count_flips(got, want)
    if str(dtype) in EXACT_DTYPES:
        assert not flips.flipped, f"in {dtype}, {flips} against {against}: the tokens must be equal"
        print(f"{dtype}: token for token the same as {against}: {flips.total} tokens in {flips.sequences} "
              f"sequence{'s' if flips.sequences != 1 else ''}")
    else:
        print(f"{dtype}: against {against}, {flips} ({HALF_PRECISION_NOTE})")
    return flips


__all__ = ["Flips", "HALF_PRECISION_NOTE", "compare_tokens", "count_flips"]
