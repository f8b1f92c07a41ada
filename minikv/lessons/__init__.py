"""The lessons' machinery: what a `your-turn` cell's checkpoint calls, and how lessons are generated.

* ``checkpoint``: the cell after a learner's `your-turn` cell tries their code on a few cases, says in one
  line what is right or wrong, and hands back the code the lesson goes on with (theirs if it passed, the
  course's otherwise), so a lesson always runs to its end.
* ``build``: each lesson in ``notebooks/`` is generated from its source in ``notebooks/answers/``, which holds
  the course's answers between ``### BEGIN SOLUTION`` / ``### END SOLUTION`` (the exercises' convention);
  ``python -m minikv exercises`` writes them, ``--check`` proves they are in sync.
* ``parity``: "the same tokens as transformers", asserted in float32 and counted in half precision
  (`compare_tokens`), where a near-tie may flip.

A learner meets only ``checkpoint``, ``Case`` and ``compare_tokens``; the rest is for the course's maintainers.
"""

from minikv.lessons.checkpoint import Case, checkpoint
from minikv.lessons.parity import compare_tokens

__all__ = ["Case", "checkpoint", "compare_tokens"]
