"""The Llama-style decoder-only transformer: Llama 3.x, Qwen2 and Qwen3 in one module.

RMSNorm pre-norm blocks, RoPE (with Llama 3.1 frequency scaling), grouped-query
attention through ``scaled_dot_product_attention``, and a SwiGLU feed-forward. Qwen2
adds q/k/v biases (``qkv_bias``), Qwen3 an RMSNorm per head on q and k (``qk_norm``).
Module names follow torchtitan: ``tok_embeddings``, ``layers.{i}.attention.{wq,wk,wv,wo}``,
``layers.{i}.attention_norm``, ``layers.{i}.feed_forward.{w1,w2,w3}``, ``layers.{i}.ffn_norm``,
``norm``, ``output``.

The model holds no parallel code. It is built on any device (``meta`` for big sizes),
then ``to_empty`` + ``init_weights()`` materializes it. Pipeline stages are slices of
one model: ``forward`` skips a missing (None) ``tok_embeddings``, ``norm`` or ``output``,
and blocks sit in a ``ModuleDict`` keyed by their index in the whole model.

With ``args.document_eos >= 0`` attention is document-causal over packed sequences and
positions restart at each document ([Note: document-causal attention] in
meshpar/models/attention.py); only a model or stage holding ``tok_embeddings`` can derive it.

Limits: training-shaped forward only (no KV cache, no dropout); the loss is computed outside
the model.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from meshpar.models.attention import CausalAttention, SequencePositions
from meshpar.models.init import ParamInit
from meshpar.models.llama.args import ModelArgs, RopeScaling

# [Note: RoPE layout]
# Each head vector is split in halves and element j is rotated with element j + Dh/2 by
# the angle pos * freq[j] (the "rotate_half" convention of Hugging Face transformers).
# Meta's original Llama code rotates adjacent pairs (2j, 2j + 1) instead; the two agree
# only after permuting the rows of wq and wk. Using the Hugging Face layout means HF
# checkpoints (Llama, Qwen2, Qwen3) convert by renaming keys, with no q/k permutation.


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> Tensor:
    """Rotation frequencies freq[Dh/2] (radians per position) in float64, Llama 3.1-scaled if asked.

    Llama 3.1 scaling keeps high frequencies (wavelength < original_max_seq_len /
    high_freq_factor), divides low frequencies (wavelength > original_max_seq_len /
    low_freq_factor) by ``factor``, and blends the two linearly in 1/wavelength between.
    """
    freqs = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if scaling is None:
        return freqs
    wavelen = 2 * math.pi / freqs
    ratio = scaling.original_max_seq_len / wavelen  # how many wavelengths fit the original context
    smooth = ((ratio - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)).clamp(0, 1)
    # smooth = 1 keeps freq (high-frequency band), smooth = 0 divides it by factor (low-frequency band)
    return (1 - smooth) * freqs / scaling.factor + smooth * freqs


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x[B, H, T, Dh] by cos, sin[T, Dh/2] (or [B, 1, T, Dh/2]: per-document positions), in
    the half-split layout of [Note: RoPE layout]."""
    x1, x2 = x.chunk(2, dim=-1)  # x1, x2[B, H, T, Dh/2]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _trunc_normal(init: ParamInit, weight: Tensor, std: float) -> None:
    init.trunc_normal_(weight, std=std, a=-3 * std, b=3 * std)


def _init_linear(init: ParamInit, linear: nn.Linear, std: float) -> None:
    _trunc_normal(init, linear.weight, std)
    if linear.bias is not None:
        nn.init.zeros_(linear.bias)


