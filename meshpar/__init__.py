"""meshpar: N-dimensional parallel training of large transformers from one TOML recipe.

Read in this order: ``recipe`` (TOML -> sections) -> ``mesh`` (degrees -> DeviceMesh) ->
``models`` (families on meta) -> ``parallelize`` (the fixed composition order) ->
``train`` (the step loop). The FSDP engine is ``meshpar.fsdp``; its public names are
re-exported here so that switching from PyTorch's engine is one import.
"""

from meshpar.distributed import comm, comm_record
from meshpar.distributed.clip import clip_grad_norm_
from meshpar.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

__version__ = "0.1.0"
__all__ = ["CPUOffloadPolicy", "FSDPModule", "MixedPrecisionPolicy", "clip_grad_norm_", "comm", "comm_record",
           "fully_shard"]
