"""The mixture-of-experts part of a family (``Family.moe``): what the training step, parallelize,
preflight and the planner ask of a model with experts, as methods over the family's model.

A family's MoE model keeps each sparse block's ``MoE`` layer as ``model.layers[i].moe`` (None in a
dense block), its args a ``MoEArgs`` (``is_sparse``, ``n_experts``, the balancing settings), and
after each forward each layer's routing record of that forward: ``aux_loss`` (a graph) and
``tokens_per_expert`` (meshpar/models/moe/model.py). Only this part reads them; the step calls
it through meshpar/training/experts.py.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from meshpar.config.keys import ModelConfig
from meshpar.models.moe.model import MoE


class MoEPart:
    """The sparse layers, the auxiliary loss, the expert loads, the bias update and the planner's
    active-parameter count of a mixture-of-experts family."""

    def overrides(self, cfg: ModelConfig) -> dict[str, Any]:
        """The args fields the recipe's ``[model]`` balancing keys set."""
        out = {"capacity_factor": cfg.capacity_factor, "aux_free_bias": cfg.aux_free_bias,
               "bias_update_rate": cfg.bias_update_rate}
        if cfg.aux_loss_coef != -1:  # -1: the size's own
            out["router_aux_loss_coef"] = cfg.aux_loss_coef
        return out

    def sparse_layers(self, stage: nn.Module) -> list[tuple[int, MoE]]:
        """(block index, ``MoE`` layer) of each sparse block of ``stage`` (a whole model or a pipeline
        stage of one)."""
        return [(int(i), block.moe) for i, block in stage.layers.items() if block.moe is not None]

    def model_sparse_layers(self, args: Any) -> list[int]:
        """The block index of every sparse layer of the whole model with ``args``."""
        return [i for i in range(args.n_layers) if args.is_sparse(i)]

    def n_experts(self, args: Any) -> int:
        return args.n_experts

    def aux_loss(self, stage: nn.Module) -> Tensor | None:
        """The weighted [Note: load-balancing loss] of ``stage``'s last forward (a graph), or None
        where the stage holds no sparse layer."""
        return stage.aux_loss

    def forget(self, module: nn.Module) -> None:
        """Drop the routing graphs the last forward left in ``module``'s sparse layers (any module:
        a stage, a block): [Note: auxiliary losses], [Note: a recompute's side outputs]."""
        for layer in module.modules():
            if isinstance(layer, MoE):
                layer.aux_loss = None

    def holds_routing_graphs(self, module: nn.Module) -> bool:
        """Whether a forward of ``module`` leaves routing graphs for ``forget``."""
        return any(isinstance(layer, MoE) for layer in module.modules())

    def expert_load(self, stage: nn.Module, tokens: int) -> Tensor:
        """[2, L, E] after a forward of ``stage`` over ``tokens`` tokens, L the whole model's sparse
        layers (``model_sparse_layers``): [0] the token slots each layer's router sent to each expert,
        [1] those over the expert's capacity, dropped ([Note: expert load]). Layers on other pipeline
        stages stay zero. The layers share one args, so one capacity."""
        experts = self.sparse_layers(stage)
        moe = experts[0][1]
        routed = torch.stack([m.tokens_per_expert for _, m in experts])  # [L_stage, E]
        where = {layer: j for j, layer in enumerate(self.model_sparse_layers(stage.args))}
        rows = [where[i] for i, _ in experts]
        full = routed.new_zeros((2, len(where), routed.shape[1]))
        full[0, rows] = routed
        if moe.capacity_factor > 0:
            capacity = moe.capacity(tokens * moe.top_k)
            full[1, rows] = (routed - capacity).clamp(min=0)
        return full

    def balances_by_bias(self, args: Any) -> bool:
        """Whether the step moves the routing biases after each optimizer step ([Note: aux-free balancing])."""
        return args.aux_free_bias

    def bias_loads(self, stage: nn.Module) -> Tensor:
        """[L_stage, E]: token slots each expert of ``stage`` received since the last bias update."""
        return stage.expert_loads()

    def update_bias(self, stage: nn.Module, loads: Tensor) -> None:
        """Move each sparse layer's routing bias by ``loads`` ([L_stage, E], summed over the
        data-parallel ranks): [Note: aux-free balancing]."""
        stage.update_expert_bias(loads)

    def inactive_params(self, args: Any) -> int:
        """Expert weights a token does not run through (the planner's active count: total less this)."""
        return args.inactive_params()
