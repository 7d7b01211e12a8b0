"""Policies for ``fully_shard``: mixed precision and CPU offload (names follow PyTorch's)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes for compute and communication; sharded parameters and optimizer state keep theirs.

    ``param_dtype``: unsharded parameters and the all-gather (None: the parameter's dtype).
    ``reduce_dtype``: the gradient reduce-scatter (None: the parameter's dtype, so fp32 when
    parameters are fp32 and compute is bf16; see [Note: gradients reduced in fp32]).
    ``output_dtype``: cast floating-point forward outputs to this (None: leave them).
    ``cast_forward_inputs``: cast floating-point forward inputs to ``param_dtype``.

    [Note: gradients reduced in fp32]
    Summing N bf16 gradients loses the low bits of each addend (8 mantissa bits); reducing
    in fp32 costs twice the reduce-scatter bytes and keeps them, so it is the default.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


@dataclass(frozen=True)
class CPUOffloadPolicy:
    """Keep sharded parameters, gradients and optimizer state on CPU (pinned when a device exists)."""

    pin_memory: bool = True
