"""Held-out sets: what a design check grades on, the same at every grading (issue 46).

A design check measures a learner's design with the exercise's public ``objective(..., seed=...)``, on every seed of
a **held-out set**: a named, versioned tuple of seeds committed in the check module (out of a submission's reach, and
printed in no notebook; learners develop on seeds of their own). The grade is the mean of the per-seed figures
against a target; the verdict, passing or failing, names the set and its version, says what was measured and what
the target is, and a failing one names the seed where the design did worst and the public line that reproduces it.

The same notebook therefore gets the same grade at every run. A new set (other seeds, another size) is a new
version: ``ex03-v2``, never a silent change of ``ex03-v1``. How large a set is and where its target sits is decided
on the designs of GRADING.md's tables: each design's mean is at least two standard errors (over the set's seeds)
away from every target, so a design's verdict does not hang on which seeds were drawn
(``tests/designs.py`` prints the tables; ``tests/test_designs.py`` asserts them).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field


@dataclass(frozen=True)
class HeldOutSet:
    """`seeds`, each drawing `each` (e.g. "6 serving traces") with the exercise's public draw; `name` carries the
    version ("ex03-v1")."""

    name: str
    seeds: tuple[int, ...]
    each: str

    def describe(self) -> str:
        return f"held-out set {self.name} ({len(self.seeds)} seeds, {self.each} each)"


@dataclass
class Criterion:
    """One figure of a design, per seed of a held-out set, and its target on the mean over the seeds."""

    what: str                 # the figure, "{}" where its value goes: "{} of the free list's runs"
    values: list[float]       # one per seed, in the set's order
    target: float
    at_most: bool             # True: the mean must be <= target; False: >= target
    unit: str = "x"
    digits: int = 3           # the mean's (three, so that a mean just past the target never prints as the target)
    target_digits: int = 2
    short: str = ""           # a name for a table ("runs / the free list's")

    @property
    def mean(self) -> float:
        return statistics.fmean(self.values)

    @property
    def sd(self) -> float:
        return statistics.stdev(self.values) if len(self.values) > 1 else 0.0

    @property
    def se(self) -> float:
        return self.sd / math.sqrt(len(self.values))

    @property
    def passed(self) -> bool:
        return self.mean <= self.target if self.at_most else self.mean >= self.target

    @property
    def standard_errors_away(self) -> float:
        """How many standard errors the mean lies from the target (inf when every seed measured the same)."""
        return abs(self.mean - self.target) / self.se if self.se else math.inf

    @property
    def label(self) -> str:
        return self.short or self.what.replace("{}", "").strip()

    def worst(self) -> int:
        """The index of the seed that did worst on this figure."""
        pick = max if self.at_most else min
        return pick(range(len(self.values)), key=lambda i: self.values[i])

    def _value(self, x: float, digits: int) -> str:
        return f"{x:.{digits}f}{self.unit}"

    def said(self) -> str:
        lo, hi = min(self.values), max(self.values)
        return (f"{self.what.format(self._value(self.mean, self.digits))} (the mean over the {len(self.values)} "
                f"seeds, each {self._value(lo, self.digits)} to {self._value(hi, self.digits)}); the target is "
                f"{'<=' if self.at_most else '>='} {self._value(self.target, self.target_digits)}")


@dataclass
class Measurement:
    """A design measured on a held-out set: its criteria (all must pass) and the public objective's result per seed."""

    held_out: HeldOutSet
    criteria: list[Criterion]
    per_seed: list[dict] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.criteria)

    def said(self) -> str:
        """What was measured, the targets and the set: the message of a passing check, the start of a failing one's."""
        return f"on {self.held_out.describe()}: " + "; ".join(c.said() for c in self.criteria)

    def summary(self) -> str:
        """One line for a table: each criterion's mean, spread, standard error and distance to its target."""
        return "; ".join(f"{c.label}: {c.mean:.3f} (sd {c.sd:.3f}, se {c.se:.4f}; target "
                         f"{'<=' if c.at_most else '>='} {c.target:g}: {'pass' if c.passed else 'fail'}, "
                         f"{c.standard_errors_away:.1f} se away)" for c in self.criteria)
