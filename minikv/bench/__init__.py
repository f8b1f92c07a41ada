"""Benchmarks: each prints side-by-side ratios from one run (`python -m minikv bench ...`)."""
