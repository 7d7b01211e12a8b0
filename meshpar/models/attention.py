"""Document-causal attention for packed sequences: the mask and positions, derived from token ids.

    mask, positions = document_mask(tokens, eos=eos_id, dtype=h.dtype)   # in a model's forward

Used by every family when its args set ``document_eos >= 0`` (see the note below); with the
default ``document_eos = -1`` nothing here runs and attention is plain causal.

Limits: a dense [B, 1, T, T] mask (memory and compute O(B * T^2) per forward, no skipped
blocks); it needs the token ids, so only a model (or pipeline stage) holding the token
embedding can build it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# [Note: document-causal attention]
# Training packs documents into fixed-length sequences, each document ending with an EOS token
# id (meshpar.data). With plain causal attention a token also attends to the tail of the
# previous documents, and positions run across them. With ``document_eos = eos`` in a family's
# args, the model's top-level forward, which sees tokens[B, T], derives per row:
#
#     doc[b, t]       = number of EOS tokens strictly before t (an EOS belongs to the document
#                       it ends; a sequence may start or end in the middle of a document)
#     positions[b, t] = t - (index of the first token of t's document)
#     mask[b, 0, i, j] = doc[b, i] == doc[b, j] and j <= i
#
# and passes the mask down to every attention call (scaled_dot_product_attention with
# ``attn_mask=`` instead of ``is_causal=True``). RoPE rotates by cos, sin gathered at
# ``positions`` ([B, 1, T, Dh/2], broadcast over heads); GPT-2 adds its learned position
# embedding at ``positions``. A packed sequence's outputs (and gradients) then equal those of
# running each document alone (tests/test_document_attention.py, to 1e-9 in float64).
#
# The mask is passed in the activations' dtype, as an additive bias (0 where attended, -inf
# elsewhere), not as bools: scaled_dot_product_attention converts a bool mask to exactly that
# bias on every call, and autograd saves each call's converted copy for backward (seen with
# saved_tensors_hooks, torch 2.13): one [B, 1, T, T] tensor per layer. Converted once, all
# layers read and save the same tensor. Memory: B * T^2 elements per forward (bf16: 128 MiB
# at B = 1, T = 8192), plus any per-call copy a kernel makes (CUDA's memory-efficient kernel
# pads the last dim to a multiple of 16). Compute: the dense kernels evaluate all T^2 scores
# and skip nothing, not even the upper triangle that ``is_causal`` lets flash kernels skip.
# The cheap form on GPUs is FlexAttention (torch.nn.attention.flex_attention) with a
# BlockMask built from ``doc``: O(T^2 / block^2) metadata, and blocks that straddle no document
# are skipped, so the cost follows sum(len_d^2) rather than T^2.
#
# Tensor parallelism: tokens are replicated on the tp ranks, so each builds the whole mask; the
# attention module's inputs (x, cos, sin, mask) are all-gathered for x only and the rest pass
# untouched (plan tables in models/<family>/parallelize.py), and attention runs on local heads
# over the whole sequence. FSDP casts the floating-point mask with the other inputs (a no-op:
# it is built in the compute dtype). Activation checkpointing and torch.compile see the mask as
# one more block argument. Pipeline stages after the first receive hidden states, not token
# ids: they refuse ``document_eos >= 0`` (document attention runs with pp = 1). Context
# parallelism fills the Llama family's ``positions`` slot with its own provider: no rank builds [T, T]
# ([Note: documents under context parallelism] in meshpar/parallel/context_parallel/apply.py).


# [Note: masked grouped-query attention on CUDA]
# scaled_dot_product_attention with an explicit mask and ``enable_gqa=True`` runs CPU's fused
# kernel, but on CUDA it falls back to the math kernel (flash takes no mask, and the
# memory-efficient kernel no GQA: reported against torch 2.x, e.g. ComfyUI#15135), which keeps
# [B, H, T, keys] fp32 scores for backward: at T = 8192 and 32 heads, 8 GiB per layer. So on
# CUDA a masked call repeats K and V to the query heads first (a transient [B, H, keys, Dh]
# each, 1/T of that) and runs the memory-efficient kernel. CPU keeps ``enable_gqa``.


@dataclass(frozen=True)
class Kernels:
    """The kernel paths attention takes, chosen for the device a step is *for*. Training leaves the
    defaults (the tensors' device decides); the planner, which runs a GPU's step on CPU fake tensors,
    passes the GPU's choices to its own model (``use_kernels``; meshpar/planner/simulate.py)."""

    fused_causal: bool | None = None  # a chunk's bottom-right causal mask applied unbuilt (CUDA's flash)
    expands_kv: bool | None = None  # masked GQA repeats K/V: [Note: masked grouped-query attention on CUDA]
    ring_scores: int | None = None  # scores per ring block; None: by device (context_parallel/ring.py)
    fake: bool = False  # fake tensors: a fused causal chunk gets no mask object; one ring block per chunk pair
    # the all-gather's attention on flex_attention (context_parallel/flex.py); off by default until a GPU
    # run has checked it ([Note: cp attention on flex_attention])
    flex: bool = False

    def fuses_causal(self, q: Tensor) -> bool:
        return q.is_cuda if self.fused_causal is None else self.fused_causal

    def expands(self, q: Tensor) -> bool:
        return q.is_cuda if self.expands_kv is None else self.expands_kv


BY_DEVICE = Kernels()  # training's: every path chosen by the tensors' device


def masked_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, kernels: Kernels = BY_DEVICE) -> Tensor:
    """Attention of q[B, H, n, Dh] over k, v[B, Hkv, keys, Dh] under ``mask`` (bool, True where
    attended, or an additive bias; broadcast to [B, H, n, keys]): [Note: masked grouped-query
    attention on CUDA]."""
    if kernels.expands(q) and k.shape[1] != q.shape[1]:
        group = q.shape[1] // k.shape[1]  # query head i reads kv head i // group
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


