"""Apply parallelism to a model from outside, in one fixed order.

The order (shared/DESIGN.md) is: pipeline split -> tensor parallel -> activation
checkpointing -> torch.compile per block -> fully_shard per block, then the root ->
optimizer. It runs on the model as built on the meta device, before ``to_empty`` and
``init_weights``, so only local shards are ever allocated. Model files hold no parallel
code; this module and each family's plan tables do. Today data parallelism is built
(replicated, sharded and hybrid); recipes asking for the other dims are refused at
validation (``Family.check_degrees``) before any process starts.
"""

from __future__ import annotations

import torch
from torch import nn

from meshpar.fsdp import MixedPrecisionPolicy, fully_shard
from meshpar.mesh import Mesh
from meshpar.recipe import ParallelConfig


def mixed_precision(cfg: ParallelConfig, *, root: bool) -> MixedPrecisionPolicy:
    """The recipe's dtypes; only the root casts its output (logits) back to fp32 for the loss."""
    param, reduce = getattr(torch, cfg.param_dtype), getattr(torch, cfg.reduce_dtype)
    if param == torch.float32 and reduce == torch.float32:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce, output_dtype=torch.float32 if root else None)


def parallelize_transformer(model: nn.Module, mesh: Mesh, cfg: ParallelConfig) -> nn.Module:
    """Shard a transformer built on meta: each block in ``model.layers`` is one FSDP unit, the root
    owns the rest (embeddings, final norm, output). With ``dp_shard = 1`` the model stays whole and
    the training step averages gradients over ``dp_replicate`` (meshpar.replicate)."""
    layout = mesh.layout
    if layout.dp_shard > 1:
        dp_mesh = mesh.world["dp_replicate", "dp_shard"] if layout.dp_replicate > 1 else mesh["dp_shard"]
        for block in model.layers.values():
            fully_shard(block, mesh=dp_mesh, reshard_after_forward=cfg.reshard_after_forward,
                        mp_policy=mixed_precision(cfg, root=False), shard_threshold=cfg.shard_threshold)
        fully_shard(model, mesh=dp_mesh, reshard_after_forward=cfg.reshard_after_forward,
                    mp_policy=mixed_precision(cfg, root=True), shard_threshold=cfg.shard_threshold)
    return model
