"""``fully_shard``: the entry point of meshpar's FSDP engine.

    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)   # the root: embeddings, final norm, output

``fully_shard`` changes the module's class to also derive from ``FSDPModule`` (no wrapper;
parameter names unchanged) and replaces each managed parameter with an
``nn.Parameter(DTensor)`` sharded on dim 0 (or the dim ``shard_placement_fn`` picks) over
``mesh`` (1-D), or over the second dim of a 2-D ``(replicate, shard)`` mesh (hybrid);
``shard_placement_fn`` may put some parameters on another mesh (placement.py).

The API is PyTorch 2.13's FSDP2 API, name for name and signature for signature
(tests/test_fsdp_api.py checks it; tests/test_fsdp_compat.py runs the same scripts under both
engines), so switching engines is one import. Where meshpar differs, the README's FSDP section
says so. Layers: api (here; ``FSDPModule``'s methods in module.py) -> hook state (state.py) ->
parameter group (param_group.py) -> sharded parameter (sharded_param.py) -> collectives
(meshpar/distributed/comm.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from meshpar.distributed._torch import module_parameters, unflatten_mesh
from meshpar.fsdp.module import FSDPModule
from meshpar.fsdp.param_group import ParamGroup
from meshpar.fsdp.placement import Placements
from meshpar.fsdp.policies import CPUOffloadPolicy, DataParallelMeshDims, MixedPrecisionPolicy, OffloadPolicy
from meshpar.fsdp.sharded_param import MeshInfo, ShardedParam
from meshpar.fsdp.state import FSDPState

_CLASSES: dict[type, type] = {}

# [Note: a parameter in two units]
# fully_shard swaps the sharded parameter in on the modules of its own unit. A module outside the
# unit that holds the same tensor (an output projection tied to an embedding sharded apart) keeps the
# original, which a later fully_shard would shard again: two copies, each with its own gradient and
# optimizer state, and the tie gone after the first step. PyTorch's engine refuses it at the root's
# first forward; meshpar at the second fully_shard, naming the first unit. The original carries the
# name of the unit that sharded it (``SHARDED_BY``, an attribute of that tensor object alone): no
# registry outlives it or is shared between models, and a sharded model's full-size originals can
# still be freed.
SHARDED_BY = "meshpar_sharded_by"


def _remember_sharded(p: nn.Parameter, unit: str) -> None:
    setattr(p, SHARDED_BY, unit)


def _unit_sharding(p: nn.Parameter) -> str | None:
    """The unit that sharded ``p`` (the very tensor) earlier, if one did."""
    return getattr(p, SHARDED_BY, None)


def _default_mesh() -> DeviceMesh:
    if not dist.is_initialized():
        raise ValueError("fully_shard without mesh= needs an initialized default process group "
                         "(torch.distributed.init_process_group), or pass mesh=init_device_mesh(...)")
    device_type = "cuda" if torch.cuda.is_available() and dist.get_backend() != "gloo" else "cpu"
    return init_device_mesh(device_type, (dist.get_world_size(),))


def _spmd_mesh_info(mesh: DeviceMesh, dims: DataParallelMeshDims) -> MeshInfo:
    """``dp_mesh_dims``: the data-parallel sub-mesh of the full SPMD ``mesh`` ([Note: parameters on
    the full SPMD mesh] in sharded_param.py)."""
    names = mesh.mesh_dim_names
    if not names:
        raise ValueError("fully_shard(dp_mesh_dims=...) needs a mesh with named dims "
                         "(init_device_mesh(..., mesh_dim_names=(...)))")
    unknown = [n for n in (*dims.shard_names, *dims.replicate_names) if n not in names]
    if unknown:
        raise ValueError(f"dp_mesh_dims names {unknown}, not dims of the mesh {names}")
    if len(dims.shard_names) != 1 or len(dims.replicate_names) > 1:
        raise NotImplementedError(
            f"dp_mesh_dims={dims}: meshpar takes exactly one shard dim and at most one replicate dim; flatten "
            f"several into one mesh dim first (or pass the data-parallel sub-mesh as mesh=)")
    shard, replicate = dims.shard_names[0], (dims.replicate_names or (None,))[0]
    spmd_dims = (names.index(shard), None if replicate is None else names.index(replicate))
    if replicate is None:
        return MeshInfo(mesh[shard], shard_dim=0, replicate_dim=None, spmd=mesh, spmd_dims=spmd_dims)
    return MeshInfo(mesh[replicate, shard], shard_dim=1, replicate_dim=0, spmd=mesh, spmd_dims=spmd_dims)


def _mesh_info(mesh: DeviceMesh, dp_mesh_dims: DataParallelMeshDims | None) -> MeshInfo:
    if dp_mesh_dims is not None:
        return _spmd_mesh_info(mesh, dp_mesh_dims)
    if mesh.ndim == 1:
        return MeshInfo(mesh, shard_dim=0, replicate_dim=None)
    if mesh.ndim == 2:
        if not mesh.mesh_dim_names:
            raise ValueError("fully_shard on a 2-D mesh needs named dims (replicate, shard), e.g. "
                             "init_device_mesh(..., mesh_dim_names=('dp_replicate', 'dp_shard'))")
        return MeshInfo(mesh, shard_dim=1, replicate_dim=0)
    raise ValueError(f"fully_shard takes a 1-D mesh (shard) or a 2-D mesh (replicate, shard); got {mesh.ndim}-D "
                     f"{mesh.mesh_dim_names}")


def _managed(modules: list[nn.Module], ignored: set[int]) -> dict[int, list[tuple[nn.Module, str]]]:
    """Parameters of ``modules`` not owned by a nested unit: id -> every (module, attr) holding it."""
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    roots = {id(m) for m in modules}
    stack, seen = list(reversed(modules)), set()
    while stack:
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        if id(m) not in roots and isinstance(m, FSDPModule):
            continue
        for attr, p in module_parameters(m).items():
            if p is not None and id(p) not in ignored:
                places.setdefault(id(p), []).append((m, attr))
        stack.extend(reversed(list(m.children())))
    return places


def _check_spmd_param(p: nn.Parameter, name: str, info: MeshInfo) -> None:
    if not isinstance(p, DTensor) or p.device_mesh != info.spmd:
        raise ValueError(f"{name} is not a DTensor on the mesh passed to fully_shard; with dp_mesh_dims every "
                         f"parameter must be one (distribute it on the full mesh, Replicate() on the "
                         f"data-parallel dims)")
    for i in info.spmd_dims:
        if i is not None and not isinstance(p.placements[i], Replicate):
            raise ValueError(f"{name} is {p.placements[i]} on the data-parallel mesh dim "
                             f"{info.spmd.mesh_dim_names[i]!r}; with dp_mesh_dims it must be Replicate() there "
                             f"(FSDP shards it)")


_FULL_PRECISION = MixedPrecisionPolicy()
_NO_OFFLOAD = OffloadPolicy()


def fully_shard(module: nn.Module | list[nn.Module], *, mesh: DeviceMesh | None = None,
                reshard_after_forward: bool | int | None = None,
                shard_placement_fn: Callable[[nn.Parameter], Shard | Any | None] | None = None,
                mp_policy: MixedPrecisionPolicy = _FULL_PRECISION, offload_policy: OffloadPolicy = _NO_OFFLOAD,
                ignored_params: set[nn.Parameter] | None = None, dp_mesh_dims: DataParallelMeshDims | None = None,
                shard_threshold: int = 0, accumulate_dtype: torch.dtype | None = None) -> nn.Module | list[nn.Module]:
    """Shard ``module``'s parameters (those no nested ``fully_shard`` took) over ``mesh``.

    ``module``: a module, or a list of modules that form one unit (one all-gather, one
    reduction; [Note: a group of several modules] in state.py). ``mesh``: 1-D (shard) or 2-D
    (replicate, shard); None: every rank of the default process group.
    ``reshard_after_forward``: True frees unsharded parameters after forward and all-gathers
    again in backward; False keeps them until after backward; an int ``k`` keeps 1/k of them
    ([Note: int reshard_after_forward]); None (the default) is True, except for the root,
    which backward needs first and so keeps them (as PyTorch's ``fully_shard`` does).
    ``shard_placement_fn(param)``: ``Shard(d)`` shards ``param`` on dim d (which must divide
    evenly unless d is 0), None on dim 0; ``ShardPlacementResult(Shard(d) or None, mesh_info)``
    shards it over ``mesh_info``'s mesh, in a parameter group of its own ([Note: several
    parameter groups in one unit] in placement.py). ``offload_policy``: ``CPUOffloadPolicy()`` keeps
    shards, gradients and so optimizer state on CPU. ``ignored_params``: left alone (not
    sharded, not reduced). ``dp_mesh_dims``: ``mesh`` is the full SPMD mesh, every parameter a
    DTensor on it (Replicate on the dims named here), sharded over ``shard`` and replicated
    over ``replicate`` ([Note: parameters on the full SPMD mesh] in sharded_param.py).
    ``shard_threshold`` (meshpar's addition): parameters with fewer
    elements stay replicated, their gradients all-reduced. ``accumulate_dtype`` (meshpar's
    addition): the dtype unsharded gradients are summed in across microbatches without
    gradient sync (None: ``reduce_dtype``, as in PyTorch's engine; [Note: accumulating in
    reduce_dtype] in reduce.py).
    """
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    if not modules or not all(isinstance(m, nn.Module) for m in modules):
        raise ValueError(f"fully_shard takes an nn.Module or a non-empty list of them; got {module!r}")
    for m in modules:
        if isinstance(m, FSDPModule):
            raise ValueError(f"fully_shard was already applied to this {type(m).__bases__[-1].__name__}; "
                             f"apply it once per module")
    if len({id(m) for m in modules}) != len(modules):
        raise ValueError("fully_shard got the same module twice in one list")
    if offload_policy is None:
        offload_policy = _NO_OFFLOAD
    if not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(f"offload_policy must be OffloadPolicy() or CPUOffloadPolicy(...); got {offload_policy!r}")
    info = _mesh_info(mesh or _default_mesh(), dp_mesh_dims)
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, bool):
        if info.spmd is not None:
            raise NotImplementedError("an int reshard_after_forward with dp_mesh_dims; pass True or False")
        n = info.shard_size
        if not isinstance(reshard_after_forward, int) or reshard_after_forward < 1 or n % reshard_after_forward:
            raise ValueError(f"reshard_after_forward={reshard_after_forward!r}: an int must divide the shard group "
                             f"size {n} (e.g. the GPUs per node)")
    places = _managed(modules, {id(p) for p in ignored_params or ()})
    params = {pid: module_parameters(pl[0][0])[pl[0][1]] for pid, pl in places.items()}
    devices = {p.device for p in params.values()}
    if len(devices) > 1:
        raise ValueError(f"{type(modules[0]).__name__} has parameters on several devices "
                         f"({sorted(map(str, devices))}); move it to one device (or build it on meta) before "
                         f"fully_shard")
    dims, placements = {}, Placements(info)
    for pid, p in params.items():
        name = f"{type(places[pid][0][0]).__name__}.{places[pid][0][1]}"
        earlier = _unit_sharding(p)  # a nested unit or a sibling: [Note: a parameter in two units]
        if earlier is not None:
            raise ValueError(f"{name} is shared with a parameter already managed by another FSDP unit ({earlier}); "
                             f"tied parameters must live in one unit: fully_shard([module_a, module_b]) together, "
                             f"or a module that holds every use of it")
        if not p.is_floating_point():
            raise ValueError(f"{name} is {p.dtype}; fully_shard shards floating-point parameters only "
                             f"(register it as a buffer, or pass it in ignored_params)")
        if info.spmd is not None:
            _check_spmd_param(p, name, info)
        elif isinstance(p, DTensor) and len(p.device_mesh.shape) != 1:
            raise NotImplementedError(f"{name} is a DTensor on a {p.device_mesh.ndim}-D mesh; fully_shard composes "
                                      f"with 1-D tensor parallelism (a tp sub-mesh), or takes the full mesh with "
                                      f"dp_mesh_dims")
        if p.ndim == 0:
            raise ValueError(f"{name} is a 0-dim parameter; fully_shard needs at least one dim to shard "
                             f"(make it shape [1], or pass it in ignored_params)")
        dims[pid] = placements.add(pid, p, name, shard_placement_fn(p) if shard_placement_fn is not None else None)
    grouped = placements.groups()  # [Note: several parameter groups in one unit] in placement.py
    several = len(grouped) > 1
    if several and isinstance(offload_policy, CPUOffloadPolicy):
        raise NotImplementedError("CPUOffloadPolicy on a unit whose shard_placement_fn puts parameters on several "
                                  "meshes (not proven equal to PyTorch's engine); offload a unit of one mesh, or "
                                  "fully_shard the parameters of the other mesh as a unit of their own")
    device = _device(info.mesh)
    offload = offload_policy if isinstance(offload_policy, CPUOffloadPolicy) else None
    groups = []
    for group_info, pids in grouped:
        sharded = [ShardedParam(params[pid], places[pid], group_info, device, offload=offload, shard_dim=dims[pid],
                                shard=params[pid].numel() >= shard_threshold) for pid in pids]
        group = ParamGroup(sharded, group_info, mp_policy, accumulate_dtype, several=several)
        if reshard_after_forward is not None and not isinstance(reshard_after_forward, bool):
            _reshard_to(group, reshard_after_forward)
        groups.append(group)
    unit = ", ".join(type(m).__name__ for m in modules)
    for p in params.values():  # [Note: a parameter in two units]
        _remember_sharded(p, unit)
    state = FSDPState(modules, groups, mp_policy, reshard_after_forward)
    for group in groups:
        _register_state_dict_hooks(group)
    for m in modules:
        m._fsdp_state = state
        cls = m.__class__
        if cls not in _CLASSES:
            _CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
        m.__class__ = _CLASSES[cls]
    return module


def _register_state_dict_hooks(group: ParamGroup) -> None:
    """``state_dict()`` / ``load_state_dict()`` see the sharded DTensors (reshard first, as PyTorch's
    engine does), and a load that assigned new ones (``assign=True``) is adopted after."""
    holders = {id(m): m for p in group.all_params for m, _ in p.places}
    for m in holders.values():
        m.register_state_dict_pre_hook(lambda *_: group.reshard())
        m.register_load_state_dict_pre_hook(lambda *_: group.reshard())
        m.register_load_state_dict_post_hook(lambda *_: group.refresh())


def _reshard_to(group: ParamGroup, k: int) -> None:
    """An int ``reshard_after_forward`` for one group: backward gathers in k-rank groups, unless k is
    the group's whole shard size (then it reshards fully, as True)."""
    info = group.mesh_info
    if info.shard_size % k:  # fully_shard checked the default mesh; a group on a mesh of its own here
        raise ValueError(f"reshard_after_forward={k}: an int must divide the shard group size {info.shard_size} of "
                         f"every mesh shard_placement_fn names ({info.shard_dim_name})")
    if k >= info.shard_size:
        return
    if len({group.compute_dtype(p) for p in group.params}) > 1:
        raise NotImplementedError("an int reshard_after_forward with parameters of several dtypes in one unit "
                                  "(no param_dtype to cast them to); pass True, or a param_dtype")
    group.post_forward = _post_forward_group(info, k)


def _post_forward_group(info: MeshInfo, k: int) -> tuple:
    """The k-rank groups of consecutive shard ranks (a node, typically) that backward gathers in.

    [Note: int reshard_after_forward]
    After forward each rank keeps 1/k of every unsharded parameter instead of 1/N, so
    backward's all-gather runs within k neighbouring ranks (intra-node links) at the price of
    N/k times the sharded memory between forward and backward. Creating the groups is a
    collective over the whole mesh, so every rank must make the same fully_shard calls.
    """
    name = info.shard_dim_name
    outer, inner = f"{name}_outer", f"{name}_inner"
    if info.mesh.mesh_dim_names:
        sub = unflatten_mesh(info.mesh, info.shard_dim, (info.shard_size // k, k), (outer, inner))
    else:  # fully_shard's default mesh (1-D, unnamed, which unflattening refuses): its ranks in rows of k
        sub = DeviceMesh(info.mesh.device_type, info.mesh.mesh.view(-1, k), mesh_dim_names=(outer, inner))
    return sub[inner].get_group(), k, inner


def _device(mesh: DeviceMesh) -> torch.device:
    """Where unsharded parameters and collectives live: the mesh's device (meta models included)."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)

