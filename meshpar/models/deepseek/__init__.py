"""DeepSeek-V3 family: multi-head latent attention and DeepSeekMoE (shared and fine-grained routed
experts, sigmoid group-limited routing with an auxiliary-loss-free bias)."""

from meshpar.models.deepseek.args import DEEPSEEK_V3_SIZES, DeepSeekArgs, Yarn
from meshpar.models.deepseek.model import DeepSeekTransformer

__all__ = ["DEEPSEEK_V3_SIZES", "DeepSeekArgs", "DeepSeekTransformer", "Yarn"]
