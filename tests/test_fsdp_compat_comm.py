"""meshpar.fsdp against torch.distributed.fsdp: communication and layout.

The second half of the compatibility suite (tests/test_fsdp_compat.py holds the first and
says how it works): gradient accumulation under every combination of the accumulation
switches, HSDP made by an all-reduce hook, ``shard_placement_fn`` layouts and their
checkpoints moved between engines, user-supplied all-gather / reduce-scatter
(``set_custom_all_gather`` / ``set_custom_reduce_scatter``), and ``dp_mesh_dims`` (parameters
that are DTensors on the full SPMD mesh). Each scenario runs under torch's engine, then
meshpar's, on the same ranks; torch's is the reference. Float64, ``tests.parity.TOL``.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from types import ModuleType

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from tests.distributed import CaseSet
from tests.fsdp_compat_models import (
    Ctx,
    Record,
    assert_same_record,
    both,
    build,
    each,
    engines,
    scenario_case,
    setup,
    shard_blocks,
    subcases,
    train,
    train_accumulating,
)
from tests.fsdp_models import Net
from tests.parity import TOL


# --- 9. gradient accumulation: every combination of the accumulation switches ------------------------------
def _accumulation(E: ModuleType, ctx: Ctx, switches: tuple[tuple[str, bool], ...]) -> Record:
    """Three microbatches per step; ``switches`` on the first two, all True on the last."""
    rec, early = Record(), dict(switches)
    model = shard_blocks(E, build(Net), ctx.mesh)

    def switch(last: bool) -> None:
        model.set_requires_gradient_sync(last or early["sync"])
        if "all_reduce" in early:  # after requires_gradient_sync, which sets both
            model.set_requires_all_reduce(last or early["all_reduce"])
        if "reshard" in early:
            model.set_reshard_after_backward(last or early["reshard"])
        if early.get("is_last"):
            model.set_is_last_backward(last)

    train_accumulating(model, rec, switch)
    return rec


def _case_accumulation(ctx: Ctx) -> None:
    # 1-D: sync x reshard-after-backward x is-last-backward; HSDP 2x2: reduce-scatter only (no
    # all-reduce) on the early microbatches, or no sync at all
    names = ("sync", "reshard", "is_last") if ctx.world == 2 else ("sync", "all_reduce")
    combos = [tuple(zip(names, values, strict=True)) for values in itertools.product((False, True), repeat=len(names))]
    each(_accumulation, ctx, tuple(combos))


# --- 10. set_all_reduce_hook: HSDP made by the user, against native HSDP ------------------------------------
def _all_reduce_hook(E: ModuleType, ctx: Ctx, native: bool) -> Record:
    rec = Record()
    model = build(Net)
    if native:
        shard_blocks(E, model, ctx.mesh)
    else:  # FSDP over dp_shard; the hook averages the reduced shards over dp_replicate
        replicas = ctx.mesh["dp_replicate"]

        def hook(grad: torch.Tensor) -> None:
            dist.all_reduce(grad, group=replicas.get_group())
            grad.div_(replicas.size())

        shard_blocks(E, model, ctx.mesh["dp_shard"])
        for module in model.modules():
            if isinstance(module, E.FSDPModule):
                module.set_all_reduce_hook(hook)
    train(model, rec, "hsdp", grads=False)
    return rec


def _case_all_reduce_hook(ctx: Ctx) -> None:
    subcases({"user-made HSDP": lambda: both(_all_reduce_hook, ctx, False),
               "native HSDP": lambda: both(_all_reduce_hook, ctx, True),
               "user-made vs native, torch": lambda: _user_vs_native(ctx, engines()[0]),
               "user-made vs native, meshpar": lambda: _user_vs_native(ctx, engines()[1])})


def _user_vs_native(ctx: Ctx, E: ModuleType) -> None:
    user, native = _all_reduce_hook(E, ctx, False), _all_reduce_hook(E, ctx, True)
    # the same averages either way; only the placements differ ((Shard(0),) vs (Replicate(), Shard(0)))
    values = lambda r: Record({k: v for k, v in r.items() if not k.endswith(".layout")})
    assert_same_record(values(user), values(native), TOL, f"{E.__name__}: user-made HSDP vs native HSDP")




# --- 14. shard_placement_fn; checkpoints between engines with such placements ---------------------------
def _placement(kind: str, world: int) -> Callable[[nn.Parameter], Shard | None]:
    if kind == "dim 1":  # Shard(1) where dim 1 divides the world, else None: torch's default Shard(0)
        return lambda p: Shard(1) if p.ndim == 2 and p.shape[1] % world == 0 else None
    # the largest dim, where sharding it is even (a nonzero dim must be), else None
    return lambda p: Shard(d) if (d := max(range(p.ndim), key=lambda i: p.shape[i])) == 0 \
        or p.shape[d] % world == 0 else None


def _shard_placement_fn(E: ModuleType, ctx: Ctx, kind: str) -> Record:
    rec = Record()
    model = build(Net)
    shard_blocks(E, model, ctx.mesh, shard_placement_fn=_placement(kind, ctx.world))
    rec["local shapes"] = [(n, tuple(p.to_local().shape)) for n, p in model.named_parameters()]
    train(model, rec, kind)
    return rec


def _dcp_moves(model: nn.Module, fresh: nn.Module, path: str, what: str) -> None:
    """Save ``model`` with DCP, load it into ``fresh`` (another engine, other initial values): the
    same parameters, bit for bit."""
    dcp.save(model.state_dict(), checkpoint_id=path)
    sd = fresh.state_dict()
    dcp.load(sd, checkpoint_id=path)
    fresh.load_state_dict(sd)
    want, got = Record(), Record()
    want.params("p", model)
    got.params("p", fresh)
    assert_same_record(got, want, 0.0, what)


def _dcp_between(src: ModuleType, dst: ModuleType, ctx: Ctx, path: str) -> None:
    """A trained model under ``src`` (dim-1 placements) into a fresh one under ``dst``."""
    fn = _placement("dim 1", ctx.world)
    model = shard_blocks(src, build(Net), ctx.mesh, shard_placement_fn=fn)
    train(model, Record(), "src", steps=1, grads=False)
    fresh = shard_blocks(dst, build(Net, seed=1), ctx.mesh, shard_placement_fn=fn)
    _dcp_moves(model, fresh, path, f"dcp from {src.__name__} to {dst.__name__}")


def _case_shard_placement_fn(ctx: Ctx) -> None:
    ref, ours = engines()
    subcases({**{kind: functools.partial(both, _shard_placement_fn, ctx, kind) for kind in ("dim 1", "largest dim")},
               "dcp torch -> meshpar": lambda: _dcp_between(ref, ours, ctx, str(ctx.tmp / "torch_to_meshpar")),
               "dcp meshpar -> torch": lambda: _dcp_between(ours, ref, ctx, str(ctx.tmp / "meshpar_to_torch"))})


# --- user-supplied collectives ----------------------------------------------------------------------------
class _AllGather:
    """torch's ``AllGather`` interface (``allocate``, then a call) over torch.distributed, counting calls."""

    def __init__(self) -> None:
        self.calls = 0

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, async_op: bool = False):
        self.calls += 1
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


