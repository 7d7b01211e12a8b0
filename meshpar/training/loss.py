"""The training loss: mean cross-entropy over a microbatch's tokens, from whole logits or chunk by chunk.

    loss = TokenLoss(head, chunks)        # meshpar.training.loop builds it with the model
    loss(out, targets)                    # out: logits[B, T, V], or h[B, T, D] when the head is deferred

What the step, a pipeline's last stage and validation call. With ``train.loss_chunks`` > 1 the
model's forward stops after the final norm (the model's ``head_in_loss`` slot, which
meshpar.parallel.parallelize.build sets before parallelizing) and the loss applies the output
projection, the model's ``head``, a chunk of tokens at a time ([Note: chunked cross-entropy]).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.utils.checkpoint import checkpoint

from meshpar.distributed.mesh import Layout
from meshpar.profiling.labels import run_labelled

# [Note: chunked cross-entropy]
# The whole-vocabulary loss holds logits[N, V] (N = B*T tokens), their fp32 copy and the log-softmax
# saved for backward, and in backward their gradients: at V = 128k this outweighs a block's
# activations. Chunked, the loss splits the N tokens of h[N, D] into chunks and runs each as one
# non-reentrant checkpoint: head(h_c) -> logits[n, V] -> fp32 -> cross-entropy summed. A chunk saves
# only its input (a view of h); backward recomputes its logits from h_c and the head's weight just
# before using them. So one chunk's logits live at a time, for one more forward of the head
# (2*N*D*V FLOPs: a third of the head's training FLOPs). Per token the arithmetic is the unchunked
# loss's (same matmul, same upcast): only the sums' order differs, the mean being sum_c(S_c) / N and
# the head's gradient sum_c(g_c^T h_c). Autograd adds up every chunk's gradient for the head weight
# before its AccumulateGrad runs, so an FSDP unit still reduces it once (meshpar/fsdp/state.py,
# [Note: a group of several modules]). Under tensor parallel, h arrives sequence-sharded: it is
# gathered once here (the head's input style would gather each chunk's tokens) and each chunk's
# logits stay vocabulary-sharded for loss parallel. A chunk is a slice of this rank's tokens, so
# context parallelism (a slice of each sequence) and a pipeline's last stage need nothing else.
# The chunks' gradients for the head weight are summed in one more V x D buffer: the price in
# backward. Validation runs whole: after a no-grad forward FSDP has freed the root's parameters,
# so the head runs inside the forward (``head_in_loss`` applies only while autograd records) and
# the loss takes its logits, which nothing saves for a backward.

# [Note: the loss over trained tokens]
# Fine-tuning trains only some targets (the rest are IGNORE, -100), and their count differs
# between microbatches and ranks, so a mean per microbatch would weigh a token by how few
# trained tokens shared its microbatch, and the gradient would depend on the layout. Instead the
# step's loss is sum(trained tokens' losses over the global batch) / N, N the global batch's
# trained targets, which the loader counts for every rank alike (meshpar/data/loader.py ``Step``).
# Each rank's gradient is averaged over the D = dp x cp ranks that reduce it, and each
# microbatch's loss is divided by accum, so a microbatch's loss is its summed losses times
# ``TokenWeight.value`` = accum * D / N: summed over microbatches and averaged over ranks that is
# the global sum / N, whatever the layout (tests/test_sft.py). Pretraining, every target trained,
# keeps the mean per microbatch (the same value: N = accum * D * tokens per microbatch).

AUTO_CHUNK_BYTES = 256 * 2**20  # loss_chunks = 0: the fewest chunks whose fp32 logits fit in this


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """logits[B, T, V] (or [N, V]) targets[B, T] (or [N]) -> the mean (or sum) over the tokens, computed in
    fp32 (fp64 logits, a float64 model's, stay fp64); with loss parallel logits are a DTensor sharded on V
    and the loss is computed on the shards."""
    def loss(x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(0, 1) if x.dim() == 3 else x
        return F.cross_entropy(x.to(torch.promote_types(x.dtype, torch.float32)), targets.flatten(),
                               reduction=reduction)

    if isinstance(logits, DTensor):  # its all-reduces (max, sum) run on the tp mesh
        return run_labelled("tp.loss_parallel", "cross_entropy", loss, logits)
    return loss(logits)


def plain(loss: torch.Tensor) -> torch.Tensor:
    """A loss as a plain tensor (under loss parallel it is a replicated DTensor scalar)."""
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def resolve_chunks(chunks: int, tokens: int, vocab: int) -> int:
    """``train.loss_chunks`` for a microbatch of ``tokens`` tokens on this rank and ``vocab`` logits per
    token on this rank (V / tp under loss parallel); 0 chooses the fewest chunks whose fp32 logits fit in
    ``AUTO_CHUNK_BYTES``. Never more chunks than tokens."""
    if chunks == 0:
        chunks = math.ceil(tokens * vocab * 4 / AUTO_CHUNK_BYTES)
    return max(1, min(chunks, tokens))


def layout_chunks(chunks: int, micro_batch: int, seq_len: int, vocab: int, layout: Layout, loss_parallel: bool) -> int:
    """``resolve_chunks`` for a run: each rank's microbatch holds micro_batch x seq_len / cp tokens, and its
    logits V / tp under tensor parallel's loss parallel."""
    split = layout.tp if layout.tp > 1 and loss_parallel else 1
    return resolve_chunks(chunks, micro_batch * seq_len // layout.cp, vocab // split)


def last_head(stages: Iterable[nn.Module]) -> nn.Module | None:
    """The output projection of the stage whose forward leaves it to the loss (``head_in_loss``), or None."""
    return next((stage.head for stage in stages if stage.head_in_loss), None)  # every family's slot


@dataclass
class TokenWeight:
    """While a step runs on fine-tuning data: each trained token's weight ([Note: the loss over
    trained tokens]); None: the mean over the microbatch's targets."""

    value: float | None = None

    @contextlib.contextmanager
    def __call__(self, value: float | None) -> Iterator[None]:
        self.value = value
        try:
            yield
        finally:
            self.value = None


@dataclass(frozen=True)
class TokenLoss:
    """A microbatch's mean cross-entropy from its stage's output: whole logits when ``head`` is None,
    else hidden states h[B, T, D] that ``head`` projects chunk by chunk ([Note: chunked cross-entropy]).
    ``chunks``: as ``resolve_chunks`` returns it. Under ``weight(w)`` the summed loss times w instead
    ([Note: the loss over trained tokens]); targets of IGNORE (-100) count in neither."""

    head: nn.Module | None = None
    chunks: int = 1
    weight: TokenWeight = field(default_factory=TokenWeight)

    def __call__(self, out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        w = self.weight.value
        if self.head is None or not torch.is_grad_enabled():  # a no-grad forward returns logits
            return cross_entropy(out, targets) if w is None else cross_entropy(out, targets, reduction="sum") * w
        if isinstance(out, DTensor) and not all(p.is_replicate() for p in out.placements):
            out = out.redistribute(placements=[Replicate()] * out.device_mesh.ndim)  # every token, once
        h, t = out.flatten(0, 1), targets.flatten()  # h[N, D], t[N]
        n = t.numel()
        size = math.ceil(n / self.chunks)
        if size >= n:
            total = self._chunk(h, t)
        else:
            total = None
            for h_c, t_c in zip(h.split(size), t.split(size), strict=True):
                part = checkpoint(self._chunk, h_c, t_c, use_reentrant=False, preserve_rng_state=False)
                total = part if total is None else total + part
        return total / n if w is None else total * w

    def _chunk(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # h[n, D] @ head[D, V] -> logits[n, V] (vocab-sharded under loss parallel) -> summed loss
        return cross_entropy(self.head(h), targets, reduction="sum")
