"""The GPT-2 family (124M to 1.5B)."""

from meshpar.models.family import DENSE_DIMS, Family
from meshpar.models.gpt2 import convert
from meshpar.models.gpt2.model import GPT2, GPT2_SIZES, GPT2Args
from meshpar.models.gpt2.parallelize import GPT2_TP_PLAN, check_gpt2_layout

FAMILIES = (Family("gpt2", GPT2, GPT2Args, GPT2_SIZES, GPT2_TP_PLAN, check_gpt2_layout, DENSE_DIMS, convert,
                   sample_refusal="it has no KV cache: its positions are learned"),)
