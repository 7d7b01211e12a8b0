"""meshpar's FSDP engine: per-parameter sharding on DTensor (see api.py for the layering).

The public names are those of PyTorch 2.13's FSDP2 API."""

from meshpar.fsdp.api import fully_shard
from meshpar.fsdp.module import FSDPModule, UnshardHandle, register_fsdp_forward_method, share_comm_ctx
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
