"""The mixture-of-experts decoder: Qwen3-MoE and Mixtral in one module.

The Llama family's attention, RMSNorm, RoPE and SwiGLU (imported from meshpar/models/llama/model.py),
with the feed-forward of sparse blocks replaced by ``MoE``: a router ``Linear(D, E)``, softmax over
experts, top-k per token (optionally renormalized), and E SwiGLU experts stored stacked,
``w1, w3[E, F, D]`` and ``w2[E, D, F]``, so that a later expert-parallel pass can ``Shard(0)`` them.
Module names: ``layers.{i}.moe.router``, ``layers.{i}.moe.experts.{w1,w2,w3}`` in sparse blocks,
``layers.{i}.feed_forward.{w1,w2,w3}`` in dense ones; the rest as in the Llama family.

Like the dense families: no parallel code, built on meta then ``to_empty`` + ``init_weights()``,
blocks in a ``ModuleDict`` keyed by index, forward passes through a missing embedding / norm / output.

After each forward, each ``MoE`` layer keeps its record of that forward: ``aux_loss``, its
load-balancing loss (a scalar tensor in the graph), and ``tokens_per_expert``, the token slots each
expert received. ``model.aux_loss`` weighs and sums the first; the family's ``moe`` part
(meshpar/models/moe/part.py) is what the training step reads them through.

Limits: token-choice routing only; no router jitter or z-loss. Expert parallelism is applied from
outside, through the slots ``Experts.dispatch`` and ``MoE.totals`` (meshpar/parallel/expert_parallel.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from meshpar.models.init import ParamInit
from meshpar.models.llama.model import FeedForward, Transformer, TransformerBlock, _trunc_normal
from meshpar.models.moe.args import MoEArgs
from meshpar.models.moe.grouped import Kernel, grouped_mm

# [Note: load-balancing loss]
# Per sparse layer, over the N tokens of one forward (Switch Transformer, eq. 4; Mixtral):
#     aux = E * sum_e f_e * P_e,  f_e = (token slots routed to e) / (N * top_k),  P_e = mean_t p_t[e]
# or, with ``balance_loss = "sequence"`` (DeepSeek-V3's sequence-wise loss, arXiv 2412.19437 eq. 17-20),
# the same over each sequence's T tokens (a row of the batch, every document packed in it), then the
# mean over rows: balance within each sequence, not only over the batch.
# f_e counts the router's choices before any capacity drop; it carries no gradient, P_e does, so
# the loss pushes probability away from overloaded experts. A uniform router gives 1. The model's
# aux_loss is router_aux_loss_coef * sum over sparse layers. Hugging Face's load_balancing_loss_func
# pools all layers before the product and lets f sum to top_k, so its value differs; the
# coefficient's order of magnitude carries over, the exact value does not.

# [Note: routing statistics over the whole forward]
# The auxiliary loss, the token counts and the aux-free loads are statistics of every token of one
# forward. Under tensor (sequence) parallelism a rank's MoE layer sees only its slice of the
# sequence, so meshpar/parallel/expert_parallel.py fills the layer's ``totals`` slot with sums
# over the tp (and cp) ranks; the capacity drop stays per call (``slots.drop_over_capacity``).

# [Note: aux-free balancing]
# DeepSeek-V3 (arXiv 2412.19437, section 2.1.2): a per-expert bias b is added to the routing scores
# for the top-k choice only; the gate weights stay the unbiased probabilities. After each optimizer
# step, b_e += rate * sign(mean load - load_e), the loads counted over the step's forwards on every
# data-parallel rank. b is a buffer (no gradient, saved in checkpoints) that the training step
# updates (``update_expert_bias``, called from meshpar/training/step.py after it sums the loads over dp).
# Activation checkpointing recomputes a forward and counts its loads twice, every expert alike:
# sign(mean - load) does not change under that scaling.


def swiglu_experts(x: Tensor, w1: Tensor, w2: Tensor, w3: Tensor, counts: Tensor, kernel: Kernel = "auto",
                   mm: Callable[[Tensor, Tensor, Tensor, Kernel], Tensor] = grouped_mm) -> Tensor:
    """x[S, D] sorted by expert, counts[E]: run e @ w1[e]^T, w3[e]^T -> [S_e, F]; @ w2[e]^T -> [S_e, D].
    The experts' whole computation, for the stacked weights of all experts or of one rank's share
    (meshpar/parallel/expert_parallel.py). ``mm``: the per-expert matmul (the planner's reads no counts)."""
    h = F.silu(mm(x, w1.transpose(1, 2), counts, kernel))
    h = h * mm(x, w3.transpose(1, 2), counts, kernel)
    return mm(h, w2.transpose(1, 2), counts, kernel)


class LocalExperts:
    """What fills ``Experts.dispatch`` by default: every expert's rows computed on this rank."""

    def __call__(self, experts: Experts, x: Tensor, counts: Tensor) -> Tensor:
        return experts.compute(x, counts, experts.weights())


class LocalTotals:
    """What fills ``MoE.totals`` by default: (slots per expert, summed router probabilities, tokens)
    over every token of this forward, from one call's ``counts[E]``, ``prob_sum[E]`` and ``n``
    tokens: the same, when the call sees the whole forward ([Note: routing statistics over the
    whole forward])."""

    def __call__(self, counts: Tensor, prob_sum: Tensor, n: int) -> tuple[Tensor, Tensor, int]:
        return counts, prob_sum, n


class ChosenSlots:
    """What fills ``MoE.slots`` by default: token slots per expert counted from the router's
    choices, and the capacity drop (``capacity_factor`` in meshpar/models/moe/args.py). Both read
    the choices' values; the planner's simulation, on fake tensors, fills the slot with balanced
    counts instead (meshpar/planner/moe.py)."""

    def count(self, flat: Tensor, n_experts: int) -> Tensor:
        """flat[S] expert of each slot -> counts[E]."""
        return torch.bincount(flat, minlength=n_experts)

    def drop_over_capacity(self, order: Tensor, flat: Tensor, counts: Tensor, capacity: int) -> tuple[Tensor, Tensor]:
        """Keep each expert's first ``capacity`` slots in token order; dropped slots add nothing
        (the token keeps its residual and its other experts)."""
        starts = torch.cumsum(counts, 0) - counts  # first sorted position of each expert's run
        rank = torch.arange(order.numel(), device=order.device) - starts[flat[order]]  # position within its run
        return order[rank < capacity], counts.clamp(max=capacity)


class Experts(nn.Module):
    """A family's E experts, stacked: what expert parallelism and the planner ask of them, and no
    parameters of its own (a family's experts subclass this: ``SwiGLUExperts``, gpt-oss's).

    Slot: ``dispatch(experts, x[S, D], counts[E]) -> [S, D]`` runs the experts on rows sorted by
    expert (``LocalExperts`` unless expert parallelism filled it).

    What a subclass declares: ``stacked`` names every parameter whose dim 0 is the expert, which
    ep shards on that dim; ``compute`` runs any run of experts from those tensors (all of them, or
    one rank's share), with ``mm`` the per-expert matmul; ``init_weights`` initializes them."""

    stacked: tuple[str, ...] = ()

    def __init__(self) -> None:
        super().__init__()
        self.kernel: Kernel = "auto"  # grouped_mm's choice; tests and benchmarks force one
        self.dispatch: Callable[[Experts, Tensor, Tensor], Tensor] = LocalExperts()

    def forward(self, x: Tensor, counts: Tensor) -> Tensor:
        return self.dispatch(self, x, counts)

    def weights(self) -> dict[str, Tensor]:
        """The ``stacked`` parameters by name (DTensors under ep: ``compute`` wants their local parts)."""
        return {name: getattr(self, name) for name in self.stacked}

    def compute(self, x: Tensor, counts: Tensor, weights: Mapping[str, Tensor],
                mm: Callable[[Tensor, Tensor, Tensor, Kernel], Tensor] = grouped_mm) -> Tensor:
        """x[S, D] sorted by expert, counts[L] -> [S, D], for the L experts whose ``stacked`` tensors
        ``weights`` holds ([L, ...] each)."""
        raise NotImplementedError(f"{type(self).__name__} declares no compute")

    def init_weights(self, init: ParamInit, std: float, out_std: float) -> None:
        raise NotImplementedError(f"{type(self).__name__} declares no init_weights")


class SwiGLUExperts(Experts):
    """E SwiGLU experts, stacked: w1, w3[E, F, D], w2[E, D, F] (each slice is an nn.Linear weight)."""

    stacked = ("w1", "w2", "w3")

    def __init__(self, n_experts: int, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))

    def compute(self, x: Tensor, counts: Tensor, weights: Mapping[str, Tensor],
                mm: Callable[[Tensor, Tensor, Tensor, Kernel], Tensor] = grouped_mm) -> Tensor:
        return swiglu_experts(x, weights["w1"], weights["w2"], weights["w3"], counts, self.kernel, mm)

    def init_weights(self, init: ParamInit, std: float, out_std: float) -> None:
        _trunc_normal(init, self.w1, std)
        _trunc_normal(init, self.w3, std)
        _trunc_normal(init, self.w2, out_std)


