"""Float8 training through torchao: the recipe's ``model.float8`` applied to a stage built on meta.

    skipped = apply_float8(stage, "tensorwise", emulate=False, fsdp_all_gather=True)
    ... after each optimizer step: precompute_scales(stage)

The transformer's ``nn.Linear`` layers become torchao's ``Float8Linear`` (matmuls in float8 with
dynamic scales: ``tensorwise`` one scale per tensor, ``rowwise`` one per row, ``rowwise_with_gw_hp``
rowwise with the weight gradient in high precision), except the output projection (the logits,
which float8 costs accuracy on, as torchtitan leaves it) and any layer whose dims are not multiples
of 16 (float8 matmuls need them). With tensorwise scaling under FSDP the weights are all-gathered in
float8 (torchao's weight subclass defines the all-gather extension: meshpar/fsdp/extensions.py), and
``precompute_scales`` computes every weight's scale in one pass after the optimizer step, as
torchao recommends, instead of an all-reduce per weight per all-gather. ``emulate`` runs the float8
casts and matmuls in high precision where no float8 kernel exists (a CPU): the same numbers, the
speed of neither.
"""

from __future__ import annotations

import dataclasses

from torch import nn

MODES = ("none", "tensorwise", "rowwise", "rowwise_with_gw_hp")
SKIPPED_NAMES = ("output",)  # the output projection (Llama, Qwen); GPT-2 ties it to the embedding


def _config(mode: str, emulate: bool, fsdp_all_gather: bool):
    from torchao.float8 import Float8LinearConfig

    if mode == "tensorwise":
        return Float8LinearConfig(emulate=emulate, enable_fsdp_float8_all_gather=fsdp_all_gather)
    return dataclasses.replace(Float8LinearConfig.from_recipe_name(mode), emulate=emulate)


def shards_over_ranks(layout) -> bool:
    """Whether FSDP gathers parameters from several ranks (``Mesh.fsdp``: dp_shard x cp)."""
    return layout.dp_shard * layout.cp > 1


def float8_all_gather(mode: str, layout) -> bool:
    """Whether FSDP all-gathers the weights in float8 (tensorwise only; rowwise gathers in the
    parameter dtype, as torchao does)."""
    return mode == "tensorwise" and shards_over_ranks(layout)


def apply_float8(model: nn.Module, mode: str, *, emulate: bool, fsdp_all_gather: bool) -> list[str]:
    """Convert ``model``'s eligible linear layers in place; returns the names of those left out."""
    from torchao.float8 import convert_to_float8_training

    skipped: list[str] = []

    def eligible(module: nn.Module, name: str) -> bool:
        if not isinstance(module, nn.Linear):
            return True  # the filter is asked of every module; only linears are converted
        if name.split(".")[-1] in SKIPPED_NAMES or module.in_features % 16 or module.out_features % 16:
            skipped.append(name)
            return False
        return True

    convert_to_float8_training(model, config=_config(mode, emulate, fsdp_all_gather), module_filter_fn=eligible)
    return skipped


def precompute_scales(model: nn.Module) -> None:
    """Every float8-gathered weight's scale for the next all-gathers, in one pass (tensorwise)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)
