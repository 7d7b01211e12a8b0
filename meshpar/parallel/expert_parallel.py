"""Expert parallelism: each MoE layer's experts split over the ``ep`` ranks; token slots travel to
the rank that holds their expert and come back, by all-to-all.

    apply_expert_parallel(family.moe.sparse_layers(model), ep_mesh)   # a 1-D DeviceMesh named "ep"

Every expert weight (``Experts.stacked``: ``layers.{i}.moe.experts.{w1,w2,w3}`` ``[E, ...]``) becomes a DTensor
``Shard(0)`` over ``ep``: rank r holds experts ``r * E/ep ... (r + 1) * E/ep - 1``, so checkpoints
(DCP) keep the global ``[E, ...]`` shapes and load onto any ``ep`` degree. Routing, the auxiliary
loss and the dispatch order stay the model's own (meshpar/models/moe/model.py); expert parallelism
fills the slot the model exposes for it, ``Experts.dispatch`` (``ExpertParallelDispatch``), so
names and the model files stay free of parallel code.

Gradients: an expert's weight gradient sums the contributions of every rank's token slots, so
data-parallel averaging divides it by all the data-parallel ranks, not only those it is replicated
over. In a recipe (``parallel.ep``) ep borrows its ranks from ``dp_shard`` (``Mesh.ep``) and
meshpar/parallel/parallelize.py FSDP-shards the experts over the ranks ep leaves with that divide factor;
tests/test_expert_parallel.py also drives it by hand, without FSDP. For users: docs/moe.md.

Limits: tokens dropped by a capacity factor are dropped before dispatch, per rank (per tp slice).

Notes: [Note: expert-parallel dispatch], [Note: the tp ranks are data-parallel for the experts].
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from meshpar.distributed import comm
from meshpar.models.moe.model import Experts, MoE

# [Note: expert-parallel dispatch]
# ``MoE.forward`` hands the experts its slots sorted by expert, ``x[S, D]`` with ``counts[E]``. With
# ``n = ep`` ranks of ``L = E / n`` experts, rank j's experts' rows are one contiguous run of ``x``:
#   counts[E] -> [n, L]         send_splits[j] = rows for rank j's experts
#   all-to-all counts           recv_counts[i, l] = rows rank i sends for my expert l
#   all-to-all x rows           received = [from rank 0: expert 0 | 1 ... L-1][from rank 1: ...]...
#   permute expert-major        [expert 0: from 0 | 1 ...][expert 1: ...]...  (stable: source order)
#   the local experts           experts.compute(received, recv_counts.sum(0), w[L, ...])
#   unpermute, all-to-all back  the rows in x's order, on the rank they came from
# Splits are uneven and read on the host (one sync per layer). Backward is the same exchange
# reversed (``comm.all_to_all_rows`` is an autograd function), so ``meshpar.distributed.comm`` counts
# every call and byte on ``ep``: per layer and pass, a rank sends its rows for other ranks' experts
# (``D * itemsize`` bytes each) and ``n - 1`` counts, inside ``meshpar::moe.dispatch / combine[<layer>]``.

# [Note: the tp ranks are data-parallel for the experts]
# Under tensor parallelism the residual stream between sub-layers is sharded on the sequence
# (``Shard(1)``). A sparse layer routes its rank's slice ``[B, T/tp, D]`` alone (the family's plan:
# meshpar/models/moe/parallelize.py): no all-gather in, no reduce-scatter out, weights not split over
# tp. So the tp ranks see different tokens, as data-parallel ranks do: the router's and the experts'
# gradients sum over them, and meshpar/parallel/parallelize.py FSDP-shards the layer over
# ``dp_shard x tp`` (the experts over ``dp_shard_mod_ep x tp`` under ep; ``Mesh.sparse``), averaging
# over dp only. ``route_over_sequence`` makes the routing statistics (auxiliary loss, token counts,
# aux-free loads) the whole sequence's with one all-reduce of ``2E`` numbers per layer and forward
# (``2BE`` for the sequence-wise loss's per-row statistics);
# its backward is the identity, as every tp rank holds the same loss. cp splits the sequence too
# (experts over ``dp_shard_mod_ep x cp [x tp]``), but each cp rank has its own loss, averaged with
# the others': there the statistics' backward sums as well (``_totals_over_sequence``). Splitting
# the experts over tp instead (Megatron) gathers every token to every tp rank, for weights FSDP shards.


def apply_expert_parallel(layers: Sequence[tuple[int, MoE]], mesh: DeviceMesh) -> None:
    """Split the experts of every ``(block index, MoE layer)`` of ``layers`` (the family's
    ``moe.sparse_layers(model)``) over ``mesh`` (1-D) and route token slots by all-to-all ([Note:
    expert-parallel dispatch]). The layers hold their values (each rank the same), or are on meta."""
    n = mesh.size()
    for layer, moe in layers:
        experts = moe.experts
        if moe.n_experts % n:
            raise ValueError(f"{moe.n_experts} experts do not split over ep = {n} ranks; choose an ep degree that "
                             f"divides the expert count")
        for name in experts.stacked:
            weight = getattr(experts, name)
            sharded = distribute_tensor(weight.detach(), mesh, [Shard(0)])
            setattr(experts, name, nn.Parameter(sharded, requires_grad=weight.requires_grad))
        experts.dispatch = ExpertParallelDispatch(mesh, layer)


class ExpertParallelDispatch:
    """``Experts.dispatch`` over ``ep``: each rank holds ``E / ep`` experts, and token rows go to
    their expert's rank and back by all-to-all ([Note: expert-parallel dispatch])."""

    def __init__(self, mesh: DeviceMesh, layer: int) -> None:
        self.mesh, self.layer = mesh, layer  # layer: the block index, for the collectives' labels

    def __call__(self, experts: Experts, x: Tensor, counts: Tensor) -> Tensor:
        return _dispatch(experts, self.mesh, self.layer, x, counts)


