"""Profiler ranges that cost one check when no profiler records, and marks for a listener.

    with trace_range("meshpar::fsdp.copy_in"):   # a range in torch.profiler traces, else nothing
        ...
    mark("clip dp_shard,tp")                     # tells the listeners (the planner's tracker), if any

``torch.autograd.profiler.record_function`` enters and exits through two dispatcher ops whether or
not a profiler is on: about 20 us a range on the CPU dev machine, and FSDP opens several per unit
and step (docs/performance.md#host-overhead). ``trace_range`` opens one only while a profiler
records; a profile started inside a range sees the ranges opened after it started.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar

from torch.autograd.profiler import record_function

from meshpar.distributed._torch import profiler_enabled

_NOTHING = contextlib.nullcontext()  # reusable and reentrant


def trace_range(name: str) -> contextlib.AbstractContextManager:
    """``record_function(name)`` while a profiler records, else a no-op context."""
    return record_function(name) if profiler_enabled() else _NOTHING


# the listeners of this thread's open ``listen`` blocks, innermost last (a tuple: each block sets its own)
_LISTENERS: ContextVar[tuple[Callable[[str], None], ...]] = ContextVar("meshpar_mark_listeners", default=())


def mark(name: str) -> None:
    """Tell the listeners that the work named ``name`` starts: the planner's memory tracker labels
    its stretches by these (meshpar/planner/tracker.py). One lookup without listeners."""
    for listener in _LISTENERS.get():
        listener(name)


@contextlib.contextmanager
def listen(listener: Callable[[str], None]) -> Iterator[None]:
    """``listener(name)`` on every ``mark(name)`` in this block, on this thread."""
    token = _LISTENERS.set((*_LISTENERS.get(), listener))
    try:
        yield
    finally:
        _LISTENERS.reset(token)
