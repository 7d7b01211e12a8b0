"""Replicated data parallelism: identical parameters on every replica, gradients averaged.

This is the ``dp_replicate`` dimension on its own (with ``dp_shard = 1``; with sharding, the
FSDP engine all-reduces across replicas itself). Replicas start identical because
initialization is the same on every rank; after the last microbatch of a step,
:func:`all_reduce_gradients` averages every gradient over the replicas with one
collective on one flat buffer (per dtype).

[Note: one flat all-reduce per step]
Gradient accumulation sums local gradients over microbatches without communication; the
single all-reduce at the end then carries ``sum_params numel`` elements once per step,
whatever the accumulation depth. Gloo and NCCL both reach far better bandwidth on one
large buffer than on hundreds of per-parameter calls.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from meshpar.distributed import comm


@torch.no_grad()
def all_reduce_gradients(module: nn.Module, mesh: DeviceMesh) -> None:
    """Average the gradients of ``module`` over ``mesh`` (a 1-D replica mesh) in place."""
    if mesh.size() == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = defaultdict(list)
    for p in module.parameters():
        if p.grad is not None:  # tensor-parallel gradients: their local shards, the same on every replica
            grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            by_dtype[grad.dtype].append(grad)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        flat.div_(mesh.size())  # divide first: the sum of pre-scaled values cannot overflow
        comm.all_reduce(flat, mesh.get_group(), dim=(mesh.mesh_dim_names or ("dp_replicate",))[0])
        for g, reduced in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            g.copy_(reduced.view_as(g))
