"""``meshpar convert`` of ``model.family = "hf"`` checkpoints: the names are the Hugging Face names
already ([Note: a transformers model as a meshpar family]), so every tensor keeps its name and
orientation, and config.json is the architecture's own, with the checkpoint's dtype."""

from __future__ import annotations

import functools
import json
from typing import Any

import torch

from meshpar.models.hf import HFArgs, args_from_dict  # noqa: F401 - the converter's adapter interface
from meshpar.parallel.tensor_parallel.plan import TPPlan

IDENTITY = True  # meshpar name == Hugging Face name
KEYS: dict[str, str] = {}
TRANSPOSED: frozenset[str] = frozenset()
IGNORED_HF: tuple[str, ...] = ()


def TP_PLAN(loss_parallel: bool = True) -> TPPlan:  # noqa: N802 - the adapters' common name
    return TPPlan({}, {}, "model", "lm_head", loss_parallel)


def tied(args: HFArgs) -> dict[str, str]:
    """{copy: source} for the names that share one Parameter (the tied output projection)."""
    return dict(_tied(args.config))


@functools.cache
def _tied(config: str) -> tuple[tuple[str, str], ...]:
    from meshpar.models.hf import HFCausalLM

    with torch.device("meta"):
        model = HFCausalLM(HFArgs.from_config(json.loads(config)))
    first: dict[int, str] = {}
    out = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out.append((name, first[id(p)]))
        else:
            first[id(p)] = name
    return tuple(out)


def hf_config(family: str, args: HFArgs, dtype: torch.dtype) -> dict[str, Any]:
    config = args.hf_config
    config["dtype"] = str(dtype).removeprefix("torch.")
    return config
