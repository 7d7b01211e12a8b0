"""Mixture-of-experts decoder families: Qwen3-MoE and Mixtral share one model class."""

from meshpar.models.moe.args import MIXTRAL_SIZES, QWEN3_MOE_SIZES, MoEArgs
from meshpar.models.moe.model import MoETransformer

__all__ = ["MIXTRAL_SIZES", "QWEN3_MOE_SIZES", "MoEArgs", "MoETransformer"]
