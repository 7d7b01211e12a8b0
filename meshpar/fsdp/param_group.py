"""A parameter group: the parameters of one ``fully_shard`` call, the unit of communication.

Unshard is one all-gather of one flat buffer (copy-in: every parameter's local rows, padded
and cast to ``param_dtype``; copy-out: each parameter's rows from every rank into its
unsharded buffer). Gradient reduction is one reduce-scatter of one flat buffer in
``reduce_dtype`` (plus one all-reduce over the replicate dim when hybrid). Parameters below
``shard_threshold`` stay replicated: no all-gather, and their gradients share one
all-reduce over the whole data-parallel mesh.

Flat layouts, for N shard ranks and parameters p_i of padded chunk size n_i = c_i * inner_i::

    all-gather input  [n_1 | n_2 | ...]                        this rank's chunks
    all-gather output [rank 0: n_1 | n_2 ...][rank 1: ...] ...  = reduce-scatter input
    reduce-scatter output [n_1 | n_2 | ...]                     this rank's summed chunks
"""

from __future__ import annotations

import contextlib
import weakref
from collections import deque
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function
from torch.distributed.tensor import DTensor

from meshpar import comm
from meshpar.comm import comm_buffers, gradient_buffers
from meshpar.fsdp.policies import MixedPrecisionPolicy
from meshpar.fsdp.sharded_param import MeshInfo, ParamState, ShardedParam
from meshpar.fsdp.streams import CudaStreams

# [Note: one reduction in flight]
# A unit's reduce-scatter holds up to two buffers of the unit's full gradient size until it
# is awaited (the flat input and, on gloo, the all-to-all's receive buffer). Awaiting each
# unit's reduction only at the end of backward kept every unit's buffers alive at once:
# debug Llama at 4 ranks peaked at 56.3 MiB against 48.8 MiB for PyTorch's engine. So the
# units of one root share a ReduceQueue, and a unit starting its reduction first finishes
# the one before it (which ran under this unit's backward compute), as PyTorch's engine
# does: at most one reduction's buffers beside the current one's. Measured (debug Llama,
# 4 gloo ranks, bench_fsdp): peak 56.3 -> 52.1 MiB; step time unchanged within noise
# (0.79 x PyTorch's engine after, 0.70 before, run beside two other jobs). Resharding before
# the reduction starts (the unsharded parameters are not needed for it) and gathering in
# place (the input is this rank's slot of the output) took it to 50.8 MiB (PyTorch: 48.8);
# buffering N - 1 rows, not N ([Note: reduce-scatter on gloo]), to 49.6; completing our own
# unshard before prefetching ([Note: prefetch after our own unshard]) to 48.8.


def _wait(work: comm.Work, event: torch.cuda.Event | None) -> None:
    """Finish a collective: its work handle, and on CUDA the compute stream waits on its event."""
    work.wait()
    if event is not None:
        torch.cuda.current_stream().wait_event(event)


class ReduceQueue:
    """The reductions in flight across the units of one root, oldest first. A unit may keep
    ``max_in_flight`` of them (``FSDPModule.set_reduce_scatter_max_input_buffers``; 1 by default,
    see [Note: one reduction in flight])."""

    def __init__(self) -> None:
        self.pending: deque[ParamGroup] = deque()

    def admit(self, group: ParamGroup) -> None:
        """Make room for ``group``'s reduction: finish the oldest ones beyond its limit."""
        while len(self.pending) >= group.max_in_flight:
            self.pending.popleft().wait_for_reduce()
        self.pending.append(group)

    def clear(self) -> None:
        self.pending.clear()