class InnerAttention(nn.Module):
    """What an ``Attention.inner_attention`` slot holds: softmax(q k^T) v of the rotated q[B, H, T, Dh]
    over k, v[B, Hkv, T, Dh], with ``kernels`` choosing its kernel paths."""

    def __init__(self) -> None:
        super().__init__()
        self.kernels = BY_DEVICE


class CausalAttention(InnerAttention):
    """What fills a model's ``Attention.inner_attention`` slot by default: causal (or ``mask``ed)
    grouped-query attention on one device. Context parallelism puts its own module there
    (meshpar/parallel/context_parallel/apply.py)."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        if mask is not None:  # [Note: masked grouped-query attention on CUDA]
            return masked_attention(q, k, v, mask, self.kernels)
        # query head i reads kv head i // (H / Hkv), as repeat_interleave of k, v would give
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


class SequencePositions:
    """What fills a model's ``positions`` slot by default: the positions of a forward's tokens are
    0 .. T-1, and its documents are found in its own tokens. Context parallelism puts its own
    provider there, for a rank that holds a slice of each sequence (meshpar/parallel/context_parallel/apply.py).
    ``cos_table, sin_table[max_seq_len, Dh/2]`` are the model's RoPE tables."""

    def rope(self, cos_table: Tensor, sin_table: Tensor, seq_len: int) -> tuple[Tensor, Tensor]:
        """RoPE's cos, sin[seq_len, Dh/2] for the ``seq_len`` tokens of this forward."""
        return cos_table[:seq_len], sin_table[:seq_len]

    def documents(self, cos_table: Tensor, sin_table: Tensor, tokens: Tensor, eos: int,
                  dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
        """Document-causal attention's inputs for tokens[B, T]: the additive mask [B, 1, T, T] in
        ``dtype`` and RoPE's cos, sin[B, 1, T, Dh/2] at per-document positions ([Note:
        document-causal attention])."""
        mask, positions = document_mask(tokens, eos, dtype=dtype)
        return mask, cos_table[positions].unsqueeze(1), sin_table[positions].unsqueeze(1)

    def token_positions(self, seq_len: int, device: torch.device) -> Tensor:
        """The positions [seq_len] (int64) of this forward's tokens in their sequence, for a model that
        computes its own position encoding from them (family hf)."""
        return torch.arange(seq_len, device=device)

    def whole_length(self, seq_len: int) -> int:
        """The length of the whole sequence of which this forward holds ``seq_len`` tokens."""
        return seq_len

    def documents_of(self, tokens: Tensor, eos: int) -> tuple[Tensor, Tensor]:
        """The documents doc[B, T] of the whole sequence and the positions [B, t] of this forward's tokens
        in their documents (``document_ids``; here the forward holds the whole sequence)."""
        return document_ids(tokens, eos)


def use_kernels(model: nn.Module, kernels: Kernels) -> None:
    """Make every attention slot of ``model`` take ``kernels``' paths."""
    for m in model.modules():
        if isinstance(m, InnerAttention):
            m.kernels = kernels


def document_ids(tokens: Tensor, eos: int) -> tuple[Tensor, Tensor]:
    """Each packed token's document and its position in it: ``(doc[B, T], positions[B, T])``, both
    int64 ([Note: document-causal attention]); a document ends with its ``eos``."""
    if tokens.dim() != 2:
        raise ValueError(f"document attention takes token ids [B, T], got shape {tuple(tokens.shape)}")
    is_eos = (tokens == eos).long()
    doc = is_eos.cumsum(1) - is_eos  # doc[B, T]: EOS tokens strictly before t
    t = torch.arange(tokens.shape[1], device=tokens.device)
    # a document starts at 0 and after each EOS: start[b, t] = the latest such index <= t
    starts = torch.where(torch.cat([torch.ones_like(is_eos[:, :1]), is_eos[:, :-1]], 1).bool(), t, 0)
    return doc, t - starts.cummax(1).values


def document_mask(tokens: Tensor, eos: int, dtype: torch.dtype = torch.bool) -> tuple[Tensor, Tensor]:
    """The document-causal attention mask and per-document positions of packed tokens[B, T].

    Returns ``(mask[B, 1, T, T], positions[B, T])`` (see [Note: document-causal attention]).
    With ``dtype=torch.bool`` the mask is True where query i may attend to key j; with a
    floating dtype it is the additive bias (0 there, -inf elsewhere) that the models pass to
    ``scaled_dot_product_attention``. Positions are int64 and restart at 0 after each ``eos``.
    """
    doc, positions = document_ids(tokens, eos)
    t = torch.arange(tokens.shape[1], device=tokens.device)
    allowed = (doc.unsqueeze(2) == doc.unsqueeze(1)) & (t.unsqueeze(0) <= t.unsqueeze(1))  # [B, T_q, T_k]: j <= i
    allowed = allowed.unsqueeze(1)  # [B, 1, T, T]: the same for every head
    if dtype == torch.bool:
        return allowed, positions
    bias = torch.zeros(allowed.shape, dtype=dtype, device=tokens.device).masked_fill_(~allowed, float("-inf"))
    return bias, positions
