"""Shapes of the mixture-of-experts families (Qwen3-MoE, Mixtral) and their published sizes.

``MoEArgs`` extends the Llama family's ``ModelArgs``: attention (GQA, RoPE, Qwen3's q/k norms) is
the Llama family's, shared, not copied; what is new is the feed-forward of the sparse layers:
``n_experts`` SwiGLU experts of width ``moe_ffn_dim``, of which a softmax router picks ``top_k``
per token. ``ffn_dim`` is the width of the dense layers Qwen3-MoE may keep (``mlp_only_layers``,
``decoder_sparse_step``); Mixtral has none.

The named sizes reproduce the published Hugging Face ``config.json`` files (Qwen/Qwen3-30B-A3B,
Qwen/Qwen3-235B-A22B, mistralai/Mixtral-8x7B-v0.1, mistralai/Mixtral-8x22B-v0.1); the parameter
counts next to them (total parameters / ``matmul_params()``, the matmul weights a token runs
through) are checked in tests/test_moe.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshpar.models.llama.args import ModelArgs


@dataclass(frozen=True)
class MoEArgs(ModelArgs):
    """One Qwen3-MoE / Mixtral model; the defaults are the debug size's MoE part."""

    n_experts: int = 8  # E: experts per sparse layer
    top_k: int = 2  # experts each token is routed to
    moe_ffn_dim: int = 256  # hidden width of each expert's SwiGLU
    norm_topk_prob: bool = True  # renormalize the top-k gate weights to sum to 1 (Mixtral always does)
    decoder_sparse_step: int = 1  # layer i is sparse when (i + 1) % step == 0 (Qwen3-MoE), else dense
    mlp_only_layers: tuple[int, ...] = ()  # layers that keep a dense SwiGLU of width ffn_dim (Qwen3-MoE)
    # weight of the load-balancing loss added to the cross-entropy ([Note: load-balancing loss] in model.py);
    # 0 turns it off (it is still computed for the metrics)
    router_aux_loss_coef: float = 0.001
    # > 0: an expert takes at most ceil(capacity_factor * tokens * top_k / n_experts) token slots per
    # forward, the rest are dropped (earliest tokens kept); 0: no token is ever dropped
    capacity_factor: float = 0.0
    aux_free_bias: bool = False  # DeepSeek-V3's auxiliary-loss-free balancing: [Note: aux-free balancing]
    bias_update_rate: float = 1e-3  # the per-step bias update of aux-free balancing (DeepSeek-V3's gamma)
    # the load-balancing loss's statistics over each forward's tokens ("forward", Switch / Mixtral) or
    # over each sequence, averaged over sequences ("sequence", DeepSeek-V3's sequence-wise balance loss)
    balance_loss: str = "forward"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.top_k <= self.n_experts:
            raise ValueError(f"top_k ({self.top_k}) must be in 1 .. n_experts ({self.n_experts})")
        if self.balance_loss not in ("forward", "sequence"):
            raise ValueError(f"balance_loss ({self.balance_loss!r}) must be 'forward' or 'sequence'")
        for name in ("router_aux_loss_coef", "capacity_factor", "bias_update_rate"):  # recipes: [model] keys
            if getattr(self, name) < 0:
                raise ValueError(f"{name} ({getattr(self, name)}) must be >= 0")

    def is_sparse(self, layer: int) -> bool:
        """Whether block ``layer`` has experts (Hugging Face's Qwen3MoeDecoderLayer rule)."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

    def n_sparse_layers(self) -> int:
        return sum(self.is_sparse(i) for i in range(self.n_layers))

    def inactive_params(self) -> int:
        """Expert weights a token does not run through: the E - top_k experts it is not routed to, in
        every sparse layer. Active parameters = total - this (3.35B of 30.5B for Qwen3-30B-A3B)."""
        return self.n_sparse_layers() * (self.n_experts - self.top_k) * 3 * self.dim * self.moe_ffn_dim

    def matmul_params(self) -> int:
        """ACTIVE weights in matrix multiplies per token: attention, the router, the top_k experts a
        token runs through (not all n_experts), dense layers, and the output. So flops_per_token, the
        numerator of MFU, counts the work a token does, as MoE papers report it."""
        d, dh = self.dim, self.resolved_head_dim
        attention = d * self.n_heads * dh * 2 + d * self.n_kv_heads * dh * 2
        sparse = d * self.n_experts + self.top_k * 3 * d * self.moe_ffn_dim  # router + top_k experts
        ffn = sum(sparse if self.is_sparse(i) else 3 * d * self.ffn_dim for i in range(self.n_layers))
        return self.n_layers * attention + ffn + self.vocab_size * d


_QWEN3_MOE = dict(qk_norm=True, norm_eps=1e-6, rope_theta=1e6, vocab_size=151936, max_seq_len=40960, head_dim=128,
                  n_kv_heads=4, n_experts=128, top_k=8, router_aux_loss_coef=0.001)

# Parameter counts: total / matmul_params() (active; + the embedding, the usual "active" figure:
# 3.35B for 30B-A3B, 12.9B for 8x7B, as published). tests/test_moe.py checks them.
QWEN3_MOE_SIZES: dict[str, MoEArgs] = {
    # layer 1 dense (mlp_only_layers) so the debug size exercises both kinds of block
    "debug": MoEArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=64, ffn_dim=768, vocab_size=2048,
                     max_seq_len=2048, qk_norm=True, norm_eps=1e-6, rope_theta=1e6, n_experts=8, top_k=2,
                     moe_ffn_dim=256, mlp_only_layers=(1,), router_aux_loss_coef=0.01),
    # Qwen3-30B-A3B: 30,532,122,624 / 3,041,656,832
    "30b_a3b": MoEArgs(dim=2048, n_layers=48, n_heads=32, ffn_dim=6144, moe_ffn_dim=768, **_QWEN3_MOE),
    # Qwen3-235B-A22B: 235,093,634,560 / 21,567,635,456
    "235b_a22b": MoEArgs(dim=4096, n_layers=94, n_heads=64, ffn_dim=12288, moe_ffn_dim=1536, **_QWEN3_MOE),
}

_MIXTRAL = dict(n_heads=32, n_kv_heads=8, rope_theta=1e6, norm_eps=1e-5, n_experts=8, top_k=2,
                router_aux_loss_coef=0.02)

MIXTRAL_SIZES: dict[str, MoEArgs] = {
    "debug": MoEArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=256, vocab_size=2048, max_seq_len=2048,
                     norm_eps=1e-5, rope_theta=1e6, n_experts=8, top_k=2, moe_ffn_dim=256, router_aux_loss_coef=0.02),
    # Mixtral-8x7B: 46,702,792,704 / 12,748,587,008
    "8x7b": MoEArgs(dim=4096, n_layers=32, ffn_dim=14336, moe_ffn_dim=14336, vocab_size=32000, max_seq_len=32768,
                    **_MIXTRAL),
    # Mixtral-8x22B: 140,630,071,296 / 38,959,448,064
    "8x22b": MoEArgs(dim=6144, n_layers=56, ffn_dim=16384, moe_ffn_dim=16384, vocab_size=32768, max_seq_len=65536,
                     **{**_MIXTRAL, "n_heads": 48}),
}
