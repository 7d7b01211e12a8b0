"""Ring attention over the ``cp`` ranks: K/V passed from rank to rank, partial results merged exactly.

    out = ring_attention(q, k, v, cp_mesh, balanced=True)   # q[B, H, T/cp, Dh], k, v[B, Hkv, T/cp, Dh]

The other of context parallelism's two attentions (``parallel.cp_attention = "ring"``; the
default gathers K and V: [Note: all-gather of K and V] in meshpar/parallel/context_parallel/gather.py).
A rank holds two K/V chunks at a time instead of the gathered sequence; it moves 1.5x the
gather's bytes, and its attention is explicit matmuls, so on a GPU it is much slower than the
gather's fused kernels. The pair counts, bytes and memory are derived in
docs/context_parallel.md#how-the-ring-works.

Notes: [Note: ring attention], [Note: the ring on a GPU].
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from meshpar.distributed import comm
from meshpar.models.attention import BY_DEVICE, Kernels

# [Note: ring attention]
# Forward runs cp steps: at step s rank r attends its queries to the K/V of rank (r - s) mod cp
# while ``comm.send_recv`` passes them on to r + 1 and receives the next from r - 1 (posted before
# the step's attention, waited after it, so the hop runs beside the compute). Each (query chunk,
# key chunk) pair yields a partial output o and its log-sum-exp l; partials merge exactly:
# ``L = logaddexp(L, l); O = O exp(L_old - L) + o exp(l - L)`` (O and L in fp32, fp64 for fp64
# inputs; matmuls in the input dtype). Causality by chunk, not by mask: an earlier key chunk is
# attended in full, the query's own under the diagonal mask (the only mask built), a later one not
# at all; with the balanced split every step is the same work on every rank, so a hop can hide.
# Backward recomputes each pair's scores from the saved q, k, v, out and L, circulating K/V again
# with a dK/dV accumulator one step behind, which reaches its chunk's owner after cp - 1 hops.
# Scores exist per block of at most ``score_elements`` queries x keys, during that block only; a
# recomputation under selective checkpointing runs the whole ring forward again (``_mm``).

SCORE_ELEMENTS = 2**22  # scores per block, B x H x queries x keys (16 MiB in fp32): a block's queries are set by it
SCORE_ELEMENTS_CUDA = 2**26  # 256 MiB in fp32: [Note: the ring on a GPU]

# [Note: the ring on a GPU]
# The ring's matmuls and online-softmax merges are launched block by block from Python; on CUDA
# small blocks leave the GPU waiting on launches, so a block there holds up to
# ``SCORE_ELEMENTS_CUDA`` scores (transient: freed when the block is done). The ring still runs far
# below the gather's fused kernels, and the planner charges its attention FLOPs
# ``RING_ATTENTION_SLOWDOWN`` times on CUDA (meshpar/planner/cost.py). Measurements:
# docs/performance.md#context-parallel-attention-on-a-gpu. ring_flex.py runs each ring step as one
# fused flex_attention call instead ([Note: the ring on flex]; with ``Kernels.flex``).


def score_elements(device: torch.device) -> int:
    """The most scores a block of queries against one key chunk holds on ``device``."""
    return SCORE_ELEMENTS_CUDA if device.type == "cuda" else SCORE_ELEMENTS

# With ``Kernels.fake`` (the planner's simulation) a (query chunk, key chunk) pair runs as one block,
# its largest: on fake tensors the values do not matter, a block's scores are transient (the peak
# holds one block at a time) and the hops do not depend on the blocks, so memory and bytes are the
# same; at 131072 tokens real blocks would be ~10^5 fake matmuls per layer, too slow to plan.


def ring_attention(q: Tensor, k: Tensor, v: Tensor, mesh: DeviceMesh, *, balanced: bool,
                   documents: Tensor | None = None, kernels: Kernels = BY_DEVICE) -> Tensor:
    """Causal attention of this cp rank's q[B, H, T/cp, Dh] over the whole sequence's keys, its own
    k, v[B, Hkv, T/cp, Dh] passed around ``mesh`` (1-D, ``cp``): [Note: ring attention]. With
    ``documents`` (doc[B, cp, T/cp]: row r the documents of the tokens cp rank r holds) a query sees
    only its own document's keys ([Note: documents under context parallelism] in
    meshpar/parallel/context_parallel/apply.py)."""
    return _RingAttention.apply(q, k, v, documents, Ring(mesh, balanced, kernels))


class Ring:
    """This rank's place in the cp ring and the chunks every rank holds."""

    def __init__(self, mesh: DeviceMesh, balanced: bool, kernels: Kernels = BY_DEVICE) -> None:
        self.group, self.cp, self.rank, self.balanced = mesh.get_group(), mesh.size(), mesh.get_local_rank(), balanced
        self.kernels = kernels
        self.next, self.prev = (self.rank + 1) % self.cp, (self.rank - 1) % self.cp

    def forward(self, kv: Tensor, attend: Callable[[int, Tensor], None]) -> None:
        """Pass the K/V chunk ``kv`` around the ring, calling ``attend(src, chunk)`` on the chunk of each
        rank ``src`` in turn, this rank's first; each next chunk's hop runs beside the call."""
        for step in range(self.cp):
            if step < self.cp - 1:  # the next chunk arrives while this one is attended
                arriving = torch.empty_like(kv)
                hop = comm.send_recv(kv, arriving, self.group, to=self.next, frm=self.prev, dim="cp")
            attend((self.rank - step) % self.cp, kv)
            if step < self.cp - 1:
                hop.wait()
                kv = arriving

    def backward(self, kv: Tensor, grads: Callable[[int, Tensor], Tensor]) -> Tensor:
        """Pass ``kv`` around again, ``grads(src, chunk)`` giving its dK/dV (in the accumulation
        dtype) from this rank's queries; a dK/dV accumulator follows one step behind and returns to
        each chunk's owner after cp - 1 hops. This rank's own chunk's dK/dV from every rank."""
        arriving = hop = carried = returning = None  # the next K/V and its hop; the dK/dV accumulator, its hop
        for step in range(self.cp):
            if step > 0:
                hop.wait()
                kv = arriving
            if step < self.cp - 1:
                arriving = torch.empty_like(kv)
                hop = comm.send_recv(kv, arriving, self.group, to=self.next, frm=self.prev, dim="cp")
            dkv = grads((self.rank - step) % self.cp, kv)
            if step == 0:
                own = dkv  # the owner adds its own step's share when the accumulator returns
                continue
            if returning is not None:
                returning.wait()
                dkv += carried
            sent, carried = dkv.to(kv.dtype), torch.empty_like(kv)
            returning = comm.send_recv(sent, carried, self.group, to=self.next, frm=self.prev, dim="cp", tag=1)
        if returning is not None:  # after cp - 1 hops, this rank's own chunk's dK/dV from every other rank
            returning.wait()
            own += carried
        return own

    def block_scores(self, device: torch.device) -> int:
        return self.kernels.ring_scores or score_elements(device)

    def chunks(self, rank: int, local_len: int) -> list[tuple[int, int, int]]:
        """(chunk index in the sequence, first local token, tokens) of each chunk ``rank`` holds."""
        if not self.balanced:
            return [(rank, 0, local_len)]
        c = local_len // 2
        return [(rank, 0, c), (2 * self.cp - 1 - rank, c, c)]

    def pairs(self, src: int, local_len: int, heads: int, elements: int):
        """(query slice, key slice, diagonal) of every pair causality needs, this rank's queries
        against ``src``'s keys, in blocks of queries whose scores over the key chunk (``heads``:
        B x H of them per query and key) fit ``elements``; the diagonal's key slice ends at its
        block's last query, and its mask starts there."""
        for qi, q0, n in self.chunks(self.rank, local_len):
            for ki, k0, m in self.chunks(src, local_len):
                if ki > qi:
                    continue
                block = max(1, elements // (heads * m))
                starts = range(0, n, block)
                if self.kernels.fake:  # the planner's simulation: the pair's largest block
                    starts = [max(starts, key=lambda a: min(block, n - a) * (a + min(block, n - a) if ki == qi else m))]
                for a in starts:
                    rows = min(block, n - a)
                    keys = a + rows if ki == qi else m
                    yield slice(q0 + a, q0 + a + rows), slice(k0, k0 + keys), (a if ki == qi else None)


def _mm(a: Tensor, b: Tensor) -> Tensor:
    """a[N, n, k] @ b[N, k, m], as a baddbmm with beta 0: selective checkpointing keeps the output of
    every aten.bmm ([Note: what selective checkpointing keeps] in meshpar/parallel/activation_checkpoint.py),
    which here would keep every score block; the ring's forward is recomputed whole instead."""
    return torch.baddbmm(a.new_zeros(()), a, b, beta=0)


def _block(x: Tensor, qs: slice) -> Tensor:
    """Rows ``qs`` of x[B Hkv, G, T/cp, ...] as [B Hkv, G rows, ...]: a block's queries of every head
    sharing a kv head, against which one matmul takes that kv head's keys."""
    return x[:, :, qs].flatten(1, 2)


def _scores(q: Tensor, k: Tensor, diagonal: int | None, acc: torch.dtype, docs: tuple[Tensor, Tensor] | None) -> Tensor:
    """q[B Hkv, G n, Dh] / sqrt(Dh) @ k[B Hkv, m, Dh]^T -> [B Hkv, G n, m] in ``acc``; on the diagonal
    block starting at query ``diagonal`` of its chunk, key j > query i + diagonal is -inf; with
    ``docs`` (the documents of the block's queries [B, n] and keys [B, m]) so is every key of
    another document."""
    s = _mm(q * q.shape[-1] ** -0.5, k.transpose(-1, -2)).to(acc)
    m = s.shape[-1]
    if diagonal is not None:
        n = k.shape[-2] - diagonal  # the block's queries: its keys end at its last query
        mask = ~torch.ones(n, m, dtype=torch.bool, device=s.device).tril(diagonal)
        s.view(s.shape[0], -1, n, m).masked_fill_(mask, float("-inf"))
    if docs is not None:
        q_doc, k_doc = docs
        b, n = q_doc.shape
        other = (q_doc.unsqueeze(2) != k_doc.unsqueeze(1)).view(b, 1, 1, n, m)  # over kv heads and their G
        s.view(b, -1, s.shape[1] // n, n, m).masked_fill_(other, float("-inf"))
    return s


def _merge(out: Tensor, lse: Tensor, part: Tensor, part_lse: Tensor) -> None:
    """Online softmax, in place: O, L over the keys so far and o, l over more keys -> O, L over all.
    A row that has seen no key yet (L = l = -inf: with documents) stays O = 0, L = -inf."""
    merged = torch.logaddexp(lse, part_lse)
    shift = _finite(merged)
    out.mul_(torch.exp(lse - shift).unsqueeze(-1)).add_(part * torch.exp(part_lse - shift).unsqueeze(-1))
    lse.copy_(merged)


def _finite(lse: Tensor) -> Tensor:
    """``lse`` with -inf (a row whose keys are all masked) as 0, so that exp(s - lse) is 0, not nan."""
    return lse.masked_fill(lse == float("-inf"), 0)


class _RingAttention(torch.autograd.Function):
    """Shapes inside: q, O [B Hkv, G, T/cp, Dh] (G = H / Hkv: query head i reads kv head i // G), L
    [B Hkv, G, T/cp], the K/V chunk in hand [2, B Hkv, T/cp, Dh]."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, doc: Tensor | None, ring: Ring) -> Tensor:
        acc = torch.promote_types(q.dtype, torch.float32)
        b, h, tl, dh = q.shape
        qg = q.reshape(b * k.shape[1], -1, tl, dh)
        out = torch.zeros(qg.shape, dtype=acc, device=q.device)
        lse = torch.full(qg.shape[:-1], float("-inf"), dtype=acc, device=q.device)

        def attend(src: int, kv: Tensor) -> None:
            docs = _Documents(doc, ring.rank, src)
            for qs, ks, diagonal in ring.pairs(src, tl, b * h, ring.block_scores(q.device)):
                s = _scores(_block(qg, qs), kv[0, :, ks], diagonal, acc, docs(qs, ks))  # [B Hkv, G rows, keys]
                part_lse = torch.logsumexp(s, dim=-1)
                shift = part_lse if doc is None else _finite(part_lse)
                part = _mm(s.sub_(shift.unsqueeze(-1)).exp_().to(q.dtype), kv[1, :, ks])  # softmax(s) @ v
                rows = (*qg.shape[:2], -1)
                _merge(out[:, :, qs], lse[:, :, qs], part.view(*rows, dh), part_lse.view(rows))

        ring.forward(torch.stack([k, v]).flatten(1, 2), attend)
        out = out.to(q.dtype).view(q.shape)
        ctx.ring, ctx.doc = ring, doc
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        ring = ctx.ring
        acc, (b, h, tl, dh) = lse.dtype, q.shape
        qg, dog = q.reshape(lse.shape + (dh,)), grad.reshape(lse.shape + (dh,))
        delta = (dog.to(acc) * out.view(dog.shape).to(acc)).sum(-1, keepdim=True)  # rowsum(dO * O)
        dq = torch.zeros(qg.shape, dtype=acc, device=q.device)

        def grads(src: int, kv: Tensor) -> Tensor:
            dkv = torch.zeros(kv.shape, dtype=acc, device=q.device)  # dK, dV of the chunk in hand
            docs = _Documents(ctx.doc, ring.rank, src)
            for qs, ks, diagonal in ring.pairs(src, tl, b * h, ring.block_scores(q.device)):
                kb, vb, qb, dout = kv[0, :, ks], kv[1, :, ks], _block(qg, qs), _block(dog, qs)
                # P [B Hkv, G rows, keys]; every row saw a key (itself), so L is finite and masked P is 0
                p = _scores(qb, kb, diagonal, acc, docs(qs, ks)).sub_(_block(lse.unsqueeze(-1), qs)).exp_()
                dkv[1, :, ks] += _mm(p.to(q.dtype).transpose(-1, -2), dout)  # summed over the G heads
                # dS = P * (dO V^T - rowsum(dO * O)), then through the scale into dQ and dK
                ds = _mm(dout, vb.transpose(-1, -2)).to(acc).sub_(_block(delta, qs))
                ds = ds.mul_(p).mul_(dh ** -0.5).to(q.dtype)
                del p
                dq[:, :, qs] += _mm(ds, kb).view(*qg.shape[:2], -1, dh)
                dkv[0, :, ks] += _mm(ds.transpose(-1, -2), qb)
            return dkv

        own = ring.backward(torch.stack([k, v]).flatten(1, 2), grads)
        dk, dv = own.to(q.dtype).view(2, *k.shape)
        return dq.to(q.dtype).view(q.shape), dk, dv, None, None


class _Documents:
    """The documents of a pair's queries and keys, this rank's against ``src``'s, or None (causal)."""

    def __init__(self, doc: Tensor | None, rank: int, src: int) -> None:
        self.doc = doc
        if doc is not None:  # doc[B, cp, T/cp]
            self.q_doc, self.k_doc = doc[:, rank], doc[:, src]

    def __call__(self, qs: slice, ks: slice) -> tuple[Tensor, Tensor] | None:
        return None if self.doc is None else (self.q_doc[:, qs], self.k_doc[:, ks])
