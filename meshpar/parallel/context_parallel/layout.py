"""Where a cp rank's tokens sit: its slice of every sequence, their global positions, and the
order that puts every rank's gathered slices back in sequence order.

    idx = sequence_indices(seq_len=8192, cp=4, rank=1, balanced=True)   # this rank's token indices
    tokens_local = shard_sequence(tokens, cp_mesh)                         # tokens[:, idx]: [B, T/cp]
    layout = SequenceLayout(cp_mesh, balanced=True)                        # per forward: index tensors, masks

Every cp attention (apply.py, gather.py, ring.py, ring_flex.py, ulysses.py) reads its positions,
chunks and block masks from one ``SequenceLayout``, which keeps them across layers and forwards.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.attention.flex_attention import BlockMask

from meshpar.parallel.context_parallel import flex as flexlib
from meshpar.parallel.context_parallel.ring import Ring
from meshpar.parallel.context_parallel.ring_flex import step_masks

# [Note: balanced sequence split]
# Causal attention costs query t work proportional to t, so contiguous slices would give the last
# rank about 2cp - 1 times the first's work. Cut into 2cp chunks instead, rank r holds chunks r
# and 2cp - 1 - r: every rank has the same number of (query, key) pairs to within one chunk's
# diagonal. Pure scheduling: positions follow the global index and masks compare global positions,
# so losses and gradients equal the contiguous split's and one process's.


def sequence_indices(seq_len: int, cp: int, rank: int, *, balanced: bool = True) -> Tensor:
    """The global indices (int64, increasing) of the ``seq_len / cp`` tokens cp rank ``rank`` holds:
    chunks ``rank`` and ``2cp - 1 - rank`` of ``2cp`` ([Note: balanced sequence split]), or the
    ``rank``-th of ``cp`` contiguous slices (``balanced=False``)."""
    if balanced:
        if seq_len % (2 * cp):
            raise ValueError(f"a sequence of {seq_len} tokens does not cut into 2 x cp = {2 * cp} equal chunks")
        c = seq_len // (2 * cp)
        return torch.cat([torch.arange(rank * c, (rank + 1) * c),
                          torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)])
    if seq_len % cp:
        raise ValueError(f"a sequence of {seq_len} tokens does not cut into cp = {cp} equal slices")
    n = seq_len // cp
    return torch.arange(rank * n, (rank + 1) * n)


def shard_sequence(x: Tensor, mesh: DeviceMesh, *, balanced: bool = True) -> Tensor:
    """``x[B, T, ...]``'s tokens held by this cp rank: ``x[:, sequence_indices(T, ...)]``."""
    idx = sequence_indices(x.shape[1], mesh.size(), mesh.get_local_rank(), balanced=balanced)
    return x[:, idx.to(x.device)]


class _Indices(NamedTuple):
    """A forward's index tensors on one device (``SequenceLayout.indices``)."""

    positions: Tensor  # [T/cp]: the global positions of this rank's tokens
    every_rank: Tensor  # [cp, T/cp]: row r the global positions of the tokens cp rank r holds
    order: Tensor  # [T]: the permutation that puts every rank's tokens, gathered in rank order, in sequence order


class SequenceLayout:
    """Where a forward's tokens sit: this rank's global positions, the order that puts every rank's
    gathered chunks back in sequence order, and the local query chunks with how many keys each sees.

    [Note: index tensors built once]
    Every layer of every forward needs the same few index tensors; building them (a few aranges on the
    host) and copying them to the device each time costs host time and a host-to-device copy per layer.
    ``indices`` keeps them per (local length, device). Tensors made under a fake-tensor mode (the
    planner's simulation) belong to that mode and are not kept."""

    def __init__(self, mesh: DeviceMesh, balanced: bool) -> None:
        self.mesh, self.balanced = mesh, balanced
        self._built: dict[tuple, object] = {}  # _Indices, block masks
        self._doc_masks: dict[tuple, tuple[Tensor, object]] = {}  # the masks of the last forward's documents

    def indices(self, local_len: int, device: torch.device) -> _Indices:
        key = ("indices", local_len, torch.device(device))
        if key in self._built:
            return self._built[key]
        cp, rank = self.mesh.size(), self.mesh.get_local_rank()
        every_rank = torch.stack([sequence_indices(local_len * cp, cp, r, balanced=self.balanced) for r in range(cp)])
        every_rank = every_rank.to(device)
        built = _Indices(every_rank[rank], every_rank, _sequence_order(every_rank.flatten()))
        if all(type(t) is Tensor for t in built):  # [Note: index tensors built once]
            self._built[key] = built
        return built

    def flex_mask(self, local_len: int, doc: Tensor | None, device: torch.device) -> BlockMask:
        """The all-gather's block mask on flex (flex.py)."""
        return self._masks("flex", local_len, doc, device, lambda idx: flexlib.block_mask(
            idx.positions, local_len * self.mesh.size(), doc))

    def ring_masks(self, ring: Ring, local_len: int, doc: Tensor | None, device: torch.device) -> list:
        """The ring's block masks on flex, one per source rank (ring_flex.py); ``doc[B, cp, T/cp]``."""
        return self._masks("ring_flex", local_len, doc, device, lambda idx: step_masks(ring, idx.every_rank, doc))

    def _masks(self, kind: str, local_len: int, doc: Tensor | None, device: torch.device, build):
        """``build(indices)``, kept per (kind, length, device) when causal; with documents, for the doc
        tensor of the forward (every layer of a forward is handed the same one)."""
        key = (kind, local_len, torch.device(device))
        if doc is None and key in self._built:
            return self._built[key]
        if doc is not None and key in self._doc_masks and self._doc_masks[key][0] is doc:
            return self._doc_masks[key][1]
        masks = build(self.indices(local_len, device))
        if doc is not None:
            self._doc_masks[key] = (doc, masks)
        elif all(type(m.kv_indices) is Tensor for m in (masks if isinstance(masks, list) else [masks]) if m):
            self._built[key] = masks  # [Note: index tensors built once]
        return masks

    def query_chunks(self, local_len: int) -> list[tuple[int, int, int]]:
        """(first local query, queries, keys it may see: the sequence up to its chunk's end) per
        chunk this rank holds: [Note: attention per query chunk]."""
        cp, rank = self.mesh.size(), self.mesh.get_local_rank()
        if not self.balanced:
            return [(0, local_len, (rank + 1) * local_len)]
        c = local_len // 2
        return [(0, c, (rank + 1) * c), (c, c, (2 * cp - rank) * c)]


def _sequence_order(held: Tensor) -> Tensor:
    """The permutation that puts tokens gathered in rank order (global positions ``held``) in sequence order."""
    return held.argsort()


def in_sequence_order(x: Tensor, cp: int, balanced: bool) -> Tensor:
    """Gathered chunks, in rank order along dim 2, in sequence order: with the balanced split rank r
    sent chunks (r, 2cp - 1 - r), so the front halves in rank order are chunks 0 .. cp - 1 and the
    back halves in reverse rank order chunks cp .. 2cp - 1."""
    if not balanced:
        return x
    b, h, total, d = x.shape
    halves = x.view(b, h, cp, 2, total // (2 * cp), d)
    return torch.cat([halves[:, :, :, 0], halves[:, :, :, 1].flip(2)], dim=2).view(b, h, total, d)