# [Note: accumulating in reduce_dtype]
# Without gradient sync a unit keeps each parameter's unsharded gradient until the microbatch that
# reduces, summed across microbatches. PyTorch's engine sums in reduce_dtype, which with bf16
# compute and fp32 reduction doubles those gradients' memory: every unit's full gradient in fp32,
# held for the whole step. meshpar does the same by default (it is the API's documented
# behaviour), and its own trainer passes ``accumulate_dtype`` = the compute dtype, as before.
# ``meshpar plan``, gradients at the peak (GiB per rank) and the peak, compute dtype vs fp32:
#
#     recipe        gradients      peak             (usable 74.51)
#     gpt2_xl       2.90 / 5.80    52.11 / 55.01
#     llama3_8b    14.96 / 29.92   65.34 / 80.30    (fp32 does not fit)
#
# The rounding the compute dtype adds is one bf16 rounding per microbatch and element, beside the
# bf16 rounding of every gradient itself; ``grad_reduce = "microbatch"`` reduce-scatters each
# microbatch instead and keeps only sharded fp32 gradients.


# [Note: one data-parallel rank]
# With one rank in the data-parallel mesh (and no replicas) the shard is the whole parameter,
# so the all-gather, copy-in / copy-out and the reduce-scatter are copies of the same bytes.
# Unless parameters are cast for compute, the group then aliases: the unsharded parameter is a
# view of the shard's local tensor (nothing freed at reshard) and the unsharded gradient
# becomes the sharded gradient as it is (divided only when a divide factor says so). Placements
# stay Shard(0), so checkpoints are those of any other layout. Measured (debug Llama, 1 rank,
# bench_fsdp, foreach AdamW): step time meshpar/plain 1.14 -> 1.075 (PyTorch's engine 1.12);
# with fused AdamW, whose one DTensor dispatch replaces a dozen, 1.027 (PyTorch's 1.08).
# With a cast (bf16 compute on one GPU: parallelize.one_device_fsdp) the group is ``single`` but
# not ``alias``: each unshard casts every shard straight into its unsharded parameter (one copy
# kernel each, no all-gather buffer, no copy-out), and gradients are cast back as the alias path
# hands them over. Going through the collective path's copies instead (copy-in, a one-rank
# all-gather, copy-out, the reduce-scatter's copies and a divide by 1) cost the first GPU run
# 15 ms of copies per step and about as much again in launching them (Llama 1B, seq 4096,
# compiled, H200: 135 ms per step against plain PyTorch's 88); figures after it in the README.

# [Note: a local unsharded parameter keeps its identity too]
# A parameter whose whole value is local (replicated below shard_threshold, or every one on one
# rank) is a view of its shard when it computes in the shard's dtype on the shard's device.
# Otherwise (cast for mixed precision, or copied from a CPU-offloaded shard) it is written into
# its own storage in place and freed at reshard, exactly as a gathered one ([Note: the unsharded
# parameter keeps its identity] in sharded_param.py). It used to be a new tensor per unshard, so
# a unit that resharded after forward unsharded a second parameter object in backward: autograd
# accumulated the gradient into the forward's, the hook read the new one's, and the gradient was
# lost. Every replicated parameter of a bf16 block went untrained that way (a debug Llama with
# shard_threshold above every size: 18 of 21 parameters got no gradient), and on a GPU every
# CPU-offloaded parameter of a one-rank run (tests/test_cuda.py's offload test, off by 0.8% at
# step 2). tests/test_fsdp.py's local_cast_and_offload case pins it on CPU.


