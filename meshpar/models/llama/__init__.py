"""Llama-style decoder family: Llama 3.x, Qwen2 and Qwen3 share one model class."""

from meshpar.models.llama.args import LLAMA_SIZES, QWEN2_SIZES, QWEN3_SIZES, ModelArgs, RopeScaling
from meshpar.models.llama.model import Transformer

__all__ = ["LLAMA_SIZES", "QWEN2_SIZES", "QWEN3_SIZES", "ModelArgs", "RopeScaling", "Transformer"]
