"""The DeepSeek-V3 family."""

from meshpar.models.deepseek import convert
from meshpar.models.deepseek.args import DEEPSEEK_V3_SIZES, DeepSeekArgs
from meshpar.models.deepseek.model import DeepSeekTransformer
from meshpar.models.deepseek.parallelize import DEEPSEEK_TP_PLAN
from meshpar.models.family import MOE_DIMS, Family
from meshpar.models.moe.family import MOE, NO_SAMPLER
from meshpar.models.moe.parallelize import check_moe_layout

FAMILIES = (Family("deepseek_v3", DeepSeekTransformer, DeepSeekArgs, DEEPSEEK_V3_SIZES, DEEPSEEK_TP_PLAN,
                   check_moe_layout, MOE_DIMS, convert, moe=MOE, sample_refusal=NO_SAMPLER),)