class _ReduceScatter(_AllGather):
    """torch's ``ReduceScatter`` interface; honours the reduce op it is given."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op, async_op: bool = False):
        self.calls += 1
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def _custom_comms(E: ModuleType, ctx: Ctx) -> Record:
    rec = Record()
    model = shard_blocks(E, build(Net), ctx.mesh)
    gathers, scatters = [], []
    for module in model.modules():
        if isinstance(module, E.FSDPModule):
            gathers.append(_AllGather())
            scatters.append(_ReduceScatter())
            module.set_custom_all_gather(gathers[-1])
            module.set_custom_reduce_scatter(scatters[-1])
    train(model, rec, "custom")
    rec["all-gathers per unit"] = [g.calls for g in gathers]
    rec["reduce-scatters per unit"] = [s.calls for s in scatters]
    return rec


# --- dp_mesh_dims: parameters that are DTensors on the full SPMD mesh ----------------------------------------
_SPMD = {"(dp_shard, tp)": ("dp_shard", "tp"), "(tp, dp_shard)": ("tp", "dp_shard"),
         "(dp_replicate, dp_shard)": ("dp_replicate", "dp_shard")}


@functools.cache
def _spmd_mesh(names: tuple[str, str]) -> DeviceMesh:
    """One mesh object per layout for both engines: torch's engine caches its mesh info by mesh
    equality and then insists the parameters' mesh is the very object it cached."""
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=names)


