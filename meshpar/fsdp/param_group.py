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

from collections import deque

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd.profiler import record_function
from torch.distributed.tensor import DTensor

from meshpar import comm
from meshpar._torch import preserve_version_counter
from meshpar.comm import comm_buffers
from meshpar.fsdp.policies import MixedPrecisionPolicy
from meshpar.fsdp.sharded_param import MeshInfo, ParamState, ShardedParam

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


class ReduceQueue:
    """The reductions in flight across the units of one root, oldest first."""

    def __init__(self, depth: int = 1):
        self.depth = depth
        self.pending: deque[ParamGroup] = deque()

    def admit(self, group: ParamGroup) -> None:
        """Make room for ``group``'s reduction: finish the oldest ones beyond ``depth - 1``."""
        while len(self.pending) >= self.depth:
            self.pending.popleft().wait_for_reduce()
        self.pending.append(group)

    def clear(self) -> None:
        self.pending.clear()


# [Note: one data-parallel rank]
# With one rank in the data-parallel mesh (and no replicas) the shard is the whole parameter,
# so the all-gather, copy-in / copy-out and the reduce-scatter are copies of the same bytes.
# Unless parameters are cast for compute, the group then aliases: the unsharded parameter is a
# view of the shard's local tensor (nothing freed at reshard) and the unsharded gradient
# becomes the sharded gradient as it is (divided only when a divide factor says so). Placements
# stay Shard(0), so checkpoints are those of any other layout. Measured (debug Llama, 1 rank,
# bench_fsdp, foreach AdamW): step time meshpar/plain 1.14 -> 1.075 (PyTorch's engine 1.12);
# with fused AdamW, whose one DTensor dispatch replaces a dozen, 1.027 (PyTorch's 1.08).


