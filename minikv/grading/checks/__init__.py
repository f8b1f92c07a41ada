"""One module of checks per exercise, named ``exNN_topic.py``. Each exposes CHECKS: a list of
functions that take the learner's namespace and raise AssertionError with a one-line reason.

Checks compare the learner's code with the reference in `minikv` on many inputs (hypothesis
draws them where it fits), never on one hand-picked example."""

from pathlib import Path

# "01" -> "ex01_bytes", found from the file names so a new exercise needs no registration here.
MODULES = {p.stem[2:4]: p.stem for p in sorted(Path(__file__).parent.glob("ex[0-9][0-9]_*.py"))}
