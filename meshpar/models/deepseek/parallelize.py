"""Tensor-parallel plan for the DeepSeek-V3 family, as a table: heads split, the latent gathered.

Embedding, output, norms, the dense blocks' feed-forward and the sparse blocks' ``moe``: the
mixture-of-experts plan's (meshpar/models/moe/parallelize.py; the shared experts sit inside ``moe``,
so like the routed ones they run whole on each tp rank's slice of the sequence and are FSDP-sharded
over dp_shard x tp). Multi-head latent attention ([Note: MLA under tensor parallelism]):

    x                                   [B, T/tp, D]  Shard(1), the attention_norm's output
    wq_a, q_norm; wkv_a, kv_norm        on the sequence shard, weights replicated over tp
    all-gather the sequence of          q_a [B, T, q_lora], latent [B, T, kv_lora], k_rope [B, T, R]
      (no q_lora: x itself, [B, T, D])
    wq_b (or wq), wkv_b column-wise     q, k_nope, v of H/tp heads
    RoPE, attention on local heads; wo row-wise -> reduce-scatter -> [B, T/tp, D]

Limits: n_heads, the dense ffn_dim and vocab_size divide by tp; the sparse layers need dp_shard > 1
(``check_moe_tp``).
"""

from __future__ import annotations

from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle

from meshpar.models.moe.parallelize import MOE_TP_PLAN
from meshpar.parallel.tensor_parallel.plan import TPPlan
from meshpar.parallel.tensor_parallel.styles import ReplicateParallel

SEQ = Shard(1)

# [Note: MLA under tensor parallelism]
# Each tp rank owns H/tp heads: the up-projections wq_b (or wq) and wkv_b are column-wise and wo
# row-wise, as Llama's q/k/v and wo. The down-projections wq_a and wkv_a, and the norms on their
# outputs, stay whole on every rank: their outputs (q_lora, kv_lora + R wide) feed every head, and
# the norms need the whole rank. They run on the rank's slice of the sequence (no duplicated work,
# weights' gradients Partial: [Note: gradients of replicated parameters]), and what is all-gathered
# is their compressed output, not the hidden state: per token q_lora + kv_lora + R numbers instead
# of D (DeepSeek-V3: 1,536 + 512 + 64 = 2,112 against 7,168). The shared RoPE key k_rope feeds every
# local head; each rank's gradient of it covers its heads only, so the ``shared_rope_key`` slot
# gathers it and marks the local gradient Partial, whose backward is a reduce-scatter.
# Per MLA layer and microbatch: forward 3 all-gathers (2 without q_lora: x and the latent's) and wo's
# reduce-scatter; backward the reverse, a reduce-scatter per gathered tensor and one all-gather.


class GatherSequenceSharedByHeads(ParallelStyle):
    """An identity slot taking a [B, T/tp, N] Shard(1) DTensor and returning the local whole-sequence
    tensor [B, T, N] (all-gather), whose gradient on each rank is one part of a sum over tp (every
    rank's heads read it): backward reduce-scatters the parts into the Shard(1) gradient."""

    def _apply(self, module, device_mesh):
        def gather(_module, inputs):
            x, *rest = inputs
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, (SEQ,), run_check=False)
            return (x.redistribute(placements=(Replicate(),)).to_local(grad_placements=(Partial(),)), *rest)

        module.register_forward_pre_hook(gather)
        return module


replicated_on_sequence = ReplicateParallel(input_layout=SEQ)  # whole weights, [B, T/tp, N] in and out
gathered_colwise = ColwiseParallel(input_layouts=SEQ)  # all-gather [B, T, N] @ w[N, M/tp] -> local [B, T, M/tp]

DEEPSEEK_TP_PLAN = TPPlan(
    root=MOE_TP_PLAN.root,
    block={
        **{k: v for k, v in MOE_TP_PLAN.block.items() if not k.startswith("attention")},
        "attention_norm": MOE_TP_PLAN.block["attention_norm"],
        "attention.wq": gathered_colwise,  # q_lora_rank = 0 only; skipped where absent
        "attention.wq_a": replicated_on_sequence,
        "attention.q_norm": replicated_on_sequence,
        "attention.wq_b": gathered_colwise,
        "attention.wkv_a": replicated_on_sequence,
        "attention.kv_norm": replicated_on_sequence,
        "attention.wkv_b": gathered_colwise,
        "attention.shared_rope_key": GatherSequenceSharedByHeads(),
        "attention.wo": MOE_TP_PLAN.block["attention.wo"],
    },
    embedding=MOE_TP_PLAN.embedding,
    output=MOE_TP_PLAN.output,
)


def deepseek_tp_plan(loss_parallel: bool = True) -> TPPlan:
    """``DEEPSEEK_TP_PLAN`` with logits vocab-sharded (``loss_parallel``) or gathered."""
    return DEEPSEEK_TP_PLAN.with_loss_parallel(loss_parallel)