class Attention(nn.Module):
    """Causal grouped-query attention; heads are inferred from the weights' shapes, so a
    tensor-parallel shard (fewer local heads) runs unchanged. ``mask``: None (causal) or the
    additive document mask [B, 1, T, T] ([Note: document-causal attention]).

    Slot: ``inner_attention`` computes softmax(q k^T) v from the rotated q, k, v (a
    ``CausalAttention`` unless context parallelism filled it)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        d, dh = args.dim, args.resolved_head_dim
        self.head_dim = dh
        self.wq = nn.Linear(d, args.n_heads * dh, bias=args.qkv_bias)
        self.wk = nn.Linear(d, args.n_kv_heads * dh, bias=args.qkv_bias)
        self.wv = nn.Linear(d, args.n_kv_heads * dh, bias=args.qkv_bias)
        self.wo = nn.Linear(args.n_heads * dh, d, bias=False)
        self.q_norm = nn.RMSNorm(dh, eps=args.norm_eps) if args.qk_norm else None
        self.k_norm = nn.RMSNorm(dh, eps=args.norm_eps) if args.qk_norm else None
        self.inner_attention: nn.Module = CausalAttention()

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None = None) -> Tensor:
        # x[B, T, D] @ wq[D, H*Dh] -> q[B, T, H*Dh] -> q[B, H, T, Dh]; k, v likewise with Hkv heads
        q = rearrange(self.wq(x), "b t (h d) -> b h t d", d=self.head_dim)
        k = rearrange(self.wk(x), "b t (h d) -> b h t d", d=self.head_dim)
        v = rearrange(self.wv(x), "b t (h d) -> b h t d", d=self.head_dim)
        if self.q_norm is not None:  # Qwen3: normalize each head before the rotation
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = self.inner_attention(q, k, v, mask)  # out[B, H, T, Dh]
        return self.wo(rearrange(out, "b h t d -> b t (h d)"))  # [B, T, H*Dh] @ wo[H*Dh, D] -> [B, T, D]

    def init_weights(self, init: ParamInit, std: float, out_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            _init_linear(init, linear, std)
        _init_linear(init, self.wo, out_std)
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                norm.reset_parameters()


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        # x[B, T, D] @ w1, w3[D, F] -> [B, T, F]; [B, T, F] @ w2[F, D] -> [B, T, D]
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, init: ParamInit, std: float, out_std: float) -> None:
        _init_linear(init, self.w1, std)
        _init_linear(init, self.w3, std)
        _init_linear(init, self.w2, out_std)


class TransformerBlock(nn.Module):
    """Pre-norm block: h = x + attention(norm(x)); out = h + feed_forward(norm(h))."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_dim)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None = None) -> Tensor:
        # mask passed positionally: the TP plan's PrepareModuleInput lists (x, cos, sin, mask)
        h = x + self.attention(self.attention_norm(x), cos, sin, mask)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self, init: ParamInit, std: float, out_std: float) -> None:
        self.attention_norm.reset_parameters()
        self.attention.init_weights(init, std, out_std)
        self.ffn_norm.reset_parameters()
        self.feed_forward.init_weights(init, std, out_std)


# [Note: initialization]
# Linear weights: truncated normal, std 0.02, cut at 3 std. The projections that write
# into the residual stream (wo, w2) use 0.02 / sqrt(2 * n_layers), so the stream's variance
# does not grow with depth (GPT-2's scheme). Embeddings: normal, std 0.02, Hugging Face's
# initializer_range for Llama and Qwen. torchtitan uses std 1.0, which is harmless with an
# untied output (the first RMSNorm rescales) but with tied embeddings the same matrix is
# the output projection and std 1.0 would start the logits at std ~sqrt(D); 0.02 suits
# both cases, and small models train stably with it. Norms are ones, biases zero.
# Random values come from meshpar.models.init ([Note: layout-independent init]): init_weights()
# draws one base seed from the global RNG, and each value is a function of that seed, the
# parameter's name and the value's position. So after torch.manual_seed(s), a model built
# on meta equals one built on CPU, a pipeline stage equals the same layers of the whole
# model, and every sharding (FSDP, HSDP, tensor parallel) equals one process.

# [Note: weight tying and to_empty]
# With tie_embeddings, output.weight and tok_embeddings.weight are one Parameter. Moving
# a meta model with to_empty() creates a new Parameter per module and silently unties
# them, so init_weights() ties them again (tie_weights) before initializing. When a
# pipeline split puts the embedding and the output in different stages, each keeps its
# own copy; the output's copy is initialized under the embedding's name, so both start
# equal to the whole model's tied matrix (keeping them equal in training is the
# pipeline's job).


