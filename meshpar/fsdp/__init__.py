"""meshpar's FSDP engine: per-parameter sharding on DTensor (see api.py for the layering).

The public names are those of torch 2.13's ``torch.distributed.fsdp`` FSDP2 API."""

from meshpar.fsdp.api import (
    FSDPModule,
    UnshardHandle,
    fully_shard,
    register_fsdp_forward_method,
    share_comm_ctx,
)
from meshpar.fsdp.policies import CPUOffloadPolicy, DataParallelMeshDims, MixedPrecisionPolicy, OffloadPolicy

__all__ = [
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "UnshardHandle",
    "fully_shard",
    "register_fsdp_forward_method",
    "share_comm_ctx",
]
