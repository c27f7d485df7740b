"""Benchmarks, one module per stage: ``python -m aimsym.bench.NAME`` (numbers go to docs/performance.md)."""
