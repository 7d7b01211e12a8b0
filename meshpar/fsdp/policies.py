"""Policies for ``fully_shard``: mixed precision, offload, data-parallel mesh dims (names and fields
follow PyTorch's, so its policy objects and ours are interchangeable)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes for compute and communication; sharded parameters and optimizer state keep theirs.

    ``param_dtype``: unsharded parameters and the all-gather (None: the parameter's dtype).
    ``reduce_dtype``: the gradient reduction and, without gradient sync, the accumulation of
    unsharded gradients (None: the compute dtype, as in PyTorch's engine; recipes set fp32,
    see [Note: gradients reduced in fp32]).
    ``output_dtype``: cast floating-point forward outputs to this (None: leave them).
    ``cast_forward_inputs``: cast floating-point forward inputs to ``param_dtype``, inside
    tuples, lists, dicts, named tuples and dataclasses alike (meshpar/fsdp/tree.py).

    [Note: gradients reduced in fp32]
    Summing N bf16 gradients loses the low bits of each addend (8 mantissa bits); reducing
    in fp32 costs twice the reduce-scatter bytes and keeps them, so meshpar's recipes reduce
    in fp32 unless ``parallel.reduce_dtype`` says otherwise.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


@dataclass
class OffloadPolicy:
    """No offloading: the default ``offload_policy``; its subclass ``CPUOffloadPolicy`` offloads."""


@dataclass
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters, gradients and optimizer state on CPU: the optimizer steps there, and
    shards are copied to the device for each all-gather. ``pin_memory``: pin them (when a device
    exists to copy to) so the copies are asynchronous."""

    pin_memory: bool = True


@dataclass
class DataParallelMeshDims:
    """Which dims of a full SPMD mesh are data parallel, for ``fully_shard(..., dp_mesh_dims=...)``:
    ``shard`` (FSDP shards over it; several names are flattened into one) and ``replicate`` (HSDP)."""

    shard: str | tuple[str, ...] | None = None
    replicate: str | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.shard is None and self.replicate is None:
            raise ValueError("DataParallelMeshDims needs shard or replicate (or both): the mesh dim names "
                             "FSDP shards over and replicates over")

    @property
    def shard_names(self) -> tuple[str, ...]:
        return _names(self.shard)

    @property
    def replicate_names(self) -> tuple[str, ...]:
        return _names(self.replicate)


def _names(dims: str | tuple[str, ...] | None) -> tuple[str, ...]:
    return () if dims is None else (dims,) if isinstance(dims, str) else tuple(dims)
