"""A rank that stops answering: its peers fail within ``fault.timeout`` plus a few seconds,
naming the collective, its mesh dim, the step and the ranks that did not arrive, and print
their flight recorder (meshpar/runtime/fault.py, meshpar/distributed/comm_record.py [Note: the flight recorder]).

The end-to-end test SIGSTOPs one rank of a 2-rank ``meshpar train`` (a hung GPU or a stuck
NCCL call looks the same from outside) with a 10 s timeout; gloo's default would wait 30
minutes, and before fault.timeout nothing named the operation.
"""

from __future__ import annotations

import datetime
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from meshpar.distributed import comm, comm_record
from meshpar.runtime.fault import report_collective_failure
from tests.distributed import run_distributed
from tests.processes import finish_run, rank_pid, start_run, wait_for_step

TIMEOUT_S = 10


def _rank1_absent(tmp: str) -> str | None:
    """Rank 0 all-reduces over a 4 s timeout while rank 1 sleeps (never joins); rank 0 returns its report."""
    group = dist.new_group(timeout=datetime.timedelta(seconds=4))
    record = comm_record.CommRecord()  # as a run's (meshpar/train.py)
    with record.active():
        record.step = 7
        t = torch.ones(1000)
        comm.all_reduce(t, group, dim="dp_shard").wait()  # both ranks: a completed one in the record
        if dist.get_rank() == 1:
            time.sleep(15)
            return None
        try:
            comm.all_reduce(t, group, dim="dp_shard", async_op=True).wait()
        except Exception as e:  # noqa: BLE001 - the timeout under test
            failure = e
        else:
            raise AssertionError("the all-reduce with a sleeping peer did not time out")
    # outside the block, as meshpar/train.py reports: the run's record is passed
    return report_collective_failure(failure, rank=0, world=2, step=record.step, timeout=datetime.timedelta(seconds=4),
                                     record=record)


@pytest.mark.timeout(90)
def test_report_names_op_dim_step_and_absent_rank():
    report, _ = run_distributed(_rank1_absent, 2, "", timeout=60)
    assert "a collective failed at step 7 in all_reduce over dp_shard (#2," in report, report
    assert "within 3 s (stopped, dead or elsewhere): [1]" in report, report
    assert "timeout 4 s (fault.timeout)" in report, report
    lines = report.splitlines()
    recorder = lines[lines.index(next(ln for ln in lines if "flight recorder" in ln)) + 1:]
    assert len(recorder) == 2 and "done" in recorder[0] and "NOT DONE" in recorder[1], report


@pytest.mark.timeout(120)
def test_stopped_rank_fails_its_peer_within_the_timeout(tmp_path):
    out = tmp_path / "run"
    proc = start_run(out, f"--fault.timeout={TIMEOUT_S}", "--train.steps=200")
    wait_for_step(proc, out, 3)
    victim = rank_pid(proc.pid, 1)
    stopped = time.monotonic()
    os.kill(victim, signal.SIGSTOP)
    try:
        lines: list[str] = []
        while time.monotonic() - stopped < TIMEOUT_S + 40:
            line = proc.stdout.readline()
            lines.append(line)
            if "a collective failed at step" in line:
                break
        waited = time.monotonic() - stopped
        report = "".join(lines[-3:])
        assert "a collective failed at step" in report, "".join(lines)[-3000:]
    finally:
        os.kill(victim, signal.SIGCONT)  # let the launcher's SIGTERM reach it
    code, rest = finish_run(proc, timeout=60)
    text = report + rest
    assert code == 1, text[-3000:]
    # 10 s timeout + 3 s for the other ranks' reports; 20 s of slack for a loaded machine (gloo's default: 30 min)
    assert waited < TIMEOUT_S + 20, f"rank 0 failed {waited:.1f} s after rank 1 stopped"
    assert "rank 0: a collective failed at step" in text and "over dp_shard" in text, text[-3000:]
    assert "(stopped, dead or elsewhere): [1]" in text, text[-3000:]
    assert f"timeout {TIMEOUT_S} s (fault.timeout)" in text, text[-3000:]
    assert "flight recorder" in text, text[-3000:]
    print(f"rank 0 reported {waited:.1f} s after rank 1 was stopped (timeout {TIMEOUT_S} s)")
