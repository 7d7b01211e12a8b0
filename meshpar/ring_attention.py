"""Ring attention over the ``cp`` ranks: K/V passed from rank to rank, partial results merged exactly.

    out = ring_attention(q, k, v, cp_mesh, balanced=True)   # q[B, H, T/cp, Dh], k, v[B, Hkv, T/cp, Dh]

The other of context parallelism's two attentions (``parallel.cp_attention = "ring"``; the
default gathers K and V: [Note: all-gather of K and V] in meshpar/context_parallel.py).

[Note: ring attention]
Rank r holds its queries and its own chunk(s) of K and V. Forward runs cp steps: at step s it
holds the K/V of rank (r - s) mod cp, posts the hop that sends them on to rank r + 1 while
receiving rank r - s - 1's from rank r - 1 (``comm.send_recv``: isend and irecv posted before
the step's attention, waited after it, so the transfer runs beside the compute), and attends its
queries to the keys it holds. Each (query chunk, key chunk) pair yields a partial output o and
its log-sum-exp l over those keys; partials merge exactly (online softmax):
``L = logaddexp(L, l); O = O exp(L_old - L) + o exp(l - L)``. O accumulates in float32 (float64
for float64 inputs), the matmuls run in the input dtype, L is float32 or float64.

Causality by chunk, not by mask: a key chunk entirely before a query chunk is attended in full,
the same chunk causally (the diagonal mask, the only mask built), a later one not at all. With
the balanced split (rank r holds chunks r and 2cp - 1 - r of 2cp: [Note: balanced sequence
split]) every rank computes, at each step from another rank, exactly two full c x c pairs
(c = T / 2cp): from a rank s < r its front chunk against both of r's chunks, from s > r both
of s's chunks against r's back chunk; at its own step one full pair and two diagonals. So each
rank does 2cp c^2 + c pairs, and every step is the same work on every rank, which is what lets
a hop hide behind it. The contiguous split (rank r holds slice r of cp) skips every key slice
after its own: rank 0 computes one diagonal, rank cp - 1 all of them.

Backward (exact: the flash-attention backward from the saved q, k, v, out and L, scores
recomputed per pair) circulates K/V again; a dK/dV accumulator for each K/V chunk travels one
step behind it, every rank adding its contribution, and reaches the chunk's owner after cp - 1
hops, where the owner adds its own step's. Per layer and microbatch a rank sends, per hop,
2 x B x Hkv x T/cp x Dh elements: (cp - 1) hops forward, 2 (cp - 1) backward (K/V and dK/dV),
the all-gather's volume forward and twice it backward ([Note: all-gather of K and V]).

Memory: a rank holds two K/V chunks at a time (the one it attends to and the one arriving),
not the gathered T; it saves q, its own k and v, the output and L, the same as one attention;
scores exist per block of at most ``BLOCK`` queries against one key chunk, during that block's
computation only. The attention itself is explicit matmuls (no fused kernel takes a partial
log-sum-exp through torch's public API): on a GPU, slower than the flash kernel the all-gather
path calls.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from meshpar import comm

BLOCK = 512  # queries per score block: at most [B, H, BLOCK, key chunk] scores live at once


def ring_attention(q: Tensor, k: Tensor, v: Tensor, mesh: DeviceMesh, *, balanced: bool) -> Tensor:
    """Causal attention of this cp rank's q[B, H, T/cp, Dh] over the whole sequence's keys, its own
    k, v[B, Hkv, T/cp, Dh] passed around ``mesh`` (1-D, ``cp``): [Note: ring attention]."""
    return _RingAttention.apply(q, k, v, _Ring(mesh, balanced))


class _Ring:
    """This rank's place in the cp ring and the chunks every rank holds."""

    def __init__(self, mesh: DeviceMesh, balanced: bool) -> None:
        self.group, self.cp, self.rank, self.balanced = mesh.get_group(), mesh.size(), mesh.get_local_rank(), balanced
        self.next, self.prev = (self.rank + 1) % self.cp, (self.rank - 1) % self.cp

    def chunks(self, rank: int, local_len: int) -> list[tuple[int, int, int]]:
        """(chunk index in the sequence, first local token, tokens) of each chunk ``rank`` holds."""
        if not self.balanced:
            return [(rank, 0, local_len)]
        c = local_len // 2
        return [(rank, 0, c), (2 * self.cp - 1 - rank, c, c)]

    def pairs(self, src: int, local_len: int):
        """(query slice, key slice, diagonal) of every pair causality needs, this rank's queries
        against ``src``'s keys, in blocks of at most BLOCK queries; the diagonal's key slice ends
        at its block's last query."""
        for qi, q0, n in self.chunks(self.rank, local_len):
            for ki, k0, m in self.chunks(src, local_len):
                if ki > qi:
                    continue
                for a in range(0, n, BLOCK):
                    rows = min(BLOCK, n - a)
                    keys = a + rows if ki == qi else m
                    yield slice(q0 + a, q0 + a + rows), slice(k0, k0 + keys), (a if ki == qi else None)


