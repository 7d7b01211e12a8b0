"""Inference in one process: ``meshpar generate`` (generate.py)."""
