"""Shapes of the DeepSeek-V3 family and its published sizes.

``DeepSeekArgs`` extends the mixture-of-experts ``MoEArgs`` (routed experts, top-k, aux-free bias,
load-balancing loss) with what DeepSeek-V2/V3 add:

- multi-head latent attention (MLA): queries through an optional low-rank bottleneck
  (``q_lora_rank``; 0: a plain projection), keys and values from one compressed latent of
  ``kv_lora_rank`` per token plus a decoupled RoPE key of ``qk_rope_head_dim`` shared by every head;
  each head's query and key are ``qk_nope_head_dim + qk_rope_head_dim`` wide, its value ``v_head_dim``;
  ``head_dim`` is the rotated width (the RoPE tables'), as in Hugging Face's config;
- YaRN RoPE scaling (``yarn``) and the softmax scale it implies;
- DeepSeekMoE: the first ``first_k_dense`` layers dense (``ffn_dim``), the rest with
  ``n_shared_experts`` always-on experts (one SwiGLU of width ``n_shared_experts * moe_ffn_dim``)
  beside the routed ones, sigmoid scores, routing limited to the ``topk_group`` best of ``n_group``
  expert groups, the gate weights renormalised (``norm_topk_prob``) and scaled by
  ``routed_scaling_factor``.

Sizes reproduce the published Hugging Face configs: ``16b`` is Moonlight-16B-A3B
(moonshotai/Moonlight-16B-A3B, model_type deepseek_v3), ``671b`` DeepSeek-V3
(deepseek-ai/DeepSeek-V3, without its multi-token-prediction layer). Parameter counts are checked in
tests/test_deepseek.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshpar.models.moe.args import MoEArgs


@dataclass(frozen=True)
class Yarn:
    """YaRN RoPE scaling (arXiv 2309.00071) with DeepSeek's attention scale (``mscale``)."""

    factor: float = 40.0  # context extension: low frequencies are divided by this
    original_max_seq_len: int = 4096  # the context length RoPE was trained at
    beta_fast: float = 32.0  # rotations above which a frequency is kept (extrapolated)
    beta_slow: float = 1.0  # rotations below which it is divided by factor (interpolated)
    mscale: float = 1.0
    mscale_all_dim: float = 1.0


def yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class DeepSeekArgs(MoEArgs):
    """One DeepSeek-V3-style model; the defaults are the debug size's."""

    q_lora_rank: int = 64  # 0: queries by one projection (Moonlight, DeepSeek-V2-Lite)
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    n_shared_experts: int = 1
    first_k_dense: int = 1  # Hugging Face's first_k_dense_replace
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    yarn: Yarn | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.head_dim != self.qk_rope_head_dim:
            raise ValueError(f"head_dim ({self.head_dim}) must equal qk_rope_head_dim ({self.qk_rope_head_dim}): "
                             "it sizes the RoPE tables")
        if self.n_experts % self.n_group or not 0 < self.topk_group <= self.n_group:
            raise ValueError(f"n_experts ({self.n_experts}) must split into n_group ({self.n_group}) groups, and "
                             f"topk_group ({self.topk_group}) be in 1 .. n_group")
        if self.top_k > self.topk_group * (self.n_experts // self.n_group):
            raise ValueError(f"top_k ({self.top_k}) exceeds the experts of topk_group ({self.topk_group}) groups")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """1 / sqrt(qk_head_dim), times mscale^2 under YaRN with mscale_all_dim (DeepSeek's rule)."""
        scale = self.qk_head_dim ** -0.5
        if self.yarn is not None and self.yarn.mscale_all_dim:
            scale *= yarn_mscale(self.yarn.factor, self.yarn.mscale_all_dim) ** 2
        return scale

    def is_sparse(self, layer: int) -> bool:
        return layer >= self.first_k_dense

    def attention_params(self) -> int:
        d, h = self.dim, self.n_heads
        q = d * h * self.qk_head_dim if not self.q_lora_rank else \
            d * self.q_lora_rank + self.q_lora_rank * h * self.qk_head_dim
        kv = d * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank * h * (
            self.qk_nope_head_dim + self.v_head_dim)
        return q + kv + h * self.v_head_dim * d

    def matmul_params(self) -> int:
        """ACTIVE matmul weights per token: MLA's projections, the router, the top_k routed and the
        shared experts of sparse layers, dense layers, and the output (as MoEArgs counts them)."""
        d = self.dim
        sparse = d * self.n_experts + (self.top_k + self.n_shared_experts) * 3 * d * self.moe_ffn_dim
        ffn = sum(sparse if self.is_sparse(i) else 3 * d * self.ffn_dim for i in range(self.n_layers))
        return self.n_layers * self.attention_params() + ffn + self.vocab_size * d

    def flops_per_token(self, seq_len: int) -> float:
        """6 per active weight, plus attention's q k^T (qk_head_dim wide) and p v (v_head_dim wide):
        2 * 2 * H * T * (qk + v) / 2 per token forward, times 3 with backward."""
        return 6.0 * self.matmul_params() + 6.0 * self.n_layers * self.n_heads * seq_len * (
            self.qk_head_dim + self.v_head_dim)


_V3 = dict(aux_free_bias=True, norm_topk_prob=True, router_aux_loss_coef=0.001, balance_loss="sequence",
           qkv_bias=False, tie_embeddings=False)

# Parameter counts (total, excluding the multi-token-prediction layer) are checked in tests/test_deepseek.py.
DEEPSEEK_V3_SIZES: dict[str, DeepSeekArgs] = {
    # two dense layers' worth of everything small: q compression, 4 groups of 2 experts, YaRN
    "debug": DeepSeekArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=8, head_dim=16, ffn_dim=768, vocab_size=2048,
                          norm_eps=1e-6, max_seq_len=2048, n_experts=8, top_k=2, moe_ffn_dim=128, n_group=4,
                          topk_group=2, routed_scaling_factor=2.5, yarn=Yarn(factor=4.0, original_max_seq_len=512),
                          **_V3),
    # moonshotai/Moonlight-16B-A3B
    "16b": DeepSeekArgs(dim=2048, n_layers=27, n_heads=16, n_kv_heads=16, head_dim=64, ffn_dim=11264,
                        vocab_size=163840, norm_eps=1e-5, rope_theta=50000.0, max_seq_len=8192, q_lora_rank=0,
                        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_experts=64,
                        top_k=6, moe_ffn_dim=1408, n_shared_experts=2, first_k_dense=1,
                        routed_scaling_factor=2.446, **_V3),
    # deepseek-ai/DeepSeek-V3
    "671b": DeepSeekArgs(dim=7168, n_layers=61, n_heads=128, n_kv_heads=128, head_dim=64, ffn_dim=18432,
                         vocab_size=129280, norm_eps=1e-6, rope_theta=10000.0, max_seq_len=163840, q_lora_rank=1536,
                         kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                         n_experts=256, top_k=8, moe_ffn_dim=2048, n_shared_experts=1, first_k_dense=3, n_group=8,
                         topk_group=4, routed_scaling_factor=2.5, yarn=Yarn(factor=40.0, original_max_seq_len=4096),
                         **_V3),
}
