"""The gpt-oss decoder: the mixture-of-experts model with gpt-oss's attention and experts.

The structure of meshpar/models/moe/model.py (blocks in a ``ModuleDict``, pre-norm ``MoEBlock``s
with ``attention`` and ``moe``, the load-balancing statistics, the ``Experts.dispatch`` slot) with:

``GptOssAttention`` (``layers.{i}.attention``): the Llama family's grouped-query attention with
biases on wq, wk, wv and wo, and ``sinks`` (a logit per head joining each query's softmax with
no value: [Note: attention sinks as one more key]); each block sees keys ``sliding_window`` back
or all of them, by ``GptOssArgs.layer_type``. RoPE: YaRN in the half-split layout of
[Note: RoPE layout] (transformers' gpt-oss rotates halves too), cos and sin times YaRN's factor.

``GptOssMoE`` (``layers.{i}.moe``): ``MoE`` with a biased router (softmax over experts,
top-k renormalised: the softmax of the top-k logits) and ``GptOssExperts``, stacked as
transformers stores them, each expert e on its rows x:

    gate_up = x @ gate_up_proj[e] + gate_up_proj_bias[e]            [S_e, 2F], gate | up interleaved
    gate, up = gate_up[:, 0::2].clamp(max=limit), gate_up[:, 1::2].clamp(-limit, limit)
    out = ((up + 1) * gate * sigmoid(alpha * gate)) @ down_proj[e] + down_proj_bias[e]

Like every family: no parallel code, built on meta then ``to_empty`` + ``init_weights()``, forward
passes through a missing embedding / norm / output (pipeline stages).

Limits: context parallelism and KV-cache generation fill ``inner_attention`` with attention that
has neither a window nor sinks, so neither runs gpt-oss (preflight refuses cp, saying so).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from meshpar.models.attention import InnerAttention
from meshpar.models.deepseek.model import yarn_frequencies
from meshpar.models.gpt_oss.args import SLIDING, GptOssArgs
from meshpar.models.init import ParamInit
from meshpar.models.llama.model import Attention, _trunc_normal, apply_rope
from meshpar.models.moe.grouped import Kernel, grouped_mm
from meshpar.models.moe.model import Experts, MoE, MoEBlock, MoETransformer

# [Note: attention sinks as one more key]
# gpt-oss's softmax over a query's keys has one more logit per head h, the learned sink s_h, with no
# value: p_j = exp(l_j) / (exp(s_h) + sum_j' exp(l_j')). scaled_dot_product_attention has no argument
# for it, but it is one more key. Each head is widened from Dh to W (Dh + 1 rounded up to a multiple
# of 8, which the fused kernels want): every query of head h carries s_h * sqrt(Dh) in column Dh, every
# real key 0 there, and a key prepended at position 0 is 1 there and 0 elsewhere, with a zero value.
# At scale 1/sqrt(Dh) its logit is s_h for each query head (so one sink key serves grouped-query
# attention), and the real keys' logits are unchanged. A dummy query prepended at position 0 makes the
# pattern plain causal (query i + 1 sees the sink and real keys 0 .. i): full layers run on any causal
# kernel (flash on CUDA), sliding ones on one [T+1, T+1] mask that every sliding layer of a forward
# shares (``sink_mask``). Either way the kernel keeps O(T) per head for backward, not eager attention's
# [T, T] probabilities. The dummy query's row and the padded columns of the output are dropped.
# Cost: a head W / Dh wider (72 / 64 for gpt-oss) and one row more. s_h * sqrt(Dh) is exact for
# Dh a power of 4 (gpt-oss: 64).


def rope_tables(args: GptOssArgs, length: int) -> tuple[Tensor, Tensor]:
    """RoPE's cos, sin[length, Dh/2] in float64, times YaRN's attention factor 0.1 ln(factor) + 1
    (the model's ``rope_cos``, ``rope_sin``)."""
    freqs = yarn_frequencies(args.resolved_head_dim, args.rope_theta, args.yarn,
                             truncate=args.yarn is not None and args.yarn.truncate)
    angles = torch.outer(torch.arange(length, dtype=torch.float64), freqs)
    factor = 1.0 if args.yarn is None or args.yarn.factor <= 1 else 0.1 * math.log(args.yarn.factor) + 1.0
    return angles.cos() * factor, angles.sin() * factor


def sink_mask(seq_len: int, window: int | None, documents: Tensor | None, dtype: torch.dtype,
              device: torch.device) -> Tensor | None:
    """The additive mask of ``SinkAttention`` over T + 1 positions (the sink first: [Note: attention
    sinks as one more key]): [T+1, T+1], or [B, 1, T+1, T+1] with the document mask ``documents``
    [B, 1, T, T]; query i + 1 sees the sink and real keys i - window < j <= i. None where plain causal
    attention does the same (no documents, no window shorter than the sequence)."""
    if documents is None and (window is None or window >= seq_len):
        return None
    i = torch.arange(seq_len + 1, device=device).unsqueeze(1)
    j = torch.arange(seq_len + 1, device=device).unsqueeze(0)
    seen = (j >= 1) & (j <= i) & ((i - j < window) if window is not None else True)
    bias = torch.zeros(seq_len + 1, seq_len + 1, dtype=dtype, device=device).masked_fill_(~(seen | (j == 0)),
                                                                                          float("-inf"))
    return bias if documents is None else bias + F.pad(documents, (1, 0, 1, 0))


class SinkAttention(InnerAttention):
    """What fills gpt-oss's ``Attention.inner_attention`` slot: attention of the rotated q[B, H, T, Dh]
    over k, v[B, Hkv, T, Dh] whose softmax includes each head's sink logit ``sinks[H]``, under
    ``mask`` from ``sink_mask`` (None: causal): [Note: attention sinks as one more key]."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor, mask: Tensor | None) -> Tensor:
        b, h, t, dh = q.shape
        width, scale = (dh + 8) // 8 * 8, dh ** -0.5
        sink = (sinks.to(torch.promote_types(sinks.dtype, torch.float32)) / scale).to(q.dtype)  # s_h * sqrt(Dh)
        q = torch.cat([q, sink.view(1, h, 1, 1).expand(b, h, t, 1)], dim=-1)
        q = F.pad(q, (0, width - dh - 1, 1, 0))  # [B, H, 1 + T, W]: the dummy query first
        unit = torch.zeros(t + 1, width, dtype=k.dtype, device=k.device)
        unit[0, dh] = 1.0  # the sink key
        k = F.pad(k, (0, width - dh, 1, 0)) + unit  # [B, Hkv, 1 + T, W]
        v = F.pad(v, (0, width - dh, 1, 0))  # the sink's value: zeros
        gqa = k.shape[1] != h
        if gqa and mask is not None and self.kernels.expands(q):
            # [Note: masked grouped-query attention on CUDA] in meshpar/models/attention.py
            group = h // k.shape[1]
            k, v, gqa = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1), False
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                             enable_gqa=gqa)
        return out[:, :, 1:, :dh]  # [B, H, T, Dh]


class Sinks(nn.Module):
    """The sink logits ``weight[H]``, one per query head; a module so that tensor parallelism can shard
    them over heads as wq's output (the plan's ``attention.sinks``). ``forward()`` returns them."""

    def __init__(self, n_heads: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_heads))

    def forward(self) -> Tensor:
        return self.weight


class GptOssAttention(Attention):
    """The Llama family's attention with a bias on wo too and each head's sink. Slot: ``inner_attention``
    (``SinkAttention``), taking (q, k, v, sinks, mask)."""

    def __init__(self, args: GptOssArgs) -> None:
        super().__init__(args)  # wq, wk, wv with biases (qkv_bias)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=True)
        self.sinks = Sinks(args.n_heads)
        self.inner_attention: nn.Module = SinkAttention()

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None = None) -> Tensor:
        # x[B, T, D] @ wq[D, H*Dh] + b -> q[B, H, T, Dh]; k, v likewise with Hkv heads
        q = self.wq(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
        k = self.wk(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
        v = self.wv(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = self.inner_attention(q, k, v, self.sinks(), mask)  # [B, H, T, Dh]
        return self.wo(out.transpose(1, 2).flatten(2))  # [B, T, H*Dh] @ wo[H*Dh, D] + b -> [B, T, D]

    def init_weights(self, init: ParamInit, std: float, out_std: float) -> None:
        super().init_weights(init, std, out_std)  # weights truncated normal, biases zero
        nn.init.zeros_(self.sinks.weight)  # exp(0): one more key's worth of weight in every softmax


class GptOssExperts(Experts):
    """E experts with biases and the clamped SwiGLU (module docstring), stacked as transformers stores
    them: gate_up_proj[E, D, 2F] (gate and up columns interleaved), gate_up_proj_bias[E, 2F],
    down_proj[E, F, D], down_proj_bias[E, D]. Slot: ``dispatch``, ``Experts``'."""

    stacked = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")

    def __init__(self, args: GptOssArgs) -> None:
        super().__init__()  # kernel and the dispatch slot
        e, d, f = args.n_experts, args.dim, args.moe_ffn_dim
        self.gate_up_proj = nn.Parameter(torch.empty(e, d, 2 * f))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * f))
        self.down_proj = nn.Parameter(torch.empty(e, f, d))
        self.down_proj_bias = nn.Parameter(torch.empty(e, d))
        self.alpha, self.limit = args.swiglu_alpha, args.swiglu_limit

    def compute(self, x: Tensor, counts: Tensor, weights: Mapping[str, Tensor],
                mm: Callable[[Tensor, Tensor, Tensor, Kernel], Tensor] = grouped_mm) -> Tensor:
        """x[S, D] sorted by expert, counts[L] -> [S, D], for the L experts ``weights`` holds ([L, ...] each)."""
        # each row's expert among the L, for its biases (output_size: no device sync, and fake tensors work)
        expert = torch.repeat_interleave(torch.arange(counts.shape[0], device=x.device), counts,
                                         output_size=x.shape[0])
        gate_up = mm(x, weights["gate_up_proj"], counts, self.kernel) + weights["gate_up_proj_bias"][expert]
        gate = gate_up[:, 0::2].clamp(max=self.limit)  # [S, F]
        up = gate_up[:, 1::2].clamp(-self.limit, self.limit)
        h = (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
        return mm(h, weights["down_proj"], counts, self.kernel) + weights["down_proj_bias"][expert]

    def init_weights(self, init: ParamInit, std: float, out_std: float) -> None:
        _trunc_normal(init, self.gate_up_proj, std)
        _trunc_normal(init, self.down_proj, out_std)
        nn.init.zeros_(self.gate_up_proj_bias)
        nn.init.zeros_(self.down_proj_bias)


class GptOssMoE(MoE):
    """``MoE`` with a biased router and ``GptOssExperts``; routing, statistics and dispatch are ``MoE``'s."""

    def __init__(self, args: GptOssArgs) -> None:
        super().__init__(args)
        self.router = nn.Linear(args.dim, args.n_experts, bias=True)
        self.experts = GptOssExperts(args)

    def init_weights(self, init: ParamInit, std: float, out_std: float) -> None:
        super().init_weights(init, std, out_std)
        nn.init.zeros_(self.router.bias)


class GptOssBlock(MoEBlock):
    """A pre-norm block: ``GptOssAttention`` and ``GptOssMoE`` (every gpt-oss layer is sparse)."""

    def __init__(self, args: GptOssArgs, layer: int) -> None:
        super().__init__(args, layer)
        self.attention = GptOssAttention(args)
        self.moe = GptOssMoE(args)


class GptOssTransformer(MoETransformer):
    """Decoder-only gpt-oss: ``forward(tokens[B, T]) -> logits[B, T, V]``; ``aux_loss`` as the MoE
    families'. Pipeline passthrough, ``positions`` and ``head_in_loss`` as the Llama family's; each
    block gets the mask of its layer type (``sink_mask``), built once per forward."""

    def __init__(self, args: GptOssArgs) -> None:
        super().__init__(args)
        self.layers = nn.ModuleDict({str(i): GptOssBlock(args, i) for i in range(args.n_layers)})

    def attention_slots(self) -> list[tuple[nn.Module, bool]]:
        """None that context parallelism may fill: its attention has neither a window nor sinks
        (preflight refuses cp before launch, quoting the family's reason; this is the same refusal, late)."""
        raise NotImplementedError("gpt-oss has no slot for context-parallel attention, which has neither a sliding "
                                  "window nor sink logits; run with parallel.cp = 1")

    def rope_tables(self, length: int) -> tuple[Tensor, Tensor]:
        return rope_tables(self.args, length)

    def forward(self, tokens: Tensor) -> Tensor:
        args, eos = self.args, self.args.document_eos
        if eos >= 0 and self.tok_embeddings is None:
            raise ValueError(f"document_eos = {eos}: this pipeline stage receives hidden states, not token ids, "
                             "so it cannot find document boundaries; document-causal attention needs pp = 1")
        h = tokens if self.tok_embeddings is None else self.tok_embeddings(tokens)  # h[B, T, D]
        seq_len = h.shape[1]
        if seq_len > args.max_seq_len:
            raise ValueError(f"sequence length {seq_len} exceeds max_seq_len {args.max_seq_len}; "
                             "build the model with a larger max_seq_len")
        documents = None
        if eos < 0:
            cos, sin = self.positions.rope(self.rope_cos, self.rope_sin, seq_len)  # [T, Dh/2]
        else:  # [Note: document-causal attention]: documents[B, 1, T, T], cos, sin[B, 1, T, Dh/2]
            documents, cos, sin = self.positions.documents(self.rope_cos, self.rope_sin, tokens, eos, h.dtype)
        kinds = {args.layer_type(int(i)) for i in self.layers}
        masks = {kind: sink_mask(seq_len, args.sliding_window if kind == SLIDING else None, documents, h.dtype,
                                 h.device) for kind in kinds}
        for i, layer in self.layers.items():
            h = layer(h, cos, sin, masks[args.layer_type(int(i))])
        if self.norm is not None:
            h = self.norm(h)
        if self.output is None or (self.head_in_loss and torch.is_grad_enabled()):
            return h
        return self.output(h)  # h[B, T, D] @ output[D, V] -> logits[B, T, V]


__all__ = ["GptOssAttention", "GptOssExperts", "GptOssMoE", "GptOssTransformer", "SinkAttention", "rope_tables",
           "sink_mask", "yarn_frequencies"]
