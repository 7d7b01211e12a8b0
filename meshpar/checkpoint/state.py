"""A run's state as a checkpoint stores it: parameters by global name (the first, for tied
parameters), the optimizer's per-parameter tensors keyed by those names, and each rank's
random generator state. The objects themselves, not copies, so DCP loads into them in place.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from meshpar.checkpoint.format import CheckpointError


def param_names(modules: Iterable[nn.Module]) -> dict[int, str]:
    """id(parameter) -> its global name (the first, for tied parameters)."""
    names: dict[int, str] = {}
    for module in modules:
        for name, p in module.named_parameters():
            names.setdefault(id(p), name)
    return names


def optimizer_state(optimizer: torch.optim.Optimizer, names: dict[int, str], *,
                    create: bool = False) -> dict[str, dict[str, torch.Tensor]]:
    """The optimizer's per-parameter tensors keyed by parameter name: the objects themselves, so
    DCP loads into them in place. ``create`` first makes AdamW's state (zeros) where a parameter
    has none yet, with the dtypes and devices ``torch.optim.AdamW`` itself would use."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            if not state and create:
                if not isinstance(optimizer, torch.optim.AdamW) or group.get("amsgrad"):
                    raise CheckpointError(f"loading optimizer state into {type(optimizer).__name__} is not "
                                          f"supported; set checkpoint.exclude = [\"optimizer\"]")
                on_device = group.get("fused") or group.get("capturable")
                state["step"] = (torch.zeros((), dtype=torch.float32, device=_local(p).device) if on_device
                                 else torch.tensor(0.0, dtype=torch.float32))
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if state:
                out[names[id(p)]] = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state
