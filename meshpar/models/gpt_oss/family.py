"""The gpt-oss family (openai/gpt-oss-20b, -120b): meshpar's mixture of experts with gpt-oss's
attention and experts; every parallel dim but context parallelism (``not_built`` says why)."""

from meshpar.models.family import DENSE_DIMS, Family
from meshpar.models.gpt_oss import convert
from meshpar.models.gpt_oss.args import GPT_OSS_SIZES, GptOssArgs
from meshpar.models.gpt_oss.model import GptOssTransformer
from meshpar.models.gpt_oss.parallelize import GPT_OSS_TP_PLAN
from meshpar.models.moe.family import MOE, NO_SAMPLER
from meshpar.models.moe.parallelize import check_moe_layout

NO_CP = ("cp fills every layer's attention slot with meshpar's context-parallel attention "
         "(meshpar/parallel/context_parallel/), causal attention over the whole sequence with neither a sliding "
         "window nor sink logits, so gpt-oss's sliding layers would attend to every earlier token instead of their "
         "window and each head's learned sink would drop out of its softmax; tp's sequence parallelism still "
         "splits activations over the sequence")

# meshpar/models/decode.py fills the attention slots with a KV cache that has no window and no sinks
NO_CACHE = "meshpar's KV-cache attention has no sliding window and no sinks; generate with transformers after " \
           "`meshpar convert --to hf`"

FAMILIES = (Family("gpt_oss", GptOssTransformer, GptOssArgs, GPT_OSS_SIZES, GPT_OSS_TP_PLAN, check_moe_layout,
                   DENSE_DIMS | {"ep"}, convert, moe=MOE, sample_refusal=NO_SAMPLER, generate_refusal=NO_CACHE,
                   not_built={"cp": NO_CP}),)
