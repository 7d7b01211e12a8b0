"""What the collectives leave behind: counts per mesh dim, the flight recorder, buffer tags, and
the switch that forces one-rank collectives through the backend.

meshpar/distributed/comm.py issues every collective and reports each one here (``record_collective``). This
module issues none and imports nothing of meshpar, so the training loop, the fault report, the
memory tracker and FSDP read and set it without reaching for the collectives::

    with meshpar.distributed.comm_record.count() as c:
        train_step()
    c.calls[("all_gather", "dp_shard")], c.bytes[("reduce_scatter", "dp_shard")]

Bytes are the ring volumes of [Note: bytes counted] (meshpar/distributed/comm.py).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass, field

# [Note: communication buffers are tagged here, counted elsewhere]
# Storages allocated inside ``comm_buffers()`` are collective buffers, and inside
# ``gradient_buffers()`` gradients FSDP holds itself (summed without sync, in reduce_dtype).
# Only a thread-local tag lives here, so FSDP can mark its buffers without importing the memory
# tracker that reads the mark (meshpar/profiling/memory.py, through ``buffer_tag()``).
_scope = threading.local()


@contextlib.contextmanager
def _tagged(tag: str) -> Iterator[None]:
    before = getattr(_scope, "tag", None)
    _scope.tag = tag
    try:
        yield
    finally:
        _scope.tag = before


def comm_buffers() -> contextlib.AbstractContextManager:
    """Storages allocated in this block (on this thread) are communication buffers."""
    return _tagged("communication")


def gradient_buffers() -> contextlib.AbstractContextManager:
    """Storages allocated in this block (on this thread) are gradients."""
    return _tagged("gradient")


def buffer_tag() -> str | None:
    """``"communication"``, ``"gradient"`` or None: the innermost block this thread is in."""
    return getattr(_scope, "tag", None)


# [Note: forcing the collectives of one rank]
# Over one rank a collective is a copy (or nothing), and FSDP on a one-rank mesh skips even that
# ([Note: one data-parallel rank]). That is right for training and blind for testing: the
# collective path, its buffers and, on CUDA, its streams ([Note: CUDA streams in FSDP]) then never
# run on a one-GPU machine. ``force_collectives()`` (or MESHPAR_FORCE_COLLECTIVES=1 in a process's
# environment, for spawned ranks) makes every collective of meshpar/distributed/comm.py run through the backend
# even over one rank, and FSDP units built or lazily initialized inside it take the collective path.
# A test-only switch: it changes no result, only which code computes it. The environment is read
# when asked, not at import (tests/distributed.py forks ranks from a server that imported meshpar).
_forced: bool | None = None  # None: as the environment says


@contextlib.contextmanager
def force_collectives(enabled: bool = True) -> Iterator[None]:
    """Run one-rank collectives through the backend in this block; see [Note: forcing the
    collectives of one rank]."""
    global _forced
    before, _forced = _forced, enabled
    try:
        yield
    finally:
        _forced = before


def forced() -> bool:
    """Whether one-rank collectives run through the backend (``force_collectives``)."""
    if _forced is None:
        return os.environ.get("MESHPAR_FORCE_COLLECTIVES", "") == "1"
    return _forced


# [Note: the native reduce-scatter layout]
# A reduce-scatter's input is laid out for the backend that runs it (``comm.ReduceScatterInput``):
# one [n, per_rank] buffer for a native reduce-scatter (NCCL), the n - 1 other rows beside the
# output on gloo or CPU tensors ([Note: reduce-scatter on gloo]). ``native_reduce_scatter()`` picks
# the native layout whatever the backend: ``meshpar plan`` simulates an NCCL step on CPU fake tensors.
_native_layout = False


@contextlib.contextmanager
def native_reduce_scatter(enabled: bool = True) -> Iterator[None]:
    """Reduce-scatter inputs created in this block take the native (NCCL) layout; see [Note: the
    native reduce-scatter layout]."""
    global _native_layout
    before, _native_layout = _native_layout, enabled
    try:
        yield
    finally:
        _native_layout = before


def native_layout() -> bool:
    """Whether reduce-scatter inputs take the native layout on any backend (``native_reduce_scatter``)."""
    return _native_layout


@dataclass(eq=False)  # compared by identity: nested count() blocks must each remove their own
class CommCounter:
    """Calls and bytes per (collective, mesh dim), for one ``count()`` block."""

    calls: Counter = field(default_factory=Counter)
    bytes: Counter = field(default_factory=Counter)

    def record(self, op: str, dim: str, nbytes: float) -> None:
        self.calls[(op, dim)] += 1
        self.bytes[(op, dim)] += nbytes

    def total_bytes(self, op: str | None = None) -> float:
        return sum(b for (o, _), b in self.bytes.items() if op is None or o == op)

    def total_calls(self, op: str | None = None) -> int:
        return sum(n for (o, _), n in self.calls.items() if op is None or o == op)


_active: list[CommCounter] = []


@contextlib.contextmanager
def count() -> Iterator[CommCounter]:
    """Record every meshpar collective issued in this block (on this rank)."""
    counter = CommCounter()
    _active.append(counter)
    try:
        yield counter
    finally:
        _active.remove(counter)


# [Note: the flight recorder]
# Each rank keeps its last few collectives (``fault.flight_recorder`` of them), in the spirit of
# NCCL's flight recorder: sequence number, op, mesh dim, bytes, the training step, when it was
# issued and whether it has completed (``comm.Work.wait`` returned, or the call was synchronous).
# When a collective fails or times out, meshpar/runtime/fault.py prints them: the first one not
# completed is the one the rank was stuck in, and the ranks' records side by side show which
# rank fell behind. Appending costs a deque push per collective (tens of collectives a step).
@dataclass
class FlightEntry:
    seq: int
    op: str
    dim: str
    nbytes: float
    step: int | None
    issued: float  # time.time()
    done: bool = False


_flight: deque[FlightEntry] = deque(maxlen=32)
_flight_state = {"seq": 0, "step": None}


def set_flight_recorder(size: int) -> None:
    """Keep the last ``size`` collectives (default 32)."""
    global _flight
    _flight = deque(_flight, maxlen=size)


def set_step(step: int | None) -> None:
    """The training step that collectives issued from now on belong to (for the flight record)."""
    _flight_state["step"] = step


def current_step() -> int | None:
    return _flight_state["step"]


def flight_record() -> list[FlightEntry]:
    """This rank's last collectives, oldest first."""
    return list(_flight)


def record_collective(op: str, dim: str, nbytes: float) -> FlightEntry:
    """Count one collective in every open ``count()`` block and append it to the flight record;
    meshpar/distributed/comm.py calls this as it issues each one."""
    for counter in _active:
        counter.record(op, dim, nbytes)
    _flight_state["seq"] += 1
    entry = FlightEntry(_flight_state["seq"], op, dim, nbytes, _flight_state["step"], time.time())
    _flight.append(entry)
    return entry
