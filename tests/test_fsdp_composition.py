"""meshpar's FSDP engine composed with tensor parallelism, CPU offload and int reshard_after_forward.

Each case trains a small model 5 AdamW steps in float64 on a slice of the global batch per
data-parallel rank and compares the loss at every step and every gathered parameter with one
process to 1e-9 (tests/parity.py [Note: parity in float64]); the
TP case also compares placements and local shapes with PyTorch's fully_shard (the two engines'
checkpoints must be interchangeable). The three runs share one 4-rank job (``JOBS``).
"""

import copy
import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from meshpar.distributed import comm_record
from tests.distributed import CaseSet
from tests.parity import TOL, default_dtype

STEPS, BATCH = 5, 8


class MLP(nn.Module):
    def __init__(self, d: int = 6, h: int = 10):
        super().__init__()
        self.w1, self.w2 = nn.Linear(d, h), nn.Linear(h, d)

    def forward(self, x):
        return x + self.w2(torch.relu(self.w1(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(5, 6)
        self.layers = nn.ModuleList([MLP(), MLP(), MLP()])
        self.out = nn.Linear(6, 3)

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def _train(model: nn.Module, ref: nn.Module, dp_rank: int, dp_size: int) -> list[tuple[float, float]]:
    """Returns (mean loss over dp ranks, reference loss) per step."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        x = torch.randn(BATCH, 5, generator=data)
        per_rank = BATCH // dp_size
        loss = model(x[dp_rank * per_rank:(dp_rank + 1) * per_rank]).pow(2).mean()
        loss.backward()
        ref_loss = ref(x).pow(2).mean()
        ref_loss.backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append((total.item() / dist.get_world_size(), ref_loss.item()))
    return losses


def _max_param_diff(model: nn.Module, ref: nn.Module) -> float:
    full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
    return max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items())


@default_dtype()
def _tp_case(engine: str):
    torch.manual_seed(0)
    ref = Net()
    model = copy.deepcopy(ref)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    for layer in model.layers:
        parallelize_module(layer, mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    if engine == "meshpar":
        from meshpar import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    for layer in model.layers:
        fully_shard(layer, mesh=mesh["dp_shard"])
    fully_shard(model, mesh=mesh["dp_shard"])
    layout = {k: (tuple(map(repr, v.placements)), tuple(v.to_local().shape)) for k, v in model.state_dict().items()}
    dp = mesh["dp_shard"]
    # every tp rank of one dp rank sees the same data, so the mean over all ranks is the dp mean
    losses = _train(model, ref, dp.get_local_rank(), dp.size())
    return layout, losses, _max_param_diff(model, ref)


@default_dtype()
def _offload_and_int_reshard_case():
    from meshpar import CPUOffloadPolicy, fully_shard

    out = {}
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp_shard",))
    for name, kwargs in {"offload": dict(offload_policy=CPUOffloadPolicy()),
                         "reshard=2": dict(reshard_after_forward=2),
                         "reshard=1": dict(reshard_after_forward=1)}.items():
        torch.manual_seed(0)
        ref = Net()
        model = copy.deepcopy(ref)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, **kwargs)
        fully_shard(model, mesh=mesh, **kwargs)
        with comm_record.count() as counted:
            losses = _train(model, ref, dist.get_rank(), dist.get_world_size())
        devices = {p.to_local().device.type for p in model.parameters()}
        model(torch.randn(2, 5)).sum().backward()  # leave gradients to look at
        grad_devices = {p.grad.to_local().device.type for p in model.parameters() if p.grad is not None}
        out[name] = (losses, _max_param_diff(model, ref), devices, grad_devices, dict(counted.calls))
    return out


JOBS = CaseSet({"tp_meshpar": (functools.partial(_tp_case, "meshpar"), 4),
                "tp_torch": (functools.partial(_tp_case, "torch"), 4),
                "offload_and_int_reshard": (_offload_and_int_reshard_case, 4)}, timeout=300)


@pytest.mark.parity
def test_fsdp_on_tensor_parallel_params_matches_one_process_and_pytorch():
    ours = JOBS.check("tp_meshpar", 4)[0]
    theirs = JOBS.check("tp_torch", 4)[0]
    layout, losses, diff = ours
    assert layout == theirs[0]  # same placements and local shapes for every parameter
    assert layout["layers.0.w1.weight"] == (("_StridedShard(dim=0, sf=2)", "Shard(dim=0)"), (3, 6))
    assert layout["layers.0.w2.weight"] == (("Shard(dim=0)", "Shard(dim=1)"), (3, 5))
    assert len(losses) == STEPS, losses
    for (loss, ref_loss), (torch_loss, _) in zip(losses, theirs[1], strict=True):
        assert abs(loss - ref_loss) <= TOL * abs(ref_loss)
        assert loss == torch_loss  # the same arithmetic as PyTorch's engine, bit for bit
    assert diff <= TOL


@pytest.mark.parity
def test_cpu_offload_and_int_reshard_after_forward_match_one_process():
    results = JOBS.check("offload_and_int_reshard", 4)[0]
    units = 4  # three layers and the root
    assert results.keys() == {"offload", "reshard=2", "reshard=1"}
    for name, (losses, diff, devices, grad_devices, calls) in results.items():
        assert len(losses) == STEPS, name
        for loss, ref_loss in losses:
            assert abs(loss - ref_loss) <= TOL * abs(ref_loss), name
        assert diff <= TOL, name
        assert devices == grad_devices == {"cpu"}, name
        assert calls[("reduce_scatter", "dp_shard")] == units * STEPS, name
    # int k: forward gathers over all 4 shard ranks, backward within the k-rank group
    # (given explicitly to the root too, so all 4 units re-gather)
    for k in (1, 2):
        calls = results[f"reshard={k}"][4]
        assert calls[("all_gather", "dp_shard")] == units * STEPS
        assert calls[("all_gather", "dp_shard_inner")] == units * STEPS
