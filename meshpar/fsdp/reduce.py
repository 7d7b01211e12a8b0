"""Gradient reduction of a parameter group: one reduce-scatter of one flat buffer.

Post-accumulate-grad hooks count a unit's gradients; the last one starts the reduction: a
reduce-scatter in ``reduce_dtype`` (plus one all-reduce over the replicate dim when hybrid),
divided by the data-parallel size (part of it before the sum in float16), handed to the sharded
parameters when awaited. Parameters below ``shard_threshold`` share one all-reduce over the whole
data-parallel mesh. Without gradient sync the unsharded gradients are summed across microbatches
instead. The units of one root share a ``ReduceQueue`` that bounds the reductions in flight.

``Reducer`` is the part of a ``ParamGroup`` (param_group.py) that does this: it reads the group's
parameters and settings (``ReducedGroup``) and owns the reductions' state; the flat layout is
described in param_group.py.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist

from meshpar.distributed import comm
from meshpar.distributed.comm_record import CommRecord, gradient_buffers
from meshpar.distributed.tracing import trace_range
from meshpar.fsdp.policies import MixedPrecisionPolicy
from meshpar.fsdp.sharded_param import MeshInfo, ShardedParam
from meshpar.fsdp.streams import CudaStreams, _wait


class ReducedGroup(Protocol):
    """What a ``Reducer`` reads of its group (``ParamGroup``), which sets all of it; the settings
    are ``FSDPModule``'s (module.py)."""

    params: list[ShardedParam]  # sharded ones, reduce-scattered in this order
    replicated: list[ShardedParam]  # below shard_threshold: all-reduced
    all_params: list[ShardedParam]
    mesh_info: MeshInfo
    mp: MixedPrecisionPolicy
    accumulate_dtype: torch.dtype | None  # [Note: accumulating in reduce_dtype]
    world: int
    single: bool  # [Note: one data-parallel rank]
    requires_all_reduce: bool
    reduce_unused: bool
    max_in_flight: int
    divide_factor: float | None
    all_reduce_hook: tuple[Callable[[torch.Tensor], None], object] | None
    custom_reduce_scatter: object | None
    reduce_group: dist.ProcessGroup | None
    streams: CudaStreams | None
    reduce_queue: ReduceQueue | None
    record: CommRecord | None  # what its collectives report to: [Note: the active record]

    def post_backward(self) -> None: ...  # when the last gradient of a backward has accumulated

# [Note: one reduction in flight]
# A unit's reduce-scatter holds up to two buffers of the unit's full gradient size until it is
# awaited (the flat input and, on gloo, the all-to-all's receive buffer). Awaiting every unit's
# reduction only at the end of backward would keep all of them alive at once. So the units of one
# root share a ReduceQueue, and a unit starting its reduction first finishes the one before it
# (which ran under this unit's backward compute), as PyTorch's engine does: at most one
# reduction's buffers beside the current one's. The unsharded parameters are resharded before the
# reduction starts (it does not need them). Peak memory against PyTorch's engine:
# docs/performance.md#peak-memory-against-pytorchs-engine.


class ReduceQueue:
    """The reductions in flight across the units of one root, oldest first. A unit may keep
    ``max_in_flight`` of them (``FSDPModule.set_reduce_scatter_max_input_buffers``; 1 by default,
    see [Note: one reduction in flight])."""

    def __init__(self) -> None:
        self.pending: deque[Reducer] = deque()

    def admit(self, reducer: Reducer) -> None:
        """Make room for ``reducer``'s reduction: finish the oldest ones beyond its group's limit."""
        while len(self.pending) >= reducer.group.max_in_flight:
            self.pending.popleft().wait()
        self.pending.append(reducer)

    def clear(self) -> None:
        self.pending.clear()


# [Note: dividing before and after the sum]
# The reduced gradient is the sum over data-parallel ranks divided by their number N. A float16 sum
# of N gradients can overflow where their mean would not, so in a reduce dtype other than float32 and
# bfloat16 each rank first divides by p, a power of two near sqrt(N) (doubled from 1 while it divides
# N and p < N/p), and the sum by N/p after; in float32 and bfloat16 only after. PyTorch's factors
# (``_get_gradient_divide_factors``), so both engines round alike; dividing by a power of two is exact
# until it underflows.

