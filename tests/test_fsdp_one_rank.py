"""meshpar's FSDP on one data-parallel rank with a cast for compute ([Note: one data-parallel rank]),
in one process: the steady unshard (meshpar/fsdp/unshard.py [Note: the steady cast]) does the same
copies as the full path, so a run with it equals a run without it bit for bit, through what changes
what it keeps: a parameter frozen and unfrozen, ``load_state_dict(assign=True)`` replacing the
sharded parameters, and ``model.to(dtype)``. The run must also have taken the steady path (else it
proved nothing)."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from meshpar.distributed import comm_record
from meshpar.fsdp import MixedPrecisionPolicy, fully_shard
from meshpar.fsdp import unshard as unshardlib
from tests.fsdp_models import NET, shard_units


@pytest.fixture
def mesh():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",))
    finally:
        dist.destroy_process_group()


def _run(mesh, steady: bool, threshold: int = 0) -> tuple[list[float], dict[str, torch.Tensor], int]:
    """(losses, parameters after the last step, unshards the steady path served). ``threshold``: FSDP's
    ``shard_threshold`` under forced collectives, so that units hold sharded parameters, which the
    collective path gathers, beside replicated ones, which are cast."""
    served = [0]
    run = unshardlib._CastPlan.run

    def counted(plan, *args) -> bool:
        done = run(plan, *args)
        served[0] += done
        return done

    with mock.patch.object(unshardlib._CastPlan, "run", counted) if steady else \
            mock.patch.object(unshardlib._CastPlan, "of", classmethod(lambda cls, group: None)), \
            comm_record.force_collectives(threshold > 0):
        model = NET.build().double()
        shard_units(model, fully_shard, mesh=mesh, shard_threshold=threshold,
                    mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float64))
        opt = torch.optim.AdamW(model.parameters(), lr=NET.lr)
        losses = []
        for step in range(8):
            if step == 2:
                model.layers[1].a.weight.requires_grad_(False)
            if step == 3:
                model.layers[1].a.weight.requires_grad_(True)
            if step == 4:  # new sharded parameters: a plan keeps the old ones
                model.load_state_dict({k: v.detach().clone() for k, v in model.state_dict().items()}, assign=True)
                opt = torch.optim.AdamW(model.parameters(), lr=NET.lr)
            if step == 6:  # the compute dtype is the policy's; the parameters' own dtype changes
                model.to(torch.float32)
                opt = torch.optim.AdamW(model.parameters(), lr=NET.lr)
            loss = NET.loss(model, NET.batch(step))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        params = {k: (v.to_local() if isinstance(v, DTensor) else v).detach().clone()
                  for k, v in model.named_parameters()}
    return losses, params, served[0]


@pytest.mark.parametrize("threshold", [0, 20], ids=["one rank", "replicated beside sharded"])
def test_the_steady_cast_equals_the_full_path_bit_for_bit(mesh, threshold):
    losses, params, served = _run(mesh, True, threshold)
    want_losses, want_params, _ = _run(mesh, False, threshold)
    assert losses == want_losses
    assert params.keys() == want_params.keys()
    for name, want in want_params.items():
        assert torch.equal(params[name], want), name
    if threshold == 0:
        assert served >= 8, served  # steady unshards in forward and backward of most steps
    else:  # units of both kinds take the full path (the biases and the gain are replicated, weights sharded)
        assert served == 0, served


@pytest.mark.parametrize("param_dtype", [None, torch.float32], ids=["alias", "cast"])
def test_one_rank_divides_by_the_factor_once(mesh, param_dtype):
    """``set_gradient_divide_factor`` on one rank, through the one-rank hand-over (``_hand_over`` in
    meshpar/fsdp/reduce.py): every unit's gradients are the undivided run's divided by the factor,
    once (4, a power of two: exact in float64). PyTorch 2.13's engine divides a float64 reduction
    by it twice at one rank, so tests/test_fsdp_compat.py compares this one at two ranks only."""
    def grads(factor: float | None) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = NET.build().double()
        shard_units(model, fully_shard, mesh=mesh,
                    mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float64))
        for unit in model.modules():
            if factor is not None and hasattr(unit, "set_gradient_divide_factor"):
                unit.set_gradient_divide_factor(factor)
        batch = tuple(t.double() if t.is_floating_point() else t for t in NET.batch(0))
        NET.loss(model, batch).backward()
        return {k: p.grad.to_local().clone() for k, p in model.named_parameters()}

    plain, divided = grads(None), grads(4.0)
    assert plain.keys() == divided.keys()
    for name, want in plain.items():
        assert want.abs().sum() > 0, name
        assert torch.equal(divided[name], want / 4), name
