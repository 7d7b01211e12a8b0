"""The simulated step's memory tracker: live bytes per phase and per stretch, collectives by mesh dim.

    with StepTracker(stage, groups=groups_by_name(mesh), record=record) as tracker, label_blocks(stage, tracker):
        train_step(..., phase=priced(tracker, phases))   # phases["B0"].peak, .segments, .comm

meshpar's ``AllocationTracker`` (torch's MemTracker) keeping only the peaks the planner reads:
each phase's (``priced``: "F<i>", "B<i>", "sync") and each stretch's within it, labelled by block
position (``label_blocks``) or by a mark the work leaves (``tracing.mark``). ``simulate.py`` runs
the step under it; ``extrapolate.py`` reads the stretches.
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from meshpar.distributed import comm_record
from meshpar.distributed._torch import FakeTensor, MemRefType, active_fake_mode, tree_map_only
from meshpar.distributed.mesh import DIMS, Mesh
from meshpar.distributed.tracing import listen
from meshpar.profiling.memory import AllocationTracker


@dataclass
class Phase:
    """Live bytes across one phase of the step (a microbatch's forward or backward, the sync)."""

    start: int = 0
    end: int = 0
    peak: int = 0
    saved: int = 0  # activation and temporary bytes the phase left alive
    at_peak: dict[str, int] = field(default_factory=dict)  # bytes per category at the phase's peak
    comm: Counter = field(default_factory=Counter)  # (op, mesh dim) -> bytes on the wire from this rank
    # the peak (total, bytes per category) of each stretch of the phase, by label in order of first
    # appearance: "start" (the phase's first value), then ("in" | "out" | "grad", block position)
    # and ("mark", name) from label_blocks (what planner/extrapolate.py reads)
    segments: dict[Hashable, tuple[int, dict[str, int]]] = field(default_factory=dict)
    calls: Counter = field(default_factory=Counter)  # (op, mesh dim) -> collectives issued


# [Note: device queries skip the tracker]
# Half the ops a simulated step dispatches are ``prim.device``: C++ asking a fake tensor its device
# (each DTensor wrap, the autograd engine). They allocate nothing, but through MemTracker and then
# FakeTensorMode each costs a full dispatch. The tracker answers them as FakeTensor itself does
# (its ``device`` property) and keeps what MemTracker does after any op of the step's fake mode,
# the peak update, so every figure is unchanged (tests/test_plan.py's headers, exactly).
_DEVICE = torch.ops.prim.device.default


class StepTracker(AllocationTracker):
    """``AllocationTracker`` keeping only global and per-phase peaks (MemTracker also updates
    every module's peak after every op, which is O(modules) per op:
    docs/performance.md#the-simulations-own-costs), and counting DTensor's collectives (tensor
    parallelism) by mesh dim. Higher-order operators pass through it as ops (flex_attention under
    ``parallel.cp_flex``: what it returns is what it allocates)."""

    supports_higher_order_operators = True

    def __init__(self, *tracked: Any, groups: dict[str, tuple[str, int]], record: comm_record.CommRecord) -> None:
        super().__init__(*tracked)
        self._groups = groups  # process group name -> (mesh dim, size)
        self._record = record  # the simulation's: meshpar.distributed.comm's collectives per phase
        self.current_phase: Phase | None = None
        self.segment: Hashable = "start"  # the label of the stretch running now (label_blocks)

    def _update_peak_stats(self, peak_state: Any) -> None:
        ph = self.current_phase
        if ph is None:
            return
        total = sum(snap["Total"] for snap in self._curr_mem_snap.values())
        seg = ph.segments.get(self.segment)
        if seg is None or total > seg[0]:
            now = self.current()
            ph.segments[self.segment] = (total, now)
            if total > ph.peak:
                ph.peak, ph.at_peak = total, now

    def __enter__(self) -> StepTracker:
        super().__enter__()
        self._step_mode = active_fake_mode()  # the step's fake mode, not DTensor's shape propagation's
        return self

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DEVICE and isinstance(args[0], FakeTensor):  # [Note: device queries skip the tracker]
            if active_fake_mode() is self._step_mode:
                self._update_peak_stats(None)
            return args[0].device
        if DTensor in types:  # DTensor desugars it into local ops, which come back here
            return NotImplemented
        waits = False
        if func.namespace == "_c10d_functional":
            op = func._schema.name.split("::")[-1]
            self._count(op, args)
            waits = op == "wait_tensor"
        return self._dispatch_and_track(func, args, kwargs, waits)

    # [Note: MemTracker's dispatch without pytrees]
    # MemTracker's own __torch_dispatch__ runs the op, then tracks every tensor of the result with
    # ``tree_map_only``, which flattens and rebuilds the result for every op of the step (its cost:
    # docs/performance.md#the-simulations-own-costs). Ops return a tensor, or lists and tuples of them
    # (and of Nones, ints): walked directly here; anything else through the pytree. Otherwise this is
    # MemTracker's code path: the same category per output, the same peak update, so every figure
    # is unchanged (the recipes' headers in tests/test_plan.py, exactly).
    def _dispatch_and_track(self, func, args, kwargs, waits: bool):
        # as MemTracker: under a fake mode a wait returns its input
        res = args[0] if waits and active_fake_mode() else func(*args, **(kwargs or {}))
        if active_fake_mode() is self._step_mode:  # MemTracker's _fake_mode_on_entry, taken in __enter__
            if self._in_opt:
                reftype = MemRefType.OPT
            elif self._mod_tracker.is_bw and not self._in_ac:
                reftype = MemRefType.TEMP
            else:
                reftype = MemRefType.ACT
            self._track_result(reftype, res)
            self._update_peak_stats(None)
        return res

    def _track_result(self, reftype: Any, res: Any) -> None:
        if isinstance(res, torch.Tensor):
            self._track(reftype, res)
        elif type(res) in (list, tuple):  # a named tuple or other subclass: the pytree below
            for x in res:
                if isinstance(x, torch.Tensor):
                    self._track(reftype, x)
                elif isinstance(x, (list, tuple)):
                    self._track_result(reftype, x)
        elif res is not None and not isinstance(res, (int, float, bool)):
            track = functools.partial(self._track, reftype)
            tree_map_only(torch.Tensor, track, res)

    def _count(self, op: str, args: tuple) -> None:
        if self.current_phase is None or op == "wait_tensor":
            return
        group = next((a for a in args if isinstance(a, str) and a in self._groups), None)
        dim, n = self._groups.get(group, ("other", 1))
        x = args[0][0] if isinstance(args[0], (list, tuple)) else args[0]
        nbytes = x.numel() * x.element_size()
        # ring volumes per rank, as meshpar.distributed.comm counts them ([Note: bytes counted])
        wire = {"all_gather_into_tensor": nbytes * (n - 1), "reduce_scatter_tensor": nbytes * (n - 1) / n,
                "all_reduce": 2 * nbytes * (n - 1) / n, "all_to_all_single": nbytes * (n - 1) / n}.get(op, nbytes)
        key = (op.removesuffix("_into_tensor").removesuffix("_tensor"), dim)
        self.current_phase.comm[key] += wire
        self.current_phase.calls[key] += 1

    @contextlib.contextmanager
    def phase(self, ph: Phase) -> Iterator[Phase]:
        before = self.current()
        ph.start = ph.peak = before["Total"]
        ph.at_peak = before
        self.segment = "start"
        ph.segments["start"] = (ph.start, before)
        self.current_phase = ph
        with self._record.count() as counted:
            yield ph
        self.current_phase = None
        after = self.current()
        ph.end = after["Total"]
        ph.saved = sum(after[c] - before[c] for c in ("Activation", "Temp"))
        for (op, dim), nbytes in counted.bytes.items():  # meshpar.distributed.comm's; "extra": clipping's pp groups
            ph.comm[(op, "pp" if dim == "extra" else dim)] += nbytes
        for (op, dim), calls in counted.calls.items():
            ph.calls[(op, "pp" if dim == "extra" else dim)] += calls


def groups_by_name(mesh: Mesh) -> dict[str, tuple[str, int]]:
    """Process group name -> (mesh dim, size), for the dims of more than one rank."""
    out = {}
    for dim in (*DIMS, "dp"):
        if mesh[dim].size() > 1:
            g = mesh[dim].get_group()
            out[g.group_name] = (dim, g.size())
    return out


def priced(tracker: StepTracker, phases: dict[str, Phase]) -> Callable[..., contextlib.AbstractContextManager]:
    """``train_step``'s ``phase`` hook: live bytes and collectives per phase as the planner prices
    them, "F<i>" and "B<i>" per microbatch and "sync" (gradient reductions, clipping)."""
    def phase(name: str, microbatch: int | None = None) -> contextlib.AbstractContextManager:
        key = {"forward": f"F{microbatch}", "backward": f"B{microbatch}", "optimizer": "sync"}.get(name)
        return contextlib.nullcontext() if key is None else tracker.phase(phases.setdefault(key, Phase()))

    return phase


@contextlib.contextmanager
def label_blocks(stage: torch.nn.Module, tracker: StepTracker) -> Iterator[None]:
    """Label the tracker's stretches by block position ``j`` in ``stage.layers``: ("in", j) from
    the block's forward call, ("out", j) after it, ("grad", j) once the gradient of its output
    is computed (its backward, recomputation included, comes next). Module and tensor hooks only:
    a checkpointed block's recomputation calls the inner forward and fires none. Work outside the
    blocks that marks itself (``tracing.mark``: clipping's groups) is labelled ("mark", name), and
    the last stage's head, from its final norm on, ("mark", "head")."""
    def label(name: Hashable) -> Callable[..., None]:
        def set_label(*_: Any) -> None:
            tracker.segment = name
        return set_label

    def after(j: int) -> Callable[..., None]:
        def hook(_module: torch.nn.Module, _args: Any, out: Any) -> None:
            tracker.segment = ("out", j)
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(label(("grad", j)))
        return hook

    def marked(name: str) -> None:
        tracker.segment = ("mark", name)

    handles = []
    for j, block in enumerate(stage.layers.values()):
        handles += [block.register_forward_pre_hook(label(("in", j))), block.register_forward_hook(after(j))]
    head = _after_blocks(stage)
    if head is not None:  # the last stage's final norm, output and loss: a stretch of their own
        handles.append(head.register_forward_pre_hook(label(("mark", "head"))))
    try:
        with listen(marked):
            yield
    finally:
        for h in handles:
            h.remove()


def _after_blocks(stage: torch.nn.Module) -> torch.nn.Module | None:
    """The first module a stage runs after its blocks (the final norm: ``norm``, ``ln_f``), None on
    a stage without one (a pipeline stage before the last)."""
    children = iter(stage.named_children())
    for name, _ in children:
        if name == "layers":
            return next((m for _, m in children if m is not None), None)
    return None
