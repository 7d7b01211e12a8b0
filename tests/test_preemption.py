"""Runs that survive signals and dead ranks: ``meshpar train`` on 2 gloo ranks, interrupted,
resumed, and compared with an uninterrupted run.

- A stop signal (``fault.signals``) to one rank, to the launcher, or to every process of the
  run: every rank finishes its step, one checkpoint is saved, the run exits with 75 and says where; the next launch
  resumes, and metrics.jsonl of the combined run equals the clean run's bit for bit.
- ``--max-restarts``: a rank SIGKILLed mid-run is named by the launcher, every rank is
  restarted from the newest checkpoint, and metrics.jsonl again equals the clean run's; one that
  crashes (SIGSEGV) with none left is named with its signal after its Python stacks.

Every value compared is computed by the same arithmetic in the same order (same layout,
same world size, state restored exactly), so equality is exact; timings are left out.
Linux only: ranks are found through /proc (by the process name the launcher gives them).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import ROOT
from tests.processes import STEPS, finish_run, metrics_records, rank_pid, start_run, wait_for_step

pytestmark = pytest.mark.skipif(not Path("/proc/self/comm").exists(), reason="finds ranks through /proc")


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> list[dict]:
    """metrics.jsonl of an uninterrupted run."""
    out = tmp_path_factory.mktemp("clean")
    code, output = finish_run(start_run(out))
    assert code == 0, output[-3000:]
    records = metrics_records(out)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)), records
    return records


def _stop(out: Path, at_step: int, send, name: str) -> tuple[str, int, float]:
    """Start (or resume) the run in ``out``, ``send(proc)`` a stop signal once it is past ``at_step``:
    its output, the step it stopped after (checkpointed, the last in metrics.jsonl), the seconds
    from signal to exit."""
    proc = start_run(out)
    wait_for_step(proc, out, at_step)
    sent = time.monotonic()
    send(proc)
    code, output = finish_run(proc)
    seconds = time.monotonic() - sent
    assert code == 75, output[-3000:]
    line = next((ln for ln in output.splitlines() if f"stopped by {name} after step" in ln), None)
    assert line is not None, output[-3000:]
    step = int(line.split("after step ")[1].split(":")[0])
    assert (out / "checkpoints" / f"step_{step}" / "meshpar.json").is_file(), line
    assert max(r["step"] for r in metrics_records(out)) == step
    return output, step, seconds


@pytest.mark.timeout(300)
def test_stop_signal_saves_exits_75_and_resumes_bit_for_bit(clean, tmp_path):
    out = tmp_path / "run"
    # 1. SIGTERM to rank 1 only: both ranks stop after the same step
    _, first, s1 = _stop(out, 6, lambda proc: os.kill(rank_pid(proc.pid, 1), signal.SIGTERM), "SIGTERM")
    # 2. SIGUSR1 (SLURM's warning) to the launcher, which hands it to every rank
    output, second, s2 = _stop(out, first + 5, lambda proc: os.kill(proc.pid, signal.SIGUSR1), "SIGUSR1")
    assert f"resumed from {out / 'checkpoints' / f'step_{first}'}" in output, output[-3000:]
    # 3. SIGTERM to every process of the run, as SLURM and Kubernetes send it: the ranks' forkserver
    # must outlive it, or the ranks die with it (meshpar/runtime/launch.py)
    _, _, s3 = _stop(out, second + 5, lambda proc: os.killpg(proc.pid, signal.SIGTERM), "SIGTERM")
    # 4. to the end
    code, output = finish_run(start_run(out))
    assert code == 0, output[-3000:]
    assert metrics_records(out) == clean, "metrics.jsonl of the interrupted run differs from the clean run's"
    print(f"seconds from signal to exit: {s1:.1f}, {s2:.1f}, {s3:.1f}")


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
    """A rank that crashes (SIGSEGV) with no restarts left: the launcher names it and its signal, and
    the rank printed its threads' Python stacks first (faulthandler: the run starts without
    PYTHONFAULTHANDLER; under ``meshpar train`` torch's elastic agent enables it in every rank it
    starts), meshpar's frames among them."""
    out = tmp_path / "run"
    proc = start_run(out, faulthandler=False)
    wait_for_step(proc, out, 3)
    victim = rank_pid(proc.pid, 1)
    os.kill(victim, signal.SIGSEGV)
    code, output = finish_run(proc)
    assert code == 1, output[-3000:]
    assert f"rank 1 (pid {victim}) failed: signal SIGSEGV; no restarts left" in output, output[-3000:]
    dump = output[output.index("Fatal Python error: Segmentation fault"):]
    assert 'File "' in dump and "meshpar/" in dump, dump[:3000]


@pytest.mark.timeout(120)
def test_a_rank_entry_point_enables_faulthandler():
    """Under torchrun (SLURM, multi-node) each rank is ``python -m meshpar.train``, which no agent
    prepares: its ``run`` enables faulthandler itself, so a crash there prints the Python stacks too.
    Here a plain interpreter runs it (on a recipe that does not exist: it returns 2 at once), then
    crashes."""
    code = ("import os, signal, sys; from meshpar.train import run; "
            "assert run(['no/such/recipe.toml']) == 2; os.kill(os.getpid(), signal.SIGSEGV)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONFAULTHANDLER"}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=100)
    assert done.returncode == -signal.SIGSEGV, done.stderr[-3000:]
    assert "Fatal Python error: Segmentation fault" in done.stderr and "<string>" in done.stderr, done.stderr[-3000:]