def _scores(q: Tensor, k: Tensor, diagonal: int | None, acc: torch.dtype) -> Tensor:
    """q[B, Hkv, G, n, Dh] @ k[B, Hkv, 1, m, Dh]^T / sqrt(Dh) -> [B, Hkv, G, n, m] in ``acc``; on the
    diagonal block starting at query ``diagonal`` of its chunk, key j > query i + diagonal is -inf."""
    s = (q @ k.transpose(-1, -2)).to(acc) * q.shape[-1] ** -0.5
    if diagonal is not None:
        n, m = s.shape[-2:]
        s = s.masked_fill(~torch.ones(n, m, dtype=torch.bool, device=s.device).tril(diagonal), float("-inf"))
    return s


def _grouped(x: Tensor, hkv: int) -> Tensor:
    """[B, H, T, Dh] -> [B, Hkv, H / Hkv, T, Dh]: query head i reads kv head i // (H / Hkv)."""
    return x.unflatten(1, (hkv, -1))


def _merge(out: Tensor, lse: Tensor, part: Tensor, part_lse: Tensor) -> None:
    """Online softmax, in place: O, L over the keys so far and o, l over more keys -> O, L over all."""
    merged = torch.logaddexp(lse, part_lse)
    out.mul_(torch.exp(lse - merged).unsqueeze(-1)).add_(part * torch.exp(part_lse - merged).unsqueeze(-1))
    lse.copy_(merged)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, ring: _Ring) -> Tensor:
        acc = torch.promote_types(q.dtype, torch.float32)
        hkv, tl = k.shape[1], q.shape[2]
        qg = _grouped(q, hkv)
        out = torch.zeros(qg.shape, dtype=acc, device=q.device)  # O [B, Hkv, G, T/cp, Dh]
        lse = torch.full(qg.shape[:-1], float("-inf"), dtype=acc, device=q.device)  # L [B, Hkv, G, T/cp]
        kv = torch.stack([k, v]).unsqueeze(3)  # [2, B, Hkv, 1, T/cp, Dh]: the chunk in hand
        for step in range(ring.cp):
            if step < ring.cp - 1:  # the next chunk arrives while this one is attended
                arriving = torch.empty_like(kv)
                hop = comm.send_recv(kv, arriving, ring.group, to=ring.next, frm=ring.prev, dim="cp")
            for qs, ks, diagonal in ring.pairs((ring.rank - step) % ring.cp, tl):
                s = _scores(qg[..., qs, :], kv[0][..., ks, :], diagonal, acc)
                part_lse = torch.logsumexp(s, dim=-1)
                part = torch.exp(s - part_lse.unsqueeze(-1)).to(q.dtype) @ kv[1][..., ks, :]
                _merge(out[..., qs, :], lse[..., qs], part, part_lse)
            if step < ring.cp - 1:
                hop.wait()
                kv = arriving
        out = out.to(q.dtype).flatten(1, 2)  # [B, H, T/cp, Dh]
        ctx.ring = ring
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        ring = ctx.ring
        acc, hkv, tl = lse.dtype, k.shape[1], q.shape[2]
        qg, dog = _grouped(q, hkv), _grouped(grad.contiguous(), hkv)
        delta = (dog.to(acc) * _grouped(out, hkv).to(acc)).sum(-1)  # rowsum(dO * O) [B, Hkv, G, T/cp]
        dq = torch.zeros(qg.shape, dtype=acc, device=q.device)
        kv = torch.stack([k, v]).unsqueeze(3)
        arriving = hop = carried = returning = None  # the next K/V and its hop; the dK/dV accumulator, its hop
        for step in range(ring.cp):
            if step > 0:
                hop.wait()
                kv = arriving
            if step < ring.cp - 1:
                arriving = torch.empty_like(kv)
                hop = comm.send_recv(kv, arriving, ring.group, to=ring.next, frm=ring.prev, dim="cp")
            dkv = torch.zeros(kv.shape, dtype=acc, device=q.device)  # dK, dV of the chunk in hand
            for qs, ks, diagonal in ring.pairs((ring.rank - step) % ring.cp, tl):
                kb, vb, dout = kv[0][..., ks, :], kv[1][..., ks, :], dog[..., qs, :]
                p = torch.exp(_scores(qg[..., qs, :], kb, diagonal, acc) - lse[..., qs].unsqueeze(-1))
                dkv[1][..., ks, :] += (p.to(q.dtype).transpose(-1, -2) @ dout).sum(2, keepdim=True)
                ds = (p * ((dout @ vb.transpose(-1, -2)).to(acc) - delta[..., qs].unsqueeze(-1))).to(q.dtype)
                ds = ds * q.shape[-1] ** -0.5
                dq[..., qs, :] += ds @ kb
                dkv[0][..., ks, :] += (ds.transpose(-1, -2) @ qg[..., qs, :]).sum(2, keepdim=True)
            if step == 0:
                own = dkv  # the owner adds its own step's share when the accumulator returns
                continue
            if returning is not None:
                returning.wait()
                dkv += carried
            sent, carried = dkv.to(q.dtype), torch.empty(kv.shape, dtype=q.dtype, device=q.device)
            returning = comm.send_recv(sent, carried, ring.group, to=ring.next, frm=ring.prev, dim="cp", tag=1)
        if returning is not None:  # after cp - 1 hops, this rank's own chunk's dK/dV from every other rank
            returning.wait()
            own += carried
        dk, dv = own.squeeze(3).to(q.dtype)
        return dq.to(q.dtype).flatten(1, 2), dk, dv, None
