"""Context parallelism: every sequence split over the ``cp`` ranks, attention exact over all of it.

    idx = sequence_indices(seq_len=8192, cp=4, rank=1, balanced=True)   # this rank's token indices
    tokens_local = tokens[:, idx]                                          # [B, T/cp]
    apply_context_parallel(model, cp_mesh)                                 # before FSDP, on meta
    apply_context_parallel(model, cp_mesh, attention="ring")               # or K/V around a ring
    apply_context_parallel(model, cp_mesh, attention="ulysses")            # or heads split for attention

Each cp rank holds ``T / cp`` tokens of every sequence of its data-parallel batch and runs the
whole model on them; only attention needs the other ranks' tokens. The model files hold no
parallel code: cp fills two slots they expose, ``Transformer.positions``
(``ContextParallelPositions``: RoPE at the global positions of the rank's tokens, documents over
the whole sequence) and each ``Attention.inner_attention`` (``ContextParallelAttention``: K and V
gathered over cp, or passed around a ring, meshpar/parallel/context_parallel/ring.py, or the heads
split over cp for a whole-sequence attention, meshpar/parallel/context_parallel/ulysses.py).
docs/context_parallel.md compares the attentions; docs/performance.md has their measurements.

Limits: the gathered K/V are materialized per layer (the ring holds two chunks of T/cp); under
torch.compile attention stays eager; GPT-2 (learned positions) has no context parallelism.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.attention.bias import causal_lower_right
from torch.nn.attention.flex_attention import BlockMask
from torch.utils.checkpoint import checkpoint

from meshpar.distributed import comm
from meshpar.models.attention import (
    BY_DEVICE,
    InnerAttention,
    Kernels,
    SequencePositions,
    document_ids,
    masked_attention,
)
from meshpar.parallel.context_parallel import flex as flexlib
from meshpar.parallel.context_parallel.ring import Ring, ring_attention
from meshpar.parallel.context_parallel.ring_flex import flex_ring_attention, step_masks
from meshpar.parallel.context_parallel.ulysses import ulysses_attention

# [Note: balanced sequence split]
# Causal attention costs query t work proportional to t, so contiguous slices would give the last
# rank about 2cp - 1 times the first's work. Cut into 2cp chunks instead, rank r holds chunks r
# and 2cp - 1 - r: every rank has the same number of (query, key) pairs to within one chunk's
# diagonal. Pure scheduling: positions follow the global index and masks compare global positions,
# so losses and gradients equal the contiguous split's and one process's.

# [Note: all-gather of K and V]
# K and V (after RoPE) are gathered from every cp rank in rank order, put back in sequence order,
# and the local queries attend over them; backward reduce-scatters their gradients
# (``_GatherSequence``). Under grouped-query attention K and V are the small operands: a rank
# receives 2 x B x Hkv x T x Dh x (cp - 1) / cp elements per layer and microbatch. The ring
# ([Note: ring attention]) moves the same bytes in forward and twice as many in backward, and
# buys memory (two K/V chunks instead of T) and overlap; the gather is the default because it
# calls one fused kernel per query chunk where the ring runs explicit matmuls.

# [Note: MLA's latent gathered over cp]
# DeepSeek's multi-head latent attention makes every head's K and V from one latent per token
# (meshpar/models/deepseek/model.py). Under the gather, cp fills MLA's ``sequence_keys`` slot: each rank
# gathers the normalised latent and the rotated RoPE key (kv_lora_rank + qk_rope_head_dim numbers per
# token), not K and V (H x 2 x qk_head_dim, V padded: [Note: MLA's values padded to the keys' width]),
# and runs wkv_b on the whole sequence itself, a small matmul done cp times over. The attention slot then
# takes K and V whole (``keys_gathered``). Under tp x cp the latent is a sequence-sharded DTensor on tp
# and K and V are gathered as for Llama (their heads already split over tp); so are ring and Ulysses.

# [Note: attention per query chunk]
# Each chunk of local queries attends to the keys up to its own chunk's end, the last ``n`` of them
# causally: ``causal_lower_right(n, keys)``, which the fused GPU kernels apply without building it.
# No [T/cp, T] mask exists and the keys after a chunk are never computed: rank r's two chunks of
# c = T/2cp queries see (r + 1) c and (2cp - r) c keys.

# [Note: the causal mask off the fused kernels]
# Off CUDA's flash kernel, PyTorch builds each chunk's [n, keys] mask and keeps it for backward:
# T^2 / cp per layer. So there each chunk's attention is checkpointed: the mask lives only during
# its call and backward recomputes that one attention (the same kernels, the same numbers).

# [Note: compiling a block under cp]
# ``ContextParallelAttention.forward`` is ``torch.compiler.disable``d: collectives, an autograd
# Function and a checkpoint per chunk that dynamo would break at anyway. A compiled block is then
# two graphs around one eager call. A checkpointed block cannot be split so (torch's checkpoint
# compiles its region whole or not at all), so ``apply_compile`` compiles its norms and
# feed-forward instead (meshpar/parallel/parallelize.py).

# [Note: documents under context parallelism]
# Document-causal attention needs each token's document, a prefix count of EOS over the whole
# sequence, which a rank's slice does not show. ``ContextParallelPositions.documents`` all-gathers
# the token ids over cp once per forward, derives doc[B, T] and the positions in their documents
# (``document_ids``), and passes doc in the mask's place. Attention builds masks from doc, never
# [T, T]: the gather per query chunk inside its checkpointed call, the ring per score block
# ([Note: ring attention]); a block of queries may meet a key chunk with none of its document.


# parallel.cp_attention: [Note: all-gather of K and V], [Note: ring attention], ulysses.py
ATTENTIONS = ("allgather", "ring", "ulysses")


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
    """A forward's index tensors on one device (``_Layout.indices``)."""

    positions: Tensor  # [T/cp]: the global positions of this rank's tokens
    every_rank: Tensor  # [cp, T/cp]: row r the global positions of the tokens cp rank r holds
    order: Tensor  # [T]: the permutation that puts every rank's tokens, gathered in rank order, in sequence order


