"""A run that survives its cluster: stop signals, the ranks' agreement on the last step, and
readable failures of collectives.

    signals = StopSignals(recipe.fault.signals)        # before the first step
    ...
    if signals.agree(step, every):                      # every rank, after each step
        save a checkpoint; exit with EXIT_PREEMPTED
    ...
    except Exception as e: report_collective_failure(e, step, timeout)  # names op, dim, absent ranks

[Note: stopping on a signal]
A scheduler that preempts a job sends SIGTERM (SLURM: SIGUSR1 ``--signal`` seconds before the
time limit) and kills it after a grace period. A signal lands on each rank at a different point
of its step, or on one rank only, so a rank must not stop on its own: its peers would wait for it
in their next collective. The handler only records the signal; after a step every rank adds its
flag to one all-reduce (MAX of one int64 on the CPU group: no device sync; ``fault.agree_every``
spreads its cost), and when any rank has a signal every rank stops after that same step, saves a
checkpoint synchronously and exits with ``EXIT_PREEMPTED``. The same signal again within
``REPEAT_AFTER_S`` is a duplicate (SLURM and the torchrun agent both deliver it) and is ignored;
later, it restores the default action and re-sends it: a user who means "now" gets it. Once the
stop checkpoint is committed, further signals are ignored, so that the agent's SIGTERM after the
first rank exits cannot hide the clean stop.
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence

import torch.distributed as dist

from meshpar.config.keys import PREEMPTION_SIGNALS
from meshpar.distributed import comm, comm_record

EXIT_PREEMPTED = 75  # sysexits' EX_TEMPFAIL: stopped (a signal, a lost quorum) after saving a checkpoint; run again
REPEAT_AFTER_S = 5.0  # a repeated signal this much later means "now"; sooner, it is the same one twice
DEFAULT_TIMEOUT = {"gloo": 300.0, "nccl": 600.0}  # seconds a collective waits when fault.timeout = 0


def collective_timeout(seconds: float, device_type: str) -> datetime.timedelta:
    """``fault.timeout`` as the process group's timeout; 0 picks the backend's default."""
    return datetime.timedelta(seconds=seconds or DEFAULT_TIMEOUT["nccl" if device_type == "cuda" else "gloo"])


class StopSignals:
    """Records the first of ``names`` this process receives; see [Note: stopping on a signal]."""

    def __init__(self, names: Sequence[str]):
        self.received: str | None = None  # the first stop signal this rank got
        self.stopped_by: str | None = None  # the one every rank agreed to stop on
        self._first = 0.0  # when it came (time.monotonic)
        self._previous: dict[signal.Signals, object] = {}
        if threading.current_thread() is not threading.main_thread():
            return  # Python delivers signals to the main thread only (tests may train on another)
        for name in names:
            sig = signal.Signals[name]
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, _frame) -> None:
        name = signal.Signals(signum).name
        now = time.monotonic()
        if self.received == name and now - self._first > REPEAT_AFTER_S:  # a second one: the default action
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        if self.received is None:
            self.received, self._first = name, now

    def agree(self) -> str | None:
        """Every rank: the signal any rank received (the same answer on all), or None. Collective."""
        code = comm.world_max(PREEMPTION_SIGNALS.index(self.received) + 1 if self.received else 0)
        self.stopped_by = PREEMPTION_SIGNALS[code - 1] if code else None
        return self.stopped_by

    def saved(self) -> None:
        """The stop checkpoint is committed and the process exits next: further signals (the agent
        forwarding its own, once a peer has exited) are ignored, so every rank exits with
        ``EXIT_PREEMPTED`` rather than dying on the second one."""
        for sig in self._previous:
            signal.signal(sig, signal.SIG_IGN)

    def close(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()


# --- failures of collectives ------------------------------------------------------------------------
def is_collective_failure(e: BaseException) -> bool:
    """A timeout or a broken connection in a collective (gloo's and NCCL's wording), not a bug."""
    text = str(e)
    return isinstance(e, (dist.DistBackendError, dist.DistError)) or (isinstance(e, RuntimeError) and any(
        s in text for s in ("Timed out", "timed out", "Connection reset", "Connection closed", "Broken pipe",
                            "NCCL", "gloo")))


def _format_entry(e: comm_record.FlightEntry, now: float) -> str:
    state = "done" if e.done else f"NOT DONE after {now - e.issued:.1f} s"
    step = "-" if e.step is None else str(e.step)
    return f"  #{e.seq:<6} step {step:>6}  {e.op}[{e.dim}]  {e.nbytes / 2**20:,.3f} MiB  {state}"


def absent_ranks(rank: int, world: int, wait_s: float = 3.0) -> list[int] | None:
    """The ranks that did not also report a failed collective within ``wait_s`` seconds (each
    failing rank writes a key in the rendezvous store): stopped, dead, or still computing.
    None when the store cannot be reached (its host rank is the one stopped)."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port or world == 1:
        return None
    try:
        store = dist.TCPStore(addr, int(port), is_master=False, timeout=datetime.timedelta(seconds=wait_s),
                              wait_for_workers=False)
        prefix = f"meshpar/failed/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
        store.set(f"{prefix}{rank}", str(time.time()))
        deadline = time.monotonic() + wait_s
        while True:
            present = [r for r in range(world) if store.check([f"{prefix}{r}"])]
            if len(present) == world or time.monotonic() > deadline:
                return [r for r in range(world) if r not in present]
            time.sleep(0.2)
    except Exception:  # noqa: BLE001 - the store's host is gone or stopped: say so, do not fail again
        return None


def report_collective_failure(e: BaseException, *, rank: int, world: int, step: int | None,
                              timeout: datetime.timedelta, record: comm_record.CommRecord | None = None) -> str:
    """The lines a rank prints when a collective failed: what, where, who did not come. ``record``: the
    run's comm record, whose flight recorder is printed (else the active one's)."""
    now = time.time()
    entries = comm_record.flight_record(record)
    stuck = next((x for x in entries if not x.done), None)
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    where = f"step {step}" if step is not None else "before the first step"
    if stuck is not None:
        what = f"in {stuck.op} over {stuck.dim} (#{stuck.seq}, {stuck.nbytes / 2**20:,.3f} MiB, issued " \
               f"{now - stuck.issued:.1f} s ago)"
    elif entries:
        last = entries[-1]
        what = f"in a collective not issued through meshpar.distributed.comm (pipeline send/recv, DTensor, DCP) " \
               f"after {last.op} over {last.dim} (#{last.seq})"
    else:
        what = "in a collective not issued through meshpar.distributed.comm"
    absent = absent_ranks(rank, world)
    who = ("ranks that did not report the failure within 3 s (stopped, dead or elsewhere): "
           f"{absent or 'none'}" if absent is not None else "the rendezvous store is unreachable (its host may be "
           "the rank that stopped)")
    lines = [f"meshpar: rank {rank}: a collective failed at {where} {what}; timeout {timeout.total_seconds():g} s "
             f"(fault.timeout). {who}.", f"meshpar: rank {rank}: {type(e).__name__}: {first}",
             f"meshpar: rank {rank}: last {len(entries)} collectives (flight recorder, oldest first):"]
    lines += [_format_entry(x, now) for x in entries]
    text = "\n".join(lines)
    print(text, file=sys.stderr, flush=True)
    return text
