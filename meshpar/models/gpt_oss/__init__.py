"""gpt-oss family (openai/gpt-oss-20b, -120b): attention with sinks over alternating sliding and full
layers, YaRN RoPE, and biased experts with a clamped SwiGLU on meshpar's mixture of experts."""

from meshpar.models.gpt_oss.args import GPT_OSS_SIZES, GptOssArgs, Yarn
from meshpar.models.gpt_oss.model import GptOssTransformer

__all__ = ["GPT_OSS_SIZES", "GptOssArgs", "GptOssTransformer", "Yarn"]
