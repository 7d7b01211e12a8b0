"""``meshpar convert`` of ``model.family = "hf"`` checkpoints: the names are the model's own
([Note: a transformers model as a meshpar family]), and config.json is the architecture's own, with
the checkpoint's dtype. A tensor keeps its name and orientation unless transformers' save_pretrained
writes it otherwise (``hf_layout``: a sparse layer's fused experts as one tensor per expert, renamed
modules), [Note: transformers' conversion run lazily] in experts.py."""

from __future__ import annotations

import functools
from typing import Any

import torch

from meshpar.models.hf import HFArgs, args_from_dict, experts, meta_model  # noqa: F401 - the adapter interface
from meshpar.parallel.tensor_parallel.plan import TPPlan

IDENTITY = True  # meshpar name == the model's own name, written under it unless hf_layout says otherwise
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
    model = meta_model(config).hf
    first: dict[int, str] = {}
    out = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out.append((name, first[id(p)]))
        else:
            first[id(p)] = name
    return tuple(out)


def hf_layout(args: HFArgs) -> dict[str, experts.Saved]:
    """{name: how it is written} for the tensors transformers' save_pretrained does not write as they are
    (their Hugging Face names in the order of their bytes, one shape each, or transposed)."""
    return _saved(args.config)[0]


def hf_export_error(args: HFArgs) -> str | None:
    """Why ``meshpar convert --to hf`` cannot write this model type as transformers saves it, or None."""
    refusal = _saved(args.config)[1]
    return f"{args.model_type}: {refusal}" if refusal else None


@functools.cache
def _saved(config: str) -> tuple[dict[str, experts.Saved], str | None]:
    return experts.saved_layout(meta_model(config).hf)


def hf_config(family: str, args: HFArgs, dtype: torch.dtype) -> dict[str, Any]:
    config = args.hf_config
    config["dtype"] = str(dtype).removeprefix("torch.")
    return config
