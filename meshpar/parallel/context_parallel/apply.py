"""Context parallelism: every sequence split over the ``cp`` ranks, attention exact over all of it.

    tokens_local = shard_sequence(tokens, cp_mesh)                         # [B, T/cp] (layout.py)
    apply_context_parallel(model, cp_mesh)                                 # before FSDP, on meta
    apply_context_parallel(model, cp_mesh, attention="ring")               # or K/V around a ring
    apply_context_parallel(model, cp_mesh, attention="ulysses")            # or heads split for attention

Each cp rank holds ``T / cp`` tokens of every sequence of its data-parallel batch and runs the
whole model on them; only attention needs the other ranks' tokens. The model files hold no
parallel code: cp fills two slots they expose, ``Transformer.positions``
(``ContextParallelPositions``: RoPE at the global positions of the rank's tokens, documents over
the whole sequence) and each ``Attention.inner_attention`` (``ContextParallelAttention``: K and V
gathered over cp, gather.py, or passed around a ring, ring.py and ring_flex.py, or the heads split
over cp for a whole-sequence attention, ulysses.py; all in meshpar/parallel/context_parallel/).
docs/context_parallel.md compares the attentions; docs/performance.md has their measurements.

Limits: the gathered K/V are materialized per layer (the ring holds two chunks of T/cp); under
torch.compile attention stays eager; GPT-2 (learned positions) has no context parallelism.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from meshpar.distributed import comm
from meshpar.models.attention import InnerAttention, Kernels, SequencePositions, document_ids
from meshpar.parallel.context_parallel import flex as flexlib
from meshpar.parallel.context_parallel.gather import GatherSequence, gather_attention
from meshpar.parallel.context_parallel.layout import SequenceLayout, in_sequence_order
from meshpar.parallel.context_parallel.ring import Ring, ring_attention
from meshpar.parallel.context_parallel.ring_flex import flex_ring_attention
from meshpar.parallel.context_parallel.ulysses import ulysses_attention

# [Note: MLA's latent gathered over cp]
# DeepSeek's multi-head latent attention makes every head's K and V from one latent per token
# (meshpar/models/deepseek/model.py). Under the gather, cp fills MLA's ``sequence_keys`` slot: each rank
# gathers the normalised latent and the rotated RoPE key (kv_lora_rank + qk_rope_head_dim numbers per
# token), not K and V (H x 2 x qk_head_dim, V padded: [Note: MLA's values padded to the keys' width]),
# and runs wkv_b on the whole sequence itself, a small matmul done cp times over. The attention slot then
# takes K and V whole (``keys_gathered``). Under tp x cp the latent is a sequence-sharded DTensor on tp
# and K and V are gathered as for Llama (their heads already split over tp); so are ring and Ulysses.

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


def apply_context_parallel(model: nn.Module, mesh: DeviceMesh, *, balanced: bool = True,
                           attention: str = "allgather", tp: int = 1, flex: bool = False) -> None:
    """Make ``model`` (a Llama-family transformer or stage, on meta or with values; or a transformers
    model, family hf, whose one ``inner_attention`` slot every layer's attention goes through) run on this cp
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
    layout = SequenceLayout(mesh, balanced)
    model.positions = ContextParallelPositions(layout)
    for owner, has_keys in model.attention_slots():  # the family's slots: each block's, or one model-wide (hf)
        # [Note: MLA's latent gathered over cp]
        latent = attention == "allgather" and tp == 1 and has_keys
        if latent:
            owner.sequence_keys = ContextParallelKeys(layout)
        owner.inner_attention = ContextParallelAttention(layout, attention, keys_gathered=latent)
        if flex:
            owner.inner_attention.kernels = Kernels(flex=True)


def attends_over_cp(block: nn.Module) -> bool:
    """Whether ``block``'s attention slot holds a cp attention (``apply_context_parallel``)."""
    return isinstance(block.attention.inner_attention, ContextParallelAttention)


class ContextParallelPositions(SequencePositions):
    """The model's ``positions`` slot on a cp rank: its tokens sit at the global positions of its
    slice of the sequence ([Note: balanced sequence split])."""

    def __init__(self, layout: SequenceLayout) -> None:
        self.layout = layout

    def rope(self, cos_table: Tensor, sin_table: Tensor, seq_len: int) -> tuple[Tensor, Tensor]:
        idx = self.layout.indices(seq_len, cos_table.device).positions
        return cos_table[idx], sin_table[idx]

    def documents(self, cos_table: Tensor, sin_table: Tensor, tokens: Tensor, eos: int,
                  dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
        """[Note: documents under context parallelism]: the whole sequence's documents doc[B, T] (what
        cp attention takes in the mask's place) and RoPE's cos, sin[B, 1, T/cp, Dh/2] at the positions
        of this rank's tokens in their documents; ``dtype`` (the mask's) is not needed."""
        doc, positions = self.documents_of(tokens, eos)
        return doc, cos_table[positions].unsqueeze(1), sin_table[positions].unsqueeze(1)

    def token_positions(self, seq_len: int, device: torch.device) -> Tensor:
        return self.layout.indices(seq_len, device).positions

    def whole_length(self, seq_len: int) -> int:
        return seq_len * self.layout.mesh.size()

    def documents_of(self, tokens: Tensor, eos: int) -> tuple[Tensor, Tensor]:
        """The whole sequence's documents doc[B, T] and the positions [B, T/cp] of this rank's tokens in
        their documents: [Note: documents under context parallelism]."""
        doc, positions = document_ids(_whole_sequence(self.layout, tokens), eos)
        return doc, positions[:, self.layout.indices(tokens.shape[1], tokens.device).positions]


class ContextParallelAttention(InnerAttention):
    """An attention's ``inner_attention`` slot on a cp rank: q[B, H, T/cp, Dh] over the keys of the
    whole sequence, gathered ([Note: all-gather of K and V]), around a ring ([Note: ring attention]),
    or for this rank's share of the heads after an all-to-all (ulysses.py)."""

    def __init__(self, layout: SequenceLayout, attention: str = "allgather", *, keys_gathered: bool = False) -> None:
        super().__init__()
        self.layout, self.attention, self.keys_gathered = layout, attention, keys_gathered

    @torch.compiler.disable  # [Note: compiling a block under cp]: eager, between two graphs
    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        doc = _documents(mask)
        if self.keys_gathered:  # k, v already the whole sequence's: [Note: MLA's latent gathered over cp]
            return gather_attention(self.layout, q, k, v, doc, self.kernels, gathered=True)
        attend = {"allgather": gather_attention, "ring": _attend_ring, "ulysses": _attend_ulysses}[self.attention]
        return attend(self.layout, q, k, v, doc, self.kernels)

    def extra_repr(self) -> str:
        gathered = ", keys gathered" if self.keys_gathered else ""
        return f"cp={self.layout.mesh.size()}, {self.attention}, balanced={self.layout.balanced}{gathered}"


class ContextParallelKeys(nn.Module):
    """MLA's ``sequence_keys`` slot on a cp rank: its latent [B, T/cp, C] and rotated RoPE key
    [B, 1, T/cp, R] -> every rank's, in sequence order ([Note: MLA's latent gathered over cp])."""

    def __init__(self, layout: SequenceLayout) -> None:
        super().__init__()
        self.layout = layout

    @torch.compiler.disable  # as ContextParallelAttention's
    def forward(self, latent: Tensor, k_rope: Tensor) -> tuple[Tensor, Tensor]:
        c, cp = latent.shape[-1], self.layout.mesh.size()
        both = torch.cat([latent.unsqueeze(1), k_rope.to(latent.dtype)], dim=-1)  # [B, 1, T/cp, C + R]
        both = in_sequence_order(GatherSequence.apply(both, self.layout.mesh.get_group()), cp, self.layout.balanced)
        return both[..., :c].squeeze(1), both[..., c:]


def _whole_sequence(layout: SequenceLayout, tokens: Tensor) -> Tensor:
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


def _attend_ring(layout: SequenceLayout, q: Tensor, k: Tensor, v: Tensor, doc: Tensor | None,
                 kernels: Kernels) -> Tensor:
    """[Note: ring attention]: q[B, H, T/cp, Dh] over every rank's k, v[B, Hkv, T/cp, Dh] in turn."""
    if doc is not None:  # each rank's tokens' documents, [B, cp, T/cp]
        doc = doc[:, layout.indices(q.shape[2], doc.device).every_rank]
    if kernels.flex and flexlib.takes(q.shape[2], q.shape[2]):  # [Note: the ring on flex]
        ring = Ring(layout.mesh, layout.balanced, kernels)
        return flex_ring_attention(q, k, v, ring, layout.ring_masks(ring, q.shape[2], doc, q.device))
    return ring_attention(q, k, v, layout.mesh, balanced=layout.balanced, documents=doc, kernels=kernels)


def _attend_ulysses(layout: SequenceLayout, q: Tensor, k: Tensor, v: Tensor, doc: Tensor | None,
                    kernels: Kernels) -> Tensor:
    """ulysses.py: q[B, H, T/cp, Dh] for H/cp heads over the whole sequence after an all-to-all."""
    idx = layout.indices(q.shape[2], q.device)
    return ulysses_attention(q, k, v, idx.every_rank.flatten(), idx.order, layout.mesh.get_group(),
                             doc, kernels)
