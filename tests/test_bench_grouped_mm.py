"""``python -m tests.benchmarks.bench_grouped_mm --cases debug`` runs: both expert kernels at the debug
model's shape, forward and backward, the same numbers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_grouped_mm_debug_case(tmp_path):
    out = tmp_path / "grouped_mm.json"
    proc = subprocess.run([sys.executable, "-m", "tests.benchmarks.bench_grouped_mm", "--cases", "debug", "--device",
                           "cpu", "--dtypes", "float32", "--repeats", "1", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())
    assert [r["routing"] for r in rows] == ["even", "skewed"]
    for r in rows:
        assert r["slots"] == 1024 and r["grouped_ms"] > 0 and r["loop_ms"] > 0
        assert r["max_rel_diff"] <= 1e-6  # fp32: the same dot products (they agree bit for bit here)
