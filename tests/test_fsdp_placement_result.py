"""``shard_placement_fn`` returning ``ShardPlacementResult``: several parameter groups in one unit,
meshpar against torch's own ``fully_shard`` ([Note: several parameter groups in one unit] in
meshpar/fsdp/placement.py).

A mixture-of-experts block is one unit whose dense weights shard over all 4 ranks and whose
stacked expert weight shards over a 2-rank mesh (``FSDPMeshInfo`` on a sub-mesh, or
``HSDPMeshInfo`` over 2 replicas x 2 shards). Both engines train it a few AdamW steps; losses,
gradients and every gathered parameter must agree, in float64 at ``tests.parity.TOL`` as the
other drop-in tests assert: the engines run the same collectives, but add in different orders
(one ulp apart in float32 even with one group: tests/parity.py [Note: parity in float64]).
Plus the refusals of the settings that name one collective for a unit (PyTorch's
engine refuses them too), and ``ShardPlacementResult(Shard(1), default mesh)`` behaving as
``Shard(1)``.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo, ShardPlacementResult
from torch.distributed.tensor import Shard

from tests.distributed import CaseSet
from tests.fsdp_compat_models import Record, assert_same_record, engines, subcases
from tests.parity import TOL

D, E_ = 8, 4  # model dim, experts


class MoEBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(D, D)
        self.experts = nn.Parameter(torch.randn(E_, D, D) * 0.2)  # stacked [E, D, D]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.dense(x))  # x[B, D] -> h[B, D]
        return h + torch.einsum("bd,edf->bf", h, self.experts) / E_


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MoEBlock() for _ in range(2))
        self.head = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(16, D, generator=g), torch.randn(16, 1, generator=g)
    rank, world = dist.get_rank(), dist.get_world_size()
    return x.chunk(world)[rank], y.chunk(world)[rank]


def _build(E: ModuleType, fn, **kwargs) -> nn.Module:
    torch.manual_seed(0)
    model = Net()
    for layer in model.layers:
        E.fully_shard(layer, mesh=_MESHES["dense"], shard_placement_fn=fn, **kwargs)
    return E.fully_shard(model, mesh=_MESHES["dense"], **kwargs)


def _train(E: ModuleType, fn, steps: int = 3, **kwargs) -> Record:
    model, record = _build(E, fn, **kwargs), Record()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for i in range(steps):
        x, y = _batch(i)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        record.loss(str(i), loss)
        record.grads(str(i), model)
        opt.step()
        opt.zero_grad()
    record.params("end", model)
    return record


_MESHES: dict = {}


def _experts_fn(kind: str):
    info = {"fsdp": _MESHES["experts_fsdp"], "hsdp": _MESHES["experts_hsdp"]}[kind]
    return lambda p: ShardPlacementResult(None, info) if p.ndim == 3 else None


def _setup(tmp: Path) -> None:
    del tmp
    torch.set_default_dtype(torch.float64)
    _MESHES["dense"] = init_device_mesh("cpu", (4,), mesh_dim_names=("dp_shard",))
    ep = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep_replicate", "ep_shard"))
    _MESHES["experts_fsdp"] = FSDPMeshInfo(ep["ep_shard"], shard_mesh_dim=0)
    _MESHES["experts_hsdp"] = HSDPMeshInfo(ep, shard_mesh_dim=1, replicate_mesh_dim=0)
    _MESHES["dense_info"] = FSDPMeshInfo(_MESHES["dense"], shard_mesh_dim=0)


def _same(kind: str, **kwargs) -> None:
    ref, ours = engines()
    fn = _experts_fn(kind)
    assert_same_record(_train(ours, fn, **kwargs), _train(ref, fn, **kwargs), TOL, f"{kind} {kwargs}")


def _case_two_meshes(_: None = None) -> None:
    """Dense over 4 ranks, experts over 2 (alone, or hybrid over 2 x 2); an int reshard_after_forward
    gathers the dense group in pairs and reshards the experts fully (2 is their whole shard size)."""
    subcases({"fsdp": lambda: _same("fsdp"), "hsdp": lambda: _same("hsdp"),
              "hsdp, reshard_after_forward=2": lambda: _same("hsdp", reshard_after_forward=2)})


def _case_groups(_: None = None) -> None:
    """Two groups in first-seen order, each parameter on its own mesh."""
    _, ours = engines()
    model = _build(ours, _experts_fn("hsdp"))
    groups = model.layers[0]._fsdp_state.groups
    # the block's own parameter (experts) is seen first, then dense's weight and bias
    assert [(len(g.params), g.world, g.mesh_info.replicate_size) for g in groups] == [(1, 2, 2), (2, 4, 1)]
    assert len(model._fsdp_state.groups) == 1


def _case_refusals(_: None = None) -> None:
    """The three settings PyTorch refuses on a unit of several groups, refused by both engines."""
    calls = {"set_custom_all_gather": lambda m: m.set_custom_all_gather(object()),
             "set_custom_reduce_scatter": lambda m: m.set_custom_reduce_scatter(object()),
             "set_all_reduce_hook": lambda m: m.set_all_reduce_hook(lambda t: None)}
    for E in engines():
        block = _build(E, _experts_fn("fsdp")).layers[0]
        for name, call in calls.items():
            with pytest.raises(ValueError) as e:
                call(block)
            if E.__name__.startswith("meshpar"):
                assert name in str(e.value) and "2 parameter groups" in str(e.value), str(e.value)
                assert "unit of their own" in str(e.value)


def _case_shard1_on_default_mesh(_: None = None) -> None:
    """``ShardPlacementResult(Shard(1), <the default mesh>)`` for every parameter: one group, as Shard(1)."""
    ref, ours = engines()
    info = _MESHES["dense_info"]

    def result(p):
        return ShardPlacementResult(Shard(1) if p.ndim > 1 else None, info)

    def plain(p):
        return Shard(1) if p.ndim > 1 else None

    got = _train(ours, result)
    assert_same_record(got, _train(ref, result), TOL, "Shard(1) result: meshpar vs torch")
    assert_same_record(got, _train(ours, plain), TOL, "Shard(1) result vs Shard(1)")
    model = _build(ours, result)
    assert len(model.layers[0]._fsdp_state.groups) == 1
    assert model.layers[0].dense.weight.placements == (Shard(1),)


CASES = CaseSet({
    "groups": (_case_groups, 4),
    "two_meshes": (_case_two_meshes, 4),
    "refusals": (_case_refusals, 4),
    "shard1_on_default_mesh": (_case_shard1_on_default_mesh, 4),
}, setup=_setup, timeout=300)


@pytest.mark.parity
@pytest.mark.parametrize(("case", "world"), CASES.params())
def test_placement_result_matches_torch(case, world):
    CASES.check(case, world)