class ParamGroup:
    def __init__(self, params: list[ShardedParam], mesh_info: MeshInfo, mp: MixedPrecisionPolicy):
        self.params = [p for p in params if p.is_sharded]
        self.replicated = [p for p in params if not p.is_sharded]
        self.mesh_info, self.mp = mesh_info, mp
        self.world = mesh_info.shard_size
        self.state = ParamState.SHARDED
        self.requires_gradient_sync = True
        self.reshard_after_backward = True
        self.divide_factor: float | None = None  # default: the data-parallel world size
        self._gather: tuple[comm.Work, torch.Tensor, int] | None = None  # all-gather in flight, its world
        # int reshard_after_forward: (group, k, dim name) of the k-rank group backward gathers in, and
        # this rank's 1/k of each unsharded parameter between forward and backward
        self.post_forward: tuple[dist.ProcessGroup, int, str] | None = None
        self._post_forward_shards: list[torch.Tensor] | None = None
        self._reduce: tuple[comm.Work, torch.Tensor, list[ShardedParam]] | None = None
        self.reduce_queue: ReduceQueue | None = None  # shared by the units of one root (set at lazy init)
        self._grads_ready: set[int] = set()
        self._hooked: set[int] = set()
        # [Note: one data-parallel rank]: no communication and no copies
        self.alias = (self.world == 1 and mesh_info.replicate_size == 1
                      and all(mp.param_dtype in (None, p.orig_dtype) for p in self.params))

    # --- sizes ---------------------------------------------------------------------------------
    @property
    def all_params(self) -> list[ShardedParam]:
        return self.params + self.replicated

    @property
    def per_rank_numel(self) -> int:
        return sum(p.padded_numel for p in self.params)

    # --- unshard / reshard -----------------------------------------------------------------------
    def unshard(self, async_op: bool = False) -> None:
        """Start the all-gather (``async_op``) or complete the unshard."""
        if self.state is ParamState.UNSHARDED:
            return
        if self._gather is None and self.params and not self.alias:
            if self._post_forward_shards is not None:  # backward after an int reshard_after_forward
                group, world, dim = self.post_forward
                rank, pieces = dist.get_rank(group), self._post_forward_shards
                n, dtype = sum(t.numel() for t in pieces), pieces[0].dtype
                fill = lambda send: torch.cat(pieces, out=send)
            else:
                group, world, dim = self.mesh_info.shard_group, self.world, self.mesh_info.shard_dim_name
                rank, n, dtype = self.mesh_info.shard_rank, self.per_rank_numel, self.mp.param_dtype
                dtype, fill = dtype or self.params[0].orig_dtype, self._copy_in
            # in place: this rank's input is its own slot of the output, so no separate send buffer
            # (one shard fewer at the peak; PyTorch's engine does the same)
            with comm_buffers():
                recv = torch.empty(world * n, dtype=dtype, device=self.params[0].compute_device)
            send = recv[rank * n:(rank + 1) * n]
            fill(send)
            self._gather = (comm.all_gather(recv, send, group, async_op=True, dim=dim), recv, world)
        if not async_op:
            self._finish_unshard()

    def _copy_in(self, send: torch.Tensor) -> None:
        """This rank's chunks of every parameter, cast to param_dtype, into the flat ``send``."""
        with record_function("meshpar::fsdp.copy_in"):
            offset = 0
            for p in self.params:
                n = p.local_rows * p.inner  # rows past n are padding
                send[offset:offset + n].copy_(p.local.reshape(-1), non_blocking=True)
                offset += p.padded_numel

    def _finish_unshard(self) -> None:
        if self._gather is not None:
            work, recv, world = self._gather
            self._gather = None
            self._post_forward_shards = None
            with record_function("meshpar::fsdp.all_gather_wait"):
                work.wait()
            with record_function("meshpar::fsdp.copy_out"), torch.no_grad():
                # recv[world, sum_i size_i]; parameter i's padded rows, in order, are its column block
                sizes = [p.padded_numel * self.world // world for p in self.params]
                pieces = recv.view(world, -1).split(sizes, dim=1)
                for p, piece in zip(self.params, pieces, strict=True):
                    out = p.alloc_unsharded(recv.dtype, self.world).view(world, -1)
                    with preserve_version_counter(p.unsharded):
                        out.copy_(piece)
        for p in self.replicated + (self.params if self.alias else []):  # the local tensor is the whole parameter
            dtype = self.mp.param_dtype or p.orig_dtype
            data = p.local.to(p.compute_device, dtype, non_blocking=True)  # no copy unless offloaded or cast
            current = p.unsharded.to_local() if isinstance(p.unsharded, DTensor) else p.unsharded
            if current is None or current.data_ptr() != data.data_ptr():
                p.unsharded = p.as_unsharded_param(data)
        for p in self.all_params:
            p.to_unsharded()
            self._hook_grad(p)
        self.state = ParamState.UNSHARDED

    def reshard(self, after_forward: bool = False) -> None:
        """Swap the sharded parameters back in and free the unsharded storage. ``after_forward``
        with an int ``reshard_after_forward`` first keeps this rank's 1/k of each parameter, so
        backward all-gathers within the k-rank group (see ``post_forward``)."""
        if self._gather is not None:  # a prefetch nobody used: finish it so the buffers are consistent
            self._gather[0].wait()
            self._gather = None
        if self.state is ParamState.SHARDED:
            return
        if after_forward and self.post_forward is not None and self.params and not self.alias:
            group, k, _ = self.post_forward
            rank = dist.get_rank(group)
            self._post_forward_shards = [p.unsharded_padded.view(k, -1)[rank].clone() for p in self.params]
        for p in self.all_params:
            p.to_sharded()
        if not self.alias:  # an alias shares the shard's storage: nothing to free
            for p in self.params:
                p.free_unsharded()
        self.state = ParamState.SHARDED

    # --- gradients -------------------------------------------------------------------------------
    def _hook_grad(self, p: ShardedParam) -> None:
        """Count accumulated gradients; the last one of the group starts its reduction."""
        if id(p.unsharded) in self._hooked or not p.requires_grad:
            return
        self._hooked.add(id(p.unsharded))

        def on_grad(_: torch.Tensor, key: int = id(p)) -> None:
            self._grads_ready.add(key)
            if len(self._grads_ready) == sum(q.requires_grad for q in self.all_params):
                self.post_backward()

        p.unsharded.register_post_accumulate_grad_hook(on_grad)

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
            else:
                for p in self.all_params:
                    grad = p.take_unsharded_grad()
                    if grad is not None:
                        p.accumulated_grad = grad

    def _divide_factor(self) -> float:
        if self.divide_factor is not None:
            return self.divide_factor
        return self.world * self.mesh_info.replicate_size

    def _start_reduce(self) -> None:
        grads = {id(p): p.take_unsharded_grad() for p in self.all_params}
        # the parameters' own dtype (a unit whose parameters are all below shard_threshold has only
        # replicated ones: those set it too, else a float64 unit would reduce in float32)
        reduce_dtype = self.mp.reduce_dtype or (self.all_params[0].orig_dtype if self.all_params else torch.float32)
        if self.alias:  # [Note: one data-parallel rank]: the gradient is already the reduced one
            factor = self._divide_factor()
            for p in self.params:
                grad = grads[id(p)]
                if grad is not None:
                    grad = grad.to(reduce_dtype)
                    p.add_sharded_grad(grad.div_(factor) if factor != 1 else grad)
        elif self.params and any(grads[id(p)] is not None for p in self.params):
            with record_function("meshpar::fsdp.reduce_copy_in"):
                buffer = comm.ReduceScatterInput(self.per_rank_numel, self.mesh_info.shard_group,
                                                 dtype=reduce_dtype, device=self.params[0].compute_device)
                offset = 0
                for p in self.params:
                    grad = grads[id(p)]
                    if grad is None:
                        buffer.zero_rows(offset, p.padded_numel)
                    else:
                        padding = self.world * p.rows_per_rank - p.shape[0]
                        rows = grad.reshape(p.shape[0], p.inner)
                        buffer.copy_rows(offset, F.pad(rows, (0, 0, 0, padding)).view(self.world, -1) if padding
                                         else rows.view(self.world, -1))
                    offset += p.padded_numel
            work = comm.reduce_scatter_rows(buffer, self.mesh_info.shard_group, async_op=True,
                                            dim=self.mesh_info.shard_dim_name)
            recv = buffer.output
            self._reduce = (work, recv, self.params)
        replicated = [(p, grads[id(p)]) for p in self.replicated if grads[id(p)] is not None]
        if replicated:  # one all-reduce over the whole dp mesh for all small parameters
            flat = torch.cat([g.reshape(-1).to(reduce_dtype) for _, g in replicated])
            for dim in filter(lambda d: d is not None, (self.mesh_info.replicate_dim, self.mesh_info.shard_dim)):
                comm.all_reduce(flat, self.mesh_info.mesh.get_group(dim), dim=self.mesh_info.dim_name(dim))
            flat.div_(self._divide_factor())
            for (p, _), piece in zip(replicated, flat.split([g.numel() for _, g in replicated]), strict=True):
                p.add_sharded_grad(piece.view(p.shape))

    def wait_for_reduce(self) -> None:
        """Finish the reduction in flight, if any, and hand the sharded gradients to the parameters."""
        if self._reduce is None:
            return
        work, recv, params = self._reduce
        self._reduce = None
        with record_function("meshpar::fsdp.reduce_scatter_wait"):
            work.wait()
        if self.mesh_info.replicate_dim is not None:
            with record_function("meshpar::fsdp.all_reduce_replicas"):
                comm.all_reduce(recv, self.mesh_info.replicate_group,
                                dim=self.mesh_info.dim_name(self.mesh_info.replicate_dim))
        recv.div_(self._divide_factor())
        offset = 0
        for p in params:
            p.add_sharded_grad(recv[offset:offset + p.local_rows * p.inner].view(p.local_rows, *p.shape[1:]))
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
