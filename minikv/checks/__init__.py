"""One module of checks per exercise. Each module exposes CHECKS: a list of functions that take
the learner's namespace and raise AssertionError with a one-line reason.

Checks compare the learner's code with the reference in `minikv` on many inputs (hypothesis
draws them where it fits), never on one hand-picked example."""

MODULES = {"01": "ex01_bytes"}
