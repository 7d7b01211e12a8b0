"""Ulysses context parallelism (``parallel.cp_attention = "ulysses"``): heads split over cp for
attention, the sequence split everywhere else.

Each cp rank holds T/cp tokens of every sequence and all of its (tp-local) heads. Before
attention one all-to-all per operand trades the sequence split for a head split:
q[B, H, T/cp, Dh] -> [B, H/cp, T, Dh] (and k, v likewise), each rank attends over the whole
sequence for its heads with a plain causal or document mask (so a fused kernel sees the shape it
is fastest on), and one all-to-all turns the output back. Backward runs the same exchanges in
reverse (``meshpar.distributed.comm.all_to_all_rows``).

[Note: Ulysses with grouped-query attention]
Query head i reads kv head i // (H / Hkv). Rank j takes query heads j*H/cp .. (j+1)*H/cp - 1, which
read kv heads j*Hkv/cp .. when cp divides Hkv. When it does not, K and V are first repeated
(``repeat_interleave``: kv head g becomes r copies) to the fewest heads Hkv*r that cp divides and that
divide H, so the mapping still holds; each rank then sends r times the kv bytes of a layout cp
divides, and backward sums the copies' gradients. Per rank and layer, forward sends
(cp - 1)/cp of q, k, v and the output: B x T/cp x Dh x (2H + 2 Hkv r) x (cp - 1)/cp elements.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from meshpar.distributed import comm
from meshpar.models.attention import Kernels, masked_attention


def kv_repeats(n_heads: int, n_kv_heads: int, cp: int) -> int:
    """r of [Note: Ulysses with grouped-query attention]: the fewest copies of each kv head so that cp
    divides Hkv * r and Hkv * r divides H (1 when cp divides Hkv)."""
    group = n_heads // n_kv_heads
    for r in range(1, group + 1):
        if group % r == 0 and (n_kv_heads * r) % cp == 0:
            return r
    raise ValueError(f"{n_heads} query heads do not split over cp = {cp}")


def _heads_to_ranks(x: Tensor, group, cp: int) -> Tensor:
    """x[B, h, t, Dh] (this rank's tokens, every head) -> [B, h/cp, cp * t, Dh]: head block j to rank j,
    the sequence chunks received in rank order."""
    b, h, t, d = x.shape
    rows = x.view(b, cp, h // cp, t, d).movedim(1, 0).reshape(cp, -1)  # [cp, B * h/cp * t * Dh]
    got = comm.all_to_all_rows(rows, [1] * cp, [1] * cp, group, dim="cp", label="cp.ulysses")
    return got.view(cp, b, h // cp, t, d).movedim(0, 2).reshape(b, h // cp, cp * t, d)


def _ranks_to_heads(x: Tensor, group, cp: int) -> Tensor:
    """The inverse: x[B, h/cp, cp * t, Dh] (this rank's heads, every rank's tokens in rank order) ->
    [B, h, t, Dh]."""
    b, hl, total, d = x.shape
    t = total // cp
    rows = x.view(b, hl, cp, t, d).movedim(2, 0).reshape(cp, -1)  # chunk r back to rank r
    got = comm.all_to_all_rows(rows, [1] * cp, [1] * cp, group, dim="cp", label="cp.ulysses")
    return got.view(cp, b, hl, t, d).movedim(0, 1).reshape(b, cp * hl, t, d)


def ulysses_attention(q: Tensor, k: Tensor, v: Tensor, held: Tensor, order: Tensor, group,
                      documents: Tensor | None, kernels: Kernels) -> Tensor:
    """q[B, H, T/cp, Dh] over k, v[B, Hkv, T/cp, Dh] of every cp rank; ``held[cp * T/cp]``: the global
    position of each token in rank order (every rank's slice in turn), ``order`` its inverse
    permutation (``held.argsort()``), both on q's device; ``documents``: doc[B, T] of the whole
    sequence for document-causal attention, or None (causal)."""
    cp = torch.distributed.get_world_size(group)
    r = kv_repeats(q.shape[1], k.shape[1], cp)
    if r > 1:  # [Note: Ulysses with grouped-query attention]
        k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)
    q, k, v = (_heads_to_ranks(x.contiguous(), group, cp)[:, :, order] for x in (q, k, v))
    if documents is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    else:
        t = torch.arange(q.shape[2], device=q.device)
        allowed = (documents.unsqueeze(2) == documents.unsqueeze(1)) & (t.unsqueeze(0) <= t.unsqueeze(1))
        out = masked_attention(q, k, v, allowed.unsqueeze(1), kernels)  # [B, 1, T, T]
    return _ranks_to_heads(out[:, :, held], group, cp)


def check_heads(n_heads: int, n_kv_heads: int, cp: int, tp: int) -> str | None:
    """Why Ulysses cannot split these heads over cp x tp, naming the degrees that work; None when it can."""
    if n_heads % (cp * tp) == 0:
        return None
    works = [c for c in range(2, n_heads // tp + 1) if (n_heads // tp) % c == 0]
    return (f"parallel.cp_attention = 'ulysses' splits each tp rank's {n_heads // tp} query heads over cp = {cp}, "
            f"which does not divide them; use cp in {works or '(none above 1)'} or cp_attention = 'allgather'")

