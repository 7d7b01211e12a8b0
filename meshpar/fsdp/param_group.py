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

This file holds the group: its parameters, settings and flat layout, and the order of its
phases (unshard, reshard, post-backward, end of backward, reset). It owns two parts that do the
work: ``unsharder`` (unshard.py: the all-gather side and the state of its unshards) and
``reducer`` (reduce.py: the gradient side and the reductions in flight, with the ``ReduceQueue``
the units of one root share). Each part reads the group's parameters and settings, and owns its
own state; neither touches the other's. The unsharder hands each parameter it unshards to the
reducer's ``hook_grad``; the reducer's hooks call the group's ``post_backward``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from meshpar.distributed import comm_record
from meshpar.distributed.tracing import trace_range
from meshpar.fsdp.extensions import Extension, has_extension
from meshpar.fsdp.policies import MixedPrecisionPolicy
from meshpar.fsdp.reduce import ReduceQueue, Reducer
from meshpar.fsdp.sharded_param import MeshInfo, ParamState, ShardedParam
from meshpar.fsdp.streams import CudaStreams
from meshpar.fsdp.unshard import Unsharder

# [Note: one data-parallel rank]
# With one rank in the data-parallel mesh (and no replicas) the shard is the whole parameter,
# so the all-gather, copy-in / copy-out and the reduce-scatter are copies of the same bytes.
# Unless parameters are cast for compute, the group then aliases: the unsharded parameter is a
# view of the shard's local tensor (nothing freed at reshard) and the unsharded gradient
# becomes the sharded gradient as it is (divided only when a divide factor says so). Placements
# stay Shard(0), so checkpoints are those of any other layout. With a cast (bf16 compute on one
# GPU: parallelize.one_device_fsdp) the group is ``single`` but not ``alias``: each unshard casts
# every shard straight into its unsharded parameter (one copy kernel each, no all-gather buffer,
# no copy-out), and gradients are cast back as the alias path hands them over, so a one-rank step
# issues none of the collective path's copies and launches (docs/performance.md#gpu-speed-against-plain-pytorch).


