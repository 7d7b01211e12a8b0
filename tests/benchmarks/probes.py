"""Probes used inside a rank process by the benchmarks: collectives counted two ways, tensor memory.

    with PythonCollectives() as c: step()      # torch.distributed's Python functions
    with DispatchedCollectives() as d: step()  # every collective op the dispatcher runs here
    with PeakMemory(model, optimizer) as m: step()
    m.peak_bytes, persistent_bytes(model, optimizer)

Both counters fill a ``meshpar.distributed.comm_record.CommCounter`` with the bytes meshpar/distributed/comm.py counts
([Note: bytes counted]): all-gather, reduce-scatter and all-to-all move (N-1)/N of the full
buffer, all-reduce twice that; a broadcast counts its whole buffer.

[Note: what each engine calls on gloo]
torch 2.13's ``fully_shard`` (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py) calls
``dist.all_gather_single`` and ``dist.reduce_scatter_single``, looked up on the module at call
time, so ``PythonCollectives`` sees them; ``dist.all_reduce`` only with HSDP or replicated
parameters. They reach the dispatcher as ``c10d::_allgather_base_`` and
``c10d::_reduce_scatter_base_``. meshpar reaches it as ``_allgather_base_`` and, for its gloo
reduce-scatter, ``alltoall_base_``. DDP's reducer calls ``c10d::allreduce_`` from C++, past
every Python function, so only ``DispatchedCollectives`` sees DDP. Functional collectives
(``_c10d_functional::*``, DTensor's redistribute) are counted by ``DispatchedCollectives``.

[Note: peak memory on CPU]
``PeakMemory`` is PyTorch's ``MemTracker`` (a TorchDispatchMode that follows every tensor
storage it sees created, with weakref callbacks for frees, and patches
``UntypedStorage.resize_``), so it counts live tensor bytes, not process RSS, and works on
CPU with DTensors. Both FSDP engines allocate each unsharded parameter once and free /
refill it with ``storage.resize_``; a storage first allocated in an earlier step is unknown
to a tracker entered later, so ``PeakMemory`` adopts a storage the first time it is resized.
Not seen: buffers that C++ allocates outside the dispatcher or on other threads (gloo's
internal buffers, e.g. its copy of the input in ``reduce_scatter``; DDP's gradient buckets,
allocated at construction).
"""

from __future__ import annotations

import contextlib
import inspect
import statistics
import threading
import time
from functools import wraps
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from meshpar.distributed.comm_record import CommCounter
from meshpar.profiling.memory import AllocationTracker


def _nbytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


def _ring_bytes(full: int, n: int, times: int | None) -> float:
    """Per-rank wire bytes of a ring collective over ``n`` ranks on a ``full``-byte buffer."""
    return float(full) if times is None else times * full * (n - 1) / n


# torch.distributed function -> (op counted, argument holding the full buffer, ring multiplier)
_PYTHON_API = {
    "all_gather_single": ("all_gather", "output_tensor", 1),
    "all_gather_into_tensor": ("all_gather", "output_tensor", 1),
    "_all_gather_base": ("all_gather", "output_tensor", 1),
    "all_gather": ("all_gather", "tensor_list", 1),
    "reduce_scatter_single": ("reduce_scatter", "input", 1),
    "reduce_scatter_tensor": ("reduce_scatter", "input", 1),
    "_reduce_scatter_base": ("reduce_scatter", "input", 1),
    "reduce_scatter": ("reduce_scatter", "input_list", 1),
    "all_reduce": ("all_reduce", "tensor", 2),
    "all_reduce_coalesced": ("all_reduce", "tensors", 2),
    "all_to_all_single": ("all_to_all", "input", 1),
    "all_to_all": ("all_to_all", "input_tensor_list", 1),
    "broadcast": ("broadcast", "tensor", None),
}


