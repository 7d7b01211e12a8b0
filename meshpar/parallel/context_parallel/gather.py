"""Context parallelism's default attention: K and V all-gathered over cp, the local queries
attending over them chunk by chunk.

    out = gather_attention(layout, q, k, v, doc, kernels)   # q[B, H, T/cp, Dh] over the whole sequence

``GatherSequence`` (an all-gather whose backward reduce-scatters) is also how MLA gathers its
latent (apply.py, ``ContextParallelKeys``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.bias import causal_lower_right
from torch.utils.checkpoint import checkpoint

from meshpar.distributed import comm
from meshpar.models.attention import BY_DEVICE, Kernels, masked_attention
from meshpar.parallel.context_parallel import flex as flexlib
from meshpar.parallel.context_parallel.layout import SequenceLayout, in_sequence_order

# [Note: all-gather of K and V]
# K and V (after RoPE) are gathered from every cp rank in rank order, put back in sequence order,
# and the local queries attend over them; backward reduce-scatters their gradients
# (``GatherSequence``). Under grouped-query attention K and V are the small operands: a rank
# receives 2 x B x Hkv x T x Dh x (cp - 1) / cp elements per layer and microbatch. The ring
# ([Note: ring attention]) moves the same bytes in forward and twice as many in backward, and
# buys memory (two K/V chunks instead of T) and overlap; the gather is the default because it
# calls one fused kernel per query chunk where the ring runs explicit matmuls.

# [Note: attention per query chunk]
# Each chunk of local queries attends to the keys up to its own chunk's end, the last ``n`` of them
# causally: ``causal_lower_right(n, keys)``, which the fused GPU kernels apply without building it.
# No [T/cp, T] mask exists and the keys after a chunk are never computed: rank r's two chunks of
# c = T/2cp queries see (r + 1) c and (2cp - r) c keys.

# [Note: the causal mask off the fused kernels]
# Off CUDA's flash kernel, PyTorch builds each chunk's [n, keys] mask and keeps it for backward:
# T^2 / cp per layer. So there each chunk's attention is checkpointed: the mask lives only during
# its call and backward recomputes that one attention (the same kernels, the same numbers).


def gather_attention(layout: SequenceLayout, q: Tensor, k: Tensor, v: Tensor, doc: Tensor | None, kernels: Kernels,
                     *, gathered: bool = False) -> Tensor:
    """[Note: all-gather of K and V]: q[B, H, T/cp, Dh] over k, v gathered to [B, Hkv, T, Dh] (or
    given whole: ``gathered``); ``doc`` None (causal) or the documents doc[B, T] ([Note: documents
    under context parallelism] in apply.py)."""
    if not gathered:
        cp, group = layout.mesh.size(), layout.mesh.get_group()
        k = in_sequence_order(GatherSequence.apply(k, group), cp, layout.balanced)
        v = in_sequence_order(GatherSequence.apply(v, group), cp, layout.balanced)
    if kernels.flex and flexlib.takes(q.shape[2], k.shape[2]):  # [Note: cp attention on flex_attention]
        return flexlib.attend(q, k, v, layout.flex_mask(q.shape[2], doc, q.device))
    # [Note: the causal mask off the fused kernels]: recomputed in backward rather than kept; a
    # document mask is built and recomputed on every device
    plain = kernels.fuses_causal(q) and doc is None
    run = chunk_attention if plain else _checkpointed_chunk_attention
    positions = layout.indices(q.shape[2], q.device).positions
    out = []
    for first, n, keys in layout.query_chunks(q.shape[2]):
        docs = () if doc is None else (doc[:, positions[first:first + n]], doc[:, :keys])
        out.append(run(q[:, :, first:first + n], k[:, :, :keys], v[:, :, :keys], *docs, kernels=kernels))
    return out[0] if len(out) == 1 else torch.cat(out, dim=2)


def chunk_attention(q: Tensor, k: Tensor, v: Tensor, q_doc: Tensor | None = None, k_doc: Tensor | None = None,
                     kernels: Kernels = BY_DEVICE) -> Tensor:
    """q[B, H, n, Dh] over the keys k, v[B, Hkv, keys, Dh] up to its chunk's end, causal at the bottom
    right: torch's ``causal_lower_right`` on CUDA (the flash kernel applies it unbuilt); elsewhere
    the same mask built here as bools, since torch would build it anyway, and a tensor subclass
    cannot be made under a dispatch mode (selective checkpointing, fake tensors, the allocation
    tracker). With documents (q_doc[B, n], k_doc[B, keys]) a query also sees only its own
    document's keys: the mask [B, 1, n, keys], built here."""
    n, keys = q.shape[2], k.shape[2]
    if kernels.fuses_causal(q) and q_doc is None:
        # fake tensors cannot become the CausalBias subclass: the simulation attends unmasked, which
        # saves what the GPU's causal kernel saves ([Note: context parallel attention on fake tensors])
        mask = None if kernels.fake else causal_lower_right(n, keys)
    else:
        mask = torch.ones(n, keys, dtype=torch.bool, device=q.device).tril(diagonal=keys - n)
        if q_doc is not None:  # [Note: masked grouped-query attention on CUDA]
            mask = mask & (q_doc.unsqueeze(2) == k_doc.unsqueeze(1)).unsqueeze(1)  # [B, 1, n, keys]
            return masked_attention(q, k, v, mask, kernels)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def _checkpointed_chunk_attention(*args: Tensor | None, kernels: Kernels) -> Tensor:
    """``chunk_attention`` whose mask lives only during its call: [Note: the causal mask off the fused kernels]."""
    return checkpoint(chunk_attention, *args, kernels=kernels, use_reentrant=False)


class GatherSequence(torch.autograd.Function):
    """x[B, H, t, Dh] on each of n ranks -> [B, H, n * t, Dh] in rank order; backward sums the
    gradient of every rank's copy and hands each rank its own slice (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        n = torch.distributed.get_world_size(group)
        x = x.contiguous()
        out = x.new_empty((n, *x.shape))
        comm.all_gather(out.view(-1), x.view(-1), group, dim="cp").wait()
        return out.movedim(0, 2).flatten(2, 3)  # [n, B, H, t, Dh] -> [B, H, n * t, Dh]

    @staticmethod
    def backward(ctx, grad: Tensor):
        group = ctx.group
        n = torch.distributed.get_world_size(group)
        b, h, total, d = grad.shape
        rows = grad.view(b, h, n, total // n, d).movedim(2, 0).reshape(n, -1)  # [n, B * H * t * Dh]
        buffer = comm.ReduceScatterInput(rows.shape[1], group, dtype=grad.dtype, device=grad.device)
        buffer.copy_rows(0, rows)
        comm.reduce_scatter_rows(buffer, group, dim="cp").wait()
        return buffer.output.view(b, h, total // n, d), None
