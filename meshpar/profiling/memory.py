"""Tensor memory by category over time: what a step's peak is made of, on any device.

``AllocationTracker`` is PyTorch's ``MemTracker`` (a TorchDispatchMode that follows every
tensor storage created under it, with weakref callbacks for frees, categorizing each as
parameter, buffer, gradient, activation, temporary or optimizer state) with three additions:

- communication buffers are a category of their own: storages allocated inside
  ``comm_buffers()`` (meshpar's FSDP all-gather and reduce-scatter buffers) count there,
  not as activations or temporaries, and those inside ``gradient_buffers()`` (gradients FSDP
  sums itself across microbatches) count as gradients;
- storages allocated before the tracker and later resized (FSDP frees and refills unsharded
  parameters with ``storage.resize_``) are adopted when first resized, as parameters;
- ``timeline`` records the live bytes per category after every change (at most one point
  per ``resolution_s``, keeping the largest total seen in each interval, so peaks survive).

It counts live tensor bytes, not the allocator's reserved memory or process RSS, and works
on CPU, where there is no allocator to ask; on CUDA, ``meshpar.profiling`` also records the
caching allocator's own history.
"""

from __future__ import annotations

import time
from functools import wraps
from typing import Any

import torch

from meshpar.distributed._torch import MemRefType, MemTracker, RefType, UpdateType, WeakRefInfo  # imported on first use
from meshpar.distributed.comm_record import buffer_tag


class Category(RefType):
    """MemTracker's categories (same names and values, so its own code keys into these),
    plus communication buffers."""

    PARAM = "Parameter"
    BUFFER = "Buffer"
    GRAD = "Gradient"
    ACT = "Activation"
    TEMP = "Temp"
    OPT = "Optstate"
    OTH = "Other"
    COMM = "Communication"


class AllocationTracker(MemTracker):
    """Live tensor bytes per category on this process; ``tracked`` are the modules, optimizers
    and tensors that exist before the block (so their memory is categorized, not missed)."""

    def __init__(self, *tracked: Any, timeline: bool = False, resolution_s: float = 1e-3) -> None:
        super().__init__()
        self._ref_class = Category
        self._timeline_on, self._resolution = timeline, resolution_s
        self.timeline: list[tuple[float, dict[str, int]]] = []  # (seconds since enter, bytes per category)
        self._t0 = time.perf_counter()
        self._bucket: tuple[float, dict[str, int]] | None = None
        self.track_external(*tracked)

    def __enter__(self) -> AllocationTracker:
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        if self._bucket is not None:
            self.timeline.append(self._bucket)
            self._bucket = None

    # --- one forward after another ------------------------------------------------------------------
    def _pre_fw_hook(self, module: torch.nn.Module, inputs: Any) -> None:
        # MemTracker keeps per-module statistics for one forward of the outermost module and
        # refuses a second (gradient accumulation, several steps); the totals this class
        # reports do not depend on them, so start them afresh instead: all of them for the
        # outermost module, only its own for a submodule called on its own again (a chunked
        # loss's head, once per chunk).
        if module in self.memory_tracking and not self._mod_tracker.is_bw:
            name = self._mod_tracker.get_known_fqn(module)
            if set(self._mod_tracker.parents) - {name} == {"Global"}:
                if "." in name:
                    del self.memory_tracking[module]
                else:
                    self.reset_mod_stats()
        super()._pre_fw_hook(module, inputs)

    # --- categories ---------------------------------------------------------------------------------
    def _track(self, reftype: RefType, t: torch.Tensor) -> None:
        tag = buffer_tag()
        if tag == "communication":
            reftype = Category.COMM
        elif tag == "gradient":
            reftype = Category.GRAD
        super()._track(reftype, t)

    def _track_resize(self) -> None:
        original = self._orig_resize

        @wraps(original)
        def resize_(storage: torch.UntypedStorage, size: int) -> None:
            original(storage, size)
            winfo, _ = self._WINFO.get(storage, (None, None))
            if winfo is None:  # allocated before this tracker: adopt it now, at its new size
                if storage.size() > 0 and storage.device.type != "meta":
                    winfo, ref = WeakRefInfo.create_winfo(storage, storage.device, MemRefType.PARAM,
                                                          self._delete_callback)
                    self._WINFO[storage] = (winfo, ref)
                    self._update_snap(UpdateType.ADD, winfo)
            elif winfo.size != storage.size():
                old = winfo.mem_consumed
                winfo.update_mem_consumed(storage)
                self._update_snap(UpdateType.SIZE, winfo, old_mem_consumed=old)

        torch.UntypedStorage.resize_ = resize_

    # --- the timeline -------------------------------------------------------------------------------
    def _update_snap(self, *args: Any, **kwargs: Any) -> None:
        super()._update_snap(*args, **kwargs)
        if self._timeline_on:
            now = time.perf_counter() - self._t0
            point = self.current()
            if self._bucket is None or now - self._bucket[0] >= self._resolution:
                if self._bucket is not None:
                    self.timeline.append(self._bucket)
                self._bucket = (now, point)
            elif point["Total"] > self._bucket[1]["Total"]:
                self._bucket = (self._bucket[0], point)

    def current(self) -> dict[str, int]:
        """Live bytes per category name, summed over devices, and ``Total``: a new dict, read from
        the live snapshot (``get_tracker_snapshot`` deep-copies it first, at every peak the planner's
        tracker records)."""
        return _by_name(self._curr_mem_snap)

    def peak(self) -> dict[str, int]:
        """Bytes per category at the peak, summed over devices, and ``Total``."""
        return _by_name(self._peak_mem_snap)

    @property
    def peak_bytes(self) -> int:
        return sum(self._peak_mem.values())


def _by_name(snapshot: dict[Any, dict[Any, int]]) -> dict[str, int]:
    out: dict[str, int] = {c.value: 0 for c in Category}
    out["Total"] = 0
    for per_device in snapshot.values():
        for key, value in per_device.items():
            name = key.value if isinstance(key, RefType) else key
            out[name] = out.get(name, 0) + value
    return out