class ParamGroup:
    def __init__(self, params: list[ShardedParam], mesh_info: MeshInfo, mp: MixedPrecisionPolicy,
                 accumulate_dtype: torch.dtype | None = None):
        self.params = [p for p in params if p.is_sharded]
        self.replicated = [p for p in params if not p.is_sharded]
        self.mesh_info, self.mp, self.accumulate_dtype = mesh_info, mp, accumulate_dtype
        self.world = mesh_info.shard_size
        self.state = ParamState.SHARDED
        # --- FSDPModule settings (names follow PyTorch's) ---
        self.requires_gradient_sync = True  # False: keep unsharded gradients, reduce on a later backward
        self.requires_all_reduce = True  # HSDP, False: reduce-scatter only, sum the partial results
        self.reshard_after_backward = True
        self.unshard_in_backward = True
        self.reduce_unused = False  # True: a trainable parameter without a gradient gets a zero one
        self.max_in_flight = 1  # reductions this unit may keep in flight: [Note: one reduction in flight]
        self.divide_factor: float | None = None  # default: the data-parallel world size
        self.force_sum = False  # set_force_sum_reduction_for_comms: meshpar always sums, then divides
        self.all_reduce_hook: tuple[Callable[[torch.Tensor], None], object] | None = None  # (hook, stream)
        self.custom_all_gather = None  # FSDPModule.set_custom_all_gather
        self.custom_reduce_scatter = None
        self.reduce_group: dist.ProcessGroup | None = None  # set_separate_reduce_scatter_group
        # --- in flight ---
        self.streams: CudaStreams | None = None  # on CUDA (set at lazy init): [Note: CUDA streams in FSDP]
        # all-gather in flight: (work, output, its world, the event that ends it on CUDA)
        self._gather: tuple[comm.Work, torch.Tensor, int, torch.cuda.Event | None] | None = None
        # int reshard_after_forward: (group, k, dim name) of the k-rank group backward gathers in, and
        # this rank's 1/k of each unsharded parameter between forward and backward
        self.post_forward: tuple[dist.ProcessGroup, int, str] | None = None
        self._post_forward_shards: list[torch.Tensor] | None = None
        # reduction in flight: (work, output, the parameters reduced, those of them with a gradient,
        # and on CUDA the event that ends it and the input, kept until the compute stream waited on it)
        self._reduce: tuple[comm.Work, torch.Tensor, list[ShardedParam], list[ShardedParam],
                            torch.cuda.Event | None, comm.ReduceScatterInput | None] | None = None
        self._partial: torch.Tensor | None = None  # HSDP without all-reduce: summed reduce-scatter outputs
        self._partial_params: list[ShardedParam] | None = None
        self._partial_with_grad: set[int] = set()
        self.reduce_queue: ReduceQueue | None = None  # shared by the units of one root (set at lazy init)
        self._grads_ready: set[int] = set()
        self.refresh_layout()

    # --- sizes and dtypes --------------------------------------------------------------------------
    def refresh(self) -> None:
        """After the sharded parameters may have been replaced (``.to``, ``to_empty``, a load with
        ``assign=True``): adopt them, then recompute what depends on their dtypes."""
        for p in self.all_params:
            p.refresh_after_apply()
        self.refresh_layout()

    def refresh_layout(self) -> None:
        """``single`` and ``alias`` ([Note: one data-parallel rank]: no communication) and the
        all-gather's dtype and per-parameter segments. Mixed dtypes (a frozen fp32 parameter in a
        bf16 unit) travel as bytes in one collective, each segment 8-byte aligned so it can be
        viewed back as its own dtype."""
        self.all_params = self.params + self.replicated
        self.single = (self.world == 1 and self.mesh_info.replicate_size == 1 and self.custom_all_gather is None
                       and not comm.forced())  # [Note: forcing the collectives of one rank]
        self.alias = self.single and all(self.mp.param_dtype in (None, p.orig_dtype) for p in self.params)
        dtypes = {self.compute_dtype(p) for p in self.params}
        if len(dtypes) <= 1:
            segments = [p.padded_numel for p in self.params]
            self._layout = (dtypes.pop() if dtypes else torch.float32, segments)
        else:
            self._layout = (torch.uint8, [-(-p.padded_numel * self.compute_dtype(p).itemsize // 8) * 8
                                          for p in self.params])
        self.per_rank_numel = sum(self._layout[1])

    def compute_dtype(self, p: ShardedParam) -> torch.dtype:
        return self.mp.param_dtype or p.orig_dtype

    # --- unshard / reshard -----------------------------------------------------------------------
    def unshard(self, async_op: bool = False) -> None:
        """Start the all-gather (``async_op``) or complete the unshard."""
        if self.state is ParamState.UNSHARDED:
            return
        if self._gather is None and self.params and not self.single:
            custom = None
            if self._post_forward_shards is not None:  # backward after an int reshard_after_forward
                group, world, dim = self.post_forward
                rank, pieces = dist.get_rank(group), self._post_forward_shards
                n, dtype = sum(t.numel() for t in pieces), pieces[0].dtype
                fill = lambda send: torch.cat(pieces, out=send)
            else:
                group, world, dim = self.mesh_info.shard_group, self.world, self.mesh_info.shard_dim_name
                dtype, segments = self._layout
                rank, n, custom = self.mesh_info.shard_rank, sum(segments), self.custom_all_gather
                fill = lambda send: self._copy_in(send, segments)
            # in place: this rank's input is its own slot of the output, so no separate send buffer
            # (one shard fewer at the peak; PyTorch's engine does the same)
            streams = self.streams
            with streams.copy_in_after_compute() if streams else contextlib.nullcontext():
                with comm_buffers():
                    if custom is not None:
                        recv = custom.allocate((world * n,), dtype=dtype, device=self.params[0].compute_device)
                    else:
                        recv = torch.empty(world * n, dtype=dtype, device=self.params[0].compute_device)
                send = recv[rank * n:(rank + 1) * n]
                fill(send)
            if streams is None:
                work, event = comm.all_gather(recv, send, group, async_op=True, dim=dim, custom=custom), None
            else:  # stream-ordered: [Note: CUDA streams in FSDP]
                with streams.all_gather_after_copy_in():
                    work = comm.all_gather(recv, send, group, async_op=False, dim=dim, custom=custom)
                    event = streams.all_gather.record_event()
            self._gather = (work, recv, world, event)
        if not async_op:
            self._finish_unshard()

    def _copy_in(self, send: torch.Tensor, segments: list[int]) -> None:
        """This rank's chunks of every parameter, cast to param_dtype, into the flat ``send``."""
        with record_function("meshpar::fsdp.copy_in"):
            offset = 0
            for p, seg in zip(self.params, segments, strict=True):
                n = p.local_shape.numel()  # elements past n are padding
                dst = send[offset:offset + seg]
                if send.dtype == torch.uint8:
                    dst = dst.view(self.compute_dtype(p))
                dst[:n].copy_(p.local.reshape(-1), non_blocking=True)
                offset += seg

    def _finish_unshard(self) -> None:
        if self._gather is not None:
            work, recv, world, event = self._gather
            self._gather = None
            post_forward = self._post_forward_shards is not None
            self._post_forward_shards = None
            with record_function("meshpar::fsdp.all_gather_wait"):
                _wait(work, event)
            with record_function("meshpar::fsdp.copy_out"), torch.no_grad():
                # recv[world, sum_i size_i]; parameter i's padded chunks, in order, are its column block
                segments = [p.padded_numel for p in self.params] if post_forward else self._layout[1]
                sizes = [seg * self.world // world for seg in segments]
                pieces = recv.view(world, -1).split(sizes, dim=1)
                for p, piece in zip(self.params, pieces, strict=True):
                    if recv.dtype == torch.uint8:
                        piece = piece.view(self.compute_dtype(p))[:, :p.padded_numel]
                    p.write_unsharded(piece, world)
        # the local tensor is the whole parameter: replicated ones, and all on one rank ([Note: one
        # data-parallel rank]); [Note: a local unsharded parameter keeps its identity too]
        with record_function("meshpar::fsdp.cast"), torch.no_grad():
            for p in self.replicated + (self.params if self.single else []):
                dtype = self.compute_dtype(p)
                if p.local.device != p.compute_device or p.local.dtype != dtype:
                    p.write_unsharded_from_local(dtype)  # cast, or copied from CPU (offload), in place
                    continue
                current = p.unsharded.to_local() if isinstance(p.unsharded, DTensor) else p.unsharded
                if current is None or current.data_ptr() != p.local.data_ptr() or current.shape != p.local.shape:
                    p.unsharded, p.unsharded_padded = p.as_unsharded_param(p.local), None  # a view of the shard
        for p in self.all_params:
            p.to_unsharded()
            self._hook_grad(p)
        self.state = ParamState.UNSHARDED

    def wait_for_gather(self) -> None:
        """Finish an all-gather in flight (``UnshardHandle.wait``): the unsharded parameters are then
        registered on the module."""
        if self._gather is not None:
            self._finish_unshard()

    def reshard(self, after_forward: bool = False) -> None:
        """Swap the sharded parameters back in and free the unsharded storage. ``after_forward``
        with an int ``reshard_after_forward`` first keeps this rank's 1/k of each parameter, so
        backward all-gathers within the k-rank group (see ``post_forward``)."""
        if self._gather is not None:  # a prefetch nobody used: finish it so the buffers are consistent
            work, _, _, event = self._gather
            _wait(work, event)  # on CUDA its buffer may then be reused: [Note: CUDA streams in FSDP]
            self._gather = None
        if self.state is ParamState.SHARDED:
            return
        if after_forward and self.post_forward is not None and self.params and not self.single:
            group, k, _ = self.post_forward
            rank = dist.get_rank(group)
            self._post_forward_shards = [p.post_forward_piece(k, rank) for p in self.params]
        for p in self.all_params:
            p.to_sharded()
            p.free_unsharded()  # a view of the shard has no storage of its own: nothing to free
        self.state = ParamState.SHARDED

    # --- gradients -------------------------------------------------------------------------------
    def _hook_grad(self, p: ShardedParam) -> None:
        """Count accumulated gradients; the last one of the group starts its reduction.

        [Note: hook the object, not its id]
        A new unsharded parameter is made whenever the old one cannot serve (``model.to(dtype)``,
        a replicated parameter cast for mixed precision). Remembering hooked parameters by
        ``id()`` once skipped hooking such a new one whenever CPython gave it the address of a
        dead, hooked one: that rank then reduced the group at the end of backward instead of
        from the hook, the ranks issued their collectives in different orders, and gloo failed
        with "Received data size doesn't match expected size" (one rank in 2, a few dtype flips
        in; tests/test_fsdp.py::test_hooks_survive_new_unsharded). A weak reference to the
        hooked parameter itself cannot be confused with a newcomer.
        """
        if not p.requires_grad or (p.hooked is not None and p.hooked() is p.unsharded):
            return
        p.hooked = weakref.ref(p.unsharded)
        # the hook holds its group weakly: the parameter's hook dict -> this closure -> the group -> the
        # parameter is a cycle through a tensor, which Python's collector cannot see into while C++ also
        # holds the tensor, so a strong reference kept every model alive after its last use (one fp32
        # copy of the parameters per model built; bench_gpu's later cases found 4.6 GiB per 1B model)
        group = weakref.ref(self)

        def on_grad(_: torch.Tensor, key: int = id(p)) -> None:
            self = group()
            if self is None:
                return
            self._grads_ready.add(key)
            if len(self._grads_ready) == sum(q.requires_grad for q in self.all_params):
                self.post_backward()

        p.unsharded.register_post_accumulate_grad_hook(on_grad)

    def reduce_dtype(self) -> torch.dtype:
        # the parameters' own dtype unless reduce_dtype / param_dtype say otherwise (a unit whose
        # parameters are all below shard_threshold has only replicated ones: those set it too, else
        # a float64 unit would reduce in float32)
        trainable = [p for p in self.all_params if p.requires_grad] or self.all_params
        return self.mp.reduce_dtype or self.mp.param_dtype or (trainable[0].orig_dtype if trainable
                                                                else torch.float32)

    def post_backward(self) -> None:
        """After this unit's backward: reduce (or keep, without sync) its gradients; reshard."""
        self._grads_ready.clear()
        with record_function("meshpar::fsdp.post_backward"):
            if self.reshard_after_backward:  # first: the gradients outlive the parameters, and the
                self.reshard()  # reduction's buffers then take the unsharded parameters' place
            if self.requires_gradient_sync:
                self.wait_for_reduce()  # at most one reduction in flight per group
                if self.reduce_queue is not None:  # and across groups: [Note: one reduction in flight]
                    self.reduce_queue.admit(self)
                self._start_reduce()
            else:  # no sync: sum the unsharded gradients, in reduce_dtype ([Note: accumulating in reduce_dtype])
                dtype = self.accumulate_dtype or self.reduce_dtype()
                for p in self.all_params:
                    grad = p.take_unsharded_grad()
                    if grad is not None:
                        with gradient_buffers():
                            p.accumulated_grad = grad if grad.dtype == dtype else grad.to(dtype)

    def _divide_factor(self) -> float:
        if self.divide_factor is not None:
            return self.divide_factor
        return self.world * self.mesh_info.replicate_size

    def _start_reduce(self) -> None:
        grads = {id(p): p.take_unsharded_grad() for p in self.all_params if p.requires_grad}
        if self.reduce_unused:  # PyTorch: zeros for trainable parameters that got no gradient
            for p in self.all_params:
                if id(p) in grads and grads[id(p)] is None:
                    grads[id(p)] = torch.zeros(p.shape, dtype=self.reduce_dtype(), device=p.compute_device)
        reduce_dtype = self.reduce_dtype()
        # the parameters reduce-scattered: trainable ones, a zero row for those without a gradient on this
        # rank (the collective's size must not depend on what one rank used); only those with a gradient
        # get one back
        trainable = [p for p in self.params if id(p) in grads]
        if self.single:  # [Note: one data-parallel rank]: the gradient is already the reduced one
            factor = self._divide_factor()
            for p in trainable:
                grad = grads[id(p)]
                if grad is not None:
                    grad = grad.to(reduce_dtype)
                    if factor != 1:
                        grad = grad.div_(factor)
                    self._call_hook(grad)
                    p.add_sharded_grad(grad)
        elif trainable and (any(grads[id(p)] is not None for p in trainable) or self._partial is not None):
            group = self.reduce_group or self.mesh_info.shard_group
            with record_function("meshpar::fsdp.reduce_copy_in"):
                buffer = comm.ReduceScatterInput(sum(p.padded_numel for p in trainable), group, dtype=reduce_dtype,
                                                 device=trainable[0].compute_device, custom=self.custom_reduce_scatter)
                offset = 0
                for p in trainable:
                    grad = grads[id(p)]
                    if grad is None:
                        buffer.zero_rows(offset, p.padded_numel)
                    else:
                        buffer.copy_rows(offset, p.rows_of(grad.to(reduce_dtype), self.world))
                    offset += p.padded_numel
            dim = self.mesh_info.shard_dim_name
            if self.streams is None:
                work, event, keep = comm.reduce_scatter_rows(buffer, group, async_op=True, dim=dim), None, None
            else:  # stream-ordered; the buffers live until the compute stream waited: [Note: CUDA streams in FSDP]
                with self.streams.reduce_scatter_after_compute():
                    work = comm.reduce_scatter_rows(buffer, group, async_op=False, dim=dim)
                    event, keep = self.streams.reduce_scatter.record_event(), buffer
            with_grad = [p for p in trainable if grads[id(p)] is not None]
            self._reduce = (work, buffer.output, trainable, with_grad, event, keep)
        replicated = [(p, grads[id(p)]) for p in self.replicated if grads.get(id(p)) is not None]
        if replicated:  # one all-reduce over the whole dp mesh for all small parameters
            flat = torch.cat([g.reshape(-1).to(reduce_dtype) for _, g in replicated])
            for dim in filter(lambda d: d is not None, (self.mesh_info.replicate_dim, self.mesh_info.shard_dim)):
                comm.all_reduce(flat, self.mesh_info.mesh.get_group(dim), dim=self.mesh_info.dim_name(dim))
            flat.div_(self._divide_factor())
            for (p, _), piece in zip(replicated, flat.split([g.numel() for _, g in replicated]), strict=True):
                p.add_sharded_grad(piece.view(p.shape))

    def _call_hook(self, output: torch.Tensor) -> None:
        """``FSDPModule.set_all_reduce_hook``: the user's hook on the reduced output, in place."""
        if self.all_reduce_hook is None:
            return
        hook, stream = self.all_reduce_hook
        with record_function("meshpar::fsdp.all_reduce_hook"):
            if stream is not None:
                with torch.cuda.stream(stream):
                    hook(output)
                torch.cuda.current_stream().wait_stream(stream)
            else:
                hook(output)

    def wait_for_reduce(self) -> None:
        """Finish the reduction in flight, if any, and hand the sharded gradients to the parameters."""
        if self._reduce is None:
            return
        work, recv, params, with_grad, event, _ = self._reduce
        self._reduce = None  # the input is freed here, after the compute stream waited on it
        with record_function("meshpar::fsdp.reduce_scatter_wait"):
            _wait(work, event)
        if self.mesh_info.replicate_dim is not None:
            if self._partial is not None:  # an earlier microbatch's reduce-scatter without the all-reduce
                if self._partial_params != params:
                    raise RuntimeError("the trainable parameters of an FSDP unit changed between microbatches "
                                       "reduced with set_requires_all_reduce(False); keep requires_grad fixed "
                                       "within one accumulation")
                recv.add_(self._partial)
                with_grad = self._partial_with_grad | {id(p) for p in with_grad}
                with_grad = [p for p in params if id(p) in with_grad]
                self._partial = self._partial_params = None
            if not self.requires_all_reduce:  # keep the shard's sum for the microbatch that all-reduces
                self._partial, self._partial_params = recv, params
                self._partial_with_grad = {id(p) for p in with_grad}
                return
            with record_function("meshpar::fsdp.all_reduce_replicas"):
                comm.all_reduce(recv, self.mesh_info.replicate_group,
                                dim=self.mesh_info.dim_name(self.mesh_info.replicate_dim))
        recv.div_(self._divide_factor())
        self._call_hook(recv)
        offset, assign = 0, {id(p) for p in with_grad}
        for p in params:
            if id(p) in assign:
                p.add_sharded_grad(p.local_of(recv[offset:offset + p.padded_numel]))
            offset += p.padded_numel

    def finish_backward(self) -> None:
        """End of a backward, or ``FSDPModule.reduce_grads``: reduce what no hook reduced (unused
        parameters, gradients accumulated without sync or written outside the hooks), wait, reshard."""
        if self._grads_ready or any(p.accumulated_grad is not None or (p.unsharded is not None
                                                                      and p.unsharded.grad is not None)
                                    for p in self.all_params):
            self.post_backward()
        self.wait_for_reduce()
        self._grads_ready.clear()
        if self.reshard_after_backward:
            self.reshard()

    def reset(self) -> None:
        """``FSDPModule.reset_iter_state``: after a forward or backward that raised, drop what the
        failed iteration left (collectives in flight are finished and discarded, with every gradient
        not yet handed to the sharded parameters) and reshard."""
        if self._reduce is not None:
            _wait(self._reduce[0], self._reduce[4])
            self._reduce = None
        self._partial = self._partial_params = None
        self._grads_ready.clear()
        self._post_forward_shards = None
        for p in self.all_params:
            p.accumulated_grad = None
            if p.unsharded is not None:
                p.unsharded.grad = None
        self.reshard()
