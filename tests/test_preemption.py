"""Runs that survive signals and dead ranks: ``meshpar train`` on 2 gloo ranks, interrupted,
resumed, and compared with an uninterrupted run.

- A stop signal (``fault.signals``) to one rank, or to the launcher: every rank finishes its
  step, one checkpoint is saved, the run exits with 75 and says where; the next launch
  resumes, and metrics.jsonl of the combined run equals the clean run's bit for bit.
- ``--max-restarts``: a rank SIGKILLed mid-run is named by the launcher, every rank is
  restarted from the newest checkpoint, and metrics.jsonl again equals the clean run's.

Every value compared is computed by the same arithmetic in the same order (same layout,
same world size, state restored exactly), so equality is exact; timings are left out.
Linux only: ranks are found through /proc (their RANK environment variable).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.processes import STEPS, finish_run, metrics_records, rank_pid, start_run, wait_for_step

pytestmark = pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds ranks through /proc")


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> list[dict]:
    """metrics.jsonl of an uninterrupted run."""
    out = tmp_path_factory.mktemp("clean")
    code, output = finish_run(start_run(out))
    assert code == 0, output[-3000:]
    records = metrics_records(out)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)), records
    return records


@pytest.mark.timeout(300)
def test_stop_signal_saves_exits_75_and_resumes_bit_for_bit(clean, tmp_path):
    out = tmp_path / "run"
    stops = []
    # 1. SIGTERM to rank 1 only: both ranks stop after the same step
    proc = start_run(out)
    wait_for_step(proc, out, 6)
    sent = time.monotonic()
    os.kill(rank_pid(proc.pid, 1), signal.SIGTERM)
    code, output = finish_run(proc)
    stops.append(time.monotonic() - sent)
    assert code == 75, output[-3000:]
    line = next((ln for ln in output.splitlines() if "stopped by SIGTERM after step" in ln), None)
    assert line is not None, output[-3000:]
    first = int(line.split("after step ")[1].split(":")[0])
    assert (out / "checkpoints" / f"step_{first}" / "meshpar.json").is_file(), line
    assert max(r["step"] for r in metrics_records(out)) == first
    # 2. SIGUSR1 (SLURM's warning) to the launcher, which hands it to every rank
    proc = start_run(out)
    wait_for_step(proc, out, first + 5)
    sent = time.monotonic()
    os.kill(proc.pid, signal.SIGUSR1)
    code, output = finish_run(proc)
    stops.append(time.monotonic() - sent)
    assert code == 75, output[-3000:]
    assert "stopped by SIGUSR1 after step" in output, output[-3000:]
    assert f"resumed from {out / 'checkpoints' / f'step_{first}'}" in output, output[-3000:]
    # 3. to the end
    code, output = finish_run(start_run(out))
    assert code == 0, output[-3000:]
    assert metrics_records(out) == clean, "metrics.jsonl of the interrupted run differs from the clean run's"
    print(f"seconds from signal to exit: {', '.join(f'{s:.1f}' for s in stops)}")


@pytest.mark.timeout(300)
def test_killed_rank_restarts_from_the_newest_checkpoint(clean, tmp_path):
    out = tmp_path / "run"
    proc = start_run(out, "--max-restarts", "2", "--checkpoint.every=5")
    wait_for_step(proc, out, 8)
    victim = rank_pid(proc.pid, 1)
    os.kill(victim, signal.SIGKILL)
    code, output = finish_run(proc)
    assert code == 0, output[-3000:]
    assert f"rank 1 (pid {victim}) failed: signal SIGKILL; restarting all 2 ranks from the newest checkpoint " \
           f"(1 restart left after this one)" in output, output[-3000:]
    assert "resumed from" in output, output[-3000:]
    assert metrics_records(out) == clean, "metrics.jsonl after a restart differs from the clean run's"


@pytest.mark.timeout(120)
def test_no_restarts_left_fails_naming_the_rank(tmp_path):
    out = tmp_path / "run"
    proc = start_run(out)
    wait_for_step(proc, out, 3)
    victim = rank_pid(proc.pid, 1)
    os.kill(victim, signal.SIGKILL)
    code, output = finish_run(proc)
    assert code == 1, output[-3000:]
    assert f"rank 1 (pid {victim}) failed: signal SIGKILL; no restarts left" in output, output[-3000:]
