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
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention

from meshpar.distributed import _torch

BLOCK = 128  # query and key tile of the block mask (flex's default)


def takes(local_len: int, seq_len: int) -> bool:
    """Whether the flex path takes a rank's ``local_len`` queries over ``seq_len`` keys: whole tiles only."""
    return local_len % BLOCK == 0 and seq_len % BLOCK == 0


def block_mask(positions: Tensor, seq_len: int, doc: Tensor | None = None) -> BlockMask:
    """[Note: cp attention on flex_attention]: the mask of queries at global ``positions[n]``
    (increasing) over keys 0 .. ``seq_len`` - 1, causal, and within documents when ``doc[B, T]`` (the
    whole sequence's ids, nondecreasing) is given."""
    keys = torch.arange(seq_len, device=positions.device)
    return pair_mask(positions, keys, *(() if doc is None else (doc[:, positions], doc)))


def pair_mask(q_pos: Tensor, k_pos: Tensor, q_doc: Tensor | None = None, k_doc: Tensor | None = None) -> BlockMask:
    """The block mask of queries at global positions ``q_pos[n]`` over keys at ``k_pos[m]`` (each
    increasing): query i sees key j when ``q_pos[i] >= k_pos[j]`` and, given the documents of both
    (``q_doc[B, n]``, ``k_doc[B, m]``, nondecreasing), they are in one document. The all-gather's
    keys are the whole sequence; a ring step's are one rank's chunks (ring_flex.py)."""
    n, m = q_pos.numel(), k_pos.numel()
    if not (n % BLOCK == 0 and m % BLOCK == 0):
        raise ValueError(f"flex cp attention takes lengths in whole tiles of {BLOCK}: {n} queries, {m} keys")
    q_tiles, k_tiles = q_pos.view(n // BLOCK, BLOCK), k_pos.view(m // BLOCK, BLOCK)
    p_lo, p_hi = q_tiles[:, 0].unsqueeze(1), q_tiles[:, -1].unsqueeze(1)  # [nq, 1]
    k_lo, k_hi = k_tiles[:, 0].unsqueeze(0), k_tiles[:, -1].unsqueeze(0)  # [1, nk]
    seen = (k_lo <= p_hi).unsqueeze(0)  # [1, nq, nk]: some pair attends
    full = (k_hi <= p_lo).unsqueeze(0)  # [1, nq, nk]: every pair does
    if q_doc is None:
        mask_mod = functools.partial(_causal, q_pos, k_pos)
    else:
        b = q_doc.shape[0]
        q_doc_tiles, k_doc_tiles = q_doc.view(b, n // BLOCK, BLOCK), k_doc.view(b, m // BLOCK, BLOCK)
        qd_lo, qd_hi = q_doc_tiles[..., 0].unsqueeze(2), q_doc_tiles[..., -1].unsqueeze(2)  # [B, nq, 1]
        kd_lo, kd_hi = k_doc_tiles[..., 0].unsqueeze(1), k_doc_tiles[..., -1].unsqueeze(1)  # [B, 1, nk]
        seen = seen & (kd_hi >= qd_lo) & (kd_lo <= qd_hi)
        full = full & (qd_lo == qd_hi) & (kd_lo == kd_hi) & (qd_lo == kd_lo)
        mask_mod = functools.partial(_in_document, q_pos, k_pos, q_doc, k_doc)
    partial = seen & ~full
    return BlockMask.from_kv_blocks(*_listed(partial), *_listed(full), BLOCK_SIZE=BLOCK, mask_mod=mask_mod,
                                    seq_lengths=(n, m))


def _listed(tiles: Tensor) -> tuple[Tensor, Tensor]:
    """[B, nq, nk] bools -> (count [B, 1, nq], indices [B, 1, nq, nk]: the marked key tiles first, in order)."""
    count = tiles.sum(-1, dtype=torch.int32)
    order = torch.argsort((~tiles).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return count.unsqueeze(1), order.unsqueeze(1)


def _causal(q_pos: Tensor, k_pos: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    return q_pos[q_idx] >= k_pos[kv_idx]


def _in_document(q_pos: Tensor, k_pos: Tensor, q_doc: Tensor, k_doc: Tensor, b: Tensor, h: Tensor, q_idx: Tensor,
                 kv_idx: Tensor) -> Tensor:
    return (q_pos[q_idx] >= k_pos[kv_idx]) & (q_doc[b, q_idx] == k_doc[b, kv_idx])


@functools.cache
def _compiled():
    return torch.compile(flex_attention, dynamic=False)


def attend_lse(q: Tensor, k: Tensor, v: Tensor, mask: BlockMask) -> tuple[Tensor, Tensor]:
    """q[B, H, n, Dh] over k, v[B, Hkv, m, Dh] under ``mask``: the output and its log-sum-exp [B, H, n]
    (natural log; -inf for a query that sees no key), both differentiable: compiled flex on CUDA,
    elsewhere the eager reference through flex's operator (the public function will not
    differentiate on CPU: ``_torch.flex_attention_reference``)."""
    if q.is_cuda:
        out, aux = _compiled()(q, k, v, block_mask=mask, enable_gqa=k.shape[1] != q.shape[1],
                               return_aux=AuxRequest(lse=True))
        return out, aux.lse
    return _torch.flex_attention_reference(q, k, v, mask)


def attend(q: Tensor, k: Tensor, v: Tensor, mask: BlockMask) -> Tensor:
    """q[B, H, n, Dh] over the gathered k, v[B, Hkv, T, Dh] under ``block_mask``'s mask: compiled flex
    on CUDA; elsewhere the eager reference through flex's operator, which differentiates (the
    planner's fake CPU tensors need that) but is slow: CPU training keeps its kernels
    ([Note: cp attention on flex_attention])."""
    if not q.is_cuda:
        return _torch.flex_attention_reference(q, k, v, mask)[0]
    return _compiled()(q, k, v, block_mask=mask, enable_gqa=k.shape[1] != q.shape[1])
