"""``fully_shard`` and ``FSDPModule``: the public face of meshpar's FSDP engine.

    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)   # the root: embeddings, final norm, output

``fully_shard`` changes the module's class to also derive from ``FSDPModule`` (no wrapper;
parameter names unchanged) and replaces each managed parameter with an
``nn.Parameter(DTensor)`` sharded on dim 0 over ``mesh`` (1-D), or over the second dim of
a 2-D ``(replicate, shard)`` mesh (hybrid). Names and meanings follow PyTorch's
``fully_shard`` so switching engines is one import; layers: api (here) -> hook state
(state.py) -> parameter group (param_group.py) -> sharded parameter (sharded_param.py)
-> collectives (meshpar/comm.py).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from meshpar._torch import module_parameters, unflatten_mesh
from meshpar.fsdp.param_group import ParamGroup
from meshpar.fsdp.policies import CPUOffloadPolicy, MixedPrecisionPolicy
from meshpar.fsdp.sharded_param import MeshInfo, ShardedParam
from meshpar.fsdp.state import FSDPState


class FSDPModule:
    """Mixed into every ``fully_shard``-ed module's class; the methods follow PyTorch's."""

    _fsdp_state: FSDPState

    def _states(self, recurse: bool) -> list[FSDPState]:
        modules = self.modules() if recurse else [self]
        return [m._fsdp_state for m in modules if isinstance(m, FSDPModule)]

    def unshard(self, async_op: bool = False) -> None:
        """All-gather this unit's parameters now (``async_op``: start it; forward waits for it)."""
        if self._fsdp_state.group is not None:
            self._fsdp_state.group.unshard(async_op=async_op)

    def reshard(self) -> None:
        if self._fsdp_state.group is not None:
            self._fsdp_state.group.reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: backward keeps unsharded gradients (no reduce-scatter) until a step with True."""
        for state in self._states(recurse):
            if state.group is not None:
                state.group.requires_gradient_sync = requires_gradient_sync

    def reduce_grads(self) -> None:
        """Reduce now the gradients this unit holds unsharded (accumulated over no-sync
        microbatches, or written outside its hooks, e.g. by ``torch.autograd.grad`` in a
        zero-bubble weight pass), wait, add them to the sharded ``.grad`` and reshard if
        ``reshard_after_backward``. A no-op with nothing pending. Call with gradient sync on."""
        if self._fsdp_state.group is not None:
            self._fsdp_state.group.finish_backward()

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        for state in self._states(recurse):
            if state.group is not None:
                state.group.reshard_after_backward = reshard_after_backward

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        self._fsdp_state.forward_prefetch = [_state_of(m) for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        self._fsdp_state.backward_prefetch = [_state_of(m) for m in modules]

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide reduced gradients by ``factor`` instead of the data-parallel world size."""
        for state in self._states(recurse=True):
            if state.group is not None:
                state.group.divide_factor = factor

    def _apply(self, fn, recurse: bool = True):
        # to_empty / .to replace our sharded Parameters; adopt the new ones (and keep ties).
        result = super()._apply(fn, recurse)
        if self._fsdp_state.group is not None:
            for p in self._fsdp_state.group.all_params:
                p.refresh_after_apply()
        return result


def _state_of(module: nn.Module) -> FSDPState:
    if not isinstance(module, FSDPModule):
        raise ValueError(f"{type(module).__name__} is not fully sharded; prefetch lists take fully_shard-ed modules")
    return module._fsdp_state


_CLASSES: dict[type, type] = {}


def _mesh_info(mesh: DeviceMesh) -> MeshInfo:
    if mesh.ndim == 1:
        return MeshInfo(mesh, shard_dim=0, replicate_dim=None)
    if mesh.ndim == 2:
        if not mesh.mesh_dim_names:
            raise ValueError("fully_shard on a 2-D mesh needs named dims (replicate, shard), e.g. "
                             "init_device_mesh(..., mesh_dim_names=('dp_replicate', 'dp_shard'))")
        return MeshInfo(mesh, shard_dim=1, replicate_dim=0)
    raise ValueError(f"fully_shard takes a 1-D mesh (shard) or a 2-D mesh (replicate, shard); got {mesh.ndim}-D "
                     f"{mesh.mesh_dim_names}")


def _managed(module: nn.Module, ignored: set[int]) -> tuple[dict[int, list[tuple[nn.Module, str]]], set[int]]:
    """Parameters of ``module`` not owned by a nested unit: id -> every (module, attr) holding it."""
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    nested_ids: set[int] = set()
    stack = [module]
    while stack:
        m = stack.pop()
        if m is not module and isinstance(m, FSDPModule):
            if m._fsdp_state.group is not None:
                nested_ids.update(p.orig_id for p in m._fsdp_state.group.all_params)
            continue
        for attr, p in module_parameters(m).items():
            if p is not None and id(p) not in ignored:
                places.setdefault(id(p), []).append((m, attr))
        stack.extend(m.children())
    return places, nested_ids


