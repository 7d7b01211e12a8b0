"""Tensor-parallel plan for the mixture-of-experts families (Qwen3-MoE, Mixtral), as a table.

Attention, norms, embedding, output and the dense blocks' feed-forward: the Llama family's plan
(meshpar/models/llama/parallelize.py: Megatron-style with sequence parallelism). A sparse block's
``moe`` takes its rank's slice of the sequence as a local tensor and returns one: each tp rank
routes its own tokens through whole experts ([Note: the tp ranks are data-parallel for the experts]
in meshpar/parallel/expert_parallel.py, which also sums the routing statistics over tp):

    ffn_norm(x)                     -> [B, T/tp, D] (Shard(1))
    moe: local [B, T/tp, D] -> route, experts (all-to-all over ep when ep > 1) -> local [B, T/tp, D]
    back to Shard(1)                -> added to the residual stream, no collective

Limits: as the Llama plan's (n_heads, n_kv_heads, the dense ffn_dim and vocab_size divide by tp).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import PrepareModuleInputOutput

from meshpar.config.errors import RecipeError
from meshpar.models.llama.parallelize import LLAMA_TP_PLAN, check_llama_tp
from meshpar.parallel.tensor_parallel.plan import TPPlan

if TYPE_CHECKING:
    from meshpar.distributed.mesh import Layout

SEQ = Shard(1)

# [B, T/tp, D] Shard(1) DTensor -> local in; local out -> Shard(1) DTensor, no communication
tokens_stay_on_their_rank = PrepareModuleInputOutput(input_layouts=(SEQ,), desired_input_layouts=(SEQ,),
                                                     use_local_input=True, output_layouts=(SEQ,),
                                                     desired_output_layouts=(SEQ,), use_local_output=False)

MOE_TP_PLAN = TPPlan(
    root=LLAMA_TP_PLAN.root,
    block={**LLAMA_TP_PLAN.block, "moe": tokens_stay_on_their_rank},  # feed_forward.*: the dense blocks
    embedding=LLAMA_TP_PLAN.embedding,
    output=LLAMA_TP_PLAN.output,
)


def moe_tp_plan(loss_parallel: bool = True) -> TPPlan:
    """``MOE_TP_PLAN`` with logits vocab-sharded (``loss_parallel``) or gathered."""
    return MOE_TP_PLAN.with_loss_parallel(loss_parallel)


def check_moe_tp(args, layout: Layout) -> None:
    """Before launch: what the plan shards divides by tp, and FSDP units exist for the sparse layers'
    parameters to sum their gradients over tp (dp_shard > 1)."""
    check_llama_tp(args, layout.tp)
    if layout.dp_shard == 1:
        raise RecipeError(f"parallel.tp = {layout.tp} with parallel.dp_shard = 1: a mixture-of-experts family's "
                          f"sparse layers are FSDP-sharded over dp_shard x tp (each tp rank routes its own slice "
                          f"of the sequence), which needs dp_shard > 1; use dp_shard >= 2 or tp = 1",
                          "parallel.dp_shard")
    if args.capacity_factor > 0:
        raise RecipeError(f"model.capacity_factor = {args.capacity_factor} with parallel.tp = {layout.tp}: the "
                          f"capacity would apply to each tp rank's slice of the sequence, which is not built; set "
                          f"capacity_factor = 0 or tp = 1", "model.capacity_factor")


def check_moe_layout(args, layout: Layout) -> None:
    """Tensor parallelism as this plan builds it; the capacity per call refused under cp; ep divides
    the expert count."""
    if layout.tp > 1:
        check_moe_tp(args, layout)
    if layout.cp > 1 and args.capacity_factor > 0:
        raise RecipeError(f"model.capacity_factor = {args.capacity_factor} with parallel.cp = {layout.cp}: the "
                          f"capacity would apply to each cp rank's slice of the sequence, which is not built; "
                          f"set capacity_factor = 0 or cp = 1", "model.capacity_factor")
    if layout.ep > 1 and args.n_experts % layout.ep:
        raise RecipeError(f"parallel.ep = {layout.ep}: {args.n_experts} experts do not split over {layout.ep} "
                          f"ranks; choose an ep that divides the expert count", "parallel.ep")
