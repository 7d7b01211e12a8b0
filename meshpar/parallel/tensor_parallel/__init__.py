"""Tensor / sequence parallelism: plans as tables, meshpar's styles, degree checks."""