class _Layout:
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


def _in_sequence_order(x: Tensor, cp: int, balanced: bool) -> Tensor:
    """Gathered chunks, in rank order along dim 2, in sequence order: with the balanced split rank r
    sent chunks (r, 2cp - 1 - r), so the front halves in rank order are chunks 0 .. cp - 1 and the
    back halves in reverse rank order chunks cp .. 2cp - 1."""
    if not balanced:
        return x
    b, h, total, d = x.shape
    halves = x.view(b, h, cp, 2, total // (2 * cp), d)
    return torch.cat([halves[:, :, :, 0], halves[:, :, :, 1].flip(2)], dim=2).view(b, h, total, d)


def apply_context_parallel(model: nn.Module, mesh: DeviceMesh, *, balanced: bool = True,
                           attention: str = "allgather", tp: int = 1, flex: bool = False) -> None:
    """Make ``model`` (a Llama-family transformer or stage, on meta or with values) run on this cp
    rank's slice of each sequence, by filling its slots: ``model.positions`` gives RoPE at global
    positions (and the whole sequence's documents when the model's ``document_eos`` is set: [Note:
    documents under context parallelism]), each block's ``attention.inner_attention`` attends over
    ``mesh`` (1-D, ``cp``) with K and V gathered (``attention="allgather"``), passed around a ring
    (``"ring"``, meshpar/parallel/context_parallel/ring.py), or with the heads split over cp for one
    whole-sequence attention (``"ulysses"``, meshpar/parallel/context_parallel/ulysses.py); an MLA
    gathers its latent instead of K and V when ``tp`` is 1 ([Note: MLA's latent gathered over cp]).
    ``flex``: the gather's and the ring's attention on flex_attention where the shapes allow
    (``Kernels.flex``; ``parallel.cp_flex``). The inputs must be sliced alike (``shard_sequence``)."""
    if attention not in ATTENTIONS:
        raise ValueError(f"cp attention {attention!r} is none of {ATTENTIONS} (parallel.cp_attention)")
    layout = _Layout(mesh, balanced)
    model.positions = ContextParallelPositions(layout)
    for block in model.layers.values():
        # [Note: MLA's latent gathered over cp]
        latent = attention == "allgather" and tp == 1 and hasattr(block.attention, "sequence_keys")
        if latent:
            block.attention.sequence_keys = ContextParallelKeys(layout)
        block.attention.inner_attention = ContextParallelAttention(layout, attention, keys_gathered=latent)
        if flex:
            block.attention.inner_attention.kernels = Kernels(flex=True)


def attends_over_cp(block: nn.Module) -> bool:
    """Whether ``block``'s attention slot holds a cp attention (``apply_context_parallel``)."""
    attention = getattr(block, "attention", None)  # a block without the slot (family hf) attends locally
    return isinstance(getattr(attention, "inner_attention", None), ContextParallelAttention)


class ContextParallelPositions(SequencePositions):
    """The model's ``positions`` slot on a cp rank: its tokens sit at the global positions of its
    slice of the sequence ([Note: balanced sequence split])."""

    def __init__(self, layout: _Layout) -> None:
        self.layout = layout

    def rope(self, cos_table: Tensor, sin_table: Tensor, seq_len: int) -> tuple[Tensor, Tensor]:
        idx = self.layout.indices(seq_len, cos_table.device).positions
        return cos_table[idx], sin_table[idx]

    def documents(self, cos_table: Tensor, sin_table: Tensor, tokens: Tensor, eos: int,
                  dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
        """[Note: documents under context parallelism]: the whole sequence's documents doc[B, T] (what
        cp attention takes in the mask's place) and RoPE's cos, sin[B, 1, T/cp, Dh/2] at the positions
        of this rank's tokens in their documents; ``dtype`` (the mask's) is not needed."""
        doc, positions = document_ids(_whole_sequence(self.layout, tokens), eos)
        positions = positions[:, self.layout.indices(tokens.shape[1], tokens.device).positions]  # [B, T/cp]
        return doc, cos_table[positions].unsqueeze(1), sin_table[positions].unsqueeze(1)


class ContextParallelAttention(InnerAttention):
    """An attention's ``inner_attention`` slot on a cp rank: q[B, H, T/cp, Dh] over the keys of the
    whole sequence, gathered ([Note: all-gather of K and V]), around a ring ([Note: ring attention]),
    or for this rank's share of the heads after an all-to-all (ulysses.py)."""

    def __init__(self, layout: _Layout, attention: str = "allgather", *, keys_gathered: bool = False) -> None:
        super().__init__()
        self.layout, self.attention, self.keys_gathered = layout, attention, keys_gathered

    @torch.compiler.disable  # [Note: compiling a block under cp]: eager, between two graphs
    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        if self.keys_gathered:  # k, v already the whole sequence's: [Note: MLA's latent gathered over cp]
            return _attend(self.layout, q, k, v, mask, self.kernels, gathered=True)
        attend = {"allgather": _attend, "ring": _attend_ring, "ulysses": _attend_ulysses}[self.attention]
        return attend(self.layout, q, k, v, mask, self.kernels)

    def extra_repr(self) -> str:
        gathered = ", keys gathered" if self.keys_gathered else ""
        return f"cp={self.layout.mesh.size()}, {self.attention}, balanced={self.layout.balanced}{gathered}"


class ContextParallelKeys(nn.Module):
    """MLA's ``sequence_keys`` slot on a cp rank: its latent [B, T/cp, C] and rotated RoPE key
    [B, 1, T/cp, R] -> every rank's, in sequence order ([Note: MLA's latent gathered over cp])."""

    def __init__(self, layout: _Layout) -> None:
        super().__init__()
        self.layout = layout

    @torch.compiler.disable  # as ContextParallelAttention's
    def forward(self, latent: Tensor, k_rope: Tensor) -> tuple[Tensor, Tensor]:
        c, cp = latent.shape[-1], self.layout.mesh.size()
        both = torch.cat([latent.unsqueeze(1), k_rope.to(latent.dtype)], dim=-1)  # [B, 1, T/cp, C + R]
        both = _in_sequence_order(_GatherSequence.apply(both, self.layout.mesh.get_group()), cp, self.layout.balanced)
        return both[..., :c].squeeze(1), both[..., c:]


def _whole_sequence(layout: _Layout, tokens: Tensor) -> Tensor:
    """Every cp rank's token ids [B, T/cp], gathered, in sequence order: [B, T]."""
    cp, local_len = layout.mesh.size(), tokens.shape[1]
    tokens = tokens.contiguous()
    gathered = tokens.new_empty((cp, *tokens.shape))  # [cp, B, T/cp]
    comm.all_gather(gathered.view(-1), tokens.view(-1), layout.mesh.get_group(), dim="cp").wait()
    return gathered.movedim(0, 1).flatten(1)[:, layout.indices(local_len, tokens.device).order]


def _documents(mask: Tensor | None) -> Tensor | None:
    """The doc[B, T] ids that ``ContextParallelPositions.documents`` passed in the mask's place, or None (causal)."""
    if mask is not None and (mask.is_floating_point() or mask.dim() != 2):
        raise ValueError(f"context parallel attention takes None (causal) or the documents doc[B, T] of "
                         f"ContextParallelPositions.documents, not a mask of shape {tuple(mask.shape)} and dtype "
                         f"{mask.dtype}: was the model's positions slot filled by apply_context_parallel?")
    return mask


def _attend(layout: _Layout, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, kernels: Kernels, *,
            gathered: bool = False) -> Tensor:
    """[Note: all-gather of K and V]: q[B, H, T/cp, Dh] over k, v gathered to [B, Hkv, T, Dh] (or
    given whole: ``gathered``); ``mask`` None (causal) or the documents doc[B, T] ([Note: documents
    under context parallelism])."""
    doc = _documents(mask)
    if not gathered:
        cp, group = layout.mesh.size(), layout.mesh.get_group()
        k = _in_sequence_order(_GatherSequence.apply(k, group), cp, layout.balanced)
        v = _in_sequence_order(_GatherSequence.apply(v, group), cp, layout.balanced)
    if kernels.flex and flexlib.takes(q.shape[2], k.shape[2]):  # [Note: cp attention on flex_attention]
        return flexlib.attend(q, k, v, layout.flex_mask(q.shape[2], doc, q.device))
    # [Note: the causal mask off the fused kernels]: recomputed in backward rather than kept; a
    # document mask is built and recomputed on every device
    plain = kernels.fuses_causal(q) and doc is None
    run = _chunk_attention if plain else _checkpointed_chunk_attention
    positions = layout.indices(q.shape[2], q.device).positions
    out = []
    for first, n, keys in layout.query_chunks(q.shape[2]):
        docs = () if doc is None else (doc[:, positions[first:first + n]], doc[:, :keys])
        out.append(run(q[:, :, first:first + n], k[:, :, :keys], v[:, :, :keys], *docs, kernels=kernels))
    return out[0] if len(out) == 1 else torch.cat(out, dim=2)


def _attend_ring(layout: _Layout, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None,
                 kernels: Kernels) -> Tensor:
    """[Note: ring attention]: q[B, H, T/cp, Dh] over every rank's k, v[B, Hkv, T/cp, Dh] in turn."""
    doc = _documents(mask)
    if doc is not None:  # each rank's tokens' documents, [B, cp, T/cp]
        doc = doc[:, layout.indices(q.shape[2], doc.device).every_rank]
    if kernels.flex and flexlib.takes(q.shape[2], q.shape[2]):  # [Note: the ring on flex]
        ring = Ring(layout.mesh, layout.balanced, kernels)
        return flex_ring_attention(q, k, v, ring, layout.ring_masks(ring, q.shape[2], doc, q.device))
    return ring_attention(q, k, v, layout.mesh, balanced=layout.balanced, documents=doc, kernels=kernels)


def _attend_ulysses(layout: _Layout, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None,
                    kernels: Kernels) -> Tensor:
    """ulysses.py: q[B, H, T/cp, Dh] for H/cp heads over the whole sequence after an all-to-all."""
    idx = layout.indices(q.shape[2], q.device)
    return ulysses_attention(q, k, v, idx.every_rank.flatten(), idx.order, layout.mesh.get_group(),
                             _documents(mask), kernels)


def _chunk_attention(q: Tensor, k: Tensor, v: Tensor, q_doc: Tensor | None = None, k_doc: Tensor | None = None,
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
    """``_chunk_attention`` whose mask lives only during its call: [Note: the causal mask off the fused kernels]."""
    return checkpoint(_chunk_attention, *args, kernels=kernels, use_reentrant=False)


class _GatherSequence(torch.autograd.Function):
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
