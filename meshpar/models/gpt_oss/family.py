"""The gpt-oss family (openai/gpt-oss-20b, -120b): meshpar's mixture of experts with gpt-oss's
attention and experts; every parallel dim but context parallelism (``check_gpt_oss_layout`` says why)."""

from meshpar.models.family import DENSE_DIMS, Family
from meshpar.models.gpt_oss import convert
from meshpar.models.gpt_oss.args import GPT_OSS_SIZES, GptOssArgs
from meshpar.models.gpt_oss.model import GptOssTransformer
from meshpar.models.gpt_oss.parallelize import GPT_OSS_TP_PLAN, check_gpt_oss_layout
from meshpar.models.moe.family import MOE, NO_SAMPLER

FAMILIES = (Family("gpt_oss", GptOssTransformer, GptOssArgs, GPT_OSS_SIZES, GPT_OSS_TP_PLAN, check_gpt_oss_layout,
                   DENSE_DIMS | {"ep"}, convert, moe=MOE, sample_refusal=NO_SAMPLER),)
