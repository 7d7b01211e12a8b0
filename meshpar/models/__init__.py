"""The model-family registry: family name -> ``Family`` (meshpar/models/family.py).

Each family folder's ``family.py`` defines ``FAMILIES``, its ``Family`` objects; the registry is
one line per folder below. The package imports only leaf modules of meshpar (tensor_parallel's
styles, errors, config keys), never meshpar.parallel.parallelize, so there is no import cycle.
"""

from __future__ import annotations

from meshpar.config.errors import RecipeError
from meshpar.models.deepseek import family as deepseek
from meshpar.models.family import NOT_BUILT, Family
from meshpar.models.gpt2 import family as gpt2
from meshpar.models.gpt_oss import family as gpt_oss
from meshpar.models.hf import family as hf
from meshpar.models.llama import family as llama
from meshpar.models.moe import family as moe

FAMILIES: dict[str, Family] = {f.name: f for f in (
    *llama.FAMILIES,
    *gpt2.FAMILIES,
    *moe.FAMILIES,
    *deepseek.FAMILIES,
    *gpt_oss.FAMILIES,
    *hf.FAMILIES,
)}

MOE_FAMILIES = tuple(name for name, f in FAMILIES.items() if f.moe is not None)

__all__ = ["FAMILIES", "MOE_FAMILIES", "NOT_BUILT", "Family", "get_family"]


def get_family(name: str) -> Family:
    try:
        return FAMILIES[name]
    except KeyError:
        raise RecipeError(f"model.family = '{name}': unknown family; choose one of {', '.join(FAMILIES)}",
                          "model.family") from None
