"""What the collectives of a run leave behind, and the switches they obey: one ``CommRecord``.

A record holds counts per mesh dim (``count()`` blocks), the flight recorder, the training step,
whether one-rank collectives are forced through the backend, and whether reduce-scatter inputs take
NCCL's layout. Whoever needs one owns one and activates it for its duration: the run
(meshpar/train.py), the planner's simulation (meshpar/planner/simulate.py, with NCCL's layout as an
argument). meshpar/distributed/comm.py reports every collective to the record passed to it
(``record=``), else to the active one, else to none; so two runs in two threads, or a simulation
inside a run, never see each other's counts, steps or switches. This module issues no collective::

    with CommRecord().active() as record:      # or comm_record.count(): on the active record,
        with record.count() as c:              # a fresh one for the block if none is active
            train_step()
    c.calls[("all_gather", "dp_shard")], c.bytes[("reduce_scatter", "dp_shard")]

Bytes are the ring volumes of [Note: bytes counted] (meshpar/distributed/comm.py).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import Counter, deque
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field

from meshpar.distributed._torch import backward_launch_context

# [Note: the active record]
# ``CommRecord.active()`` sets a context variable, which the thread (or task) that set it sees and no
# other: a record is the state of whoever activated it. One exception matters: on CUDA, autograd runs
# backward on a thread of its own per device, where the caller's context variables are unset. There
# ``active()`` reads the copy of the caller's context that autograd keeps for the backward it launched
# (``_torch.backward_launch_context``), so a collective in an autograd function's backward (expert or
# context parallelism) reports to the caller's record. FSDP does not rely on that: each root's
# forward captures the active record and its units pass it to every collective of that iteration,
# forward and backward (meshpar/fsdp/state.py).
_ACTIVE: ContextVar[CommRecord | None] = ContextVar("meshpar_comm_record", default=None)

# [Note: communication buffers are tagged here, counted elsewhere]
# Storages allocated inside ``comm_buffers()`` are collective buffers, and inside
# ``gradient_buffers()`` gradients FSDP holds itself (summed without sync, in reduce_dtype).
# Only a context variable lives here, so FSDP can mark its buffers without importing the memory
# tracker that reads the mark (meshpar/profiling/memory.py, through ``buffer_tag()``); the block
# and the allocations it tags run on one thread.
_BUFFER_TAG: ContextVar[str | None] = ContextVar("meshpar_buffer_tag", default=None)


@contextlib.contextmanager
def _tagged(tag: str) -> Iterator[None]:
    token = _BUFFER_TAG.set(tag)
    try:
        yield
    finally:
        _BUFFER_TAG.reset(token)


def comm_buffers() -> contextlib.AbstractContextManager:
    """Storages allocated in this block (on this thread) are communication buffers."""
    return _tagged("communication")


def gradient_buffers() -> contextlib.AbstractContextManager:
    """Storages allocated in this block (on this thread) are gradients."""
    return _tagged("gradient")


def buffer_tag() -> str | None:
    """``"communication"``, ``"gradient"`` or None: the innermost block this thread is in."""
    return _BUFFER_TAG.get()


# [Note: forcing the collectives of one rank]
# Over one rank a collective is a copy (or nothing), and FSDP on a one-rank mesh skips even that
# ([Note: one data-parallel rank]). That is right for training and blind for testing: the
# collective path, its buffers and, on CUDA, its streams ([Note: CUDA streams in FSDP]) then never
# run on a one-GPU machine. A record made with ``forced=True`` (or ``force_collectives()`` on the
# active record, or MESHPAR_FORCE_COLLECTIVES=1 in a process's environment, for spawned ranks) makes
# every collective of meshpar/distributed/comm.py reported to it run through the backend even over one
# rank, and FSDP units built or lazily initialized while it is active take the collective path. A
# test-only switch: it changes no result, only which code computes it. The environment is read when
# asked, not at import (tests/distributed.py forks ranks from a server that imported meshpar).

# [Note: the native reduce-scatter layout]
# A reduce-scatter's input is laid out for the backend that runs it (``comm.ReduceScatterInput``):
# one [n, per_rank] buffer for a native reduce-scatter (NCCL), the n - 1 other rows beside the
# output on gloo or CPU tensors ([Note: reduce-scatter on gloo]). A record made with
# ``native_layout=True`` picks the native layout whatever the backend: ``meshpar plan`` simulates an
# NCCL step on CPU fake tensors.


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


class CommRecord:
    """The collectives of one run or one simulation: open ``count()`` blocks, the flight recorder
    and the step its entries belong to, and the two switches ``comm`` obeys."""

    def __init__(self, *, forced: bool | None = None, native_layout: bool = False, flight_size: int = 32) -> None:
        self.forced = forced  # [Note: forcing the collectives of one rank]; None: as the environment says
        self.native_layout = native_layout  # [Note: the native reduce-scatter layout]
        self.counters: list[CommCounter] = []  # one per open count() block, nested ones included
        self.flight: deque[FlightEntry] = deque(maxlen=flight_size)  # [Note: the flight recorder]
        self.seq = 0  # collectives recorded so far
        self.step: int | None = None  # the training step that collectives issued from now on belong to

    @contextlib.contextmanager
    def active(self) -> Iterator[CommRecord]:
        """This record is the one collectives report to in this block, on this thread ([Note: the
        active record])."""
        token = _ACTIVE.set(self)
        try:
            yield self
        finally:
            _ACTIVE.reset(token)

    @contextlib.contextmanager
    def count(self) -> Iterator[CommCounter]:
        """Count every collective reported to this record in this block."""
        counter = CommCounter()
        self.counters.append(counter)
        try:
            yield counter
        finally:
            self.counters.remove(counter)

    def forces_collectives(self) -> bool:
        """Whether one-rank collectives run through the backend: [Note: forcing the collectives of one rank]."""
        return _forced_by_environment() if self.forced is None else self.forced

    def record(self, op: str, dim: str, nbytes: float) -> FlightEntry:
        """Count one collective in every open ``count()`` block and append it to the flight record;
        meshpar/distributed/comm.py calls this as it issues each one."""
        for counter in self.counters:
            counter.record(op, dim, nbytes)
        self.seq += 1
        entry = FlightEntry(self.seq, op, dim, nbytes, self.step, time.time())
        self.flight.append(entry)
        return entry


def _forced_by_environment() -> bool:
    return os.environ.get("MESHPAR_FORCE_COLLECTIVES", "") == "1"


def active() -> CommRecord | None:
    """The record collectives report to here: [Note: the active record]; None outside any."""
    record = _ACTIVE.get()
    if record is None:
        launched = backward_launch_context()
        if launched is not None:
            record = launched.get(_ACTIVE)
    return record


def resolve(record: CommRecord | None) -> CommRecord | None:
    """``record``, or the active one when None."""
    return record if record is not None else active()


# --- the active record's, for code that holds none --------------------------------------------------------

@contextlib.contextmanager
def _on_active(**switches: bool) -> Iterator[CommRecord]:
    """The active record with ``switches`` set for this block, or a fresh one with them, active in it."""
    record = active()
    if record is None:
        with CommRecord(**switches).active() as fresh:
            yield fresh
        return
    before = {name: getattr(record, name) for name in switches}
    for name, value in switches.items():
        setattr(record, name, value)
    try:
        yield record
    finally:
        for name, value in before.items():
            setattr(record, name, value)


@contextlib.contextmanager
def count() -> Iterator[CommCounter]:
    """Record every meshpar collective issued in this block (on this rank) in the active record, or in a
    fresh one active for the block."""
    with _on_active() as record, record.count() as counter:
        yield counter


def force_collectives(enabled: bool = True) -> contextlib.AbstractContextManager:
    """Run one-rank collectives through the backend in this block (the active record's switch, or a fresh
    record's); see [Note: forcing the collectives of one rank]."""
    return _on_active(forced=enabled)


def native_reduce_scatter(enabled: bool = True) -> contextlib.AbstractContextManager:
    """Reduce-scatter inputs created in this block take the native (NCCL) layout (the active record's
    switch, or a fresh record's); see [Note: the native reduce-scatter layout]."""
    return _on_active(native_layout=enabled)


def forced(record: CommRecord | None = None) -> bool:
    """Whether one-rank collectives run through the backend under ``record`` (else the active one)."""
    record = resolve(record)
    return _forced_by_environment() if record is None else record.forces_collectives()


def native_layout(record: CommRecord | None = None) -> bool:
    """Whether reduce-scatter inputs take the native layout under ``record`` (else the active one)."""
    record = resolve(record)
    return record is not None and record.native_layout


def record_collective(op: str, dim: str, nbytes: float, record: CommRecord | None = None) -> FlightEntry | None:
    """Report one collective to ``record`` (else the active one); None where there is none."""
    record = resolve(record)
    return None if record is None else record.record(op, dim, nbytes)


def flight_record(record: CommRecord | None = None) -> list[FlightEntry]:
    """The last collectives of ``record`` (else the active one), oldest first."""
    record = resolve(record)
    return [] if record is None else list(record.flight)


def set_step(step: int | None) -> None:
    """The training step that collectives issued from now on belong to, in the active record."""
    record = active()
    if record is None:
        raise RuntimeError("no comm record is active: run inside `with CommRecord().active():` (meshpar/train.py "
                           "activates one for the run)")
    record.step = step


def current_step() -> int | None:
    """The active record's step (None outside any record)."""
    record = active()
    return None if record is None else record.step
