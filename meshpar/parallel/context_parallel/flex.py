"""The all-gather's attention on ``torch.nn.attention.flex_attention``: one call per layer over all
of a rank's queries, its mask a block mask built from block-level arithmetic.

[Note: cp attention on flex_attention]
A rank's queries sit at known global positions (``positions[n]``, increasing: the balanced split's
two chunks in turn) and attend over the whole gathered sequence ``k, v[B, Hkv, T, Dh]``. Query i may
see key j when ``positions[i] >= j`` (and, with documents, when both are in the same document). The
block mask says which (128-query, 128-key) tiles hold any such pair and which hold only such pairs:
a tile of queries at positions [p_lo, p_hi] and keys [k_lo, k_hi] is skipped when k_lo > p_hi,
is full when k_hi <= p_lo (and, with documents, query and key tiles lie in one document), and is
otherwise partial: the kernel evaluates ``mask_mod`` in it. Documents are ids that never decrease
along the sequence, so a tile's are the range of its first and last. Nothing of size [n, T] is
built: the tiles are [T/128 x n/128] and ``mask_mod`` is evaluated in the kernel. Both chunks of the
balanced split go in one call (the per-chunk path runs two), and the keys after a chunk's end are
skipped tile by tile.

On CUDA the kernel is the compiled flex (eager flex is a reference implementation); CPU has no flex
backward, so training there keeps the per-chunk path, and a CPU forward is what its tests compare.
``Kernels.flex`` turns it on; shapes it does not take (lengths not multiples of ``BLOCK``) keep the
per-chunk path.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, flex_attention

BLOCK = 128  # query and key tile of the block mask (flex's default)


def takes(local_len: int, seq_len: int) -> bool:
    """Whether the flex path takes a rank's ``local_len`` queries over ``seq_len`` keys: whole tiles only."""
    return local_len % BLOCK == 0 and seq_len % BLOCK == 0


def block_mask(positions: Tensor, seq_len: int, doc: Tensor | None = None) -> BlockMask:
    """[Note: cp attention on flex_attention]: the mask of queries at global ``positions[n]``
    (increasing) over keys 0 .. ``seq_len`` - 1, causal, and within documents when ``doc[B, T]`` (the
    whole sequence's ids, nondecreasing) is given."""
    n = positions.numel()
    if not takes(n, seq_len):
        raise ValueError(f"flex cp attention takes lengths in whole tiles of {BLOCK}: {n} queries, {seq_len} keys")
    q_tiles = positions.view(n // BLOCK, BLOCK)
    p_lo, p_hi = q_tiles[:, 0], q_tiles[:, -1]  # [nq]
    k_lo = torch.arange(0, seq_len, BLOCK, device=positions.device)  # [nk]
    k_hi = k_lo + BLOCK - 1
    seen = (k_lo.unsqueeze(0) <= p_hi.unsqueeze(1)).unsqueeze(0)  # [1, nq, nk]: some pair attends
    full = (k_hi.unsqueeze(0) <= p_lo.unsqueeze(1)).unsqueeze(0)  # [1, nq, nk]: every pair does
    if doc is None:
        mask_mod = functools.partial(_causal, positions)
    else:
        q_doc = doc[:, positions].view(doc.shape[0], n // BLOCK, BLOCK)  # [B, nq, BLOCK]
        k_doc = doc.view(doc.shape[0], seq_len // BLOCK, BLOCK)  # [B, nk, BLOCK]
        qd_lo, qd_hi = q_doc[..., 0].unsqueeze(2), q_doc[..., -1].unsqueeze(2)  # [B, nq, 1]
        kd_lo, kd_hi = k_doc[..., 0].unsqueeze(1), k_doc[..., -1].unsqueeze(1)  # [B, 1, nk]
        seen = seen & (kd_hi >= qd_lo) & (kd_lo <= qd_hi)
        full = full & (qd_lo == qd_hi) & (kd_lo == kd_hi) & (qd_lo == kd_lo)
        mask_mod = functools.partial(_in_document, positions, doc)
    partial = seen & ~full
    return BlockMask.from_kv_blocks(*_listed(partial), *_listed(full), BLOCK_SIZE=BLOCK, mask_mod=mask_mod,
                                    seq_lengths=(n, seq_len))


def _listed(tiles: Tensor) -> tuple[Tensor, Tensor]:
    """[B, nq, nk] bools -> (count [B, 1, nq], indices [B, 1, nq, nk]: the marked key tiles first, in order)."""
    count = tiles.sum(-1, dtype=torch.int32)
    order = torch.argsort((~tiles).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return count.unsqueeze(1), order.unsqueeze(1)


def _causal(positions: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    return positions[q_idx] >= kv_idx


def _in_document(positions: Tensor, doc: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    q = positions[q_idx]
    return (q >= kv_idx) & (doc[b, q] == doc[b, kv_idx])


@functools.cache
def _compiled():
    return torch.compile(flex_attention, dynamic=False)


def attend(q: Tensor, k: Tensor, v: Tensor, mask: BlockMask) -> Tensor:
    """q[B, H, n, Dh] over the gathered k, v[B, Hkv, T, Dh] under ``block_mask``'s mask: compiled flex
    on CUDA, the eager reference elsewhere (forward only: [Note: cp attention on flex_attention])."""
    run = _compiled() if q.is_cuda else flex_attention
    return run(q, k, v, block_mask=mask, enable_gqa=k.shape[1] != q.shape[1])
