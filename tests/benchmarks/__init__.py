"""Benchmarks: scripts named ``bench_*.py`` (pytest collects ``test_*.py`` only), run with
``python -m tests.benchmarks.<name>``."""
