"""``python -m tests.benchmarks.bench_cp_attention --smoke`` runs, and its rows measure what they name:
recipes/llama_debug_cp.toml's attention shape (B 2, 8 / 4 heads of 32, T 2048, cp 2) on the CPU in
float64, cp rank 0's gather, gather-repeat, ring and ring on flex (its eager reference) each equal
to the same rows of one attention over the whole sequence (output and dQ, to float64's rounding
over 2048 keys), with the kernel each ran; a ring whose hops deliver the wrong rank's K/V is far
off, so the comparison can fail. Its time: docs/performance.md#test-suite-and-set-up."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from tests.benchmarks import bench_cp_attention as bench

ROOT = Path(__file__).resolve().parents[1]


def test_every_attention_equals_the_whole_sequence_rows(tmp_path):
    subprocess.run([sys.executable, "-m", "tests.benchmarks.bench_cp_attention", "--smoke", "--json",
                    str(tmp_path / "rows.json")], cwd=ROOT, capture_output=True, timeout=240, check=True)
    rows = {r["attention"]: r for r in json.loads((tmp_path / "rows.json").read_text())}
    assert list(rows) == ["whole", "gather", "gather-repeat", "ring-flex", "ring@65536"]
    assert rows["gather"]["cp"] == 2 and rows["gather"]["t"] == 2048 and rows["gather"]["h"] == 8
    for name, row in rows.items():
        assert row["out_diff"] < 1e-12 and row["dq_diff"] < 1e-12, (name, row)
        assert row["ms"] > 0 and row["planned_ms"] > 0 and row["peak_mib"] is None
    assert rows["gather"]["kernels"] == "cpu-flash" and rows["ring@65536"]["kernels"] == "-"
    assert rows["ring-flex"]["kernels"] == "flex-reference"
    # the rank's work is half the whole sequence's, both priced by the planner alike
    assert rows["whole"]["planned_ms"] == 2 * rows["gather"]["planned_ms"]


def test_a_ring_fed_the_wrong_chunk_is_far_off(monkeypatch):
    right = bench._Hops.__call__

    def own_chunk(self, send, recv, group, *, to, frm, dim, tag=0):
        work = right(self, send, recv, group, to=to, frm=frm, dim=dim, tag=tag)
        if not tag:
            recv.copy_(self.kv[self.rank])
        return work

    monkeypatch.setattr(bench._Hops, "__call__", own_chunk)
    ring = next(r for r in bench.measure("llama_debug_cp", "cpu", torch.float64, [65536], 1, "auto", warmup=False)
                if r["attention"] == "ring@65536")
    assert ring["out_diff"] > 1e-3 and ring["dq_diff"] > 1e-3
