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

This file holds the group's state, settings and layout; ``ParamGroup`` takes its all-gather side
from unshard.py (``GroupUnshard``) and its gradient side from reduce.py (``GroupReduce``, with
the ``ReduceQueue`` the units of one root share).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from meshpar.distributed import comm, comm_record
from meshpar.fsdp.extensions import Extension, has_extension
from meshpar.fsdp.policies import MixedPrecisionPolicy
from meshpar.fsdp.reduce import GroupReduce, ReduceQueue
from meshpar.fsdp.sharded_param import MeshInfo, ParamState, ShardedParam
from meshpar.fsdp.streams import CudaStreams, _wait
from meshpar.fsdp.unshard import GroupUnshard

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


class ParamGroup(GroupUnshard, GroupReduce):
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
        self.force_sum = False  # set_force_sum_reduction_for_comms: meshpar always sums (reduce.py divides)
        self.all_reduce_hook: tuple[Callable[[torch.Tensor], None], object] | None = None  # (hook, stream)
        self.custom_all_gather = None  # FSDPModule.set_custom_all_gather
        self.custom_reduce_scatter = None
        self.reduce_group: dist.ProcessGroup | None = None  # set_separate_reduce_scatter_group
        # --- in flight ---
        self.streams: CudaStreams | None = None  # on CUDA (set at lazy init): [Note: CUDA streams in FSDP]
        # all-gather in flight: (work, output, its world, the event that ends it on CUDA)
        self._gather: tuple[comm.Work, torch.Tensor, int, torch.cuda.Event | None] | None = None
        self._gather_pieces: list | None = None  # its layout when it carries extension inputs (unshard.Piece)
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
        self._grads_expected = 0  # trainable parameters, counted at each backward's first gradient
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
        self._cast_plan = None  # unshard.py [Note: the steady cast]
        self._refresh_extensions()
        # [Note: forcing the collectives of one rank]; an extension's hooks run at one rank too, as PyTorch's
        self.single = (self.world == 1 and self.mesh_info.replicate_size == 1 and self.custom_all_gather is None
                       and not self.extended and not comm_record.forced())
        self.alias = self.single and all(self.mp.param_dtype in (None, p.orig_dtype) for p in self.params)
        dtypes = {self.compute_dtype(p) for p in self.params}
        if len(dtypes) <= 1:
            segments = [p.padded_numel for p in self.params]
            self._layout = (dtypes.pop() if dtypes else torch.float32, segments)
        else:
            self._layout = (torch.uint8, [-(-p.padded_numel * self.compute_dtype(p).itemsize // 8) * 8
                                          for p in self.params])
        self.per_rank_numel = sum(self._layout[1])

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
        if self.extended and self.post_forward is not None:
            raise NotImplementedError(f"{self.extended[0].name}: an int reshard_after_forward with an all-gather "
                                      f"extension (PyTorch's engine does not run it either); pass True or False")

    def compute_dtype(self, p: ShardedParam) -> torch.dtype:
        return self.mp.param_dtype or p.orig_dtype

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
