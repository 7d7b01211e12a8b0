"""meshpar's FSDP engine: per-parameter sharding on DTensor (see api.py for the layering)."""

from meshpar.fsdp.api import FSDPModule, fully_shard
from meshpar.fsdp.policies import CPUOffloadPolicy, MixedPrecisionPolicy

__all__ = ["CPUOffloadPolicy", "FSDPModule", "MixedPrecisionPolicy", "fully_shard"]
