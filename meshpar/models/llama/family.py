"""The Llama-style families: Llama 3.x, Qwen2 and Qwen3 share one model class and plan."""

from meshpar.models.family import ROPE_DIMS, Family
from meshpar.models.llama import convert
from meshpar.models.llama.args import LLAMA_SIZES, QWEN2_SIZES, QWEN3_SIZES, ModelArgs
from meshpar.models.llama.model import Transformer
from meshpar.models.llama.parallelize import LLAMA_TP_PLAN, check_llama_layout

FAMILIES = tuple(Family(name, Transformer, ModelArgs, sizes, LLAMA_TP_PLAN, check_llama_layout, ROPE_DIMS, convert)
                 for name, sizes in (("llama", LLAMA_SIZES), ("qwen2", QWEN2_SIZES), ("qwen3", QWEN3_SIZES)))
