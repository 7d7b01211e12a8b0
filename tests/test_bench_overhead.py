"""tests/benchmarks/bench_overhead.py: its arithmetic, and a short run of every engine."""

from __future__ import annotations

import json
from types import SimpleNamespace

from tests.benchmarks import bench_overhead


def _event(name: str, start: float, end: float) -> SimpleNamespace:
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end))


def test_hook_time_counts_nested_and_overlapping_labels_once():
    events = [_event("FSDP::pre_forward (layers.0)", 0, 10), _event("FSDP::all_gather (layers.0)", 2, 5),
              _event("aten::mm", 10, 30), _event("FSDP::post_forward (layers.0)", 30, 40),
              _event("FSDP::x", 38, 45)]
    assert bench_overhead._covered_us(events, "FSDP::") == (10 + 15, 4)
    assert bench_overhead._covered_us(events, "meshpar::fsdp.") == (0, 0)


def test_summary_takes_the_slowest_rank_per_step_then_the_median():
    def record(steps: list[float]) -> dict:
        return dict(engine="meshpar", ranks=2, parts={"step": steps, "forward": steps, "backward": steps,
                                                      "optimizer": steps}, losses=[2.0, 1.0], casts=0)
    row, = bench_overhead.summarize([[record([0.001, 0.005, 0.003])], [record([0.002, 0.001, 0.004])]])
    assert row["step_ms"] == 4.0  # slowest per step: 2, 5, 4 ms
    assert row["rounds_ms"] == [2.0, 5.0, 4.0]
    rows = [dict(engine="meshpar", ranks=1, step_ms=3.0), dict(engine="torch", ranks=1, step_ms=4.0),
            dict(engine="plain", ranks=1, step_ms=2.0)]
    assert bench_overhead.ratios(rows) == {"meshpar/torch, 1 rank(s)": 0.75, "meshpar/plain, 1 rank(s)": 1.5}


def test_ratios_pair_the_steps_of_each_round():
    """[Note: paired ratios]: the median of each round's ratio, not the ratio of the medians (6/4 here)."""
    rows = [dict(engine="meshpar", ranks=1, step_ms=6.0, rounds_ms=[2.0, 8.0, 6.0]),
            dict(engine="plain", ranks=1, step_ms=4.0, rounds_ms=[1.0, 4.0, 6.0])]
    assert bench_overhead.ratio_rounds(rows) == {"meshpar/plain, 1 rank(s)": [2.0, 2.0, 1.0]}
    assert bench_overhead.ratios(rows) == {"meshpar/plain, 1 rank(s)": 2.0}


def test_a_short_run_of_every_engine(tmp_path, capsys):
    out = tmp_path / "overhead.json"
    bench_overhead.main(["--ranks", "1", "--blocks", "2", "--steps", "2", "--warmup", "1", "--json", str(out)])
    report = json.loads(out.read_text())
    rows = {r["engine"]: r for r in report["rows"]}
    assert set(rows) == {"plain", "meshpar", "torch"}
    # the same model, initial values, token and bf16 casts: both FSDP engines compute the same loss
    assert rows["meshpar"]["loss_first"] == rows["torch"]["loss_first"]
    assert abs(rows["plain"]["loss_first"] - rows["meshpar"]["loss_first"]) < 0.05  # autocast's bf16 rounding
    for r in rows.values():
        assert r["step_ms"] > 0 and r["casts"] > 0 and r["collectives"] == 0  # one rank: no collective
    assert rows["meshpar"]["hook_calls"] > 0 and rows["plain"]["hook_calls"] == 0
    assert "meshpar/plain, 1 rank(s)" in capsys.readouterr().out
    assert len(report["ratio_rounds"]["meshpar/plain, 1 rank(s)"]) == 2  # one ratio per timed round
