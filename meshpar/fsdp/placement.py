"""Where each parameter of a unit goes: ``shard_placement_fn``'s answer resolved to a shard dim and
a mesh, and the unit's parameters grouped by mesh, one ``ParamGroup`` (param_group.py) each.

[Note: several parameter groups in one unit]
``shard_placement_fn(param)`` may return ``ShardPlacementResult(placement, mesh_info)`` (PyTorch
2.13): that parameter is sharded over ``mesh_info``'s mesh instead of ``fully_shard``'s, so one
unit (a mixture-of-experts block) can shard its dense weights over ``dp_shard`` and its stacked
experts over the ranks ep leaves. Parameters are grouped by (shard process group, replicate
process group) in first-seen order, as PyTorch's engine does; each group is a ``ParamGroup`` with
its own collectives, default divide factor (its own data-parallel size) and int
``reshard_after_forward`` groups. The unit's hooks run every group's phases in order, backward
prefetch and the end of backward in reverse (state.py), as PyTorch's does. Settings that name one
collective for the unit (custom all-gather / reduce-scatter, the all-reduce hook) are refused with
several groups, as in PyTorch; all-gather extensions and CPU offload are refused too, not proven
equal to PyTorch's engine there.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.tensor import DTensor, Shard

from meshpar.distributed._torch import fsdp_mesh_info_parts, shard_placement_result
from meshpar.fsdp.sharded_param import MeshInfo


def shard_dim(placement: Any, param: nn.Parameter, name: str, world: int) -> int:
    """The dim ``placement`` (``Shard(d)`` or None: dim 0) shards ``param`` on, checked against the
    ``world`` shard ranks."""
    if placement is None:
        return 0
    if not isinstance(placement, Shard):
        raise ValueError(f"shard_placement_fn returned {placement!r} for {name}; it must return Shard(dim) or None "
                         f"(None: the default, Shard(0)), or ShardPlacementResult(Shard(dim) or None, mesh_info)")
    dim = placement.dim + param.ndim if placement.dim < 0 else placement.dim
    if not 0 <= dim < param.ndim:
        raise ValueError(f"shard_placement_fn returned Shard({placement.dim}) for {name}, of shape "
                         f"{tuple(param.shape)}; the dim must exist")
    if dim and param.shape[dim] % world:
        raise ValueError(f"shard_placement_fn returned Shard({dim}) for {name}, of shape {tuple(param.shape)}: dim "
                         f"{dim} ({param.shape[dim]}) must divide evenly by the {world} shard ranks (only dim 0 may "
                         f"be uneven); pick another dim or return None for Shard(0)")
    if dim and isinstance(param, DTensor):
        raise NotImplementedError(f"{name} is tensor-parallel; FSDP shards a tensor-parallel parameter on dim 0 "
                                  f"only (return None from shard_placement_fn for it)")
    return dim


class Placements:
    """The parameters of one ``fully_shard`` call, placed one by one (``add``) and grouped by mesh."""

    def __init__(self, default: MeshInfo):
        self.default = default
        # (shard group, replicate group) -> (torch's mesh info, None for fully_shard's mesh; ours; param ids)
        self._groups: dict[tuple, tuple[Any, MeshInfo, list[int]]] = {}
        self._converted: dict[int, tuple[Any, MeshInfo]] = {}  # id(torch's mesh info) -> (it, ours)

    def add(self, pid: int, param: nn.Parameter, name: str, result: Any) -> int:
        """Place ``param`` per ``result`` (what ``shard_placement_fn`` returned for it); its shard dim."""
        torch_info, info, placement = None, self.default, result
        if result is not None and not isinstance(result, Shard):
            parts = shard_placement_result(result)
            if parts is None:
                shard_dim(result, param, name, 1)  # raises, naming what it may return
            placement, torch_info = parts
            info = self._mesh_info(torch_info, param, name)
        key = (info.shard_group, info.replicate_group)
        if key not in self._groups:
            self._groups[key] = (torch_info, info, [])
        elif self._groups[key][0] is not torch_info:  # PyTorch's engine refuses it too
            raise ValueError(f"{name}: parameters over the same process groups must name the same mesh info "
                             f"object; return one FSDPMeshInfo per mesh from shard_placement_fn (and a plain "
                             f"Shard or None for fully_shard's own mesh)")
        self._groups[key][2].append(pid)
        return shard_dim(placement, param, name, info.shard_size)

    def groups(self) -> list[tuple[MeshInfo, list[int]]]:
        """``(mesh info, param ids)`` per group, in the order their first parameters came."""
        return [(info, pids) for _, info, pids in self._groups.values()]

    def _mesh_info(self, torch_info: Any, param: nn.Parameter, name: str) -> MeshInfo:
        if id(torch_info) in self._converted:
            return self._converted[id(torch_info)][1]
        mesh, shard, replicate = fsdp_mesh_info_parts(torch_info)
        if self.default.spmd is not None:
            raise NotImplementedError(f"{name}: a ShardPlacementResult with dp_mesh_dims (parameters on the full "
                                      f"SPMD mesh); pass the data-parallel sub-mesh as mesh= instead")
        if isinstance(param, DTensor):
            raise NotImplementedError(f"{name} is tensor-parallel; meshpar shards a tensor-parallel parameter over "
                                      f"fully_shard's mesh only (return None or a Shard from shard_placement_fn)")
        if (mesh.ndim, shard, replicate) not in ((1, 0, None), (2, 1, 0)):
            raise NotImplementedError(
                f"{name}: ShardPlacementResult's mesh info must be FSDPMeshInfo(mesh_1d, shard_mesh_dim=0) or "
                f"HSDPMeshInfo(mesh_2d, shard_mesh_dim=1, replicate_mesh_dim=0); got a {mesh.ndim}-D mesh with "
                f"shard dim {shard}, replicate dim {replicate}")
        if mesh.device_type != self.default.mesh.device_type:
            raise ValueError(f"{name}: ShardPlacementResult's mesh is on {mesh.device_type}, fully_shard's on "
                             f"{self.default.mesh.device_type}; one unit lives on one device type")
        info = MeshInfo(mesh, shard_dim=shard, replicate_dim=replicate)
        self._converted[id(torch_info)] = (torch_info, info)
        return info
