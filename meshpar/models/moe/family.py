"""The mixture-of-experts families Qwen3-MoE and Mixtral: one model class, one plan, two adapters."""

from meshpar.models.family import MOE_DIMS, Family
from meshpar.models.moe.args import MIXTRAL_SIZES, QWEN3_MOE_SIZES, MoEArgs
from meshpar.models.moe.convert import MIXTRAL, QWEN3_MOE
from meshpar.models.moe.model import MoETransformer
from meshpar.models.moe.parallelize import MOE_TP_PLAN, check_moe_layout
from meshpar.models.moe.part import MoEPart

MOE = MoEPart()
# meshpar's sampler runs no mixture of experts yet
NO_SAMPLER = "its forwards count expert loads for the step's metrics"

FAMILIES = tuple(Family(name, MoETransformer, MoEArgs, sizes, MOE_TP_PLAN, check_moe_layout, MOE_DIMS, adapter,
                        moe=MOE, sample_refusal=NO_SAMPLER)
                 for name, sizes, adapter in (("qwen3_moe", QWEN3_MOE_SIZES, QWEN3_MOE),
                                              ("mixtral", MIXTRAL_SIZES, MIXTRAL)))
