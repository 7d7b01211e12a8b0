"""Apply parallelism to a model from outside, in one fixed order.

The order (shared/DESIGN.md) is: pipeline split -> tensor parallel -> activation
checkpointing -> torch.compile per block -> fully_shard per block, then the root ->
optimizer. Model files hold no parallel code; this module and each family's plan tables
do. Today the data-parallel replica dimension is built; recipes asking for the others are
refused at validation (``meshpar.recipe.check``) before any process starts.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from meshpar.replicate import broadcast_parameters


def parallelize_transformer(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Parallelize a materialized, initialized model on ``mesh`` (names from meshpar.mesh)."""
    if mesh["dp_replicate"].size() > 1:
        broadcast_parameters(model, mesh["dp_replicate"])
    return model
