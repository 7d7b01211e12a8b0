"""meshpar's AdamW on local shards (meshpar/training/optim.py) against ``torch.optim.AdamW``, in one
process: the steady step ([Note: the steady step]) gives AdamW's bits, skips AdamW's ``_init_group``
once every parameter has its state, and falls back to the whole path whenever what it kept no longer
holds (a missing gradient, a gradient placed otherwise, a loaded state dict). The multi-rank
comparison with FSDP's sharded parameters is tests/test_fsdp.py's optimizer case."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from meshpar.distributed._torch import dtensor_like
from meshpar.training import optim


@pytest.fixture
def mesh():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _params(mesh) -> list[nn.Parameter]:
    torch.manual_seed(0)
    return [nn.Parameter(distribute_tensor(torch.randn(6, 4, dtype=torch.float64), mesh, [Shard(0)])),
            nn.Parameter(distribute_tensor(torch.randn(4, dtype=torch.float64), mesh, [Replicate()])),
            nn.Parameter(torch.randn(3, 2, dtype=torch.float64))]  # a plain tensor beside the DTensors


def _grad(p: torch.Tensor, step: int, i: int, how: str) -> torch.Tensor:
    g = torch.randn(p.shape, dtype=p.dtype, generator=torch.Generator().manual_seed(100 * step + i))
    if not isinstance(p, DTensor):
        return g
    if how == "fsdp":  # built on the parameter's own spec, as meshpar's FSDP builds gradients
        return dtensor_like(g, p)
    return DTensor.from_local(g, p.device_mesh, p.placements)  # placed alike, a spec of its own


@pytest.mark.parametrize("amsgrad", [False, True])
def test_the_steady_step_gives_adamws_bits_and_falls_back_when_it_must(mesh, monkeypatch, amsgrad):
    ours, theirs = _params(mesh), _params(mesh)
    opt = optim.ShardLocalAdamW([{"params": ours[:2], "weight_decay": 0.1}, {"params": ours[2:], "weight_decay": 0}],
                                lr=1e-2, fused=True, amsgrad=amsgrad)
    ref = torch.optim.AdamW([{"params": theirs[:2], "weight_decay": 0.1}, {"params": theirs[2:], "weight_decay": 0}],
                            lr=1e-2, fused=True, amsgrad=amsgrad)
    inits = []
    whole = optim.adam_init_group
    monkeypatch.setattr(optim, "adam_init_group", lambda *a: inits.append(1) or whole(*a))
    # per step: how the gradients are made, and how many groups take the whole path
    plan = [("fsdp", 2), ("fsdp", 0), ("alike", 0), ("missing", 1), ("fsdp", 1), ("load", 2), ("fsdp", 0),
            ("edit", 1), ("fsdp", 0)]
    for step, (how, whole_groups) in enumerate(plan):
        if how == "load":  # a state dict loaded: new state tensors, the kept ones no longer the state
            for o in (opt, ref):
                o.load_state_dict(copy.deepcopy(o.state_dict()))
            how = "fsdp"
        if how == "edit":  # one state tensor replaced in place of the dict
            for o, p in ((opt, ours[2]), (ref, theirs[2])):
                o.state[p]["exp_avg"] = o.state[p]["exp_avg"].clone()
            how = "fsdp"
        inits.clear()
        for i, (p, q) in enumerate(zip(ours, theirs, strict=True)):
            if how == "missing" and i == 0:
                p.grad = q.grad = None
                continue
            p.grad, q.grad = _grad(p, step, i, how), _grad(q, step, i, how)
        opt.step()
        ref.step()
        for i, (p, q) in enumerate(zip(ours, theirs, strict=True)):
            a, b = (t.to_local() if isinstance(t, DTensor) else t for t in (p, q))
            assert torch.equal(a, b), (step, how, i, (a - b).abs().max().item())
        assert len(inits) == whole_groups, (step, how, len(inits))
    for p, q in zip(ours, theirs, strict=True):
        for key, value in ref.state[q].items():
            mine = opt.state[p][key]
            assert type(mine) is type(value), key
            assert torch.equal(*(t.to_local() if isinstance(t, DTensor) else t for t in (mine, value))), key


def test_a_gradient_placed_otherwise_takes_the_whole_path(mesh):
    """A sharded weight whose gradient is replicated: stepped through DTensor's dispatch, as AdamW steps it,
    on every step (the steady step refuses it)."""
    updated = []
    for cls in (torch.optim.AdamW, optim.ShardLocalAdamW):
        torch.manual_seed(0)
        weight = nn.Parameter(distribute_tensor(torch.randn(6, 3, dtype=torch.float64), mesh, [Shard(0)]))
        opt = cls([weight], lr=0.1, fused=True)
        for _ in range(3):
            weight.grad = distribute_tensor(torch.randn(6, 3, dtype=torch.float64), mesh, [Replicate()])
            opt.step()
        updated.append(weight.full_tensor())
    assert torch.equal(*updated)
