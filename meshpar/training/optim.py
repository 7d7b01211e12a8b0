"""AdamW with decoupled weight decay on matrices only, and a warmup-then-decay schedule."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.adam import adam

from meshpar.config.recipe import OptimConfig
from meshpar.distributed._torch import adam_init_group, local_tensor


class ShardLocalAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` that steps every rank's local shards as plain tensors.

    [Note: the optimizer on local shards]
    AdamW is elementwise: a sharded parameter's update is the same kernel on its local shard,
    with its gradient's and state's local shards, as long as all three are placed alike. Handed
    DTensors, ``AdamW.step`` goes through DTensor's dispatch (sharding propagation over every
    list, per step); here each group's lists are unwrapped to their local tensors and handed to
    ``torch.optim.adam.adam`` in one fused call: the same arithmetic on the same tensors, so the
    same bits. The state is created by AdamW's own ``_init_group`` and stays DTensors, so
    ``state_dict``, checkpoints and their resharding see what ``torch.optim.AdamW`` keeps. A
    parameter whose gradient is placed otherwise (or is no DTensor) steps through DTensor's
    dispatch, as AdamW would. Host cost: docs/performance.md#host-overhead.
    """

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lists: tuple[list[torch.Tensor], ...] = ([], [], [], [], [], [])  # params, grads, m, v, v max, steps
            has_complex = adam_init_group(self, group, *lists)
            local: tuple[list[torch.Tensor], ...] = ([], [], [], [], [], [])
            other: tuple[list[torch.Tensor], ...] = ([], [], [], [], [], [])
            for i, p in enumerate(lists[0]):
                g = lists[1][i]
                alike = isinstance(p, DTensor) and isinstance(g, DTensor) and g.placements == p.placements \
                    and (g.device_mesh is p.device_mesh or g.device_mesh == p.device_mesh)
                plain = not isinstance(p, DTensor) and not isinstance(g, DTensor)
                into = local if alike or plain else other
                for j, values in enumerate(lists):
                    if values:  # the amsgrad list is empty without amsgrad
                        t = values[i]
                        into[j].append(local_tensor(t) if alike and isinstance(t, DTensor) else t)
            for chosen in (local, other):
                if chosen[0]:
                    self._update(group, chosen, has_complex)
        return loss

    def _update(self, group: dict, lists: tuple[list[torch.Tensor], ...], has_complex: bool) -> None:
        beta1, beta2 = group["betas"]
        options = {k: group[k] for k in ("amsgrad", "lr", "weight_decay", "eps", "maximize", "foreach", "capturable",
                                         "differentiable", "fused", "decoupled_weight_decay")}
        adam(*lists, has_complex=has_complex, beta1=beta1, beta2=beta2, grad_scale=getattr(self, "grad_scale", None),
             found_inf=getattr(self, "found_inf", None), **options)


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW over ``model``'s trainable parameters; norms, biases and other 1-D tensors skip decay."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # fused: one kernel per step instead of a dozen foreach ops; on local shards: no DTensor
    # dispatch ([Note: the optimizer on local shards])
    return ShardLocalAdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=True)


def lr_factor(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Multiplier on ``cfg.lr`` for optimizer step ``step`` (0-based): linear warmup, then decay
    to ``min_lr_ratio`` at the last step."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    decay_steps = max(total_steps - cfg.warmup_steps - 1, 1)
    progress = min((step - cfg.warmup_steps) / decay_steps, 1.0)
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if cfg.schedule == "cosine" else 1 - progress
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * shape


def build_lr_schedule(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg, total_steps))