def _spmd_model(E: ModuleType, names: tuple[str, str], seed: int = 0) -> nn.Module:
    """A column-parallel then a row-parallel Linear as DTensors on a 2x2 mesh (tp, where it has one,
    splits 6 rows into 3, which dp_shard splits unevenly), fully sharded with ``dp_mesh_dims``."""
    mesh = _spmd_mesh(names)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    for layer, weight, bias in ((model[0], Shard(0), Shard(0)), (model[2], Shard(1), Replicate())):
        for name, placement in (("weight", weight), ("bias", bias)):
            placements = [placement if n == "tp" else Replicate() for n in names]
            setattr(layer, name, nn.Parameter(distribute_tensor(getattr(layer, name).detach(), mesh, placements)))
    dims = E.DataParallelMeshDims(shard="dp_shard", replicate="dp_replicate" if "dp_replicate" in names else None)
    E.fully_shard(model[0], mesh=mesh, dp_mesh_dims=dims)
    return E.fully_shard(model, mesh=mesh, dp_mesh_dims=dims)


def _spmd_train(model: nn.Module, names: tuple[str, str], rec: Record, steps: int = 3) -> None:
    """AdamW on a batch sharded over the data-parallel dims; loss = mean square of the full output."""
    mesh = _spmd_mesh(names)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = [Shard(0) if n.startswith("dp") else Replicate() for n in names]
    for step in range(steps):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        loss = (model(distribute_tensor(x, mesh, batch)).full_tensor() ** 2).mean()
        loss.backward()
        rec.loss(str(step), loss)
        rec.grads(str(step), model)
        opt.step()
        opt.zero_grad()
    rec.params("end", model)


def _spmd(E: ModuleType, ctx: Ctx, layout: str) -> Record:
    rec = Record()
    _spmd_train(_spmd_model(E, _SPMD[layout]), _SPMD[layout], rec)
    return rec


def _spmd_dcp(src: ModuleType, dst: ModuleType, ctx: Ctx, path: str) -> None:
    """A trained (dp_shard, tp) model (StridedShard placements) under ``src`` into a fresh one under ``dst``."""
    names = _SPMD["(dp_shard, tp)"]
    model = _spmd_model(src, names)
    _spmd_train(model, names, Record(), steps=1)
    _dcp_moves(model, _spmd_model(dst, names, seed=1), path, f"dcp from {src.__name__} to {dst.__name__}")


def _case_dp_mesh_dims(ctx: Ctx) -> None:
    ref, ours = engines()
    subcases({**{layout: functools.partial(both, _spmd, ctx, layout) for layout in _SPMD},
              "dcp torch -> meshpar": lambda: _spmd_dcp(ref, ours, ctx, str(ctx.tmp / "spmd_torch_to_meshpar")),
              "dcp meshpar -> torch": lambda: _spmd_dcp(ours, ref, ctx, str(ctx.tmp / "spmd_meshpar_to_torch"))})


# --- an int reshard_after_forward on fully_shard's default mesh --------------------------------------------
def _int_reshard_default_mesh(E: ModuleType, ctx: Ctx, steps: str) -> Record:
    """``reshard_after_forward=2`` with no ``mesh`` (every rank of the default group, a 1-D mesh
    without dim names): backward all-gathers within pairs of ranks. ``steps`` "accumulating": three
    microbatches a step, gradient sync on the last only, as accumulation scripts run it."""
    rec = Record()
    model = build(Net)
    for block in model.layers:
        E.fully_shard(block, reshard_after_forward=2)
    E.fully_shard(model)
    if steps == "accumulating":
        train_accumulating(model, rec, lambda last: model.set_requires_gradient_sync(last))
    else:
        train(model, rec, "k=2")
    return rec


# --- the jobs ----------------------------------------------------------------------------------------------
CASES = CaseSet({
    "accumulation": (_case_accumulation, (2, 4)),
    "all_reduce_hook": (_case_all_reduce_hook, 4),
    "shard_placement_fn": (_case_shard_placement_fn, 2),
    "custom_comms": (scenario_case(_custom_comms), 2),
    "dp_mesh_dims": (_case_dp_mesh_dims, 4),
    "int_reshard_default_mesh": (scenario_case(_int_reshard_default_mesh, "one batch a step", "accumulating"), 4),
}, setup=setup, timeout=300)


@pytest.mark.parity
@pytest.mark.parametrize(("case", "world"), CASES.params())
def test_matches_torch_fsdp(case, world):
    CASES.check(case, world)
