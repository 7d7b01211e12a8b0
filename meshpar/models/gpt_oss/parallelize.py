"""Tensor-parallel plan for the gpt-oss family, as a table (its layout check is the mixture-of-experts
families' ``check_moe_layout``).

Embedding, output, norms and the sparse blocks' ``moe``: the mixture-of-experts plan's
(meshpar/models/moe/parallelize.py: each tp rank routes its own slice of the sequence through whole
experts, which FSDP shards over dp_shard x tp). Attention is the Llama family's, heads split:

    attention_norm(x)                        [B, T/tp, D]  Shard(1)
    attention input: all-gather sequence  -> [B, T, D]    (the layer's mask passes untouched)
    wq, wk, wv column-wise, with biases   -> q[B, T, H/tp*Dh], k, v[B, T, Hkv/tp*Dh]
    sinks by head                         -> sinks[H/tp], rank r's heads' as wq's output
    RoPE, attention with sinks on local heads (window or full: per head, nothing to exchange)
    wo row-wise (bias added once)         -> partial [B, T, D] -> reduce-scatter -> [B, T/tp, D]

Limits: n_heads, n_kv_heads, the experts' width and vocab_size divide by tp, the sparse layers need
dp_shard > 1 (``check_moe_layout``); no context parallelism (refused before launch with the reason the
family gives, meshpar/models/gpt_oss/family.py).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, SequenceParallel

from meshpar.models.llama.parallelize import LLAMA_TP_PLAN, colwise, rowwise
from meshpar.models.moe.parallelize import MOE_TP_PLAN, tokens_stay_on_their_rank
from meshpar.parallel.tensor_parallel.plan import TPPlan


class ShardedByHead(ParallelStyle):
    """A module whose ``forward()`` returns its own per-head parameter ``weight[H]`` (gpt-oss's
    ``Sinks``): the parameter a DTensor ``Shard(0)`` on tp, so rank r holds the sinks of the heads
    wq's column-wise shard gives it, and the forward returns them as a plain local tensor [H/tp]
    whose gradient comes back ``Shard(0)``. ``placement``: the parameter's placement on tp."""

    placement = Shard(0)

    def _shard(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for pname, param in list(module.named_parameters(recurse=False)):
            sharded = distribute_tensor(param, mesh, [self.placement], src_data_rank=self.src_data_rank)
            module.register_parameter(pname, nn.Parameter(sharded, requires_grad=param.requires_grad))

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, self._shard,
                                 output_fn=lambda _module, out, _mesh: out.to_local())


GPT_OSS_TP_PLAN = TPPlan(
    root=MOE_TP_PLAN.root,
    block={
        "attention_norm": SequenceParallel(),
        "attention": LLAMA_TP_PLAN.block["attention"],  # [B, T/tp, D] -> all-gather -> [B, T, D]; (cos, sin, mask)
        "attention.wq": colwise,  # ColwiseParallel shards a bias with its rows
        "attention.wk": colwise,
        "attention.wv": colwise,
        "attention.sinks": ShardedByHead(),
        "attention.wo": rowwise,  # the bias Replicate, added once to the reduced sum
        "ffn_norm": SequenceParallel(),
        "moe": tokens_stay_on_their_rank,
    },
    embedding=MOE_TP_PLAN.embedding,
    output=MOE_TP_PLAN.output,
)


def gpt_oss_tp_plan(loss_parallel: bool = True) -> TPPlan:
    """``GPT_OSS_TP_PLAN`` with logits vocab-sharded (``loss_parallel``) or gathered."""
    return GPT_OSS_TP_PLAN.with_loss_parallel(loss_parallel)

