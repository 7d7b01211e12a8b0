"""Replicated data parallelism: identical parameters on every replica, gradients averaged.

This is the ``dp_replicate`` dimension on its own. Parameters are broadcast from the first
replica once, so replicas start identical even if their initialization differed; after
the last microbatch of a step, :func:`all_reduce_gradients` averages every gradient over
the replicas with one collective on one flat buffer (per dtype).

[Note: one flat all-reduce per step]
Gradient accumulation sums local gradients over microbatches without communication; the
single all-reduce at the end then carries ``sum_params numel`` elements once per step,
whatever the accumulation depth. Gloo and NCCL both reach far better bandwidth on one
large buffer than on hundreds of per-parameter calls.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh


@torch.no_grad()
def broadcast_parameters(module: nn.Module, mesh: DeviceMesh) -> None:
    """Make every replica's parameters and buffers equal to the first replica's."""
    group = mesh.get_group()
    src = dist.get_global_rank(group, 0)
    for tensor in [*module.parameters(), *module.buffers()]:
        dist.broadcast(tensor, src=src, group=group)


@torch.no_grad()
def all_reduce_gradients(module: nn.Module, mesh: DeviceMesh) -> None:
    """Average the gradients of ``module`` over ``mesh`` (a 1-D replica mesh) in place."""
    if mesh.size() == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = defaultdict(list)
    for p in module.parameters():
        if p.grad is not None:
            by_dtype[p.grad.dtype].append(p.grad)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        flat.div_(mesh.size())  # divide first: the sum of pre-scaled values cannot overflow
        dist.all_reduce(flat, group=mesh.get_group())
        for g, reduced in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            g.copy_(reduced.view_as(g))
