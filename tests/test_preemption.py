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

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import ROOT, SMALL

pytestmark = pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds ranks through /proc")

STEPS = 30
TIMED = ("tokens_per_s", "mfu", "mem_gb")  # wall-clock figures: not comparable between runs


def _command(out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "meshpar.cli", "train", str(ROOT / "recipes" / "llama_debug_fsdp.toml"), *SMALL,
            f"--train.steps={STEPS}", f"--train.output_dir={out}", *extra]


def _start(out: Path, *extra: str) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    env.pop("WORLD_SIZE", None)
    return subprocess.Popen(_command(out, *extra), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (the ranks may be in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[int, str]:
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for pid in _descendants(proc.pid):  # PYTHONFAULTHANDLER: each prints where it is stuck
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGABRT)
        time.sleep(2)
        for pid in [proc.pid, *_descendants(proc.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        output, _ = proc.communicate(timeout=30)
        pytest.fail(f"the run did not end within {timeout} s:\n{output[-6000:]}")
    return proc.returncode, output


def _records(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    return [{k: v for k, v in json.loads(line).items() if k not in TIMED} for line in lines]


def _wait_for_step(proc: subprocess.Popen, out: Path, step: int, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the run ended (exit {proc.returncode}) before step {step}:\n{proc.stdout.read()[-3000:]}")
        try:
            if any(r.get("step", 0) >= step for r in _records(out)):
                return
        except json.JSONDecodeError:  # a line being written
            pass
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    pytest.fail(f"no step {step} within {timeout} s")


def _rank_pid(launcher: int, rank: int) -> int:
    """The pid of training rank ``rank`` started by ``launcher`` (a direct child, RANK in its environment)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            env = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == launcher and f"RANK={rank}".encode() in env:
            return int(entry.name)
    raise AssertionError(f"no rank {rank} under pid {launcher}")


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> list[dict]:
    """metrics.jsonl of an uninterrupted run."""
    out = tmp_path_factory.mktemp("clean")
    code, output = _finish(_start(out))
    assert code == 0, output[-3000:]
    records = _records(out)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)), records
    return records


@pytest.mark.timeout(300)
def test_stop_signal_saves_exits_75_and_resumes_bit_for_bit(clean, tmp_path):
    out = tmp_path / "run"
    stops = []
    # 1. SIGTERM to rank 1 only: both ranks stop after the same step
    proc = _start(out)
    _wait_for_step(proc, out, 6)
    sent = time.monotonic()
    os.kill(_rank_pid(proc.pid, 1), signal.SIGTERM)
    code, output = _finish(proc)
    stops.append(time.monotonic() - sent)
    assert code == 75, output[-3000:]
    line = next((ln for ln in output.splitlines() if "stopped by SIGTERM after step" in ln), None)
    assert line is not None, output[-3000:]
    first = int(line.split("after step ")[1].split(":")[0])
    assert (out / "checkpoints" / f"step_{first}" / "meshpar.json").is_file(), line
    assert max(r["step"] for r in _records(out)) == first
    # 2. SIGUSR1 (SLURM's warning) to the launcher, which hands it to every rank
    proc = _start(out)
    _wait_for_step(proc, out, first + 5)
    sent = time.monotonic()
    os.kill(proc.pid, signal.SIGUSR1)
    code, output = _finish(proc)
    stops.append(time.monotonic() - sent)
    assert code == 75, output[-3000:]
    assert "stopped by SIGUSR1 after step" in output, output[-3000:]
    assert f"resumed from {out / 'checkpoints' / f'step_{first}'}" in output, output[-3000:]
    # 3. to the end
    code, output = _finish(_start(out))
    assert code == 0, output[-3000:]
    assert _records(out) == clean, "metrics.jsonl of the interrupted run differs from the clean run's"
    print(f"seconds from signal to exit: {', '.join(f'{s:.1f}' for s in stops)}")


@pytest.mark.timeout(300)
def test_killed_rank_restarts_from_the_newest_checkpoint(clean, tmp_path):
    out = tmp_path / "run"
    proc = _start(out, "--max-restarts", "2", "--checkpoint.every=5")
    _wait_for_step(proc, out, 8)
    victim = _rank_pid(proc.pid, 1)
    os.kill(victim, signal.SIGKILL)
    code, output = _finish(proc)
    assert code == 0, output[-3000:]
    assert f"rank 1 (pid {victim}) failed: signal SIGKILL; restarting all 2 ranks from the newest checkpoint " \
           f"(1 restart left after this one)" in output, output[-3000:]
    assert "resumed from" in output, output[-3000:]
    assert _records(out) == clean, "metrics.jsonl after a restart differs from the clean run's"


@pytest.mark.timeout(120)
def test_no_restarts_left_fails_naming_the_rank(tmp_path):
    out = tmp_path / "run"
    proc = _start(out)
    _wait_for_step(proc, out, 3)
    victim = _rank_pid(proc.pid, 1)
    os.kill(victim, signal.SIGKILL)
    code, output = _finish(proc)
    assert code == 1, output[-3000:]
    assert f"rank 1 (pid {victim}) failed: signal SIGKILL; no restarts left" in output, output[-3000:]
