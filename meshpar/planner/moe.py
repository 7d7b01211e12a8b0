"""A mixture-of-experts step on fake tensors: balanced routing, in the planner's own model only.

    balance_routing(family.moe.sparse_layers(stage))   # the planner's stage, built on meta
    train_step(...)            # inside simulate()'s FakeTensorMode

Limits: the planned memory is a balanced step's. A real step's busiest expert holds more rows than
the mean (its grouped-matmul activations grow with its load, and under ep its rank receives more):
raise ``capacity_factor`` to bound it, or leave headroom for it.

Notes: [Note: the planner routes tokens evenly].
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from meshpar.distributed import comm
from meshpar.models.moe import model as moelib
from meshpar.parallel import expert_parallel as eplib

# [Note: the planner routes tokens evenly]
# ``MoE.forward`` (meshpar/models/moe/model.py) sizes its dispatch by the router's choices: a
# ``torch.bincount`` of the chosen experts, whose splits the loop kernel and the expert-parallel
# all-to-all read on the host. Fake tensors have no values, so the planner assumes the balanced
# routing the load-balancing loss aims at: each expert gets ``N * top_k / E`` of a forward's token
# slots (the remainder to the first experts); each ep rank sends ``1/ep`` of its slots to every rank.
# The routing itself (router matmul, softmax, top-k, gate weights, the sort, the auxiliary loss) runs
# unchanged; only what reads values is replaced, through the layers' slots: ``MoE.slots`` counts
# balanced slots and keeps every slot at a capacity drop (balanced loads never exceed a capacity
# factor >= 1); ``Experts.dispatch`` runs the grouped matmul as one ``bmm`` over ``[E, S/E, D]`` when
# E divides S (it saves x and w, as CUDA's grouped kernel does; the CPU loop's ``cat`` would add a
# copy no GPU makes), else a loop on the balanced splits, and under ep the same two all-to-alls
# (counted on ``ep`` by ``meshpar.distributed.comm``) and permutations, on those splits.


def _balanced(slots: int, experts: int) -> list[int]:
    """``slots`` token slots over ``experts``, as evenly as integers allow (first ones one more)."""
    base, extra = divmod(slots, experts)
    return [base + (e < extra) for e in range(experts)]


class _BalancedSlots(moelib.ChosenSlots):
    """Balanced counts; no slot over capacity."""

    def count(self, flat: Tensor, n_experts: int) -> Tensor:
        return torch.tensor(_balanced(flat.numel(), n_experts), dtype=torch.long, device=flat.device)

    def drop_over_capacity(self, order: Tensor, flat: Tensor, counts: Tensor, capacity: int) -> tuple[Tensor, Tensor]:
        return order, counts


def _grouped_mm(x: Tensor, w: Tensor, counts: Tensor, kernel: str = "auto") -> Tensor:
    """x[S, D] @ w[E, D, N] per balanced run -> [S, N] (``counts`` is not read)."""
    s, e = x.shape[0], w.shape[0]
    if s % e == 0:  # x[E, S/E, D] @ w[E, D, N] -> [E, S/E, N]
        return torch.bmm(x.view(e, s // e, x.shape[1]), w).view(s, w.shape[2])
    runs = x.split(_balanced(s, e))
    return torch.cat([run @ w[i] for i, run in enumerate(runs)])


class _BalancedLocalExperts(moelib.LocalExperts):
    """``LocalExperts`` on balanced runs."""

    def __call__(self, experts: moelib.Experts, x: Tensor, counts: Tensor) -> Tensor:
        return experts.compute(x, counts, experts.weights(), mm=_grouped_mm)


class _BalancedDispatch(eplib.ExpertParallelDispatch):
    """``ExpertParallelDispatch`` with balanced splits: the same collectives and copies."""

    def __call__(self, experts: moelib.Experts, x: Tensor, counts: Tensor) -> Tensor:
        return _dispatch(experts, self.mesh, self.layer, x, counts)


def _dispatch(experts: moelib.Experts, mesh, layer: int, x: Tensor, counts: Tensor) -> Tensor:
    group, n, dim = mesh.get_group(), mesh.size(), (mesh.mesh_dim_names or ("ep",))[0]
    weights = {name: w.to_local() if isinstance(w, DTensor) else w for name, w in experts.weights().items()}
    local = next(iter(weights.values())).shape[0]
    recv_counts = torch.empty_like(counts)
    comm.all_to_all(recv_counts, counts, [local] * n, [local] * n, group, dim=dim).wait()
    splits = _balanced(x.shape[0], n)  # sent to each rank; received from each, as many
    received = comm.all_to_all_rows(x, splits, splits, group, dim=dim, label=f"moe.dispatch[{layer}]")
    order = torch.arange(received.shape[0], device=x.device).flip(0)  # a permutation, as the real one
    y = experts.compute(received[order], recv_counts.view(n, local).sum(0), weights, mm=_grouped_mm)
    return comm.all_to_all_rows(y[order.argsort()], splits, splits, group, dim=dim, label=f"moe.combine[{layer}]")


def balance_routing(layers: Sequence[tuple[int, moelib.MoE]]) -> None:
    """Fill the slots of the MoE layers ``layers`` (the family's ``moe.sparse_layers(stage)``) for [Note:
    the planner routes tokens evenly]. For the planner's own model: a stage built for the simulation
    and dropped after it."""
    for _, moe in layers:
        moe.slots = _BalancedSlots()
        ep = moe.experts.dispatch
        if isinstance(ep, eplib.ExpertParallelDispatch):  # as expert parallelism filled it
            moe.experts.dispatch = _BalancedDispatch(ep.mesh, ep.layer)
        else:
            moe.experts.dispatch = _BalancedLocalExperts()