class MoE(nn.Module):
    """Token-choice top-k mixture of experts: out[t] = sum_{e in topk(t)} g_t[e] * expert_e(x[t]).

    Slots: ``totals`` sums the routing statistics over the whole forward (``LocalTotals`` unless
    tensor or context parallelism, which give a rank a slice of the sequence, filled it);
    ``slots`` counts the slots per expert and drops those over capacity (``ChosenSlots``)."""

    def __init__(self, args: MoEArgs) -> None:
        super().__init__()
        self.n_experts, self.top_k, self.norm_topk_prob = args.n_experts, args.top_k, args.norm_topk_prob
        self.capacity_factor, self.aux_free = args.capacity_factor, args.aux_free_bias
        self.per_sequence = args.balance_loss == "sequence"
        self.router = nn.Linear(args.dim, args.n_experts, bias=False)
        self.experts: Experts = SwiGLUExperts(args.n_experts, args.dim, args.moe_ffn_dim)
        # [Note: aux-free balancing]: the bias is training state (saved) only when it is used
        self.register_buffer("expert_bias", torch.zeros(args.n_experts), persistent=args.aux_free_bias)
        self.register_buffer("expert_load", torch.zeros(args.n_experts), persistent=False)  # slots since update
        self.aux_loss: Tensor | None = None  # unweighted [Note: load-balancing loss] of the last forward
        self.tokens_per_expert: Tensor | None = None  # [E] token slots routed, the last forward
        self.totals: Callable[[Tensor, Tensor, int], tuple[Tensor, Tensor, int]] = LocalTotals()
        self.slots: ChosenSlots = ChosenSlots()

    def route(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x[N, D] -> (probs[N, E] in >= fp32, chosen experts idx[N, k], gate weights[N, k] in x's dtype)."""
        logits = self.router(x)  # x[N, D] @ router[D, E] -> [N, E]
        probs = F.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
        scores = probs + self.expert_bias.to(probs.dtype) if self.aux_free else probs
        idx = scores.topk(self.top_k, dim=-1).indices  # [N, k]
        gates = probs.gather(-1, idx)  # the unbiased probabilities: [Note: aux-free balancing]
        if self.norm_topk_prob:
            gates = gates / gates.sum(-1, keepdim=True)
        return probs, idx, gates.to(x.dtype)

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [N, D], N = B * T
        probs, idx, gates = self.route(x)
        n, k = idx.shape
        # dispatch: the N * k token slots sorted by expert (stable: token order within an expert)
        flat = idx.flatten()  # slot s = t * k + j chose expert flat[s]
        order = flat.argsort(stable=True)  # [S]
        counts = self.slots.count(flat, self.n_experts)  # [E], before any drop
        if self.per_sequence:  # per row: counts[B, E] (a static shape: the planner runs this on fake tensors)
            rows = shape[0] if len(shape) == 3 else 1
            row_of_slot = torch.arange(n * k, device=x.device) // (n // rows * k)
            row_counts = torch.zeros(rows, self.n_experts, dtype=torch.long, device=x.device)
            row_counts.index_put_((row_of_slot, flat), torch.ones_like(flat), accumulate=True)
            stats = row_counts, probs.unflatten(0, (rows, -1)).sum(1), n // rows
        else:
            stats = counts, probs.sum(0), n
        # over every token of the forward or the row: [Note: routing statistics over the whole forward]
        total, prob_sum, n_total = self.totals(*stats)
        f = total.to(probs.dtype) / (n_total * k)
        # [Note: load-balancing loss]: a mean over rows (one row: the forward)
        self.aux_loss = self.n_experts * (f * (prob_sum / n_total)).sum(-1).mean()
        total = total.sum(0) if self.per_sequence else total
        self.tokens_per_expert = total.detach()
        if self.aux_free and torch.is_grad_enabled():
            with torch.no_grad():
                self.expert_load += total.to(self.expert_load.dtype)
        if self.capacity_factor > 0:
            order, counts = self.slots.drop_over_capacity(order, flat, counts, self.capacity(n * k))
        tokens = order // k  # the token of each kept slot
        y = self.experts(x[tokens], counts)  # [S, D]
        y = y * gates.flatten()[order].unsqueeze(-1)
        # index_add in expert order, as Hugging Face's loop over experts sums them
        return torch.zeros_like(x).index_add_(0, tokens, y).reshape(shape)

    def capacity(self, slots: int) -> int:
        """Slots each expert keeps of a call's ``slots`` (``capacity_factor`` in meshpar/models/moe/args.py)."""
        return math.ceil(self.capacity_factor * slots / self.n_experts)

    def update_expert_bias(self, load: Tensor, rate: float) -> None:
        """[Note: aux-free balancing]: b += rate * sign(mean(load) - load); ``load[E]`` summed over
        the step's forwards (and the data-parallel ranks). Resets ``expert_load``."""
        with torch.no_grad():
            self.expert_bias += rate * torch.sign(load.mean() - load).to(self.expert_bias.dtype)
            self.expert_load.zero_()

    def init_weights(self, init: ParamInit, std: float, out_std: float) -> None:
        _trunc_normal(init, self.router.weight, std)
        self.experts.init_weights(init, std, out_std)
        self.expert_bias.zero_()
        self.expert_load.zero_()


class MoEBlock(TransformerBlock):
    """The Llama block with ``moe`` in place of ``feed_forward`` when the layer is sparse."""

    def __init__(self, args: MoEArgs, layer: int) -> None:
        super().__init__(args)
        self.moe: MoE | None = None
        if args.is_sparse(layer):
            del self.feed_forward
            self.feed_forward: FeedForward | None = None
            self.moe = MoE(args)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None = None) -> Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, mask)
        ffn = self.feed_forward if self.moe is None else self.moe
        return h + ffn(self.ffn_norm(h))

    def init_weights(self, init: ParamInit, std: float, out_std: float) -> None:
        self.attention_norm.reset_parameters()
        self.attention.init_weights(init, std, out_std)
        self.ffn_norm.reset_parameters()
        (self.feed_forward if self.moe is None else self.moe).init_weights(init, std, out_std)


