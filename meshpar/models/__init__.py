"""The model-family registry: family name -> model class, named sizes, parallelize, mesh dims.

A family is a pure-PyTorch model (no parallel code, constructible on the meta device,
``init_weights()``, layers in a ``ModuleDict`` keyed by index) plus the one function that
applies parallelism to it from outside (``models/<family>/parallelize.py``) and the check of
its dimensions against a tensor-parallel degree. ``mesh_dims`` lists the parallel dimensions
this family can run with today; a recipe asking for any other is refused before launch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from meshpar.models.gpt2 import GPT2, GPT2_SIZES
from meshpar.models.gpt2.parallelize import check_gpt2_layout, parallelize_gpt2
from meshpar.models.llama import LLAMA_SIZES, QWEN2_SIZES, QWEN3_SIZES, Transformer
from meshpar.models.llama.parallelize import check_llama_layout, parallelize_llama
from meshpar.recipe import RecipeError

if TYPE_CHECKING:
    from meshpar.recipe import ModelConfig


@dataclass(frozen=True)
class Family:
    name: str
    model_cls: type[nn.Module]
    sizes: Mapping[str, Any]  # size name -> the family's frozen args dataclass
    parallelize: Callable[..., nn.Module]  # (model or stage on meta, Mesh, ParallelConfig) -> module
    check_layout: Callable[[Any, Any], None]  # (args, Layout) -> RecipeError: tp must divide the dims it shards
    mesh_dims: frozenset[str]  # parallel dims that may be > 1

    def model_args(self, cfg: ModelConfig) -> Any:
        """The named size's args with the recipe's overrides (n_layers, vocab_size) applied."""
        if cfg.size not in self.sizes:
            raise RecipeError(f"model.size = '{cfg.size}': no such size for family '{self.name}'; "
                              f"choose one of {', '.join(self.sizes)}", "model.size")
        args = self.sizes[cfg.size]
        overrides = {k: getattr(cfg, k) for k in ("n_layers", "vocab_size") if getattr(cfg, k)}
        return dataclasses.replace(args, **overrides)

    def check_degrees(self, degrees: Mapping[str, int]) -> None:
        """Refuse parallel dims (degree > 1) this family cannot run with yet, naming the key."""
        for dim, degree in degrees.items():
            if degree > 1 and dim not in self.mesh_dims:
                raise RecipeError(f"parallel.{dim} = {degree}: {NOT_BUILT[dim]} is not built yet for model family "
                                  f"'{self.name}' (built: {', '.join(sorted(self.mesh_dims)) or 'none'}); "
                                  f"set parallel.{dim} = 1", f"parallel.{dim}")

    def build(self, cfg: ModelConfig) -> nn.Module:
        """Construct on the current default device; use ``with torch.device("meta")`` for big models."""
        return self.model_cls(self.model_args(cfg))


NOT_BUILT = {
    "pp": "pipeline parallelism",
    "dp_replicate": "replicated data parallelism",
    "dp_shard": "sharded data parallelism (meshpar.fully_shard)",
    "cp": "context parallelism",
    "tp": "tensor parallelism",
}

_ND = frozenset({"pp", "dp_replicate", "dp_shard", "tp"})

FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("llama", Transformer, LLAMA_SIZES, parallelize_llama, check_llama_layout, _ND),
    Family("qwen2", Transformer, QWEN2_SIZES, parallelize_llama, check_llama_layout, _ND),
    Family("qwen3", Transformer, QWEN3_SIZES, parallelize_llama, check_llama_layout, _ND),
    Family("gpt2", GPT2, GPT2_SIZES, parallelize_gpt2, check_gpt2_layout, _ND),
)}


def get_family(name: str) -> Family:
    try:
        return FAMILIES[name]
    except KeyError:
        raise RecipeError(f"model.family = '{name}': unknown family; choose one of {', '.join(FAMILIES)}",
                          "model.family") from None
