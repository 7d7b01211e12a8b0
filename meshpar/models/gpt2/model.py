"""GPT-2: LayerNorm pre-norm blocks, learned positions, GELU MLP, tied input/output embeddings.

Module names follow Hugging Face's GPT-2 (``wte``, ``wpe``, ``layers.{i}.ln_1``,
``layers.{i}.attn.{c_attn,c_proj}``, ``layers.{i}.ln_2``, ``layers.{i}.mlp.{c_fc,c_proj}``,
``ln_f``, ``lm_head``), with blocks in ``layers`` (HF: ``h``) and ``nn.Linear`` weights
stored [out, in] (HF's Conv1D stores [in, out], so conversion transposes them).

The model holds no parallel code. It is built on any device (``meta`` for big sizes),
then ``to_empty`` + ``init_weights()`` materializes it. Pipeline stages are slices of
one model: ``forward`` skips a missing (None) embedding, ``ln_f`` or ``lm_head``.

With ``args.document_eos >= 0`` attention is document-causal over packed sequences and the
learned positions restart at each document ([Note: document-causal attention] in
meshpar/models/attention.py); only a model or stage holding ``wte`` can derive it.

Limits: no dropout, no KV cache; the loss is computed outside the model. ``c_attn`` is one
fused projection whose output is laid out [q | k | v], so a column-wise tensor-parallel shard
must split each third separately.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from meshpar.models.attention import document_mask
from meshpar.models.init import ParamInit


@dataclass(frozen=True)
class GPT2Args:
    """Shapes of one GPT-2 model; the defaults are the debug size."""

    dim: int = 256  # model width D (HF: n_embd)
    n_layers: int = 4  # transformer blocks (HF: n_layer)
    n_heads: int = 4  # attention heads H; head width Dh = dim // n_heads
    vocab_size: int = 2048  # V
    max_seq_len: int = 1024  # learned positions (HF: n_positions)
    norm_eps: float = 1e-5  # LayerNorm epsilon
    # >= 0: document-causal attention over sequences packed with this EOS id (a token attends only
    # to its own document, positions restart per document); -1: plain causal. See [Note:
    # document-causal attention] in meshpar/models/attention.py
    document_eos: int = -1

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")

    def matmul_params(self) -> int:
        """Weights that take part in matrix multiplies: c_attn, c_proj, c_fc, c_proj per block
        (12 * D^2) and lm_head (counted although tied); biases, norms, wte and wpe lookups excluded."""
        return 12 * self.n_layers * self.dim**2 + self.vocab_size * self.dim

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token at ``seq_len``: 6 * N + 12 * L * H * Dh * T.

        N is ``matmul_params()``: 2 FLOPs per multiply-add, backward twice the forward.
        The second term is q @ k^T and p @ v (forward + backward, no causal halving),
        as in the PaLM paper's model-FLOPs utilization. H * Dh = D for GPT-2.
        """
        return 6.0 * self.matmul_params() + 12.0 * self.n_layers * self.dim * seq_len


# Parameter counts are exact, tied embeddings counted once.
GPT2_SIZES: dict[str, GPT2Args] = {
    "debug": GPT2Args(),
    "124m": GPT2Args(dim=768, n_layers=12, n_heads=12, vocab_size=50257),  # 124,439,808
    "350m": GPT2Args(dim=1024, n_layers=24, n_heads=16, vocab_size=50257),  # 354,823,168
    "774m": GPT2Args(dim=1280, n_layers=36, n_heads=20, vocab_size=50257),  # 774,030,080
    "1.5b": GPT2Args(dim=1600, n_layers=48, n_heads=25, vocab_size=50257),  # 1,557,611,200
}


class Attention(nn.Module):
    """Causal multi-head attention with a fused q/k/v projection. ``mask``: None (causal) or the
    additive document mask [B, 1, T, T] ([Note: document-causal attention])."""

    def __init__(self, args: GPT2Args) -> None:
        super().__init__()
        self.head_dim = args.dim // args.n_heads
        self.c_attn = nn.Linear(args.dim, 3 * args.dim)
        self.c_proj = nn.Linear(args.dim, args.dim)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        # x[B, T, D] @ c_attn[D, 3*D] -> [B, T, 3*D], laid out [q | k | v], each (H, Dh)
        q, k, v = rearrange(self.c_attn(x), "b t (three h d) -> three b h t d", three=3, d=self.head_dim)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)  # out[B, H, T, Dh]
        return self.c_proj(rearrange(out, "b h t d -> b t (h d)"))  # [B, T, D] @ c_proj[D, D] -> [B, T, D]


class MLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(dim, 4 * dim)
        self.c_proj = nn.Linear(4 * dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        # x[B, T, D] @ c_fc[D, 4D] -> [B, T, 4D]; @ c_proj[4D, D] -> [B, T, D]
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    """Pre-norm block: h = x + attn(ln_1(x)); out = h + mlp(ln_2(h))."""

    def __init__(self, args: GPT2Args) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.attn = Attention(args)
        self.ln_2 = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.mlp = MLP(args.dim)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        # mask passed positionally: the TP plan's PrepareModuleInput lists (x, mask)
        h = x + self.attn(self.ln_1(x), mask)
        return h + self.mlp(self.ln_2(h))

    def init_weights(self, init: ParamInit, std: float, out_std: float) -> None:
        for linear, s in ((self.attn.c_attn, std), (self.attn.c_proj, out_std),
                          (self.mlp.c_fc, std), (self.mlp.c_proj, out_std)):
            init.normal_(linear.weight, std=s)
            nn.init.zeros_(linear.bias)
        self.ln_1.reset_parameters()
        self.ln_2.reset_parameters()


# [Note: GPT-2 weight tying and to_empty]
# lm_head.weight is wte.weight: one Parameter, counted and updated once. Building on meta
# and calling to_empty() unties them (it gives each module a new Parameter), so
# init_weights() ties them again before initializing; tests/test_models.py checks the
# tie after meta init and that an optimizer step moves both names together. A pipeline
# split that puts wte and lm_head in different stages leaves each with its own copy; the
# copy in lm_head is initialized under wte's name, so both start as the whole model's.


class GPT2(nn.Module):
    """GPT-2 language model: ``forward(tokens[B, T]) -> logits[B, T, V]``.

    Passthrough for pipeline stages: with ``wte`` None the input is hidden states
    [B, T, D] (and ``wpe`` is not used either); with ``ln_f`` None it is skipped; with
    ``lm_head`` None hidden states are returned. ``head_in_loss``: when True, a forward that records
    gradients stops after ``ln_f`` and returns h[B, T, D], and the loss applies ``head`` chunk by chunk
    (meshpar/training/loss.py); a no-grad forward (validation) still returns logits.

    Init (``init_weights``): normal std 0.02 for embeddings and weights, the residual
    projections (``c_proj``) 0.02 / sqrt(2 * n_layers), biases zero, LayerNorm ones/zeros.
    Random values are layout-independent (meshpar.models.init): a function of one base seed drawn
    from the global RNG, the parameter's name and the position, so a pipeline stage or any
    sharding starts equal to the whole single-process model.
    """

    def __init__(self, args: GPT2Args) -> None:
        super().__init__()
        self.args = args
        self.wte: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.wpe: nn.Embedding | None = nn.Embedding(args.max_seq_len, args.dim)
        self.layers = nn.ModuleDict({str(i): Block(args) for i in range(args.n_layers)})
        self.ln_f: nn.LayerNorm | None = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.lm_head: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.head_in_loss = False
        self.tie_weights()

    @property
    def head(self) -> nn.Linear | None:
        """The output projection (None on a pipeline stage without it)."""
        return self.lm_head

    def tie_weights(self) -> None:
        """Make lm_head.weight wte's Parameter when both are present."""
        if self.wte is not None and self.lm_head is not None:
            self.lm_head.weight = self.wte.weight

    def init_weights(self) -> None:
        """Initialize every parameter in place, re-tying lm_head to wte first."""
        self.tie_weights()
        init = ParamInit(self)  # draws the base seed from the global RNG
        std, out_std = 0.02, 0.02 / math.sqrt(2 * self.args.n_layers)
        for emb in (self.wte, self.wpe):
            if emb is not None:
                init.normal_(emb.weight, std=std)
        for layer in self.layers.values():
            layer.init_weights(init, std, out_std)
        if self.ln_f is not None:
            self.ln_f.reset_parameters()
        if self.lm_head is not None and self.wte is None:  # the last pipeline stage's copy of wte
            init.normal_(self.lm_head.weight, std=std, key="wte.weight")

    def forward(self, tokens: Tensor) -> Tensor:
        seq_len = tokens.shape[1]
        if seq_len > self.args.max_seq_len:
            raise ValueError(f"sequence length {seq_len} exceeds max_seq_len {self.args.max_seq_len} "
                             "(GPT-2's learned positions); use shorter sequences")
        eos, mask = self.args.document_eos, None
        if self.wte is None:
            if eos >= 0:
                raise ValueError(f"document_eos = {eos}: this pipeline stage receives hidden states, not token "
                                 "ids, so it cannot find document boundaries; document-causal attention needs pp = 1")
            h = tokens  # hidden states from the previous pipeline stage, h[B, T, D]
        else:
            h = self.wte(tokens)  # [B, T, D]
            if eos < 0:
                positions = torch.arange(seq_len, device=tokens.device)  # [T]
            else:  # [Note: document-causal attention]: mask[B, 1, T, T] in h's dtype, positions[B, T]
                mask, positions = document_mask(tokens, eos, dtype=h.dtype)
            h = h + self.wpe(positions)  # [B, T, D] + [T, D] or [B, T, D]
        for layer in self.layers.values():
            h = layer(h, mask)
        if self.ln_f is not None:
            h = self.ln_f(h)
        if self.lm_head is None or (self.head_in_loss and torch.is_grad_enabled()):
            return h
        return self.lm_head(h)  # h[B, T, D] @ lm_head[D, V] -> logits[B, T, V]