def _dispatch(experts: Experts, mesh: DeviceMesh, layer: int, x: Tensor, counts: Tensor) -> Tensor:
    group, n, dim = mesh.get_group(), mesh.size(), (mesh.mesh_dim_names or ("ep",))[0]
    weights = {name: w.to_local() if isinstance(w, DTensor) else w for name, w in experts.weights().items()}
    local = next(iter(weights.values())).shape[0]  # L experts on this rank
    recv_counts = torch.empty_like(counts)
    comm.all_to_all(recv_counts, counts, [local] * n, [local] * n, group, dim=dim).wait()
    recv_counts = recv_counts.view(n, local)  # [source rank, my expert]
    send_splits = counts.view(n, local).sum(1).tolist()
    recv_splits = recv_counts.sum(1).tolist()
    received = comm.all_to_all_rows(x, recv_splits, send_splits, group, dim=dim,
                                    label=f"moe.dispatch[{layer}]")  # source-major
    # expert-major order, stable in source rank: block (source i, expert l) sorts by l * n + i
    block = (torch.arange(local, device=x.device)[None, :] * n + torch.arange(n, device=x.device)[:, None]).flatten()
    order = block.repeat_interleave(recv_counts.flatten().to(x.device)).argsort(stable=True)
    y = experts.compute(received[order], recv_counts.sum(0), weights)
    return comm.all_to_all_rows(y[order.argsort()], send_splits, recv_splits, group, dim=dim,
                                label=f"moe.combine[{layer}]")


def route_over_sequence(layers: Sequence[tuple[int, MoE]], tp: DeviceMesh | None, cp: DeviceMesh | None) -> None:
    """Each MoE layer's routing statistics over the whole sequence when tp or cp ranks hold slices
    of it: [Note: the tp ranks are data-parallel for the experts], [Note: routing statistics over
    the whole forward]. ``layers``: (block index, MoE layer), the family's ``moe.sparse_layers(model)``."""
    for _, moe in layers:
        moe.totals = SequenceTotals(tp, cp)


class SequenceTotals:
    """``MoE.totals`` when tp or cp ranks hold slices of the sequence: sums over them."""

    def __init__(self, tp: DeviceMesh | None, cp: DeviceMesh | None) -> None:
        self.tp, self.cp = tp, cp

    def __call__(self, counts: Tensor, prob_sum: Tensor, n: int) -> tuple[Tensor, Tensor, int]:
        return _totals_over_sequence(self.tp, self.cp, counts, prob_sum, n)


def _totals_over_sequence(tp: DeviceMesh | None, cp: DeviceMesh | None, counts: Tensor, prob_sum: Tensor,
                          n: int) -> tuple[Tensor, Tensor, int]:
    """Sums over tp, backward the identity (the tp ranks share one loss), then over cp, backward a
    sum too: each cp rank's loss has its own copy of the auxiliary loss and the step averages their
    gradients over cp, so each rank's part must receive every copy's gradient."""
    stats, e = torch.cat([prob_sum, counts.to(prob_sum.dtype)]), counts.shape[0]  # [E] or per row [B, E]
    for mesh, backward_sums in ((tp, False), (cp, True)):
        if mesh is not None:
            stats = _SumOverRanks.apply(stats, mesh.get_group(), mesh.mesh_dim_names[0], backward_sums)
            n *= mesh.size()
    return stats[e:].round().to(counts.dtype), stats[:e], n


class _SumOverRanks(torch.autograd.Function):
    """All-reduce (sum) in forward; in backward the identity, or the same sum (``backward_sums``)."""

    @staticmethod
    def forward(ctx, x: Tensor, group, dim: str, backward_sums: bool) -> Tensor:
        ctx.group, ctx.dim, ctx.backward_sums = group, dim, backward_sums
        out = x.clone()
        comm.all_reduce(out, group, dim=dim).wait()
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        if ctx.backward_sums:
            grad = grad.clone()
            comm.all_reduce(grad, ctx.group, dim=ctx.dim).wait()
        return grad, None, None, None
