"""Running ``meshpar train`` as a user does, in a subprocess, and reaching into its ranks: start
it, wait for a step, find rank r's pid (through /proc: Linux only), finish it (killing every
descendant on a timeout, with faulthandler stacks first), read metrics.jsonl without timings.
Used by the tests of signals, restarts and hangs (test_preemption.py, test_hung_collective.py).
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

STEPS = 30
TIMED = ("tokens_per_s", "mfu", "mem_gb")  # wall-clock figures: not comparable between runs


def train_command(out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "meshpar.cli", "train", str(ROOT / "recipes" / "llama_debug_fsdp.toml"), *SMALL,
            f"--train.steps={STEPS}", f"--train.output_dir={out}", *extra]


def start_run(out: Path, *extra: str, faulthandler: bool = True) -> subprocess.Popen:
    """``meshpar train`` of the debug recipe into ``out``; ``faulthandler``: every process of it prints
    its stacks on a fatal signal (PYTHONFAULTHANDLER: ``finish_run``'s timeout dumps rely on it), else
    only what meshpar itself sets up."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    if not faulthandler:
        env.pop("PYTHONFAULTHANDLER")
    env.pop("WORLD_SIZE", None)
    return subprocess.Popen(train_command(out, *extra), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def descendants(pid: int) -> list[int]:
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


def finish_run(proc: subprocess.Popen, timeout: float = 120) -> tuple[int, str]:
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for pid in descendants(proc.pid):  # PYTHONFAULTHANDLER: each prints where it is stuck
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGABRT)
        time.sleep(2)
        for pid in [proc.pid, *descendants(proc.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        output, _ = proc.communicate(timeout=30)
        pytest.fail(f"the run did not end within {timeout} s:\n{output[-6000:]}")
    return proc.returncode, output


def metrics_records(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    return [{k: v for k, v in json.loads(line).items() if k not in TIMED} for line in lines]


def wait_for_step(proc: subprocess.Popen, out: Path, step: int, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the run ended (exit {proc.returncode}) before step {step}:\n{proc.stdout.read()[-3000:]}")
        try:
            if any(r.get("step", 0) >= step for r in metrics_records(out)):
                return
        except json.JSONDecodeError:  # a line being written
            pass
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    pytest.fail(f"no step {step} within {timeout} s")


def rank_pid(launcher: int, rank: int) -> int:
    """The pid of training rank ``rank`` started by ``launcher``: the process below it named
    ``meshpar rank R`` (meshpar/runtime/launch.py names each rank so, as soon as it starts)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for pid in descendants(launcher):
            with contextlib.suppress(OSError):
                if Path(f"/proc/{pid}/comm").read_text().strip() == f"meshpar rank {rank}":
                    return pid
        time.sleep(0.1)
    raise AssertionError(f"no process named 'meshpar rank {rank}' under pid {launcher}")
