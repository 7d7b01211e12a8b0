"""``python -m tests.benchmarks.bench_moe --smoke`` runs: 2 ranks, FSDP only and ep 2, one timed step;
the all-to-all bytes meshpar.distributed.comm counted equal the figure the routing implies."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("recipe", ["qwen3_moe_debug.toml", "deepseek_v3_debug.toml"])
def test_bench_moe_smoke(tmp_path, recipe):
    out = tmp_path / "bench_moe.json"
    proc = subprocess.run([sys.executable, "-m", "tests.benchmarks.bench_moe", "--smoke", "--json", str(out),
                           "--recipe", str(ROOT / "recipes" / recipe)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    fsdp, ep = json.loads(out.read_text())
    assert (fsdp["ep"], fsdp["a2a_calls_per_step"], fsdp["a2a_bytes_per_step"]) == (1, 0, 0)
    assert ep["ep"] == 2 and ep["a2a_calls_per_step"] == 5 * 3  # 5 calls per sparse layer, 3 sparse layers
    assert 1 <= ep["load_max_over_mean"] < 8  # at most every slot on one of the 8 experts
    assert ep["bytes_equal"] and ep["a2a_bytes_per_step"] > 0
    assert ep["vs_fsdp"] > 0
