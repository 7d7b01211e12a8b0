"""The DeepSeek-V3 decoder: multi-head latent attention (MLA) and DeepSeekMoE.

The mixture-of-experts model's structure (meshpar/models/moe/model.py: blocks in a ``ModuleDict``,
stacked experts behind the ``Experts.dispatch`` slot, the load-balancing statistics and the
aux-free bias) with two layers replaced:

``MLA`` (module ``layers.{i}.attention``), per token x[D]:

    q      = wq(x)                or  wq_b(q_norm(wq_a(x)))             [H, qk_nope + qk_rope]
    c, kr  = wkv_a(x)             (the latent [kv_lora_rank], the shared RoPE key [qk_rope])
    k_nope, v = wkv_b(kv_norm(c))                                      [H, qk_nope], [H, v_head]
    q = [q_nope, rope(q_rope)],  k = [k_nope, rope(kr) for every head]
    out = wo(softmax(q k^T * scale) v)

RoPE follows DeepSeek's layout: the rotated dims are adjacent pairs, so q_rope and kr are
de-interleaved (even then odd elements) before the half-split rotation of [Note: RoPE layout],
which gives transformers' ``rope_interleave`` values exactly. The softmax scale (``DeepSeekArgs.
softmax_scale``) is folded into q, so the ``inner_attention`` slot runs at its own 1/sqrt(width)
and context parallelism fills it as for Llama.

``DeepSeekMoE`` (module ``layers.{i}.moe``) is ``MoE`` with DeepSeek's router: sigmoid scores s, the
aux-free bias b added for the choice only, routing limited to the ``topk_group`` groups whose two
best s + b sum highest, gates s of the chosen experts renormalised and times
``routed_scaling_factor``; plus ``shared``, a SwiGLU every token runs. The load-balancing loss's
probabilities are the scores normalised per token, and it is computed per sequence and averaged,
as DeepSeek-V3's sequence-wise balance loss (section 2.1.2; ``balance_loss = "sequence"``).

Limits (docs/moe.md#deepseek-v3): no multi-token-prediction module.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from meshpar.models.attention import CausalAttention
from meshpar.models.deepseek.args import DeepSeekArgs, yarn_mscale
from meshpar.models.init import ParamInit
from meshpar.models.llama.model import FeedForward, _init_linear, apply_rope
from meshpar.models.moe.model import MoE, MoEBlock, MoETransformer

# [Note: MLA's values padded to the keys' width]
# A head's value (v_head_dim, 128 in V3) is narrower than its query and key (qk_head_dim, 192).
# PyTorch's flash kernels take one head width for q, k and v; given two, SDPA falls back to a
# kernel without that constraint, on CPU the math path, which keeps the [T, T] attention weights
# per head for backward (H x T x T numbers a layer). So V is zero-padded to the keys'
# width and the output's extra columns are dropped: each output column depends only on its own
# value column, so the kept columns are the unpadded attention's, at the cost of computing and
# keeping a value 1.5 x wider. It also gives the cp ring one width for its K | V tensor.


def yarn_frequencies(head_dim: int, theta: float, yarn, *, truncate: bool = True) -> Tensor:
    """RoPE frequencies freq[Dh/2] under YaRN, in float64: each frequency blends its interpolated
    value (divided by ``factor``) and its own by a ramp over the dims whose number of rotations in
    the original context lies between beta_slow and beta_fast, that range rounded out to whole dims
    when ``truncate`` (DeepSeek-V3; gpt-oss does not round: transformers' ``truncate``)."""
    freqs = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if yarn is None:
        return freqs

    def dim_of(rotations: float) -> float:  # the dim whose wavelength fits ``rotations`` times in the context
        return head_dim * math.log(yarn.original_max_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(yarn.beta_fast), dim_of(yarn.beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return freqs / yarn.factor * ramp + freqs * (1 - ramp)


def yarn_attention_factor(yarn) -> float:
    """YaRN's factor on cos and sin (1 when mscale == mscale_all_dim, as in DeepSeek-V3)."""
    if yarn is None:
        return 1.0
    if yarn.mscale and yarn.mscale_all_dim:
        return yarn_mscale(yarn.factor, yarn.mscale) / yarn_mscale(yarn.factor, yarn.mscale_all_dim)
    return yarn_mscale(yarn.factor, 1.0)


def deinterleave(x: Tensor) -> Tensor:
    """[..., (d 2)] -> [..., (2 d)]: even elements then odd ones (DeepSeek's pairs to the half split)."""
    return rearrange(x, "... (d two) -> ... (two d)", two=2)


class LocalKeys(nn.Module):
    """What fills ``MLA.sequence_keys`` by default: the keys are this forward's own tokens'."""

    def forward(self, latent: Tensor, k_rope: Tensor) -> tuple[Tensor, Tensor]:
        return latent, k_rope


class MLA(nn.Module):
    """Multi-head latent attention (module docstring). Heads are inferred from the weights' shapes.
    Slots: ``inner_attention``, as the Llama family's ``Attention``; ``shared_rope_key``, ``sequence_keys``."""

    def __init__(self, args: DeepSeekArgs) -> None:
        super().__init__()
        d, h = args.dim, args.n_heads
        self.nope, self.rope, self.v_dim, self.lora = (args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim,
                                                       args.kv_lora_rank)
        qk = args.qk_head_dim
        if args.q_lora_rank:
            self.wq_a = nn.Linear(d, args.q_lora_rank, bias=False)
            self.q_norm = nn.RMSNorm(args.q_lora_rank, eps=args.norm_eps)
            self.wq_b = nn.Linear(args.q_lora_rank, h * qk, bias=False)
        else:
            self.wq = nn.Linear(d, h * qk, bias=False)
        self.wkv_a = nn.Linear(d, args.kv_lora_rank + args.qk_rope_head_dim, bias=False)
        self.kv_norm = nn.RMSNorm(args.kv_lora_rank, eps=args.norm_eps)
        self.wkv_b = nn.Linear(args.kv_lora_rank, h * (args.qk_nope_head_dim + args.v_head_dim), bias=False)
        self.wo = nn.Linear(h * args.v_head_dim, d, bias=False)
        # the softmax scale folded into q: inner attention divides by sqrt(qk) itself
        self.q_scale = args.softmax_scale * math.sqrt(qk)
        self.inner_attention: nn.Module = CausalAttention()
        # slot: the RoPE key every head shares, k_rope[B, T, R] (identity); tensor parallelism gathers
        # the sequence here ([Note: MLA under tensor parallelism] in meshpar/models/deepseek/parallelize.py)
        self.shared_rope_key: nn.Module = nn.Identity()
        # slot: (the normalised latent [B, T, C], the rotated RoPE key [B, 1, T, R]) -> those of the tokens
        # the keys are of; context parallelism gathers the whole sequence's here (meshpar/parallel/
        # context_parallel/apply.py, [Note: MLA's latent gathered over cp])
        self.sequence_keys: nn.Module = LocalKeys()

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None = None) -> Tensor:
        q = self.wq(x) if hasattr(self, "wq") else self.wq_b(self.q_norm(self.wq_a(x)))
        q = rearrange(q, "b t (h d) -> b h t d", d=self.nope + self.rope)  # [B, H, T, qk]
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        latent, k_rope = self.wkv_a(x).split([self.lora, self.rope], dim=-1)  # [B, T, C], [B, T, R]
        k_rope = self.shared_rope_key(k_rope)  # [B, T, R]
        k_rope = apply_rope(deinterleave(k_rope).unsqueeze(1), cos, sin)  # [B, 1, T, R]: one for every head
        latent, k_rope = self.sequence_keys(self.kv_norm(latent), k_rope)  # the tokens the keys are of
        kv = rearrange(self.wkv_b(latent), "b t (h d) -> b h t d", d=self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)  # [B, H, T, nope], [B, H, T, v]
        q_rope = apply_rope(deinterleave(q_rope), cos, sin)
        q = torch.cat([q_nope, q_rope], dim=-1) * self.q_scale
        k = torch.cat([k_nope, k_rope.expand(-1, k_nope.shape[1], -1, -1)], dim=-1)
        # [Note: MLA's values padded to the keys' width]
        v = F.pad(v, (0, q.shape[-1] - self.v_dim)) if self.v_dim < q.shape[-1] else v
        out = self.inner_attention(q, k, v, mask)[..., :self.v_dim]  # [B, H, T, v]
        return self.wo(rearrange(out, "b h t d -> b t (h d)"))

    def init_weights(self, init: ParamInit, std: float, out_std: float) -> None:
        for name in ("wq", "wq_a", "wq_b", "wkv_a", "wkv_b"):
            if hasattr(self, name):
                _init_linear(init, getattr(self, name), std)
        _init_linear(init, self.wo, out_std)
        self.kv_norm.reset_parameters()
        if hasattr(self, "q_norm"):
            self.q_norm.reset_parameters()


class DeepSeekMoE(MoE):
    """``MoE`` with DeepSeek's router and shared experts (module docstring)."""

    def __init__(self, args: DeepSeekArgs) -> None:
        super().__init__(args)
        self.n_group, self.topk_group, self.scale = args.n_group, args.topk_group, args.routed_scaling_factor
        # the routing bias is part of the architecture (Hugging Face's e_score_correction_bias): always
        # saved and added; aux_free_bias says whether training moves it ([Note: aux-free balancing])
        self.register_buffer("expert_bias", torch.zeros(args.n_experts), persistent=True)
        self.shared = FeedForward(args.dim, args.n_shared_experts * args.moe_ffn_dim) if args.n_shared_experts else None

    def route(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x[N, D] -> (per-token normalised scores [N, E], chosen experts [N, k], gates [N, k])."""
        logits = self.router(x)
        scores = torch.sigmoid(logits.to(torch.promote_types(logits.dtype, torch.float32)))  # [N, E]
        choice = scores + self.expert_bias.to(scores.dtype)
        if self.n_group > 1:  # keep the topk_group groups whose two best experts score highest
            groups = choice.unflatten(-1, (self.n_group, -1))  # [N, G, E/G]
            best = groups.topk(2, dim=-1).values.sum(-1)  # [N, G]
            kept = torch.zeros_like(best, dtype=torch.bool).scatter_(1, best.topk(self.topk_group, -1).indices, True)
            choice = groups.masked_fill(~kept.unsqueeze(-1), float("-inf")).flatten(1)
        idx = choice.topk(self.top_k, dim=-1).indices
        gates = scores.gather(-1, idx)
        if self.norm_topk_prob:
            gates = gates / (gates.sum(-1, keepdim=True) + 1e-20)
        gates = gates * self.scale
        return scores / scores.sum(-1, keepdim=True), idx, gates.to(x.dtype)

    def forward(self, x: Tensor) -> Tensor:
        out = super().forward(x)
        return out if self.shared is None else out + self.shared(x)

    def init_weights(self, init: ParamInit, std: float, out_std: float) -> None:
        super().init_weights(init, std, out_std)
        if self.shared is not None:
            self.shared.init_weights(init, std, out_std)


class DeepSeekBlock(MoEBlock):
    """A pre-norm block with MLA, and a dense SwiGLU (the first ``first_k_dense``) or DeepSeekMoE."""

    def __init__(self, args: DeepSeekArgs, layer: int) -> None:
        super().__init__(args, layer)
        self.attention = MLA(args)
        if self.moe is not None:
            self.moe = DeepSeekMoE(args)


class DeepSeekTransformer(MoETransformer):
    """Decoder-only DeepSeek-V3 language model: ``forward(tokens[B, T]) -> logits[B, T, V]``; its
    ``aux_loss`` as the MoE families'. Pipeline passthrough as the Llama family's."""

    def __init__(self, args: DeepSeekArgs) -> None:
        super().__init__(args)
        self.layers = nn.ModuleDict({str(i): DeepSeekBlock(args, i) for i in range(args.n_layers)})

    def attention_slots(self) -> list[tuple[nn.Module, bool]]:
        """Each block's MLA: its ``inner_attention`` and ``sequence_keys`` slots."""
        return [(block.attention, True) for block in self.layers.values()]

    def rope_tables(self, length: int) -> tuple[Tensor, Tensor]:
        return rope_tables(self.args, length)


def rope_tables(args: DeepSeekArgs, length: int) -> tuple[Tensor, Tensor]:
    """RoPE's cos, sin[length, qk_rope_head_dim / 2] in float64: YaRN's frequencies, times its
    attention factor (the model's ``rope_cos``, ``rope_sin``)."""
    freqs = yarn_frequencies(args.qk_rope_head_dim, args.rope_theta, args.yarn)
    angles = torch.outer(torch.arange(length, dtype=torch.float64), freqs)
    factor = yarn_attention_factor(args.yarn)
    return angles.cos() * factor, angles.sin() * factor


__all__ = ["MLA", "DeepSeekBlock", "DeepSeekMoE", "DeepSeekTransformer", "rope_tables", "yarn_frequencies"]
