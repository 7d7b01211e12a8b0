"""One managed parameter: its dim-0 shard (a DTensor), its unsharded buffer, and where it lives.

A ``ShardedParam`` is either SHARDED (the module holds ``self.sharded``, an
``nn.Parameter(DTensor)``, and the unsharded storage is freed) or UNSHARDED (the module
holds ``self.unsharded``, a plain ``nn.Parameter`` over a full-size buffer in the compute
dtype). The parameter group moves all its parameters between the two states together.

Sharding follows ``torch.chunk`` on dim 0, as PyTorch's ``fully_shard`` does: with N ranks
each chunk has ``c = ceil(rows / N)`` rows, rank r owns rows ``[r*c, min((r+1)*c, rows))``,
so the last ranks may own fewer rows or none. Collectives need equal sizes, so every rank
sends ``c`` rows ("padded"); the padding rows are never read back.

Notes: [Note: sharding on another dim], [Note: FSDP on a tensor-parallel parameter],
[Note: the unsharded parameter keeps its identity].
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from enum import Enum, auto
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from meshpar.distributed._torch import (
    StridedShard,
    concatenate_meshes,
    dtensor_like,
    dtensor_where_it_is,
    local_tensor,
    module_parameters,
    post_accumulate_grad_hooks,
    preserve_version_counter,
)
from meshpar.distributed.tracing import trace_range
from meshpar.fsdp.policies import CPUOffloadPolicy

# [Note: sharding on another dim]
# ``shard_placement_fn`` may return ``Shard(d)``, d > 0. The dim must divide evenly by N (as in
# PyTorch's engine), so there is no padding: rank r holds ``chunk(N, dim=d)[r]``, contiguous,
# and sends it whole. Every collective still moves ``[N, n]`` rows of flat chunks; only the
# copies differ: ``rows_of`` cuts a full tensor into them (a view on dim 0, a strided copy
# on d) and ``write_unsharded`` puts them back, viewing the full tensor as
# ``[..., N, S[d]/N, ...]`` with the rank dim moved to the front.

# [Note: FSDP on a tensor-parallel parameter]
# A parameter that is already a DTensor on a ``tp`` mesh is sharded on dim 0 of its TP-local
# tensor; the sharded DTensor lives on the joint mesh ``(dp..., tp)`` (one parent mesh).
# When TP splits dim 0 too (column-wise), rank (d, t) holds rows ``d*c`` of TP shard t: in
# global terms, dp's chunks interleave with tp's, which is ``StridedShard(0,
# split_factor=tp)`` (meshpar.distributed._torch) on the dp dim, the placement PyTorch's fully_shard uses, so the two
# engines' checkpoints stay interchangeable. Unsharding rebuilds the TP-local tensor and
# hands the module the TP DTensor over it.

# [Note: the unsharded parameter keeps its identity]
# Autograd saves the unsharded weight (e.g. for ``linear``'s backward), so dropping our reference
# would not free it, and a second parameter object made for backward would not get the gradient
# autograd accumulates into the first. So the unsharded parameter is created once, over its own
# storage, freed with ``storage.resize_(0)`` and refilled in place before backward: the tensor
# autograd saved is the one we refill. The refill bumps the version counter autograd checks, so it
# runs under ``preserve_version_counter``: the values written are the ones forward used. A
# parameter whose whole value is local (replicated below shard_threshold, or every one on one
# rank) is a view of its shard when it computes in the shard's dtype on the shard's device;
# otherwise (cast for mixed precision, copied from a CPU-offloaded shard) it too is written into
# its own storage in place and freed at reshard (tests/test_fsdp.py's local_cast case).


class ParamState(Enum):
    SHARDED = auto()
    UNSHARDED = auto()


@dataclass(frozen=True)
class MeshInfo:
    """The data-parallel mesh seen by one unit: a shard dim, and a replicate dim when hybrid."""

    mesh: DeviceMesh
    shard_dim: int  # mesh dim index parameters are sharded over
    replicate_dim: int | None  # mesh dim index gradients are all-reduced over (hybrid), else None
    # dp_mesh_dims: the full SPMD mesh parameters are DTensors on, and the indices of its shard and
    # replicate dims ([Note: parameters on the full SPMD mesh])
    spmd: DeviceMesh | None = None
    spmd_dims: tuple[int, int | None] | None = None

    @property
    def shard_group(self):
        return self.mesh.get_group(self.shard_dim)

    @property
    def shard_size(self) -> int:
        return self.mesh.size(self.shard_dim)

    @property
    def shard_rank(self) -> int:
        return self.mesh.get_local_rank(self.shard_dim)

    @property
    def replicate_group(self):
        return None if self.replicate_dim is None else self.mesh.get_group(self.replicate_dim)

    @property
    def replicate_size(self) -> int:
        return 1 if self.replicate_dim is None else self.mesh.size(self.replicate_dim)

    def dim_name(self, dim: int) -> str:
        names = self.mesh.mesh_dim_names
        return names[dim] if names else f"dim{dim}"

    @property
    def shard_dim_name(self) -> str:
        return self.dim_name(self.shard_dim)

    def placements(self, sharded: bool, dim: int = 0) -> tuple[Placement, ...]:
        shard: Placement = Shard(dim) if sharded else Replicate()
        return (shard,) if self.replicate_dim is None else (Replicate(), shard)


# [Note: parameters on the full SPMD mesh]
# With ``dp_mesh_dims`` a parameter is a DTensor on the whole mesh, Replicate on the data-parallel
# dims and (say) Shard on ``tp``. Its local tensor is the TP-local one, so FSDP shards it exactly
# as a parameter of a tp sub-mesh ([Note: FSDP on a tensor-parallel parameter]); only the sharded
# DTensor differs: it stays on the full mesh, in its dim order, with the shard dim's Replicate
# replaced by Shard(d), or StridedShard(d, sf) when later mesh dims (sf ranks in all) already
# split dim d, as PyTorch's engine places it. Its gradient may be Partial on the data-parallel
# dims (a batch sharded over them): that local partial sum is what FSDP reduces, so only the other
# dims are redistributed.


@dataclass(frozen=True)
class _TensorParallelSpec:
    mesh: DeviceMesh  # the tp sub-mesh the parameter was distributed on
    placements: tuple[Placement, ...]


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= size
    return tuple(reversed(stride))


class ShardedParam:
    """See the module docstring. ``places`` are every (module, attribute) holding this parameter
    (more than one for tied weights)."""

    def __init__(self, param: nn.Parameter, places: list[tuple[nn.Module, str]], mesh_info: MeshInfo,
                 device: torch.device, *, shard: bool, shard_dim: int = 0, offload: CPUOffloadPolicy | None = None):
        """``device``: where unsharded parameters and collectives live; the shard lives there too,
        or on CPU with ``offload`` (pinned when an accelerator exists to copy to). ``shard_dim``:
        the dim to shard ([Note: sharding on another dim])."""
        self.places, self.mesh_info, self.is_sharded = places, mesh_info, shard
        self.compute_device = device
        self.orig_dtype = param.dtype
        self.global_shape = param.shape
        self.tp: _TensorParallelSpec | None = None
        if isinstance(param, DTensor):  # sharded further on dim 0 of its tensor-parallel local tensor
            self.tp = _TensorParallelSpec(param.device_mesh, tuple(param.placements))
            param = param.to_local()
        self.shape = param.shape  # the tensor FSDP shards: the parameter, or its TP-local tensor
        self.shard_dim = shard_dim if shard else 0
        n, r = (mesh_info.shard_size, mesh_info.shard_rank) if shard else (1, 0)
        self.n = n  # ranks the parameter is split over (1: replicated)
        self.rows_per_rank = math.ceil(self.shape[0] / n) if self.shape[0] else 0  # c
        self.inner = math.prod(self.shape[1:])  # elements per row
        self.local_rows = max(0, min(self.rows_per_rank, self.shape[0] - r * self.rows_per_rank))
        if self.shard_dim:  # [Note: sharding on another dim]: even, no padding
            d = self.shard_dim
            self.local_shape = torch.Size((*self.shape[:d], self.shape[d] // n, *self.shape[d + 1:]))
            self._padded_numel = self.local_shape.numel()
        else:
            self.local_shape = torch.Size((self.local_rows, *self.shape[1:]))
            self._padded_numel = self.rows_per_rank * self.inner
        if param.device.type == "meta":  # meta init: shards materialize with to_empty
            local_device = param.device
        else:
            local_device = torch.device("cpu") if offload is not None else device
        pin = offload is not None and offload.pin_memory and local_device.type == "cpu" and device.type != "cpu"
        if type(param.detach()) is torch.Tensor:
            local = torch.empty(self.local_shape, dtype=param.dtype, device=local_device, pin_memory=pin)
        else:  # a tensor subclass keeps its class (and with it an all-gather extension: extensions.py)
            local = param.detach().new_zeros(self.local_shape, device=local_device)  # new_empty may unwrap it
        if param.device.type != "meta":
            with torch.no_grad():
                if self.shard_dim:
                    local.copy_(param.detach().chunk(n, dim=self.shard_dim)[r])
                else:
                    start = r * self.rows_per_rank
                    local.copy_(param.detach()[start:start + self.local_rows])
        self._mesh, self._placements = self._sharded_layout()
        self.sharded = nn.Parameter(self._to_dtensor(local), requires_grad=param.requires_grad)
        self.unsharded: nn.Parameter | None = None
        self.unsharded_padded: torch.Tensor | None = None  # [N*c, ...] view of the unsharded storage
        self.accumulated_grad: torch.Tensor | None = None  # unsharded, across no-sync microbatches
        # the unsharded parameter that carries our post-accumulate-grad hook: [Note: hook the object, not its id]
        self.hooked: weakref.ref[nn.Parameter] | None = None
        self.extension: Any = None  # extensions.Extension when the shard defines the all-gather extension
        self.state = ParamState.SHARDED
        self.set_on_modules(self.sharded)

    # --- sizes -------------------------------------------------------------------------------
    @property
    def padded_numel(self) -> int:
        """Elements this rank sends per all-gather (its chunk, padded to ``c`` rows on dim 0)."""
        return self._padded_numel

    @property
    def requires_grad(self) -> bool:
        """Read from the sharded parameter, so ``requires_grad_`` after fully_shard takes effect."""
        return self.sharded.requires_grad

    # --- flat rows: the per-rank chunks every collective moves --------------------------------------
    def rows_of(self, full: torch.Tensor, world: int) -> torch.Tensor:
        """``full`` (the unsharded shape) as ``[world, padded_numel * N / world]``: row i is rank i's
        chunk (dim 0: padded rows, a view when no padding is needed; dim d: a strided copy)."""
        if self.shard_dim:
            d, shape = self.shard_dim, self.shape
            return full.reshape(*shape[:d], world, shape[d] // world, *shape[d + 1:]).movedim(d, 0).reshape(world, -1)
        padding = self.n * self.rows_per_rank - self.shape[0]
        rows = full.reshape(self.shape[0], self.inner)
        return (F.pad(rows, (0, 0, 0, padding)) if padding else rows).view(world, -1)

    def write_unsharded(self, pieces: torch.Tensor, world: int) -> None:
        """Fill the unsharded parameter from ``pieces`` (``[world, m]``, row i from rank i of a
        ``world``-rank all-gather) without bumping autograd's version counter."""
        out = self.alloc_unsharded(pieces.dtype, self.n)
        with preserve_version_counter(self.unsharded):
            if self.shard_dim:
                d, shape = self.shard_dim, self.shape
                chunk = (*shape[:d], shape[d] // world, *shape[d + 1:])
                out.view(*shape[:d], world, shape[d] // world, *shape[d + 1:]).copy_(
                    pieces.view(world, *chunk).movedim(0, d))
            else:
                out.view(world, -1).copy_(pieces)

    def local_of(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's chunk, shaped like the local shard, from its flat (padded) row."""
        return flat[:self.local_shape.numel()].view(self.local_shape)

    def post_forward_piece(self, k: int, rank: int) -> torch.Tensor:
        """Rank ``rank`` of ``k``'s share of the unsharded parameter (int reshard_after_forward)."""
        if self.shard_dim:
            return self.rows_of(self.unsharded_padded, k)[rank].clone()
        return self.unsharded_padded.view(k, -1)[rank].clone()

    @property
    def local(self) -> torch.Tensor:
        """The shard's local tensor itself (not ``to_local()``, which under grad mode goes through an
        autograd function: a node per call, and FSDP reads shards a dozen times per step)."""
        return local_tensor(self.sharded)

    def _sharded_layout(self) -> tuple[DeviceMesh, tuple[Placement, ...]]:
        """Mesh and placements of the sharded DTensor. With tensor parallelism, the joint mesh
        (data-parallel dims outermost) and, as PyTorch's fully_shard makes them, a strided shard
        when TP already splits dim 0: [Note: FSDP on a tensor-parallel parameter]."""
        dp = self.mesh_info.placements(self.is_sharded, self.shard_dim)
        if self.mesh_info.spmd is not None:  # [Note: parameters on the full SPMD mesh]
            spmd, (shard_idx, _) = self.mesh_info.spmd, self.mesh_info.spmd_dims
            placements = list(self.tp.placements)
            if self.is_sharded:
                d = self.shard_dim
                sf = math.prod(spmd.size(j) for j in range(shard_idx + 1, spmd.ndim)
                               if isinstance(placements[j], Shard) and placements[j].dim == d)
                placements[shard_idx] = StridedShard(d, split_factor=sf) if sf > 1 else Shard(d)
            return spmd, tuple(placements)
        if self.tp is None:
            return self.mesh_info.mesh, dp
        tp_shards_dim0 = math.prod(self.tp.mesh.size(i) for i, pl in enumerate(self.tp.placements)
                                   if isinstance(pl, Shard) and pl.dim == 0)
        if self.is_sharded and tp_shards_dim0 > 1:
            dp = (*dp[:-1], StridedShard(0, split_factor=tp_shards_dim0))
        return concatenate_meshes([self.mesh_info.mesh, self.tp.mesh]), (*dp, *self.tp.placements)

    def _to_dtensor(self, local: torch.Tensor) -> DTensor:
        return dtensor_where_it_is(local, self._mesh, self._placements, self.global_shape,
                                   _contiguous_stride(self.global_shape))

    # --- module attributes ---------------------------------------------------------------------
    def set_on_modules(self, param: nn.Parameter) -> None:
        for module, attr in self.places:
            module_parameters(module)[attr] = param

    def refresh_after_apply(self) -> None:
        """After ``module._apply`` (``to_empty``, ``.to``) or ``load_state_dict(assign=True)`` replaced
        our sharded parameter, adopt the new one (and its dtype: ``model.to(torch.float32)``
        changes what is gathered) and make every tied place hold it again."""
        module, attr = self.places[0]
        new = module_parameters(module)[attr]
        if new is not self.sharded and new is not self.unsharded:
            if not isinstance(new, DTensor):
                raise RuntimeError(f"{type(module).__name__}.{attr} is no longer a sharded DTensor after a module "
                                   f"conversion; convert fully-sharded modules with to_empty / .to only, and load "
                                   f"state dicts of DTensors")
            if not isinstance(new, nn.Parameter):
                new = nn.Parameter(new, requires_grad=self.sharded.requires_grad)
            self.sharded = new
        if self.sharded.dtype != self.orig_dtype:
            self.orig_dtype = self.sharded.dtype
            self.unsharded = self.unsharded_padded = None  # reallocated in the new dtype on the next unshard
        if self.state is ParamState.SHARDED:
            self.set_on_modules(self.sharded)

    # --- unsharded buffer ----------------------------------------------------------------------
    def alloc_unsharded(self, dtype: torch.dtype, world: int) -> torch.Tensor:
        """Allocate (or re-allocate) the unsharded storage; returns its padded [N*c, ...] view
        (the full shape when sharded on another dim: no padding)."""
        nbytes = world * self.padded_numel * dtype.itemsize
        if self.unsharded is None or self.unsharded.dtype != dtype:
            rows = world * self.rows_per_rank if not self.shard_dim else self.shape[0]
            storage = torch.empty(rows, *self.shape[1:], dtype=dtype, device=self.compute_device)
            self.unsharded_padded = storage
            self.unsharded = self.as_unsharded_param(storage[:self.shape[0]])
        elif self.unsharded_padded.untyped_storage().size() != nbytes:
            self.unsharded_padded.untyped_storage().resize_(nbytes)
        return self.unsharded_padded

    def as_unsharded_param(self, full: torch.Tensor) -> nn.Parameter:
        """The parameter the module computes with: ``full`` itself, or the TP DTensor over it."""
        if self.tp is not None:
            full = DTensor.from_local(full, self.tp.mesh, self.tp.placements, run_check=False,
                                      shape=self.global_shape, stride=_contiguous_stride(self.global_shape))
        return nn.Parameter(full, requires_grad=self.requires_grad)

    @property
    def name(self) -> str:
        module, attr = self.places[0]
        return f"{type(module).__name__}.{attr}"

    def free_unsharded(self) -> None:
        if self.extension is not None:
            self.extension.free()
        elif self.unsharded_padded is not None:
            self.unsharded_padded.untyped_storage().resize_(0)

    def to_unsharded(self) -> None:
        if self.unsharded.requires_grad != self.requires_grad:  # frozen or unfrozen since the last unshard
            self.unsharded.requires_grad_(self.requires_grad)
        self.set_on_modules(self.unsharded)
        self.state = ParamState.UNSHARDED

    def to_sharded(self) -> None:
        self.set_on_modules(self.sharded)
        self.state = ParamState.SHARDED

    # --- gradients -----------------------------------------------------------------------------
    def take_unsharded_grad(self) -> torch.Tensor | None:
        """The unsharded gradient summed over no-sync microbatches; clears both sources."""
        grad = self.unsharded.grad if self.unsharded is not None else None
        if self.unsharded is not None:
            self.unsharded.grad = None
        if isinstance(grad, DTensor):  # TP: reduce the local gradient of this TP shard
            target = self.tp.placements
            if self.mesh_info.spmd is not None:  # FSDP reduces the data-parallel dims itself
                dp = {i for i in self.mesh_info.spmd_dims if i is not None}
                target = tuple(grad.placements[i] if i in dp else pl for i, pl in enumerate(target))
            with trace_range("meshpar::tp.partial_grad"):  # Partial -> Replicate: an all-reduce
                grad = grad.redistribute(placements=target).to_local()
        if self.accumulated_grad is not None:
            grad = self.accumulated_grad if grad is None else self.accumulated_grad.add_(grad)
            self.accumulated_grad = None
        return grad

    def add_sharded_grad(self, local_grad: torch.Tensor) -> None:
        """Accumulate a reduced local gradient into ``sharded.grad`` (a DTensor like the parameter),
        then run the parameter's post-accumulate-grad hooks (optimizer in backward), as autograd
        runs them for a parameter it accumulates into."""
        device = self.local.device
        if local_grad.dtype != self.orig_dtype or local_grad.device != device:
            local_grad = local_grad.to(device, self.orig_dtype)  # to CPU when offloaded
        if self.sharded.grad is None:
            self.sharded.grad = dtensor_like(local_grad, self.sharded)
        else:
            local_tensor(self.sharded.grad).add_(local_grad)
        for hook in post_accumulate_grad_hooks(self.sharded):
            hook(self.sharded)
