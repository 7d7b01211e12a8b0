"""Shapes of the Llama-style family (Llama 3.x, Qwen2, Qwen3) and their published sizes.

One frozen dataclass describes every member: Qwen2 is Llama with biases on the q/k/v
projections, Qwen3 is Llama with an RMSNorm over each head of q and k and an explicit
``head_dim``. The named sizes reproduce the published configurations exactly; the
parameter counts quoted next to them are checked in ``tests/test_models.py``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1 RoPE frequency scaling (see ``rope_frequencies`` in model.py)."""

    factor: float = 8.0  # low frequencies are divided by this
    low_freq_factor: float = 1.0  # wavelengths above original_max_seq_len / low_freq_factor are scaled fully
    high_freq_factor: float = 4.0  # wavelengths below original_max_seq_len / high_freq_factor are kept
    original_max_seq_len: int = 8192  # the context length the unscaled model was trained with


@dataclass(frozen=True)
class ModelArgs:
    """Shapes and options of one Llama / Qwen2 / Qwen3 model; the defaults are the llama debug size."""

    dim: int = 256  # model width D (the residual stream)
    n_layers: int = 4  # transformer blocks
    n_heads: int = 8  # query heads H
    n_kv_heads: int = 4  # key/value heads; H % n_kv_heads == 0 (grouped-query attention)
    head_dim: int = 0  # per-head width Dh; 0 means dim // n_heads (Qwen3 sets it explicitly)
    ffn_dim: int = 768  # hidden width F of the SwiGLU feed-forward
    vocab_size: int = 2048  # V
    norm_eps: float = 1e-5  # RMSNorm epsilon
    rope_theta: float = 10000.0  # RoPE base
    rope_scaling: RopeScaling | None = None  # Llama 3.1 long-context scaling; None = plain RoPE
    max_seq_len: int = 2048  # longest sequence; RoPE tables are built for this many positions
    qkv_bias: bool = False  # bias on wq, wk, wv (Qwen2)
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before RoPE (Qwen3)
    tie_embeddings: bool = False  # output.weight is tok_embeddings.weight
    # >= 0: document-causal attention over sequences packed with this EOS id (a token attends only
    # to its own document, positions restart per document); -1: plain causal. See [Note:
    # document-causal attention] in meshpar/models/attention.py
    document_eos: int = -1

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.head_dim == 0 and self.dim % self.n_heads:
            raise ValueError(f"dim ({self.dim}) is not divisible by n_heads ({self.n_heads}); set head_dim")
        if self.resolved_head_dim % 2:
            raise ValueError(f"head_dim ({self.resolved_head_dim}) must be even for RoPE")

    @property
    def resolved_head_dim(self) -> int:
        """The per-head width Dh actually used (``head_dim`` or ``dim // n_heads``)."""
        return self.head_dim or self.dim // self.n_heads

    def matmul_params(self) -> int:
        """Weights that take part in matrix multiplies: every linear layer, output included
        (even when tied), biases, norms and the embedding lookup excluded."""
        d, dh = self.dim, self.resolved_head_dim
        attention = d * self.n_heads * dh * 2 + d * self.n_kv_heads * dh * 2  # wq, wo; wk, wv
        ffn = 3 * d * self.ffn_dim  # w1, w2, w3
        return self.n_layers * (attention + ffn) + self.vocab_size * d

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token at ``seq_len``: 6 * N + 12 * L * H * Dh * T.

        N is ``matmul_params()``. A multiply-add is 2 FLOPs and the backward pass costs
        twice the forward, hence 6 per weight. The second term is the attention scores
        and weighted sum (q @ k^T and p @ v: 2 matmuls of 2 * H * Dh * T FLOPs each,
        times 3 for forward + backward), counted without the causal halving, as in
        the PaLM paper's model-FLOPs utilization.
        """
        return 6.0 * self.matmul_params() + 12.0 * self.n_layers * self.n_heads * self.resolved_head_dim * seq_len


_LLAMA3 = dict(vocab_size=128256, rope_theta=500000.0, max_seq_len=131072)
_LLAMA31_SCALING = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=8192)

# Parameter counts in the comments are exact; tied embeddings are counted once.
LLAMA_SIZES: dict[str, ModelArgs] = {
    "debug": ModelArgs(),
    # Llama 3.2 1B: 1,235,814,400
    "1b": ModelArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, tie_embeddings=True,
                    rope_scaling=RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0), **_LLAMA3),
    # Llama 3.2 3B: 3,212,749,824
    "3b": ModelArgs(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim=8192, tie_embeddings=True,
                    rope_scaling=RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0), **_LLAMA3),
    # Llama 3.1 8B: 8,030,261,248
    "8b": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                    rope_scaling=_LLAMA31_SCALING, **_LLAMA3),
    # Llama 3.1 70B: 70,553,706,496
    "70b": ModelArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672,
                     rope_scaling=_LLAMA31_SCALING, **_LLAMA3),
    # Llama 3.1 405B: 405,853,388,800
    "405b": ModelArgs(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim=53248,
                      rope_scaling=_LLAMA31_SCALING, **_LLAMA3),
}

_QWEN = dict(norm_eps=1e-6, rope_theta=1e6)

QWEN2_SIZES: dict[str, ModelArgs] = {
    "debug": ModelArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=2, ffn_dim=768, vocab_size=2048,
                       qkv_bias=True, tie_embeddings=True, **_QWEN),
    # Qwen2 / Qwen2.5 0.5B: 494,032,768
    "0.5b": ModelArgs(dim=896, n_layers=24, n_heads=14, n_kv_heads=2, ffn_dim=4864, vocab_size=151936,
                      max_seq_len=32768, qkv_bias=True, tie_embeddings=True, **_QWEN),
    # Qwen2 / Qwen2.5 7B: 7,615,616,512
    "7b": ModelArgs(dim=3584, n_layers=28, n_heads=28, n_kv_heads=4, ffn_dim=18944, vocab_size=152064,
                    max_seq_len=32768, qkv_bias=True, **_QWEN),
}

QWEN3_SIZES: dict[str, ModelArgs] = {
    # head_dim 64 with dim 256 and 8 heads: q projects 256 -> 512, as Qwen3's 0.6B does (1024 -> 2048)
    "debug": ModelArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=64, ffn_dim=768, vocab_size=2048,
                       qk_norm=True, tie_embeddings=True, **_QWEN),
    # Qwen3 0.6B: 596,049,920
    "0.6b": ModelArgs(dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128, ffn_dim=3072,
                      vocab_size=151936, max_seq_len=40960, qk_norm=True, tie_embeddings=True, **_QWEN),
    # Qwen3 8B: 8,190,735,360
    "8b": ModelArgs(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, head_dim=128, ffn_dim=12288,
                    vocab_size=151936, max_seq_len=40960, qk_norm=True, **_QWEN),
}
