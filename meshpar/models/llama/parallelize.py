"""Tensor-parallel plan for the Llama family (Llama 3.x, Qwen2, Qwen3), as a table.

Megatron-style tensor parallelism with sequence parallelism: in each block, q/k/v and the
SwiGLU's w1/w3 are column-wise (each rank owns H/tp query heads, Hkv/tp kv heads, F/tp
hidden units), wo and w2 row-wise; the norms run on sequence shards; the embedding and
the output are sharded on the vocabulary. ``LLAMA_TP_PLAN`` is data: meshpar.parallel.parallelize
applies it (``meshpar.parallel.tensor_parallel.plan.apply_tp``); this module imports only leaf modules.

Per block, with x[B, T/tp, D] (Shard(1)) on each rank:

    attention_norm(x)                     -> [B, T/tp, D]
    attention input: all-gather sequence  -> [B, T, D]
    wq, wk, wv (+ Qwen2 biases)           -> q[B, T, H/tp*Dh], k, v[B, T, Hkv/tp*Dh]
    (Qwen3 q_norm, k_norm on local heads; RoPE; attention on local heads)
    wo: [B, T, H/tp*Dh] @ wo[H/tp*Dh, D]  -> partial [B, T, D] -> reduce-scatter -> [B, T/tp, D]
    the feed-forward likewise (w1, w3 column-wise, w2 row-wise)

Limits: n_heads, n_kv_heads, ffn_dim and vocab_size must be divisible by tp, and so must the
training sequence length (``check_llama_tp``, ``check_seq_len``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

from meshpar.models.llama.args import ModelArgs
from meshpar.parallel.tensor_parallel.checks import check_tp_degree
from meshpar.parallel.tensor_parallel.plan import TPPlan, vocab_parallel_output
from meshpar.parallel.tensor_parallel.styles import ReplicateParallel, VocabParallelEmbedding

if TYPE_CHECKING:
    from meshpar.distributed.mesh import Layout

SEQ = Shard(1)  # activations between blocks: h[B, T/tp, D], see [Note: the residual stream is a DTensor]


def _gather_sequence(n_extra_inputs: int) -> PrepareModuleInput:
    """A block's sub-layer input: [B, T/tp, D] -> all-gather -> [B, T, D], kept a Replicate
    DTensor ([Note: one reduce-scatter per sub-layer input in backward] in
    meshpar/parallel/tensor_parallel/plan.py); the extra inputs (RoPE's cos, sin; the document mask or None: plain
    tensors, whole on every rank) pass untouched."""
    return PrepareModuleInput(input_layouts=(SEQ, *[None] * n_extra_inputs),
                              desired_input_layouts=(Replicate(), *[None] * n_extra_inputs), use_local_output=False)


colwise = ColwiseParallel()  # [B, T, D] replicated @ w[D, N/tp] -> local [B, T, N/tp]
rowwise = RowwiseParallel(output_layouts=SEQ, use_local_output=False)  # partial -> reduce-scatter -> [B, T/tp, D]
head_norm = ReplicateParallel(input_layout=Shard(1), use_local_output=True)  # q[B, H/tp, T, Dh]: per head

# The plan table. Logits stay vocab-sharded, a DTensor [B, T, V/tp] (the loss runs under
# ``loss_parallel_context(True)``); ``.with_loss_parallel(False)`` all-gathers them to a plain
# [B, T, V] on every rank (parallel.loss_parallel = false).
LLAMA_TP_PLAN = TPPlan(
    root={
        # tokens[B, T] replicated -> embedding rows V/tp -> partial [B, T, D] -> reduce-scatter -> [B, T/tp, D]
        "tok_embeddings": VocabParallelEmbedding(output_layout=SEQ),
        "norm": SequenceParallel(),
        # [B, T/tp, D] -> all-gather -> [B, T, D] @ output[D, V/tp] -> logits [B, T, V/tp]
        "output": vocab_parallel_output(loss_parallel=True),
    },
    block={
        "attention_norm": SequenceParallel(),
        "attention": _gather_sequence(n_extra_inputs=3),  # (x, cos, sin, mask)
        "attention.wq": colwise,
        "attention.wk": colwise,
        "attention.wv": colwise,
        "attention.q_norm": head_norm,  # Qwen3 only; skipped where absent
        "attention.k_norm": head_norm,
        "attention.wo": rowwise,
        "ffn_norm": SequenceParallel(),
        "feed_forward": _gather_sequence(n_extra_inputs=0),
        "feed_forward.w1": colwise,
        "feed_forward.w3": colwise,
        "feed_forward.w2": rowwise,
    },
    embedding="tok_embeddings",
    output="output",
)


def llama_tp_plan(loss_parallel: bool = True) -> TPPlan:
    """``LLAMA_TP_PLAN`` with logits vocab-sharded (``loss_parallel``) or gathered."""
    return LLAMA_TP_PLAN.with_loss_parallel(loss_parallel)


def check_llama_tp(args: ModelArgs, tp: int) -> None:
    """RecipeError unless ``tp`` divides every dimension the plan shards (the sequence: ``check_seq_len``)."""
    check_tp_degree(tp, {"n_heads": args.n_heads, "n_kv_heads": args.n_kv_heads, "ffn_dim": args.ffn_dim,
                         "vocab_size": args.vocab_size},
                    fixes={"vocab_size": "model.vocab_size can pad the vocabulary to a multiple of the tp degree"})


def check_llama_layout(args: ModelArgs, layout: Layout) -> None:
    """Before launch: every dimension the plan shards divides by the tp degree."""
    if layout.tp > 1:
        check_llama_tp(args, layout.tp)
