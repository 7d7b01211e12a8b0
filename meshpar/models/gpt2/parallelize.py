"""Tensor-parallel plan for GPT-2, as a table.

The same scheme as the Llama plan (meshpar/models/llama/parallelize.py): column-wise
attention input and MLP c_fc, row-wise output projections, sequence-parallel LayerNorms,
vocabulary-parallel embedding and output. Two things differ:

- ``attn.c_attn`` is one fused projection laid out [q | k | v]; ``FusedColwiseParallel(3)``
  gives rank r heads r*H/tp .. (r+1)*H/tp of each of q, k and v (see [Note: fused
  projections] in meshpar/parallel/tensor_parallel/styles.py), and its global view is the unsharded weight.
- learned positions ``wpe`` and the tie of ``lm_head`` to ``wte``, see the notes below.

Limits: n_heads and vocab_size must be divisible by tp (the published GPT-2 vocabulary,
50257, is not: pad it with ``model.vocab_size``), and so must the training sequence length.
tp > 1 does not compose with dp_shard > 1 yet ([Note: GPT-2 fused c_attn under FSDP]).

``GPT2_TP_PLAN`` is data: meshpar.parallel.parallelize applies it; this module imports only leaf modules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

from meshpar.models.gpt2.model import GPT2Args
from meshpar.parallel.tensor_parallel.checks import check_fsdp_over_tp, check_tp_degree
from meshpar.parallel.tensor_parallel.plan import TPPlan, vocab_parallel_output
from meshpar.parallel.tensor_parallel.styles import FusedColwiseParallel, ReplicateParallel, VocabParallelEmbedding

if TYPE_CHECKING:
    from meshpar.distributed.mesh import Layout

SEQ = Shard(1)  # activations between blocks: h[B, T/tp, D], see [Note: the residual stream is a DTensor]

# [Note: GPT-2 positions under sequence parallelism]
# GPT2.forward computes wte(tokens) + wpe(arange(T)). The token embedding is vocab-parallel
# and its output is reduce-scattered to the sequence shard, a DTensor [B, T, D] placed
# Shard(1) (local [B, T/tp, D]). A plain wpe would return a plain [T, D] tensor that cannot
# be added to it. So wpe is replicated (``ReplicateParallel``) and its input, the positions
# [T] (the same on every rank), is taken as Shard(-1), the sequence: each rank slices its own
# T/tp positions (no communication) and looks them up, giving a DTensor [T, D] placed Shard(0)
# (local [T/tp, D]), which broadcasts against Shard(1) of [B, T, D] onto the same rows. With
# document attention the positions are [B, T] (restarting per document) and Shard(-1) is
# Shard(1): [B, T/tp] looked up to [B, T/tp, D], placed as the token embedding is. The
# table's gradient is a partial sum over tp (each rank saw its own positions), reduced as
# any replicated parameter's ([Note: gradients of replicated parameters]). A vocab-style
# row-wise wpe would work too but costs a reduce-scatter of [T, D] in every forward.

# [Note: GPT-2 tied embedding under tensor parallelism]
# lm_head.weight is wte.weight, [V, D]. The vocabulary-parallel embedding (row-wise) shards
# it Shard(0) and the column-wise output projection shards it Shard(0) too: the same rows
# V/tp on each rank for both uses. So the tie survives: apply_tp keeps them one Parameter
# (one DTensor, one gradient summing both uses, one optimizer state).

# [Note: GPT-2 fused c_attn under FSDP]
# FSDP shards dim 0 of a parameter's TP-local tensor: for c_attn, rows [d*c, (d+1)*c) of
# [q_r | k_r | v_r]. For a plain column-wise shard that is StridedShard(0, tp) on the dp
# dim, but under the fused StridedShard(0, 3) on tp no DTensor placement describes it, so
# the sharded parameter's global view (init, checkpoints, full_tensor) would be wrong and
# training would silently diverge from one process. Until FSDP shards each of a fused
# parameter's pieces separately, the plan refuses tp with dp_shard (``no_fsdp``);
# dp_replicate (no sharding) composes.

rowwise = RowwiseParallel(output_layouts=SEQ, use_local_output=False)  # partial -> reduce-scatter -> [B, T/tp, D]
# [B, T/tp, D] -> all-gather -> [B, T, D], a DTensor: [Note: one reduce-scatter per sub-layer input in backward]
gather_sequence = PrepareModuleInput(input_layouts=(SEQ,), desired_input_layouts=(Replicate(),),
                                     use_local_output=False)
# attn(x, mask): x as above; the document mask [B, 1, T, T] (or None), whole on every rank, passes untouched
gather_sequence_and_mask = PrepareModuleInput(input_layouts=(SEQ, None), desired_input_layouts=(Replicate(), None),
                                              use_local_output=False)

# The plan table. Logits stay vocab-sharded, a DTensor [B, T, V/tp] (the loss runs under
# ``loss_parallel_context(True)``); ``.with_loss_parallel(False)`` gathers them to [B, T, V].
GPT2_TP_PLAN = TPPlan(
    root={
        # tokens[B, T] replicated -> embedding rows V/tp -> partial [B, T, D] -> reduce-scatter -> [B, T/tp, D]
        "wte": VocabParallelEmbedding(output_layout=SEQ),
        # positions[T] -> this rank's [T/tp] -> [T/tp, D] (per document: [B, T] -> [B, T/tp] -> [B, T/tp, D]):
        # [Note: GPT-2 positions under sequence parallelism]
        "wpe": ReplicateParallel(input_layout=Replicate(), desired_input_layout=Shard(-1)),
        "ln_f": SequenceParallel(),
        # [B, T/tp, D] -> all-gather -> [B, T, D] @ lm_head[D, V/tp] -> logits [B, T, V/tp] (tied to wte)
        "lm_head": vocab_parallel_output(loss_parallel=True),
    },
    block={
        "ln_1": SequenceParallel(),
        "attn": gather_sequence_and_mask,
        "attn.c_attn": FusedColwiseParallel(3),  # [B, T, D] @ c_attn[D, 3D] -> local [B, T, q_r | k_r | v_r]
        "attn.c_proj": rowwise,
        "ln_2": SequenceParallel(),
        "mlp": gather_sequence,
        "mlp.c_fc": ColwiseParallel(),  # [B, T, D] @ c_fc[D, 4D/tp] -> [B, T, 4D/tp]
        "mlp.c_proj": rowwise,
    },
    embedding="wte",
    output="lm_head",
    no_fsdp="GPT-2's fused c_attn cannot be FSDP-sharded over a tensor-parallel shard yet",  # [Note: GPT-2 ...]
)


def gpt2_tp_plan(loss_parallel: bool = True) -> TPPlan:
    """``GPT2_TP_PLAN`` with logits vocab-sharded (``loss_parallel``) or gathered."""
    return GPT2_TP_PLAN.with_loss_parallel(loss_parallel)


def check_gpt2_tp(args: GPT2Args, tp: int) -> None:
    """RecipeError unless ``tp`` divides every dimension the plan shards (the sequence: ``check_seq_len``)."""
    check_tp_degree(tp, {"n_heads": args.n_heads, "vocab_size": args.vocab_size},
                    fixes={"vocab_size": "model.vocab_size can pad the vocabulary to a multiple of the tp degree "
                                         "(GPT-2's 50257 -> 50304)"})


def check_gpt2_layout(args: GPT2Args, layout: Layout) -> None:
    """Before launch: the tp divisibility checks and the layouts GPT-2 cannot run yet."""
    if layout.tp > 1:
        check_gpt2_tp(args, layout.tp)
    check_fsdp_over_tp(GPT2_TP_PLAN, layout.tp, layout.dp_shard)