_FULL_PRECISION = MixedPrecisionPolicy()


def fully_shard(module: nn.Module, *, mesh: DeviceMesh, reshard_after_forward: bool | int | None = None,
                mp_policy: MixedPrecisionPolicy = _FULL_PRECISION, offload_policy: CPUOffloadPolicy | None = None,
                shard_threshold: int = 0, ignored_params: Iterable[nn.Parameter] | None = None) -> nn.Module:
    """Shard ``module``'s parameters (those no nested ``fully_shard`` took) over ``mesh``.

    ``reshard_after_forward``: True frees unsharded parameters after forward and all-gathers
    again in backward; False keeps them until after backward; an int ``k`` keeps 1/k of them
    ([Note: int reshard_after_forward]); None (the default) is True, except for the root,
    which backward needs first and so keeps them (as PyTorch's ``fully_shard`` does). ``shard_threshold``:
    parameters with fewer elements stay replicated, their gradients all-reduced.
    ``offload_policy``: keep shards, gradients and so optimizer state on CPU; the optimizer
    steps there, and shards are copied to the device for each all-gather.
    """
    if isinstance(module, FSDPModule):
        raise ValueError(f"fully_shard was already applied to this {type(module).__bases__[-1].__name__}; "
                         f"apply it once per module")
    info = _mesh_info(mesh)
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, bool):
        n = info.shard_size
        if not isinstance(reshard_after_forward, int) or reshard_after_forward < 1 or n % reshard_after_forward:
            raise ValueError(f"reshard_after_forward={reshard_after_forward!r}: an int must divide the shard group "
                             f"size {n} (e.g. the GPUs per node)")
    places, nested_ids = _managed(module, {id(p) for p in ignored_params or ()})
    params = {pid: module_parameters(pl[0][0])[pl[0][1]] for pid, pl in places.items()}
    devices = {p.device for p in params.values()}
    if len(devices) > 1:
        raise ValueError(f"{type(module).__name__} has parameters on several devices ({sorted(map(str, devices))}); "
                         f"move it to one device (or build it on meta) before fully_shard")
    for pid, p in params.items():
        name = f"{type(places[pid][0][0]).__name__}.{places[pid][0][1]}"
        if pid in nested_ids:
            raise ValueError(f"{name} is shared with a module fully_shard-ed earlier; tied parameters must live "
                             f"in one unit: apply fully_shard to a module that holds every use of it")
        if not p.is_floating_point():
            raise ValueError(f"{name} is {p.dtype}; fully_shard shards floating-point parameters only "
                             f"(register it as a buffer, or pass it in ignored_params)")
        if isinstance(p, DTensor) and len(p.device_mesh.shape) != 1:
            raise NotImplementedError(f"{name} is a DTensor on a {p.device_mesh.ndim}-D mesh; fully_shard composes "
                                      f"with 1-D tensor parallelism (a tp sub-mesh) only")
        if p.ndim == 0:
            raise ValueError(f"{name} is a 0-dim parameter; fully_shard needs at least one dim to shard "
                             f"(make it shape [1], or pass it in ignored_params)")
    device = _device(mesh)
    sharded = [ShardedParam(p, places[pid], info, device, shard=p.numel() >= shard_threshold,
                            offload=offload_policy) for pid, p in params.items()]
    group = ParamGroup(sharded, info, mp_policy) if sharded else None
    if group is not None and reshard_after_forward is not None and not isinstance(reshard_after_forward, bool) \
            and reshard_after_forward < info.shard_size:
        group.post_forward = _post_forward_group(info, reshard_after_forward)
    module._fsdp_state = FSDPState(module, group, mp_policy, reshard_after_forward)
    cls = module.__class__
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    module.__class__ = _CLASSES[cls]
    return module


def _post_forward_group(info: MeshInfo, k: int) -> tuple:
    """The k-rank groups of consecutive shard ranks (a node, typically) that backward gathers in.

    [Note: int reshard_after_forward]
    After forward each rank keeps 1/k of every unsharded parameter instead of 1/N, so
    backward's all-gather runs within k neighbouring ranks (intra-node links) at the price of
    N/k times the sharded memory between forward and backward. Creating the groups is a
    collective over the whole mesh, so every rank must make the same fully_shard calls.
    """
    name = info.shard_dim_name
    sub = unflatten_mesh(info.mesh, info.shard_dim, (info.shard_size // k, k), (f"{name}_outer", f"{name}_inner"))
    inner = f"{name}_inner"
    return sub[inner].get_group(), k, inner


def _device(mesh: DeviceMesh) -> torch.device:
    """Where unsharded parameters and collectives live: the mesh's device (meta models included)."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)
