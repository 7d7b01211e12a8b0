"""Start N local ranks through torch's elastic launcher, so ``meshpar train`` needs no torchrun.

Each rank runs ``entrypoint(argv)`` (``"meshpar.train:run"``) with torchrun's environment;
rendezvous is a c10d store on a free localhost port, as ``torchrun --standalone`` does.

The ranks fork from a forkserver (meshpar/runtime/forkserver.py [Note: ranks fork from a
forkserver]); each gets back what a fresh ``python -u -m meshpar.train`` had: the stop signals, a
line-buffered stdout, ``OMP_NUM_THREADS`` applied, and a name, ``meshpar rank R``, for ``ps`` and
``pgrep -x`` (its command line is the forkserver's).

Failures are torchelastic's to handle, as under ``torchrun --max-restarts N``: when a rank
exits non-zero or dies on a signal, every rank is stopped and, while restarts are left,
started again; each new attempt resumes from the newest complete checkpoint (meshpar/train.py),
so nothing trained before that checkpoint is lost or repeated in metrics.jsonl. Each failure
is named in one line (rank, exit code or signal, restarts left); with none left the launch
fails with the failed ranks' exit code.

A stop signal sent to this process (``fault.signals``: SIGTERM, SIGUSR1 ...) is handed by the
agent to every rank, which then finish their step, save and exit with 75
(meshpar/runtime/fault.py [Note: stopping on a signal]); they get ``SHUTDOWN_GRACE_S`` to do so.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import sys
import traceback
import uuid
from collections.abc import Sequence
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from meshpar.runtime.fault import EXIT_PREEMPTED
from meshpar.runtime.forkserver import SHIELDED, resolve, start_forkserver

SHUTDOWN_GRACE_S = 120  # seconds ranks get to save after the agent forwards a stop signal, before SIGKILL
_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)")


def describe_exit(code: int) -> str:
    """``-9`` -> ``signal SIGKILL``; ``75`` -> ``exit code 75 (stopped, checkpoint saved)``."""
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}" + (" (stopped, checkpoint saved)" if code == EXIT_PREEMPTED else "")


class _FailureLines(logging.Handler):
    """Turns torchelastic's per-worker failure log record into one meshpar line, with the
    restarts left (the agent restarts after each failed round while any are left)."""

    def __init__(self, nproc: int, max_restarts: int):
        super().__init__(logging.WARNING)
        self.nproc, self.max_restarts, self.rounds = nproc, max_restarts, 0
        self._pids: set[str] = set()

    def emit(self, record: logging.LogRecord) -> None:
        m = _FAILED.search(record.getMessage())
        if m is None:  # anything else the launcher's processes layer has to say, one plain line
            print(f"meshpar: torchelastic: {record.getMessage()}", file=sys.stderr, flush=True)
            return
        if m.group(3) in self._pids:
            return
        self._pids.add(m.group(3))
        code, rank = int(m.group(1)), int(m.group(2))
        self.rounds += 1
        left = self.max_restarts - self.rounds + 1
        what = "stopped, checkpoint saved" if code == EXIT_PREEMPTED else f"failed: {describe_exit(code)}"
        then = (f"restarting all {self.nproc} ranks from the newest checkpoint ({left - 1} restart"
                f"{'' if left - 1 == 1 else 's'} left after this one)" if left > 0 else "no restarts left")
        print(f"meshpar: rank {rank} (pid {m.group(3)}) {what}; {then}", file=sys.stderr, flush=True)


def _rank(entrypoint: str, argv: list[str]) -> None:
    """One forked rank: made like a fresh interpreter's ([Note: ranks fork from a forkserver]),
    then ``entrypoint(argv)`` (``"package.module:function"``), whose return value is the exit code."""
    for sig in SHIELDED:  # as exec leaves them (a background shell job ignores SIGINT and SIGQUIT)
        signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SHIELDED)
    name = f"meshpar rank {os.environ.get('RANK', '?')}"[:15]  # the kernel keeps 15 bytes
    with contextlib.suppress(OSError):  # not Linux
        Path("/proc/self/comm").write_text(name)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True)
    if "OMP_NUM_THREADS" in os.environ:
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    try:
        code = resolve(entrypoint)(argv)
    except KeyboardInterrupt:  # die of SIGINT, as an interpreter does (torch.multiprocessing would exit 0)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        raise
    except Exception:  # torch.multiprocessing would write it to a file only: print it, as Python does
        traceback.print_exc()
        code = 1
    logging.shutdown()
    if code:
        sys.exit(code)  # the process's exit code, which torchelastic reports; 0 returns normally


def launch_local(nproc: int, entrypoint: str, argv: list[str], *, max_restarts: int = 0,
                 signals: Sequence[str] = ("SIGTERM",)) -> int:
    """Run ``entrypoint(argv)`` (``"package.module:function"``, returning an exit code) on ``nproc``
    local ranks; returns the launch's exit code."""
    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
    failures = _FailureLines(nproc, max_restarts)
    watched = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    watched.addHandler(failures)
    watched.propagate = False  # its records are printed as meshpar lines above, not twice
    # the agent forwards these to the ranks (its own default: SIGTERM, SIGINT, SIGHUP, SIGQUIT;
    # torchrun's --signals-to-handle)
    handled = ",".join(dict.fromkeys(["SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", *signals]))
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"meshpar-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=max_restarts, monitor_interval=0.2,
        start_method="forkserver", shutdown_timeout=SHUTDOWN_GRACE_S, signals_to_handle=handled)
    start_forkserver(entrypoint)
    try:
        elastic_launch(config, entrypoint=_rank)(entrypoint, argv)
    except SignalException as e:
        print(f"meshpar: {signal.Signals(e.sigval).name} received: the ranks were asked to finish their step, "
              f"save and stop (their last lines say where)", file=sys.stderr, flush=True)
        return EXIT_PREEMPTED
    except ChildFailedError as e:
        codes = sorted({f.exitcode for f in e.failures.values()})
        ranks = ", ".join(str(r) for r in sorted(e.failures))
        if EXIT_PREEMPTED in codes:  # a rank exits 75 only after the stop checkpoint is committed
            print(f"meshpar: stopped after saving a checkpoint (exit code {EXIT_PREEMPTED}); run the "
                  f"same command to resume", file=sys.stderr)
            return EXIT_PREEMPTED
        print(f"meshpar: rank(s) {ranks} of {nproc} failed ({', '.join(describe_exit(c) for c in codes)}); "
              f"see their output above", file=sys.stderr)
        return 2 if codes == [2] else 1
    finally:
        watched.removeHandler(failures)
        watched.propagate = True
    return 0