class PythonCollectives(contextlib.AbstractContextManager):
    """Count calls of ``torch.distributed``'s collective functions made in this block.

    Patches the names on ``torch.distributed`` and ``distributed_c10d`` (the same objects);
    a collective that calls another (``_all_gather_base`` -> ``all_gather_single``) counts once.
    """

    def __init__(self) -> None:
        self.counter = CommCounter()
        self._saved: list[tuple[Any, str, Any]] = []
        self._depth = threading.local()

    def _wrap(self, name: str, fn: Any) -> Any:
        op, arg, times = _PYTHON_API[name]
        signature = inspect.signature(fn)

        @wraps(fn)
        def counted(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(self._depth, "n", 0)
            if depth == 0:
                bound = signature.bind(*args, **kwargs)
                n = dist.get_world_size(bound.arguments.get("group"))
                self.counter.record(op, f"{n} ranks", _ring_bytes(_nbytes(bound.arguments[arg]), n, times))
            self._depth.n = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth.n = depth

        return counted

    def __enter__(self) -> CommCounter:
        for name in _PYTHON_API:
            fn = getattr(dist.distributed_c10d, name, None)
            if fn is None:
                continue
            counted = self._wrap(name, fn)
            for module in (dist, dist.distributed_c10d):
                if getattr(module, name, None) is fn:
                    self._saved.append((module, name, fn))
                    setattr(module, name, counted)
        return self.counter

    def __exit__(self, *exc: Any) -> None:
        for module, name, fn in reversed(self._saved):
            setattr(module, name, fn)
        self._saved.clear()


# dispatcher op -> (op counted, index of the argument holding the full buffer, ring multiplier)
_DISPATCHED = {
    "c10d::_allgather_base_": ("all_gather", 0, 1),
    "c10d::allgather_": ("all_gather", 0, 1),
    "c10d::allgather_coalesced_": ("all_gather", 0, 1),
    "c10d::allgather_into_tensor_coalesced_": ("all_gather", 0, 1),
    "c10d::_reduce_scatter_base_": ("reduce_scatter", 1, 1),
    "c10d::reduce_scatter_": ("reduce_scatter", 1, 1),
    "c10d::reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1, 1),
    "c10d::allreduce_": ("all_reduce", 0, 2),
    "c10d::allreduce_coalesced_": ("all_reduce", 0, 2),
    "c10d::alltoall_base_": ("all_to_all", 1, 1),
    "c10d::alltoall_": ("all_to_all", 1, 1),
    "c10d::broadcast_": ("broadcast", 0, None),
    # functional collectives: the process group is named by its last string argument
    "_c10d_functional::all_gather_into_tensor": ("all_gather", 0, 1),  # input is one rank's part
    "_c10d_functional::reduce_scatter_tensor": ("reduce_scatter", 0, 1),
    "_c10d_functional::all_reduce": ("all_reduce", 0, 2),
    "_c10d_functional::all_reduce_": ("all_reduce", 0, 2),
    "_c10d_functional::all_to_all_single": ("all_to_all", 0, 1),
    "_c10d_functional::broadcast": ("broadcast", 0, None),
    "_c10d_functional::broadcast_": ("broadcast", 0, None),
}
_NOT_COMMUNICATION = {"c10d::barrier", "c10d::monitored_barrier_", "c10d::check_for_nan",
                      "_c10d_functional::wait_tensor"}


def _group_size(args: tuple) -> int:
    for a in args:
        if isinstance(a, torch.ScriptObject):
            with contextlib.suppress(Exception):
                return dist.ProcessGroup.unbox(a).size()
    names = [a for a in args if isinstance(a, str)]
    if names:
        return dist.distributed_c10d._resolve_process_group(names[-1]).size()
    return dist.get_world_size()


class DispatchedCollectives(TorchDispatchMode):
    """Count every collective op (``c10d::*``, ``_c10d_functional::*``) dispatched on this
    thread in this block, whoever issued it; ``counter`` holds the counts. Ops outside the
    table count as ``other:<name>`` with 0 bytes, so nothing passes unseen."""

    def __init__(self) -> None:
        super().__init__()
        self.counter = CommCounter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is DTensor for t in types):  # let DTensor run; its local ops come back through here
            return NotImplemented
        name = func._schema.name
        if func.namespace in ("c10d", "_c10d_functional") and name not in _NOT_COMMUNICATION:
            n = _group_size(args)
            if name in _DISPATCHED:
                op, index, times = _DISPATCHED[name]
                full = _nbytes(args[index]) * (n if name.endswith("all_gather_into_tensor") else 1)
                self.counter.record(op, f"{n} ranks", _ring_bytes(full, n, times))
            else:
                self.counter.record(f"other:{name}", f"{n} ranks", 0)
        return func(*args, **(kwargs or {}))


