"""meshpar: N-dimensional parallel training of large transformers from one TOML recipe.

Read in this order: ``recipe`` (TOML -> sections) -> ``mesh`` (degrees -> DeviceMesh) ->
``models`` (families on meta) -> ``parallelize`` (the fixed composition order) ->
``train`` (the step loop). The FSDP engine is ``meshpar.fsdp``; its public names are
re-exported here so that switching from PyTorch's engine is one import.

The re-exports load on first use (PEP 562), so that importing ``meshpar`` (the command line's
``--help``, ``meshpar recipe``, every recipe error) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from meshpar.distributed import comm, comm_record
    from meshpar.distributed.clip import clip_grad_norm_
    from meshpar.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

__version__ = "0.1.0"
__all__ = ["CPUOffloadPolicy", "FSDPModule", "MixedPrecisionPolicy", "clip_grad_norm_", "comm", "comm_record",
           "fully_shard"]

# name -> (module, attribute; None: the module itself)
_EXPORTS = {
    "comm": ("meshpar.distributed.comm", None), "comm_record": ("meshpar.distributed.comm_record", None),
    "clip_grad_norm_": ("meshpar.distributed.clip", "clip_grad_norm_"),
    **{name: ("meshpar.fsdp", name) for name in ("CPUOffloadPolicy", "FSDPModule", "MixedPrecisionPolicy",
                                                  "fully_shard")},
}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'meshpar' has no attribute '{name}'")
    module, attr = _EXPORTS[name]
    value = importlib.import_module(module)
    value = value if attr is None else getattr(value, attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
