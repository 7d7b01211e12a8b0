"""Ring attention on ``flex_attention``: one fused call per ring step, merged by log-sum-exp.

    out = flex_ring_attention(q, k, v, ring, masks)   # masks[src]: this rank's queries over src's keys

The ring of ring.py ([Note: ring attention]) with each step's (query chunks, key chunks) pair run
as one flex call under a block mask (flex.py ``pair_mask``) instead of score blocks launched from
Python. ``parallel.cp_attention = "ring"`` takes it where ``Kernels.flex`` is on and a rank's tokens
are whole tiles of 128; the K/V hops and the dK/dV accumulator are ring.py's (``Ring.forward`` and
``Ring.backward``).

[Note: the ring on flex]
Forward: step s gives this rank's queries' output o_s and log-sum-exp l_s over rank src's keys,
merged online into O, L as in ring.py (``_merge``); nothing of a step is kept. Backward needs each
pair's gradient under the whole row's softmax, P_s = exp(S_s - L). flex computes its backward
against its own forward's (o_s, l_s), so backward runs the step's forward again with grad and
differentiates it with upstream gradients that turn flex's P into the merged one: with
w_s = exp(l_s - L) (O = sum_s w_s o_s), dO/do_s = w_s and dO/dl_s = w_s (o_s - O), so

    grad o_s = w_s dO,    grad l_s = w_s (rowsum(dO o_s) - rowsum(dO O))    (``upstream``).

A row that sees none of src's keys has l_s = -inf, w_s = 0, and gets no gradient. The cost of not
calling flex's backward operator on the merged O, L (private, and built from graphs of the score
function): each step's forward is computed twice, 9 matmul passes per pair against the gather's 7,
and the ring's hops. On CPU flex runs its eager reference (float64 tests); on CUDA, compiled.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from meshpar.parallel.activation_checkpoint import not_kept
from meshpar.parallel.context_parallel import flex as flexlib
from meshpar.parallel.context_parallel import ring as ringlib
from meshpar.parallel.context_parallel.ring import Ring


def step_masks(ring: Ring, every_rank: Tensor, doc: Tensor | None) -> list[BlockMask | None]:
    """[Note: the ring on flex]: per source rank, the block mask of this rank's queries over its keys
    (``every_rank[r]`` the global positions rank r holds, ``doc[B, cp, T/cp]`` their documents), or None
    where causality hides all of them (the contiguous split's later ranks), decided on the host."""
    n, own = every_rank.shape[1], every_rank[ring.rank]
    last = max(chunk for chunk, _, _ in ring.chunks(ring.rank, n))
    masks = []
    for src in range(ring.cp):
        if min(chunk for chunk, _, _ in ring.chunks(src, n)) > last:
            masks.append(None)
            continue
        docs = () if doc is None else (doc[:, ring.rank], doc[:, src])
        masks.append(flexlib.pair_mask(own, every_rank[src], *docs))
    return masks


def flex_ring_attention(q: Tensor, k: Tensor, v: Tensor, ring: Ring, masks: list[BlockMask | None]) -> Tensor:
    """Causal (or by the masks' documents) attention of this rank's q[B, H, T/cp, Dh] over every rank's
    k, v[B, Hkv, T/cp, Dh] passed around ``ring``: [Note: the ring on flex]."""
    return _FlexRing.apply(q, k, v, ring, masks)


class _FlexRing(torch.autograd.Function):
    """Shapes inside: q, O [B, H, T/cp, Dh], L [B, H, T/cp] (fp32, fp64 for fp64 inputs), the K/V chunk
    in hand [2, B, Hkv, T/cp, Dh]."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, ring: Ring, masks: list[BlockMask | None]) -> Tensor:
        acc = torch.promote_types(q.dtype, torch.float32)
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)

        def attend(src: int, kv: Tensor) -> None:  # grad is off in a Function's forward: nothing recorded
            if masks[src] is not None:
                part, part_lse = flexlib.attend_lse(q, kv[0], kv[1], masks[src])
                ringlib._merge(out, lse, part.to(acc), part_lse.to(acc))

        with not_kept():  # [Note: what selective checkpointing recomputes anyway]
            ring.forward(torch.stack([k, v]), attend)
        out = out.to(q.dtype)
        ctx.ring, ctx.masks = ring, masks
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        acc = lse.dtype
        dout = grad.to(acc)
        delta = (dout * out.to(acc)).sum(-1)  # rowsum(dO O)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)

        def grads(src: int, kv: Tensor) -> Tensor:
            dkv = torch.zeros(kv.shape, dtype=acc, device=q.device)
            if ctx.masks[src] is None:
                return dkv
            with torch.enable_grad():
                qs, ks, vs = (x.detach().requires_grad_() for x in (q, kv[0], kv[1]))
                part, part_lse = flexlib.attend_lse(qs, ks, vs, ctx.masks[src])
                upstream = _upstream(part.detach(), part_lse.detach(), lse, dout, delta)
                gq, gk, gv = torch.autograd.grad((part, part_lse), (qs, ks, vs), upstream)
            dq.add_(gq)
            dkv[0].add_(gk)
            dkv[1].add_(gv)
            return dkv

        own = ctx.ring.backward(torch.stack([k, v]), grads)
        dk, dv = own.to(q.dtype)
        return dq.to(q.dtype), dk, dv, None, None


def _upstream(part: Tensor, part_lse: Tensor, lse: Tensor, dout: Tensor, delta: Tensor) -> tuple[Tensor, Tensor]:
    """[Note: the ring on flex]: the gradients of a step's (o_s, l_s) that make flex's backward the
    merged softmax's: w_s dO and w_s (rowsum(dO o_s) - rowsum(dO O)), w_s = exp(l_s - L); ``lse`` (L) is
    finite, every query seeing itself, and a row of l_s = -inf gets zero."""
    w = torch.exp(part_lse.to(lse.dtype) - lse)
    grad_lse = w * ((dout * part.to(lse.dtype)).sum(-1) - delta)
    return (w.unsqueeze(-1) * dout).to(part.dtype), grad_lse.to(part_lse.dtype)