class ParamGroup:
    """The parameters of one ``fully_shard`` call: their flat layout, ``FSDPModule``'s settings, and
    the phases of an iteration, done by the ``unsharder`` and the ``reducer`` it owns."""

    def __init__(self, params: list[ShardedParam], mesh_info: MeshInfo, mp: MixedPrecisionPolicy,
                 accumulate_dtype: torch.dtype | None = None, several: bool = False):
        self.several = several  # one of several groups of a unit: [Note: several parameter groups in one unit]
        self.params = [p for p in params if p.is_sharded]
        self.replicated = [p for p in params if not p.is_sharded]
        self.mesh_info, self.mp, self.accumulate_dtype = mesh_info, mp, accumulate_dtype
        self.world = mesh_info.shard_size
        # --- FSDPModule settings (names follow PyTorch's) ---
        self.requires_gradient_sync = True  # False: keep unsharded gradients, reduce on a later backward
        self.requires_all_reduce = True  # HSDP, False: reduce-scatter only, sum the partial results
        self.reshard_after_backward = True
        self.unshard_in_backward = True
        self.reduce_unused = False  # True: a trainable parameter without a gradient gets a zero one
        self.max_in_flight = 1  # reductions this unit may keep in flight: [Note: one reduction in flight]
        self.divide_factor: float | None = None  # default: the data-parallel world size
        self.force_sum = False  # set_force_sum_reduction_for_comms: meshpar always sums (reduce.py divides)
        self.all_reduce_hook: tuple[Callable[[torch.Tensor], None], object] | None = None  # (hook, stream)
        self.custom_all_gather = None  # FSDPModule.set_custom_all_gather
        self.custom_reduce_scatter = None
        self.reduce_group: dist.ProcessGroup | None = None  # set_separate_reduce_scatter_group
        # int reshard_after_forward: (group, k, dim name) of the k-rank group backward gathers in
        self.post_forward: tuple[dist.ProcessGroup, int, str] | None = None
        # --- shared with the other units of one root (set at lazy init) ---
        self.streams: CudaStreams | None = None  # on CUDA: [Note: CUDA streams in FSDP]
        self.reduce_queue: ReduceQueue | None = None
        # what this iteration's collectives report to, in forward and backward alike, set at the root's
        # forward (None: the active record): [Note: the active record] in meshpar/distributed/comm_record.py
        self.record: comm_record.CommRecord | None = None
        # --- the parts that do the work, each owning its state in flight ---
        self.reducer = Reducer(self)
        self.unsharder = Unsharder(self, hook_grad=self.reducer.hook_grad)
        self.refresh_layout()

    @property
    def state(self) -> ParamState:
        """Whether the unsharded parameters are registered on the modules (the unsharder's)."""
        return self.unsharder.state

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
        self.unsharder.layout_changed()
        self._refresh_extensions()
        # [Note: forcing the collectives of one rank]; an extension's hooks run at one rank too, as PyTorch's
        self.single = (self.world == 1 and self.mesh_info.replicate_size == 1 and self.custom_all_gather is None
                       and not self.extended and not comm_record.forced())
        self.alias = self.single and all(self.mp.param_dtype in (None, p.orig_dtype) for p in self.params)
        dtypes = {self.compute_dtype(p) for p in self.params}
        if len(dtypes) <= 1:
            segments = [p.padded_numel for p in self.params]
            self.layout = (dtypes.pop() if dtypes else torch.float32, segments)
        else:
            self.layout = (torch.uint8, [-(-p.padded_numel * self.compute_dtype(p).itemsize // 8) * 8
                                         for p in self.params])
        self.per_rank_numel = sum(self.layout[1])

    def _refresh_extensions(self) -> None:
        """Which shards define the all-gather extension (extensions.py), looked up again after their
        local tensors may have been replaced (``to_empty``, or methods patched onto the instance)."""
        for p in self.params:
            local = p.local
            if not has_extension(local, p.name):
                if p.extension is not None:
                    p.extension, p.unsharded, p.unsharded_padded = None, None, None
                continue
            if p.shard_dim:
                raise NotImplementedError(f"{p.name}: an all-gather extension on a shard of dim {p.shard_dim}; "
                                          f"extensions gather dim-0 shards (return None from shard_placement_fn)")
            if p.extension is None or p.extension.local is not local:
                p.extension, p.unsharded, p.unsharded_padded = Extension(p.name, local), None, None
        self.extended = [p for p in self.params if p.extension is not None]
        if self.extended and self.several:
            raise NotImplementedError(f"{self.extended[0].name}: an all-gather extension in a unit whose "
                                      f"shard_placement_fn puts parameters on several meshes (not proven equal to "
                                      f"PyTorch's engine); fully_shard the parameters of the other mesh apart")
        if self.extended and self.post_forward is not None:
            raise NotImplementedError(f"{self.extended[0].name}: an int reshard_after_forward with an all-gather "
                                      f"extension (PyTorch's engine does not run it either); pass True or False")

    def compute_dtype(self, p: ShardedParam) -> torch.dtype:
        return self.mp.param_dtype or p.orig_dtype

    def reduce_dtype(self) -> torch.dtype:
        """The dtype gradients are reduced in (the reducer's)."""
        return self.reducer.reduce_dtype()

    # --- phases: the order between the two parts ------------------------------------------------------
    def unshard(self, async_op: bool = False) -> None:
        """Start the all-gather (``async_op``) or complete the unshard."""
        self.unsharder.unshard(async_op)

    def wait_for_gather(self) -> None:
        """Finish an all-gather in flight (``UnshardHandle.wait``)."""
        self.unsharder.wait()

    def reshard(self, after_forward: bool = False) -> None:
        """Swap the sharded parameters back in and free the unsharded storage (``Unsharder.reshard``)."""
        self.unsharder.reshard(after_forward)

    def post_backward(self) -> None:
        """After this unit's backward: reduce (or keep, without sync) its gradients; reshard."""
        with trace_range("meshpar::fsdp.post_backward"):
            if self.reshard_after_backward:  # first: the gradients outlive the parameters, and the
                self.reshard()  # reduction's buffers then take the unsharded parameters' place
            if self.requires_gradient_sync:
                self.reducer.reduce()
            else:
                self.reducer.accumulate()

    def finish_backward(self) -> None:
        """End of a backward, or ``FSDPModule.reduce_grads``: reduce what no hook reduced (unused
        parameters, gradients accumulated without sync or written outside the hooks), wait, reshard."""
        if self.reducer.has_unreduced():
            self.post_backward()
        self.reducer.wait()
        if self.reshard_after_backward:
            self.reshard()

    def reset(self) -> None:
        """``FSDPModule.reset_iter_state``: after a forward or backward that raised, drop what the
        failed iteration left (collectives in flight are finished and discarded, with every gradient
        not yet handed to the sharded parameters) and reshard."""
        self.reducer.drop()
        self.unsharder.drop_post_forward()
        self.reshard()
