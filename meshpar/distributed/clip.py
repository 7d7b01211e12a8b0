"""Gradient clipping with the true global norm over parameters sharded on any mix of meshes.

Each gradient contributes ``sum |g|^p`` of its local shard; contributions are summed over
the mesh dims the gradient is sharded on (``Shard`` placements) and not over the dims it is
replicated on, then over the groups given in ``extra_groups`` (pipeline stages, which hold
disjoint parameters). The result is the norm a single process would compute over the full
gradients, up to summation order: accumulated in fp32, or in fp64 when the gradients are fp64
(a float64 model, as in the parity tests, would otherwise be clipped with fp32 rounding).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from meshpar.distributed import comm
from meshpar.distributed._torch import StridedShard, foreach_mul_, foreach_norm, local_tensor
from meshpar.distributed.tracing import mark


@torch.no_grad()
def total_norm(grads: list[torch.Tensor], norm_type: float = 2.0,
               extra_groups: Iterable[dist.ProcessGroup] = ()) -> torch.Tensor:
    """Global ``norm_type``-norm of ``grads`` (plain tensors or DTensors), as an fp32 scalar (fp64
    when any gradient is fp64: a model's gradients share one dtype, so every rank picks the same)."""
    is_inf = math.isinf(norm_type)
    reduce_op = dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM
    acc_dtype = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
    # the local tensors, grouped by the set of (mesh, dim) their contributions are reduced over
    groups: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        local, key = g, ()
        if isinstance(g, DTensor):
            local = local_tensor(g)
            # StridedShard (FSDP over a column-wise tp shard, GPT-2's fused q|k|v) is not a Shard subclass
            key = tuple((g.device_mesh, i) for i, pl in enumerate(g.placements)
                        if isinstance(pl, (Shard, StridedShard)))
        group = groups.setdefault(key, [])  # even for an empty shard: every rank reduces the same keys
        if local.numel():
            group.append(local.detach())
    partial: dict[tuple, torch.Tensor] = {}
    # [Note: clipping's groups in a fixed order] by the names of their dims, whatever parameter a
    # stage holds first, each marked, and its temporaries freed before the next: the planner's
    # simulated step labels the memory of each group's stretch by that mark, and a stretch must
    # hold the same work in every pipeline stage (meshpar/planner/extrapolate.py)
    for key in sorted(groups, key=_dim_names):
        mark(f"clip {','.join(_dim_names(key))}")
        value = torch.zeros((), dtype=acc_dtype)
        for same in _by_device_and_dtype(groups[key]):
            contribution = _contribution(same, norm_type, acc_dtype)
            value = value.to(contribution.device)
            value = torch.maximum(value, contribution) if is_inf else value + contribution
        partial[key] = value
    mark("clip total")
    total = torch.zeros((), dtype=acc_dtype)
    for key, value in partial.items():
        for mesh, dim in key:
            names = mesh.mesh_dim_names
            comm.all_reduce(value, mesh.get_group(dim), dim=names[dim] if names else f"dim{dim}", op=reduce_op)
        total = total.to(value.device)
        total = torch.maximum(total, value) if is_inf else total + value
    for group in extra_groups:
        comm.all_reduce(total, group, dim="extra", op=reduce_op)
    return total if is_inf else total.pow(1.0 / norm_type)


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float, norm_type: float = 2.0,
                    extra_groups: Iterable[dist.ProcessGroup] = ()) -> torch.Tensor:
    """Scale gradients in place so their global norm is at most ``max_norm``; returns the norm before.
    A non-finite norm scales nothing.

    ``extra_groups``: process groups whose ranks hold disjoint parameters (pipeline stages).
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    norm = total_norm(grads, norm_type, extra_groups)
    # a non-finite norm leaves the gradients as they are (no host sync to decide): scaling by NaN
    # would hide which gradient was bad (meshpar/training/nonfinite.py names it, then skips or stops)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    coef = torch.where(torch.isfinite(norm), coef, torch.ones_like(coef))
    for same in _by_device_and_dtype([local_tensor(g) if isinstance(g, DTensor) else g for g in grads]):
        foreach_mul_(same, coef.to(same[0].device, same[0].dtype))
    return norm


def _contribution(tensors: list[torch.Tensor], norm_type: float, dtype: torch.dtype) -> torch.Tensor:
    """``sum |g|^p`` (the max for the inf-norm) over ``tensors`` (one device and dtype), in ``dtype``:
    one multi-tensor kernel, each gradient read once (abs, pow and sum per gradient read a 1B model's
    fp32 gradients three times and wrote two temporaries of their size; a loop of per-gradient norms
    launched 147 kernels)."""
    norms = torch.stack(foreach_norm(tensors, norm_type, dtype))
    return norms.max() if math.isinf(norm_type) else norms.pow(norm_type).sum()


def _dim_names(key: tuple) -> tuple[str, ...]:
    """The mesh dims a clipping group's contributions are summed over, by name."""
    return tuple((mesh.mesh_dim_names or [f"dim{i}" for i in range(mesh.ndim)])[dim] for mesh, dim in key)


def _by_device_and_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` in lists of one device and dtype each (what a multi-tensor kernel takes), in order."""
    out: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for t in tensors:
        out[(t.device, t.dtype)].append(t)
    return list(out.values())
