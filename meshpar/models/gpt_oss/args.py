"""Shapes of the gpt-oss family (OpenAI's open-weight mixture of experts) and its published sizes.

``GptOssArgs`` extends the mixture-of-experts ``MoEArgs`` (experts, top-k, the load-balancing loss,
capacity, aux-free bias: read by ``MoE`` unchanged) with what gpt-oss adds:

- attention: biases on q, k, v and o (``qkv_bias``, always on), a learned sink logit per head,
  and layers alternating between a causal window of ``sliding_window`` keys and full causal
  attention (``layer_types``; by default sliding first, as every published config has it);
- YaRN RoPE (``yarn``) with its factor on cos and sin, the correction range not rounded
  (transformers' ``truncate = false``);
- experts with biases and the clamped SwiGLU (``swiglu_alpha``, ``swiglu_limit``); every layer
  sparse; the router a biased linear layer whose top-k logits are softmaxed (``norm_topk_prob``:
  the full softmax renormalised over the top-k is the same distribution).

Sizes reproduce the Hugging Face configs of openai/gpt-oss-20b and openai/gpt-oss-120b (their
``router_aux_loss_coef`` 0.9 included); parameter counts are checked in tests/test_gpt_oss.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshpar.models.moe.args import MoEArgs

SLIDING, FULL = "sliding_attention", "full_attention"  # transformers' layer_types values


@dataclass(frozen=True)
class Yarn:
    """YaRN RoPE scaling (arXiv 2309.00071) as gpt-oss configures it: no mscale, correction range
    not rounded. See ``yarn_frequencies`` in meshpar/models/deepseek/model.py."""

    factor: float = 32.0  # context extension: low frequencies are divided by this
    original_max_seq_len: int = 4096  # the context length RoPE was trained at
    beta_fast: float = 32.0  # rotations above which a frequency is kept (extrapolated)
    beta_slow: float = 1.0  # rotations below which it is divided by factor (interpolated)
    truncate: bool = False  # round the correction range to whole dims (transformers' default; gpt-oss: no)


@dataclass(frozen=True)
class GptOssArgs(MoEArgs):
    """One gpt-oss model; the defaults are the published sizes' shared values."""

    qkv_bias: bool = True  # gpt-oss's q, k, v (and o) projections have biases
    sliding_window: int = 128  # keys a sliding layer's query sees, itself included
    # per layer, SLIDING or FULL; () is the published alternation (even layers sliding), which stays
    # right when a recipe overrides n_layers
    layer_types: tuple[str, ...] = ()
    yarn: Yarn | None = Yarn()
    swiglu_alpha: float = 1.702  # gate * sigmoid(alpha * gate)
    swiglu_limit: float = 7.0  # gate clamped above at +limit, up at +-limit

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mlp_only_layers or self.decoder_sparse_step != 1 or self.rope_scaling is not None or self.qk_norm:
            raise ValueError("gpt-oss has every layer sparse, YaRN (field yarn) for its RoPE scaling and no q/k norms: "
                             "leave mlp_only_layers, decoder_sparse_step, rope_scaling and qk_norm at their defaults")
        if not self.qkv_bias or self.tie_embeddings or not self.norm_topk_prob:
            raise ValueError("gpt-oss has q/k/v biases, untied embeddings and a softmax over the top-k logits: "
                             "qkv_bias and norm_topk_prob must be true, tie_embeddings false")
        if self.layer_types and len(self.layer_types) != self.n_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.n_layers} layers; give one "
                             "per layer, or () for the published alternation")
        if not set(self.layer_types) <= {SLIDING, FULL}:
            raise ValueError(f"layer_types {self.layer_types}: each must be '{SLIDING}' or '{FULL}'")
        if self.sliding_window < 1:
            raise ValueError(f"sliding_window ({self.sliding_window}) must be >= 1")

    def layer_type(self, layer: int) -> str:
        """SLIDING or FULL for block ``layer``."""
        if self.layer_types:
            return self.layer_types[layer]
        return SLIDING if layer % 2 == 0 else FULL

    def is_sparse(self, layer: int) -> bool:
        return True

    def flops_per_token(self, seq_len: int) -> float:
        """6 per active weight (``matmul_params``), plus attention's scores and weighted sum, 12 * H * Dh
        per key a query sees (not halved for causality): ``seq_len`` keys in full layers, at most
        ``sliding_window`` in sliding ones. The sink adds one logit per query and head, not counted."""
        keys = sum(seq_len if self.layer_type(i) == FULL else min(seq_len, self.sliding_window)
                   for i in range(self.n_layers))
        return 6.0 * self.matmul_params() + 12.0 * self.n_heads * self.resolved_head_dim * keys


_PUBLISHED = dict(dim=2880, ffn_dim=2880, moe_ffn_dim=2880, n_heads=64, n_kv_heads=8, head_dim=64,
                  vocab_size=201088, max_seq_len=131072, norm_eps=1e-5, rope_theta=150000.0, top_k=4,
                  router_aux_loss_coef=0.9)

# ffn_dim (the width of dense layers, which gpt-oss has none of) is the experts' width, so the
# tensor-parallel check of the MoE families' plans reads a real dimension.
GPT_OSS_SIZES: dict[str, GptOssArgs] = {
    # both layer kinds, a window (8) shorter than a test's sequence, YaRN over a 64-token original context
    "debug": GptOssArgs(dim=64, ffn_dim=32, moe_ffn_dim=32, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16,
                        vocab_size=512, max_seq_len=256, norm_eps=1e-5, rope_theta=150000.0, n_experts=8, top_k=4,
                        sliding_window=8, yarn=Yarn(factor=4.0, original_max_seq_len=64),
                        router_aux_loss_coef=0.01),
    # openai/gpt-oss-20b: 20,914,757,184 parameters; 3,607,142,400 active (matmul_params; the card's 3.61B)
    "20b": GptOssArgs(n_layers=24, n_experts=32, **_PUBLISHED),
    # openai/gpt-oss-120b: 116,829,156,672 parameters; 5,131,100,160 active (the card's 5.13B)
    "120b": GptOssArgs(n_layers=36, n_experts=128, **_PUBLISHED),
}
