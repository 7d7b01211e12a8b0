"""AdamW with decoupled weight decay on matrices only, and a warmup-then-decay schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from meshpar.config.recipe import OptimConfig


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW over ``model``'s trainable parameters; norms, biases and other 1-D tensors skip decay."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # fused: one kernel (and, for DTensor parameters, one DTensor dispatch) per step instead of
    # a dozen foreach ops (docs/performance.md#per-step-host-costs)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=True)


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