class MoETransformer(Transformer):
    """Decoder-only MoE language model: ``forward(tokens[B, T]) -> logits[B, T, V]``; ``aux_loss``
    reads the last forward's (weighted, [Note: load-balancing loss]). Pipeline passthrough as the
    Llama family's."""

    def __init__(self, args: MoEArgs) -> None:
        super().__init__(args)
        self.layers = nn.ModuleDict({str(i): MoEBlock(args, i) for i in range(args.n_layers)})

    def moe_layers(self) -> list[MoE]:
        return [layer.moe for layer in self.layers.values() if layer.moe is not None]

    @property
    def aux_loss(self) -> Tensor | None:
        """The weighted [Note: load-balancing loss] of the last forward (a graph over its sparse
        layers' records), or None when this model (a pipeline stage) holds no sparse layer."""
        losses = [moe.aux_loss for moe in self.moe_layers() if moe.aux_loss is not None]
        return self.args.router_aux_loss_coef * torch.stack(losses).sum() if losses else None

    def update_expert_bias(self, loads: Tensor | None = None) -> None:
        """After an optimizer step, with aux-free balancing: move each sparse layer's expert bias
        ([Note: aux-free balancing]). ``loads[L_sparse, E]``: the counted loads summed over data-parallel
        ranks (default: this rank's, ``expert_loads()``)."""
        if not self.args.aux_free_bias:
            return
        loads = self.expert_loads() if loads is None else loads
        for moe, load in zip(self.moe_layers(), loads, strict=True):
            moe.update_expert_bias(load, self.args.bias_update_rate)

    def expert_loads(self) -> Tensor:
        """[L_sparse, E]: token slots each expert received since the last bias update (this rank);
        [0, E] on a pipeline stage whose layers are all dense (DeepSeek-V3's first ones)."""
        loads = [moe.expert_load for moe in self.moe_layers()]
        return torch.stack(loads) if loads else torch.zeros(0, self.args.n_experts, device=self.rope_cos.device)