class Transformer(nn.Module):
    """Decoder-only language model: ``forward(tokens[B, T]) -> logits[B, T, V]``.

    Passthrough for pipeline stages: with ``tok_embeddings`` None the input is hidden
    states [B, T, D]; with ``norm`` None it is skipped; with ``output`` None hidden states
    are returned.

    Slots where parallelism enters: ``positions`` (where this forward's tokens sit in their
    sequences and documents: a ``SequencePositions`` unless context parallelism filled it), and
    each block's ``attention.inner_attention``. ``head_in_loss``: when True, a forward that records
    gradients stops after the final norm and returns h[B, T, D], and the loss applies ``head`` chunk by
    chunk (meshpar/training/loss.py); a no-grad forward (validation) still returns logits.
    """

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in range(args.n_layers)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        # RoPE tables rope_cos, rope_sin[max_seq_len, Dh/2]: derived, so not saved in checkpoints
        half = args.resolved_head_dim // 2
        self.register_buffer("rope_cos", torch.empty(args.max_seq_len, half), persistent=False)
        self.register_buffer("rope_sin", torch.empty(args.max_seq_len, half), persistent=False)
        # a plain object, not a child module: pipeline stages and checkpoint keys see only the children
        self.positions: SequencePositions = SequencePositions()
        self.head_in_loss = False
        self.tie_weights()
        self._init_rope()

    def attention_slots(self) -> list[tuple[nn.Module, bool]]:
        """(module, whether it also has a ``sequence_keys`` slot) for each module whose
        ``inner_attention`` slot context parallelism fills: each block's attention."""
        return [(block.attention, False) for block in self.layers.values()]

    @property
    def head(self) -> nn.Linear | None:
        """The output projection (None on a pipeline stage without it)."""
        return self.output

    def tie_weights(self) -> None:
        """Make output.weight the embedding's Parameter when tied and both are present."""
        if self.args.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def rope_tables(self, length: int) -> tuple[Tensor, Tensor]:
        """RoPE's cos, sin[length, Dh/2] for ``rope_cos`` / ``rope_sin``; a family with other
        frequencies (YaRN: DeepSeek-V3, gpt-oss) overrides this."""
        # angles in float64 on the CPU: positions up to 131072 lose ~1e-2 rad in float32
        freqs = rope_frequencies(self.args.resolved_head_dim, self.args.rope_theta, self.args.rope_scaling)
        angles = torch.outer(torch.arange(length, dtype=torch.float64), freqs)  # [T, Dh/2]
        return angles.cos(), angles.sin()

    def _init_rope(self) -> None:
        if self.rope_cos.is_meta:
            return
        cos, sin = self.rope_tables(self.args.max_seq_len)
        with torch.no_grad():
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    def init_weights(self) -> None:
        """Initialize every parameter and the RoPE tables in place (see [Note: initialization])."""
        self.tie_weights()
        self._init_rope()
        init = ParamInit(self)  # draws the base seed from the global RNG
        std, out_std = 0.02, 0.02 / math.sqrt(2 * self.args.n_layers)
        if self.tok_embeddings is not None:
            init.normal_(self.tok_embeddings.weight, std=std)
        for layer in self.layers.values():
            layer.init_weights(init, std, out_std)
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None and self.output.weight is not getattr(self.tok_embeddings, "weight", None):
            if self.args.tie_embeddings:  # a stage's copy of the tied embedding: [Note: weight tying and to_empty]
                init.normal_(self.output.weight, std=std, key="tok_embeddings.weight")
            else:
                _trunc_normal(init, self.output.weight, std)

    def forward(self, tokens: Tensor) -> Tensor:
        eos = self.args.document_eos
        if eos >= 0 and self.tok_embeddings is None:
            raise ValueError(f"document_eos = {eos}: this pipeline stage receives hidden states, not token ids, "
                             "so it cannot find document boundaries; document-causal attention needs pp = 1")
        h = tokens if self.tok_embeddings is None else self.tok_embeddings(tokens)  # h[B, T, D]
        seq_len = h.shape[1]
        if seq_len > self.args.max_seq_len:
            raise ValueError(f"sequence length {seq_len} exceeds max_seq_len {self.args.max_seq_len}; "
                             "build the model with a larger max_seq_len")
        if eos < 0:
            (cos, sin), mask = self.positions.rope(self.rope_cos, self.rope_sin, seq_len), None  # [T, Dh/2]
        else:  # [Note: document-causal attention]: mask[B, 1, T, T] in h's dtype, cos, sin[B, 1, T, Dh/2]
            mask, cos, sin = self.positions.documents(self.rope_cos, self.rope_sin, tokens, eos, h.dtype)
        for layer in self.layers.values():
            h = layer(h, cos, sin, mask)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is None or (self.head_in_loss and torch.is_grad_enabled()):
            return h
        return self.output(h)  # h[B, T, D] @ output[D, V] -> logits[B, T, V]