# [Note: gloo's hidden reduce-scatter copy]
# gloo runs reduce_scatter_tensor as an all-reduce of a copy of the whole input, allocated
# in C++ where MemTracker cannot see it; its peak RSS grows by the input's size during one call, as
# meshpar's all_to_all_single + sum does (docs/performance.md#fsdp-vs-torch).
# meshpar's receive buffer is a Python tensor and is tracked; so that both engines are
# measured alike, PeakMemory holds a tracked buffer of the input's size for the duration of
# each gloo reduce-scatter called through torch.distributed (PyTorch's engine calls it
# synchronously, so the call's duration is the copy's lifetime).
_REDUCE_SCATTERS = ("reduce_scatter_single", "reduce_scatter_tensor", "_reduce_scatter_base")


class PeakMemory(AllocationTracker):
    """Live tensor bytes on this process across a block: [Note: peak memory on CPU] (meshpar's
    ``AllocationTracker``), with gloo's hidden reduce-scatter copy counted ([Note: gloo's
    hidden reduce-scatter copy]).

    ``tracked`` (modules, optimizers, tensors) are the objects that exist before the block."""

    def __init__(self, *tracked: nn.Module | torch.optim.Optimizer | torch.Tensor) -> None:
        super().__init__(*tracked)
        self._patched: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> PeakMemory:
        super().__enter__()
        for name in _REDUCE_SCATTERS:
            fn = getattr(dist.distributed_c10d, name, None)
            if fn is None:
                continue
            shadowed = _with_gloo_copy(fn)
            for module in (dist, dist.distributed_c10d):
                if getattr(module, name, None) is fn:
                    self._patched.append((module, name, fn))
                    setattr(module, name, shadowed)
        return self

    def __exit__(self, *exc: Any) -> None:
        for module, name, fn in reversed(self._patched):
            setattr(module, name, fn)
        self._patched.clear()
        super().__exit__(*exc)

    def peak_breakdown(self) -> dict[str, int]:
        """Bytes per category (parameters, gradients, activations, ...) at the peak."""
        return self.peak()


_inside = threading.local()  # a reduce-scatter that calls another (deprecated name -> new) copies once


def _with_gloo_copy(fn: Any) -> Any:
    signature = inspect.signature(fn)

    @wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if getattr(_inside, "active", False):
            return fn(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        source = bound.arguments["input"]
        hidden = torch.empty_like(source) if dist.get_backend(bound.arguments.get("group")) == "gloo" else None
        _inside.active = True
        try:
            return fn(*args, **kwargs)
        finally:
            _inside.active = False
            del hidden  # gloo's copy lives as long as the (synchronous) call

    return call


def _storages(tensors: Any) -> dict[int, int]:
    """Unique storages (data_ptr -> bytes) behind ``tensors`` (DTensors: their local tensors)."""
    out: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if isinstance(t, DTensor) else t
        storage = local.untyped_storage()
        out[storage.data_ptr()] = storage.nbytes()
    return out


def persistent_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """This rank's parameter, gradient and optimizer-state bytes (whole storages: padding counts)."""
    params = list(model.parameters())
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    parts = {"params": _storages(params), "grads": _storages(p.grad for p in params),
             "optim": _storages(state)}
    return {name: sum(d.values()) for name, d in parts.items()}


def median_seconds(fn: Any, repeats: int, device: str, warmup: bool = True) -> float:
    """The median wall time of ``repeats`` calls of ``fn`` after one untimed call (unless not
    ``warmup``), each call ended by a CUDA synchronize on ``device`` "cuda" (so the GPU's work is
    counted, not only its launch)."""
    if warmup:
        fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