# [Note: accumulating in reduce_dtype]
# Without gradient sync a unit keeps each parameter's unsharded gradient until the microbatch that
# reduces, summed across microbatches. PyTorch's engine sums in reduce_dtype, which with bf16
# compute and fp32 reduction doubles those gradients' memory: every unit's full gradient in fp32,
# held for the whole step. meshpar does the same by default (the API's documented behaviour); its
# own trainer passes ``accumulate_dtype`` = the compute dtype, which adds one bf16 rounding per
# microbatch and element beside the bf16 rounding of every gradient itself (what it saves at target
# size: docs/performance.md#planned-figures-quoted-in-the-docs). ``grad_reduce = "microbatch"``
# reduce-scatters each microbatch instead and keeps only sharded fp32 gradients.



class Reducer:
    """A parameter group's gradient side: the hooks that count its gradients, the reduction and its
    wait, the sum kept without gradient sync.

    Owns the reductions' state: the gradients counted in the current backward, the reduction in
    flight, and under HSDP without all-reduce the summed reduce-scatter outputs. Each backward's
    last gradient calls the group's ``post_backward``, which reshards and then calls ``reduce`` or
    ``accumulate`` here."""

    def __init__(self, group: ReducedGroup) -> None:
        self.group = group
        self._grads_ready: set[int] = set()  # ids of the parameters whose gradient accumulated
        self._grads_expected = 0  # trainable parameters, counted at each backward's first gradient
        # reduction in flight: (work, output, the parameters reduced, those of them with a gradient,
        # and on CUDA the event that ends it and the input, kept until the compute stream waited on it)
        self._reduce: tuple[comm.Work, torch.Tensor, list[ShardedParam], list[ShardedParam],
                            torch.cuda.Event | None, comm.ReduceScatterInput | None] | None = None
        self._partial: torch.Tensor | None = None  # HSDP without all-reduce: summed reduce-scatter outputs
        self._partial_params: list[ShardedParam] | None = None
        self._partial_with_grad: set[int] = set()

    def hook_grad(self, p: ShardedParam) -> None:
        """Count accumulated gradients; the last one of the group calls its ``post_backward``.

        [Note: hook the object, not its id]
        A new unsharded parameter is made whenever the old one cannot serve (``model.to(dtype)``,
        a replicated parameter cast for mixed precision), and CPython may give it the address of a
        dead, hooked one. Remembered by ``id()``, the newcomer would go unhooked: that rank would
        reduce the group at the end of backward instead of from the hook, and the ranks would issue
        their collectives in different orders. A weak reference to the hooked parameter itself
        cannot be confused with a newcomer (tests/test_fsdp.py::test_hooks_survive_new_unsharded).
        """
        if not p.requires_grad or (p.hooked is not None and p.hooked() is p.unsharded):
            return
        p.hooked = weakref.ref(p.unsharded)
        # the hook holds its reducer weakly: the parameter's hook dict -> this closure -> the reducer -> its
        # group -> the parameter is a cycle through a tensor, which Python's collector cannot see into while
        # C++ also holds the tensor, so a strong reference would keep every model alive after its last use
        # (one fp32 copy of the parameters per model built)
        reducer = weakref.ref(self)

        def on_grad(_: torch.Tensor, key: int = id(p)) -> None:
            self = reducer()
            if self is None:
                return
            if not self._grads_ready:  # this backward's first: how many to wait for (requires_grad_ may change)
                self._grads_expected = sum(q.requires_grad for q in self.group.all_params)
            self._grads_ready.add(key)
            if len(self._grads_ready) == self._grads_expected:
                self.group.post_backward()

        p.unsharded.register_post_accumulate_grad_hook(on_grad)

    def reduce_dtype(self) -> torch.dtype:
        # the parameters' own dtype unless reduce_dtype / param_dtype say otherwise (a unit whose
        # parameters are all below shard_threshold has only replicated ones: those set it too, else
        # a float64 unit would reduce in float32)
        g = self.group
        dtype = g.mp.reduce_dtype or g.mp.param_dtype
        if dtype is not None:
            return dtype
        trainable = [p for p in g.all_params if p.requires_grad] or g.all_params
        return trainable[0].orig_dtype if trainable else torch.float32

    def has_unreduced(self) -> bool:
        """Whether a gradient waits that no hook reduced: counted in a backward not yet complete (unused
        parameters), summed without sync, or written outside the hooks."""
        return bool(self._grads_ready) or any(
            p.accumulated_grad is not None or (p.unsharded is not None and p.unsharded.grad is not None)
            for p in self.group.all_params)

    def reduce(self) -> None:
        """Start this backward's reduction, after finishing this group's one in flight (at most one per
        group) and making room in the queue (across groups: [Note: one reduction in flight])."""
        self._grads_ready.clear()
        self.wait()
        if self.group.reduce_queue is not None:
            self.group.reduce_queue.admit(self)
        self._start_reduce()

    def accumulate(self) -> None:
        """No gradient sync: sum the unsharded gradients, in reduce_dtype ([Note: accumulating in
        reduce_dtype])."""
        self._grads_ready.clear()
        dtype = self.group.accumulate_dtype or self.reduce_dtype()
        for p in self.group.all_params:
            grad = p.take_unsharded_grad()
            if grad is not None:
                with gradient_buffers():
                    p.accumulated_grad = grad if grad.dtype == dtype else grad.to(dtype)

    def _divide_factor(self) -> float:
        g = self.group
        if g.divide_factor is not None:
            return g.divide_factor
        return g.world * g.mesh_info.replicate_size

    def _divide_factors(self) -> tuple[float, float]:
        """(before, after) the collectives: [Note: dividing before and after the sum]."""
        factor = self._divide_factor()
        if self.reduce_dtype() in (torch.float32, torch.bfloat16):
            return 1, factor
        before = 1
        while factor % before == 0 and factor / before > before:
            before *= 2
        return before, factor / before

    def _start_reduce(self) -> None:
        g = self.group
        if g.single:  # [Note: one data-parallel rank]: the gradient is already the reduced one
            self._hand_over()
            if not g.replicated:
                return
        # the single path handed its sharded parameters over; the replicated ones are all-reduced below
        params = g.replicated if g.single else g.all_params
        grads = {id(p): p.take_unsharded_grad() for p in params if p.requires_grad}
        if g.reduce_unused:  # PyTorch: zeros for trainable parameters that got no gradient
            for p in params:
                if id(p) in grads and grads[id(p)] is None:
                    grads[id(p)] = torch.zeros(p.shape, dtype=self.reduce_dtype(), device=p.compute_device)
        reduce_dtype = self.reduce_dtype()
        # the parameters reduce-scattered: trainable ones, a zero row for those without a gradient on this
        # rank (the collective's size must not depend on what one rank used); only those with a gradient
        # get one back
        trainable = [p for p in g.params if id(p) in grads]  # none on the single path
        if trainable and (any(grads[id(p)] is not None for p in trainable) or self._partial is not None):
            group = g.reduce_group or g.mesh_info.shard_group
            with trace_range("meshpar::fsdp.reduce_copy_in"):
                buffer = comm.ReduceScatterInput(sum(p.padded_numel for p in trainable), group, dtype=reduce_dtype,
                                                 device=trainable[0].compute_device, custom=g.custom_reduce_scatter,
                                                 record=g.record)
                if not self._copy_in_at_once(buffer, trainable, grads):
                    offset = 0
                    for p in trainable:
                        grad = grads[id(p)]
                        if grad is None:
                            buffer.zero_rows(offset, p.padded_numel)
                        else:
                            buffer.copy_rows(offset, p.rows_of(grad, g.world))  # cast by the copy
                        offset += p.padded_numel
                before = self._divide_factors()[0]
                if before != 1:
                    buffer.div_(before)
            dim = g.mesh_info.shard_dim_name
            if g.streams is None:
                work, event, keep = comm.reduce_scatter_rows(buffer, group, async_op=True, dim=dim), None, None
            else:  # stream-ordered; the buffers live until the compute stream waited: [Note: CUDA streams in FSDP]
                with g.streams.reduce_scatter_after_compute():
                    work = comm.reduce_scatter_rows(buffer, group, async_op=False, dim=dim)
                    event, keep = g.streams.reduce_scatter.record_event(), buffer
            with_grad = [p for p in trainable if grads[id(p)] is not None]
            self._reduce = (work, buffer.output, trainable, with_grad, event, keep)
        replicated = [(p, grads[id(p)]) for p in g.replicated if grads.get(id(p)) is not None]
        if replicated:  # one all-reduce over the whole dp mesh for all small parameters
            flat = torch.cat([grad.reshape(-1).to(reduce_dtype) for _, grad in replicated])
            before, after = self._divide_factors()
            if before != 1:
                flat.div_(before)
            for dim in filter(lambda d: d is not None, (g.mesh_info.replicate_dim, g.mesh_info.shard_dim)):
                comm.all_reduce(flat, g.mesh_info.mesh.get_group(dim), dim=g.mesh_info.dim_name(dim), record=g.record)
            flat.div_(after)
            for (p, _), piece in zip(replicated, flat.split([grad.numel() for _, grad in replicated]), strict=True):
                p.add_sharded_grad(piece.view(p.shape))

    # [Note: the gradients copied in at once]
    # A reduce-scatter's input holds, in row i, chunk i of every parameter's gradient (dim 0, padded
    # to whole chunks), cast to reduce_dtype. Where the buffer has whole rows (NCCL's layout, and the
    # planner's) one ``chunk_cat`` writes them all, pads and casts included, as PyTorch's engine does:
    # one call a unit where a copy per parameter (and a padded copy for each uneven one) made one
    # each (docs/performance.md#host-overhead). The gloo exchange's rows lie in two buffers, a
    # parameter sharded on another dim needs its chunks gathered first, and one without a gradient
    # needs zeros: those take the loop.
    def _copy_in_at_once(self, buffer: comm.ReduceScatterInput, trainable: list[ShardedParam],
                         grads: dict[int, torch.Tensor | None]) -> bool:
        if any(p.shard_dim or grads[id(p)] is None or p.n != buffer.n for p in trainable):
            return False
        return buffer.copy_chunks([grads[id(p)].reshape(p.shape[0], p.inner) for p in trainable])

    def _hand_over(self) -> None:
        """[Note: one data-parallel rank]: each trainable sharded parameter's gradient, taken in one
        pass (zeros for one that got none when ``reduce_unused``), is already the reduced one: cast
        to ``reduce_dtype``, divided, the hook run, added to ``sharded.grad``."""
        reduce_dtype, factor = self.reduce_dtype(), self._divide_factor()
        hooked, reduce_unused = self.group.all_reduce_hook is not None, self.group.reduce_unused
        for p in self.group.params:
            if not p.sharded.requires_grad:
                continue
            grad = p.take_unsharded_grad()
            if grad is None and reduce_unused:
                grad = torch.zeros(p.shape, dtype=reduce_dtype, device=p.compute_device)
            if grad is not None:
                if grad.dtype != reduce_dtype:
                    grad = grad.to(reduce_dtype)
                if factor != 1:
                    grad = grad.div_(factor)
                if hooked:
                    self._call_hook(grad)
                p.add_sharded_grad(grad)

    def _call_hook(self, output: torch.Tensor) -> None:
        """``FSDPModule.set_all_reduce_hook``: the user's hook on the reduced output, in place."""
        if self.group.all_reduce_hook is None:
            return
        hook, stream = self.group.all_reduce_hook
        with trace_range("meshpar::fsdp.all_reduce_hook"):
            if stream is not None:
                with torch.cuda.stream(stream):
                    hook(output)
                torch.cuda.current_stream().wait_stream(stream)
            else:
                hook(output)

    def wait(self) -> None:
        """Finish the reduction in flight, if any, and hand the sharded gradients to the parameters."""
        if self._reduce is None:
            return
        g = self.group
        work, recv, params, with_grad, event, _ = self._reduce
        self._reduce = None  # the input is freed here, after the compute stream waited on it
        with trace_range("meshpar::fsdp.reduce_scatter_wait"):
            _wait(work, event)
        if g.mesh_info.replicate_dim is not None:
            if self._partial is not None:  # an earlier microbatch's reduce-scatter without the all-reduce
                if self._partial_params != params:
                    raise RuntimeError("the trainable parameters of an FSDP unit changed between microbatches "
                                       "reduced with set_requires_all_reduce(False); keep requires_grad fixed "
                                       "within one accumulation")
                recv.add_(self._partial)
                with_grad = self._partial_with_grad | {id(p) for p in with_grad}
                with_grad = [p for p in params if id(p) in with_grad]
                self._partial = self._partial_params = None
            if not g.requires_all_reduce:  # keep the shard's sum for the microbatch that all-reduces
                self._partial, self._partial_params = recv, params
                self._partial_with_grad = {id(p) for p in with_grad}
                return
            with trace_range("meshpar::fsdp.all_reduce_replicas"):
                comm.all_reduce(recv, g.mesh_info.replicate_group, dim=g.mesh_info.dim_name(g.mesh_info.replicate_dim),
                                record=g.record)
        recv.div_(self._divide_factors()[1])
        self._call_hook(recv)
        offset, assign = 0, {id(p) for p in with_grad}
        for p in params:
            if id(p) in assign:
                p.add_sharded_grad(p.local_of(recv[offset:offset + p.padded_numel]))
            offset += p.padded_numel

    def drop(self) -> None:
        """After a forward or backward that raised (``ParamGroup.reset``): finish and discard the
        reduction in flight, and drop every gradient not yet handed to the sharded parameters."""
        if self._reduce is not None:
            _wait(self._reduce[0], self._reduce[4])
            self._reduce = None
        self._partial = self._partial_params = None
        self._grads_ready.clear()
        for p in self.group.all_params:
            p.accumulated_grad = None
            if p.unsharded is not None:
                p.unsharded.grad = None
