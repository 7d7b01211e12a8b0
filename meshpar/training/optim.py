"""AdamW with decoupled weight decay on matrices only, and a warmup-then-decay schedule."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.adam import adam

from meshpar.config.recipe import OptimConfig
from meshpar.distributed._torch import adam_init_group, local_tensor, same_spec


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

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._steady: dict[int, _Steady] = {}  # id(group) -> [Note: the steady step]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            steady = self._steady.get(id(group))
            lists = steady.lists(group, self.state) if steady is not None else None
            if lists is not None:
                self._update(group, lists, steady.has_complex)
                continue
            lists = ([], [], [], [], [], [])  # params, grads, m, v, v max, steps
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
            self._steady[id(group)] = _Steady.of(group, self.state, has_complex) if not other[0] else None
        return loss

    def _update(self, group: dict, lists: tuple[list[torch.Tensor], ...], has_complex: bool) -> None:
        beta1, beta2 = group["betas"]
        options = {k: group[k] for k in ("amsgrad", "lr", "weight_decay", "eps", "maximize", "foreach", "capturable",
                                         "differentiable", "fused", "decoupled_weight_decay")}
        # torch's GradScaler sets grad_scale / found_inf on the optimizer it steps (fused AdamW's contract)
        adam(*lists, has_complex=has_complex, beta1=beta1, beta2=beta2, grad_scale=getattr(self, "grad_scale", None),
             found_inf=getattr(self, "found_inf", None), **options)


# [Note: the steady step]
# After the first step every parameter has its state, and each step hands the fused kernel the same
# parameters and state tensors with new gradients. ``_Steady`` keeps a group's local parameter and
# state tensors from a step in which every parameter had a gradient placed like itself, and later
# steps only unwrap the gradients (checked placed alike: by identity where FSDP built the gradient on
# its parameter's spec); AdamW's ``_init_group`` and the placement comparisons then run no more. Anything
# else (a missing gradient, one placed otherwise, a parameter or state tensor that is not the object
# kept: a state dict loaded, a group edited) takes the whole path above, and the kernel runs on the
# same tensors either way (tests/test_optim.py and tests/test_fsdp.py compare both with torch.optim.AdamW).


class _Steady:
    """One parameter group's local tensors for the steady step."""

    def __init__(self, group: dict, params: list[torch.Tensor], state: dict, has_complex: bool) -> None:
        self.group, self.params, self.state, self.has_complex = group, params, state, has_complex
        self.kept = [(state[p], state[p]["exp_avg"], state[p]["exp_avg_sq"], state[p].get("max_exp_avg_sq"),
                      state[p]["step"]) for p in params]

    @classmethod
    def of(cls, group: dict, state: dict, has_complex: bool) -> _Steady | None:
        params = list(group["params"])
        if not all(p.grad is not None and p in state for p in params):
            return None
        return cls(group, params, state, has_complex)

    def lists(self, group: dict, state: dict) -> tuple[list[torch.Tensor], ...] | None:
        """This step's (params, grads, m, v, v max, steps) as local tensors, or None: take the whole path."""
        params = group["params"]
        if group is not self.group or state is not self.state or len(params) != len(self.params):
            return None
        out: tuple[list[torch.Tensor], ...] = ([], [], [], [], [], [])
        amsgrad = group["amsgrad"]
        for p, kept_p, (st, m, v, vmax, step) in zip(params, self.params, self.kept, strict=True):
            g = p.grad
            if p is not kept_p or g is None or state.get(p) is not st or st["exp_avg"] is not m \
                    or st["exp_avg_sq"] is not v or st["step"] is not step or st.get("max_exp_avg_sq") is not vmax:
                return None
            if isinstance(p, DTensor):
                if not (isinstance(g, DTensor) and (same_spec(g, p) or (g.placements == p.placements
                                                                       and g.device_mesh == p.device_mesh))):
                    return None
                p, g, m, v = local_tensor(p), local_tensor(g), local_tensor(m), local_tensor(v)
                vmax = local_tensor(vmax) if vmax is not None else None
            elif isinstance(g, DTensor):
                return None
            out[0].append(p)
            out[1].append(g)
            out[2].append(m)
            out[3].append(v)
            if amsgrad:
                out[4].append(vmax)
            out[5].append(step)
        return out


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
