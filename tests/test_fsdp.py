"""meshpar's FSDP engine against a single-process reference, at 1, 2 and 4 gloo ranks.

Parity (STYLE #13): the same model, seed and global batch; each rank trains on its slice
(mean loss per rank, gradients averaged over the data-parallel world by the engine); after
five AdamW steps in float64 the loss of every step and every gathered parameter match the
reference to 1e-9 (``fsdp_models.assert_parity``; tests/parity.py [Note: parity in float64]),
and ``test_parity_catches_planted_bugs`` shows that a wrong gradient fails that. Mixed
precision (bf16 compute, fp32 masters) is measured bit for bit against
PyTorch's own ``fully_shard`` instead, and checkpoints are moved between the two engines.

Process start-up dominates on two cores, so every case runs inside one spawned job per
world size (``CASES``, a tests/distributed.py ``CaseSet``); each ``test_*`` below reads its
case's outcome from that job and fails with every rank's traceback. Models and the training loop: tests/fsdp_models.py.
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecision
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.testing import assert_close
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from meshpar.distributed import comm, comm_record
from meshpar.fsdp import DataParallelMeshDims, FSDPModule, MixedPrecisionPolicy, fully_shard
from meshpar.fsdp.param_group import ParamGroup
from meshpar.fsdp.reduce import Reducer
from meshpar.fsdp.sharded_param import ShardedParam
from meshpar.models.gpt2.model import GPT2
from meshpar.training.optim import ShardLocalAdamW
from tests.distributed import CaseSet
from tests.fsdp_models import (
    GPT,
    HIDDEN,
    IN,
    NET,
    TINY_GPT2,
    Block,
    Net,
    assert_parity,
    chunk_numel,
    gather_params,
    local_slice,
    shard_units,
    train,
    unit_params,
)
from tests.helpers import build_model
from tests.parity import TOL, default_dtype, must_fail

ELEM = torch.float64.itemsize  # bytes per element: the jobs run in float64 (see _setup)


@dataclass
class Ctx:
    rank: int
    world: int
    mesh: DeviceMesh  # 1-D over every rank, named dp_shard
    tmp: Path  # shared by the ranks of one job


def _comm(ctx: Ctx, expected: dict) -> dict:
    """Expected per-(collective, dim) figures: with one data-parallel rank the engine aliases the
    shard and issues no all-gather or reduce-scatter ([Note: one data-parallel rank])."""
    if ctx.world > 1:
        return expected
    return {key: v for key, v in expected.items() if key[0] not in ("all_gather", "reduce_scatter")}


def _n(ctx: Ctx, calls: int) -> int:
    """An all-gather or reduce-scatter count: none with one data-parallel rank."""
    return calls if ctx.world > 1 else 0


def _expected_local(full: torch.Tensor, index: int, n: int) -> torch.Tensor:
    """Shard ``index`` of ``n`` as torch.chunk cuts dim 0 (empty past the last chunk)."""
    chunks = torch.chunk(full, n)
    return chunks[index] if index < len(chunks) else full[:0]


def _assert_layout(model: nn.Module, ref: nn.Module, placements: tuple, index: int, n: int) -> None:
    """Every parameter is an nn.Parameter(DTensor) with ``placements`` whose local tensor is
    torch.chunk shard ``index`` of ``n`` of the reference's value."""
    for name, ref_p in ref.named_parameters():
        p = model.get_parameter(name)
        assert isinstance(p, nn.Parameter) and isinstance(p, DTensor), f"{name} is a {type(p).__name__}"
        _eq(tuple(p.placements), placements, f"{name} placements")
        _eq((p.shape, p.dtype), (ref_p.shape, ref_p.dtype), f"{name} global shape and dtype")
        assert_close(p.to_local(), _expected_local(ref_p.detach(), index, n), rtol=0, atol=0, msg=name)


def _expected_bytes(model: nn.Module, world: int, units: list[int], times: list[int] | None = None) -> int:
    """Per-rank bytes of gathering (or reduce-scattering) ``units`` of ``unit_params(model)``
    ``times`` each: per rank, each parameter's torch.chunk rows, (N-1) peers, float64."""
    groups = unit_params(model)
    times = times or [1] * len(units)
    return sum(k * sum(chunk_numel(p, world) for p in groups[u]) * (world - 1) * ELEM
               for u, k in zip(units, times, strict=True))


def _eq(got, want, what: str) -> None:
    assert got == want, f"{what}: got {got!r}, want {want!r}"


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str, tol: float = 0.0) -> None:
    assert got.keys() == want.keys(), (what, sorted(got), sorted(want))
    assert want, f"{what}: nothing to compare"
    for key, t in want.items():
        assert_close(got[key], t, rtol=tol, atol=tol, msg=lambda m, key=key: f"{what}, {key}: {m}")


# --- 1. uneven shapes, nested units, root only --------------------------------------------------------
def _case_units(ctx: Ctx) -> None:
    for layout in ("nested", "root only", "three levels"):
        ref = NET.build()
        model = copy.deepcopy(ref)
        if layout == "nested":
            shard_units(model, fully_shard, mesh=ctx.mesh)
        elif layout == "root only":
            fully_shard(model, mesh=ctx.mesh)
        else:
            for block in model.layers:
                fully_shard(block.a, mesh=ctx.mesh)
                fully_shard(block, mesh=ctx.mesh)
            fully_shard(model, mesh=ctx.mesh)
        _assert_layout(model, ref, (Shard(0),), ctx.rank, ctx.world)
        assert_parity(model, ref, train(model, ref, NET))


# --- 2. reshard_after_forward ---------------------------------------------------------------------------
def _case_reshard_after_forward(ctx: Ctx) -> None:
    for bad in (3, 0):  # 3 divides none of 1, 2, 4
        with pytest.raises(ValueError, match=rf"reshard_after_forward={bad}\b.*shard group size {ctx.world}"):
            fully_shard(Block(), mesh=ctx.mesh, reshard_after_forward=bad)
    # Valid ints are implemented: backward all-gathers within groups of k neighbouring ranks.
    valid = [k for k in (1, 2, 4) if ctx.world % k == 0]
    # None (the default) reshards every unit but the root; an explicit value applies to the root too.
    for raf in (None, True, False, *valid):
        ref = NET.build()
        model = copy.deepcopy(ref)
        units = shard_units(model, fully_shard, mesh=ctx.mesh, reshard_after_forward=raf)
        run = train(model, ref, NET)
        assert_parity(model, ref, run)
        for c in run.steps:
            if raf is False:
                assert c.calls == _comm(ctx, {("all_gather", "dp_shard"): units,
                                              ("reduce_scatter", "dp_shard"): units}), c.calls
            elif raf is None:
                assert c.calls == _comm(ctx, {("all_gather", "dp_shard"): 2 * units - 1,
                                              ("reduce_scatter", "dp_shard"): units}), c.calls
            elif raf is True or raf == ctx.world:
                assert c.calls == _comm(ctx, {("all_gather", "dp_shard"): 2 * units,
                                              ("reduce_scatter", "dp_shard"): units}), c.calls
            else:  # forward gathers over dp_shard; backward within k ranks
                assert c.calls == {("all_gather", "dp_shard"): units, ("all_gather", "dp_shard_inner"): units,
                                   ("reduce_scatter", "dp_shard"): units}, (raf, c.calls)
                every = sum(chunk_numel(p, ctx.world) for b in unit_params(ref) for p in b)
                _eq(c.bytes[("all_gather", "dp_shard_inner")], every * (ctx.world // raf) * (raf - 1) * ELEM,
                    f"backward all-gather bytes, reshard_after_forward={raf}")


# --- 3. hybrid 2x2 --------------------------------------------------------------------------------------
def _case_hybrid(ctx: Ctx) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    shard_rank = mesh.get_local_rank("dp_shard")
    for task, raf in ((NET, True), (NET, False), (GPT, True)):
        ref = task.build()
        model = copy.deepcopy(ref)
        units = shard_units(model, fully_shard, mesh=mesh, reshard_after_forward=raf)
        _assert_layout(model, ref, (Replicate(), Shard(0)), shard_rank, 2)
        assert all(p.device_mesh == mesh for p in model.parameters())
        run = train(model, ref, task)
        assert_parity(model, ref, run)
        if task is NET:
            gathers = [2] * units if raf else [1] * units
            for c in run.steps:
                assert c.calls == {("all_gather", "dp_shard"): sum(gathers), ("reduce_scatter", "dp_shard"): units,
                                   ("all_reduce", "dp_replicate"): units}, c.calls
                _eq(c.bytes[("all_gather", "dp_shard")], _expected_bytes(ref, 2, [0, 1, 2, 3], gathers), "gathers")
                _eq(c.bytes[("reduce_scatter", "dp_shard")], _expected_bytes(ref, 2, [0, 1, 2, 3]), "reductions")
                # the reduced shard, all-reduced over 2 replicas: 2 * numel * (2-1)/2
                _eq(c.bytes[("all_reduce", "dp_replicate")], _expected_bytes(ref, 2, [0, 1, 2, 3]), "replicas")


# --- 4. gradient accumulation without sync ---------------------------------------------------------------
def _case_accumulation(ctx: Ctx) -> None:
    for k, threshold in ((2, 0), (2, 20), *(((4, 0),) if ctx.world <= 2 else ())):
        ref = NET.build()
        model = copy.deepcopy(ref)
        units = shard_units(model, fully_shard, mesh=ctx.mesh, shard_threshold=threshold)
        run = train(model, ref, NET, accumulate=k)
        assert_parity(model, ref, run)
        for step, micro in zip(run.steps, run.micro, strict=True):
            for c in micro[:-1]:
                assert c.total_calls("reduce_scatter") == 0 and c.total_calls("all_reduce") == 0, c.calls
            assert micro[-1].calls[("reduce_scatter", "dp_shard")] == _n(ctx, units), micro[-1].calls
            assert step.calls[("reduce_scatter", "dp_shard")] == _n(ctx, units), step.calls
            # with a threshold every unit also has small replicated parameters: one all-reduce each
            assert step.total_calls("all_reduce") == (units if threshold else 0), step.calls


# --- 5. communication accounting ----------------------------------------------------------------------
# Per step of Net (3 blocks + root = 4 units): (all_gather calls, all_gather bytes, reduce_scatter bytes).
# Per rank padded numel: block 130 / root 44 at 2 ranks, block 75 / root 29 at 4 ranks.
_ACCOUNTING = {
    True: {1: (8, 0, 0), 2: (8, 2 * (3 * 130 + 44) * 1 * ELEM, (3 * 130 + 44) * 1 * ELEM),
           4: (8, 2 * (3 * 75 + 29) * 3 * ELEM, (3 * 75 + 29) * 3 * ELEM)},
    False: {1: (4, 0, 0), 2: (4, (3 * 130 + 44) * 1 * ELEM, (3 * 130 + 44) * 1 * ELEM),
            4: (4, (3 * 75 + 29) * 3 * ELEM, (3 * 75 + 29) * 3 * ELEM)},
}


def _case_comm_accounting(ctx: Ctx) -> None:
    for raf in (True, False):
        ref = NET.build()
        model = copy.deepcopy(ref)
        units = shard_units(model, fully_shard, mesh=ctx.mesh, reshard_after_forward=raf)
        calls, gather_bytes, reduce_bytes = _ACCOUNTING[raf][ctx.world]
        _eq(calls, 2 * units if raf else units, "the table's all-gather calls")
        gathers = [2 if raf else 1] * units  # the root too, given reshard_after_forward=True explicitly
        _eq(gather_bytes, _expected_bytes(ref, ctx.world, list(range(units)), gathers), "the table's gather bytes")
        _eq(reduce_bytes, _expected_bytes(ref, ctx.world, list(range(units))), "the table's reduce bytes")
        run = train(model, ref, NET)
        assert_parity(model, ref, run)
        for c in run.steps:
            assert c.calls == _comm(ctx, {("all_gather", "dp_shard"): calls,
                                          ("reduce_scatter", "dp_shard"): units}), c.calls
            assert c.bytes == _comm(ctx, {("all_gather", "dp_shard"): gather_bytes,
                                          ("reduce_scatter", "dp_shard"): reduce_bytes}), c.bytes


def _case_nested_counts(ctx: Ctx) -> None:
    """A ``comm_record.count()`` inside another (a step's around a microbatch's) leaves both counting."""
    t, group = torch.ones(1), ctx.mesh.get_group()
    with comm_record.count() as outer:
        with comm_record.count() as inner:
            comm.all_reduce(t, group, dim="dp_shard")
        comm.all_reduce(t, group, dim="dp_shard")
    assert inner.calls == {("all_reduce", "dp_shard"): 1}, inner.calls
    assert outer.calls == {("all_reduce", "dp_shard"): 2}, outer.calls


# --- 6. tied embeddings -----------------------------------------------------------------------------------
def _case_tied_gpt2(ctx: Ctx) -> None:
    ref = GPT.build()
    model = copy.deepcopy(ref)
    assert model.lm_head.weight is model.wte.weight
    shard_units(model, fully_shard, mesh=ctx.mesh)
    assert model.lm_head.weight is model.wte.weight and isinstance(model.wte.weight, DTensor)
    _assert_layout(model, ref, (Shard(0),), ctx.rank, ctx.world)
    run = train(model, ref, GPT)
    assert model.lm_head.weight is model.wte.weight
    assert_parity(model, ref, run)


# --- 7. bf16 mixed precision against PyTorch's fully_shard --------------------------------------------
@default_dtype(torch.float32)  # fp32 masters, as in training; compared bit for bit, so no tolerance to derive
def _case_bf16(ctx: Ctx) -> None:
    bf16 = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for task in (NET, GPT):
        base = task.build()
        ours, theirs = copy.deepcopy(base), copy.deepcopy(base)
        shard_units(ours, fully_shard, mesh=ctx.mesh, mp_policy=MixedPrecisionPolicy(**bf16))
        shard_units(theirs, torch_fully_shard, mesh=ctx.mesh, mp_policy=TorchMixedPrecision(**bf16))
        batch = [t.chunk(ctx.world)[ctx.rank] for t in task.batch(0)]
        with torch.no_grad():
            assert ours(batch[0] if task is NET else batch[0][:, :-1]).dtype == torch.bfloat16  # no output_dtype
        task.loss(ours, batch).backward()
        for name, p in ours.named_parameters():  # shards and their gradients stay fp32
            assert isinstance(p, DTensor) and p.dtype == torch.float32 and p.to_local().dtype == torch.float32, name
            assert isinstance(p.grad, DTensor) and p.grad.to_local().dtype == torch.float32, name
        ours.zero_grad()
        run_ours, run_theirs = train(ours, None, task), train(theirs, None, task)
        # Both engines cast the fp32 shard to bf16, compute in bf16, cast gradients to fp32 and
        # reduce in fp32: the same operations, so the same bits.
        assert_close(torch.tensor([loss for loss, _ in run_ours.losses]),
                     torch.tensor([loss for loss, _ in run_theirs.losses]), rtol=0, atol=0)
        _assert_same(gather_params(ours), gather_params(theirs), "bf16 parameters")
    # output_dtype on the root casts the model's output (on a block it would feed fp32 to the root's bf16 layers)
    x = torch.randn(2, 7)
    outs = []
    for engine, policy in ((fully_shard, MixedPrecisionPolicy), (torch_fully_shard, TorchMixedPrecision)):
        model = NET.build()
        for block in model.layers:
            engine(block, mesh=ctx.mesh, mp_policy=policy(**bf16))
        engine(model, mesh=ctx.mesh, mp_policy=policy(**bf16, output_dtype=torch.float32))
        outs.append(model(x))
    assert outs[0].dtype == torch.float32
    assert_close(outs[0], outs[1], rtol=0, atol=0)


# --- 8. shard_threshold -----------------------------------------------------------------------------------
def _case_threshold(ctx: Ctx) -> None:
    for threshold in (20, 10**6):
        ref = NET.build()
        model = copy.deepcopy(ref)
        units = shard_units(model, fully_shard, mesh=ctx.mesh, shard_threshold=threshold)
        small = [[p for p in u if p.numel() < threshold] for u in unit_params(ref)]
        for name, ref_p in ref.named_parameters():
            p = model.get_parameter(name)
            if ref_p.numel() < threshold:
                assert tuple(p.placements) == (Replicate(),) and p.to_local().shape == ref_p.shape, name
                assert_close(p.to_local(), ref_p.detach(), rtol=0, atol=0)
            else:
                assert tuple(p.placements) == (Shard(0),), name
        run = train(model, ref, NET)
        assert_parity(model, ref, run)
        sharded_units = sum(len(s) < len(u) for s, u in zip(small, unit_params(ref), strict=True))
        gathers = 2 * sharded_units - 1 if sharded_units else 0
        for c in run.steps:
            assert c.calls[("all_reduce", "dp_shard")] == units, c.calls
            assert c.calls[("all_gather", "dp_shard")] == _n(ctx, gathers), c.calls
            assert c.total_calls("reduce_scatter") == _n(ctx, sharded_units), c.calls
            # one all-reduce of the unit's small gradients: 2 * numel * (N-1)/N per rank
            numel = sum(p.numel() for s in small for p in s)
            _eq(c.bytes[("all_reduce", "dp_shard")], 2 * numel * ELEM * (ctx.world - 1) / ctx.world, "all-reduce bytes")


# --- 9. meta init: only local shards are ever allocated -----------------------------------------------
class _Recorder(TorchDispatchMode):
    """Every op dispatched in the block: the collectives by name and every new (non-meta) storage."""

    def __init__(self) -> None:
        super().__init__()
        self.collectives: list[str] = []
        self.storages: dict[int, torch.UntypedStorage] = {}  # held, so no address is reused

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace in ("c10d", "_c10d_functional", "c10d_functional"):
            self.collectives.append(str(func))
        for t in tree_flatten(out)[0]:
            t = t._local_tensor if isinstance(t, DTensor) else t
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self.storages.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage())
        return out

    @property
    def nbytes(self) -> list[int]:
        return [s.nbytes() for s in self.storages.values()]


def _case_meta_init(ctx: Ctx) -> None:
    built = []
    for task in (NET, GPT):
        ref = task.build()
        with torch.device("meta"):
            model = Net() if task is NET else GPT2(TINY_GPT2)
        with _Recorder() as rec:
            shard_units(model, fully_shard, mesh=ctx.mesh)
            model.to_empty(device="cpu")
        for name, ref_p in ref.named_parameters():
            p = model.get_parameter(name)
            assert isinstance(p, DTensor) and p.device.type == "cpu" and p.to_local().device.type == "cpu", name
            assert p.to_local().shape == _expected_local(ref_p, ctx.rank, ctx.world).shape, name
        full = [p.numel() * ELEM for p in ref.parameters()]
        # exactly the local shards, nothing more; to_empty visits each module, so a tied shard is
        # allocated once per module holding it (the engine keeps the first and re-ties)
        local = sum(p.to_local().numel() * ELEM for _, p in model.named_parameters(remove_duplicate=False))
        assert sum(rec.nbytes) == local, (rec.nbytes, local)
        if ctx.world > 1:
            assert sum(rec.nbytes) < sum(full) and max(rec.nbytes) < max(full), (rec.nbytes, full)
        if task is GPT:
            assert model.lm_head.weight is model.wte.weight
            # meshpar.models.init: seeded alike, the sharded init draws the single-process model's values
            torch.manual_seed(0)
            model.init_weights()
            assert model.lm_head.weight is model.wte.weight
            _assert_same(gather_params(model), {n: p.detach() for n, p in ref.named_parameters()}, "init")
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.to_local().copy_(_expected_local(ref.get_parameter(name), ctx.rank, ctx.world))
        built.append((task, model, ref))
    for task, model, ref in built:  # trains like a model sharded from real tensors
        assert_parity(model, ref, train(model, ref, task))


# --- 10. state dicts: DTensors, no collective -------------------------------------------------------------
_DIST_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
                     "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all", "all_to_all_single",
                     "broadcast", "barrier", "gather", "scatter", "reduce", "all_gather_object",
                     "broadcast_object_list", "gather_object", "scatter_object_list", "monitored_barrier")


@contextlib.contextmanager
def _no_collectives_allowed() -> Iterator[Callable[[], None]]:
    """Count collectives three ways: meshpar.distributed.comm, wrapped torch.distributed functions, and c10d
    ops seen by a dispatch mode. Yields a function asserting all three saw none."""
    calls: Counter = Counter()

    def counting(name: str, fn: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    with contextlib.ExitStack() as stack:
        for name in _DIST_COLLECTIVES:
            if hasattr(dist, name):
                stack.enter_context(mock.patch.object(dist, name, counting(name, getattr(dist, name))))
        for name in ("_all_gather_single", "_reduce_scatter_single"):  # bound at comm's import
            stack.enter_context(mock.patch.object(comm, name, counting(name, getattr(comm, name))))
        counter = stack.enter_context(comm_record.count())
        rec = stack.enter_context(_Recorder())

        def check(expect_some: bool = False) -> None:
            seen = (counter.calls, calls, rec.collectives)
            assert all(seen) if expect_some else not any(seen), seen
        yield check


def _case_state_dict(ctx: Ctx) -> None:
    ref = NET.build()
    model = copy.deepcopy(ref)
    shard_units(model, fully_shard, mesh=ctx.mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, None, NET, steps=2, optims=(opt, None))
    if ctx.world > 1:  # the counters do see a training step's collectives
        with _no_collectives_allowed() as check:
            NET.loss(model, [t.chunk(ctx.world)[ctx.rank] for t in NET.batch(0)]).backward()
            opt.step()
            opt.zero_grad()
        check(expect_some=True)
    with _no_collectives_allowed() as check:
        sd, osd = model.state_dict(), opt.state_dict()
    check()
    params = dict(model.named_parameters())
    _eq(sd.keys(), ref.state_dict().keys(), "state_dict keys")
    for name, t in sd.items():
        assert isinstance(t, DTensor) and tuple(t.placements) == (Shard(0),), name
        assert t.to_local().data_ptr() == params[name].to_local().data_ptr(), f"{name} was copied"
    ids = {id(p): name for name, p in params.items()}
    for i, p in enumerate(opt.param_groups[0]["params"]):
        for key in ("exp_avg", "exp_avg_sq"):
            t = osd["state"][i][key]
            assert isinstance(t, DTensor) and tuple(t.placements) == (Shard(0),), (ids[id(p)], key)
            assert t.to_local().shape == p.to_local().shape, (ids[id(p)], key)
    with _no_collectives_allowed() as check:
        msd, mosd = get_model_state_dict(model), get_optimizer_state_dict(model, opt)
    check()
    _eq(msd.keys(), sd.keys(), "get_model_state_dict keys")
    for name, t in msd.items():
        assert isinstance(t, DTensor) and tuple(t.placements) == (Shard(0),), name
        assert_close(t.to_local(), sd[name].to_local(), rtol=0, atol=0)
    _eq(mosd["state"].keys(), params.keys(), "get_optimizer_state_dict keys")
    for name, state in mosd["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert isinstance(state[key], DTensor), (name, key)
            assert_close(state[key].to_local(), osd["state"][list(ids.values()).index(name)][key].to_local(),
                         rtol=0, atol=0)


# --- 11. checkpoints move between meshpar's engine and PyTorch's ------------------------------------------
def _sharded(engine: Callable, mesh: DeviceMesh, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Net()
    shard_units(model, engine, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _full_optim_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    state = get_optimizer_state_dict(model, opt)["state"]
    return {f"{name}.{key}": t.full_tensor() if isinstance(t, DTensor) else t
            for name, s in sorted(state.items()) for key, t in sorted(s.items())}


def _case_dcp(ctx: Ctx) -> None:
    for src_engine, dst_engine, tag in ((fully_shard, torch_fully_shard, "meshpar_to_torch"),
                                        (torch_fully_shard, fully_shard, "torch_to_meshpar")):
        src, src_opt = _sharded(src_engine, ctx.mesh, seed=0)
        train(src, None, NET, steps=2, optims=(src_opt, None))
        path = str(ctx.tmp / f"{tag}_{ctx.world}")
        dcp.save({"model": get_model_state_dict(src), "optim": get_optimizer_state_dict(src, src_opt)},
                 checkpoint_id=path)
        dst, dst_opt = _sharded(dst_engine, ctx.mesh, seed=1)
        state = {"model": get_model_state_dict(dst), "optim": get_optimizer_state_dict(dst, dst_opt)}
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(dst, state["model"])
        set_optimizer_state_dict(dst, dst_opt, state["optim"])
        _assert_same(gather_params(dst), gather_params(src), f"{tag} parameters")
        _assert_same(_full_optim_state(dst, dst_opt), _full_optim_state(src, src_opt), f"{tag} optimizer state")
        # and both continue alike: the optimizer state was really restored
        train(src, None, NET, steps=2, optims=(src_opt, None))
        train(dst, None, NET, steps=2, optims=(dst_opt, None))
        _assert_same(gather_params(dst), gather_params(src), f"{tag} after 2 more steps", tol=TOL)


# --- 12. bad input ----------------------------------------------------------------------------------------
class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(5, 6)
        self.block = nn.Sequential(nn.Linear(6, 5))
        self.block[0].weight = self.emb.weight


def _case_bad_input(ctx: Ctx) -> None:
    def rejects(module: nn.Module, match: str, **kwargs) -> None:
        before = {name: p for name, p in module.named_parameters()}
        with pytest.raises(ValueError, match=match):
            fully_shard(module, **{"mesh": ctx.mesh, **kwargs})
        assert not isinstance(module, FSDPModule), "a rejected module was changed"
        assert all(module.get_parameter(name) is p for name, p in before.items()), "a rejected module was changed"

    twice = fully_shard(Block(), mesh=ctx.mesh)
    with pytest.raises(ValueError, match="already applied to this Block"):
        fully_shard(twice, mesh=ctx.mesh)
    rejects(Block(), r"3-D", mesh=init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("a", "b", "c")))
    rejects(Block(), r"2-D mesh needs named dims", mesh=init_device_mesh("cpu", (1, 1)))
    mixed = Block()
    with torch.device("meta"):
        mixed.b = nn.Linear(HIDDEN, 6)
    rejects(mixed, r"several devices \(\['cpu', 'meta'\]\)")
    ints = Block()
    ints.register_parameter("count", nn.Parameter(torch.zeros(3, dtype=torch.long), requires_grad=False))
    rejects(ints, r"Block\.count is torch\.int64")
    scalar = Block()
    scalar.scale = nn.Parameter(torch.tensor(1.0))
    rejects(scalar, r"Block\.scale is a 0-dim parameter")
    rejects(Block(), r"reshard_after_forward=3\b", reshard_after_forward=3)
    tied = _Tied()
    fully_shard(tied.block, mesh=ctx.mesh)
    rejects(tied, r"Embedding\.weight is shared with a parameter already managed by another FSDP unit \(Sequential\);")
    apart = _Tied()  # the two uses in sibling units: the second keeps the original, [Note: a parameter in two units]
    fully_shard(apart.emb, mesh=ctx.mesh)
    rejects(apart.block, r"Linear\.weight is shared with a parameter already managed by another FSDP unit "
                         r"\(Embedding\)")
    net = Net()
    shard_units(net, fully_shard, mesh=ctx.mesh)
    with pytest.raises(ValueError, match="Linear is not fully sharded"):
        net.layers[0].set_modules_to_forward_prefetch([net.layers[1].a])
    # the torch 2.13 API's arguments
    rejects(Block(), r"must return Shard\(dim\) or None", shard_placement_fn=lambda p: Replicate())
    rejects(Block(), r"Shard\(2\) for Linear\.weight, of shape \(19, 6\); the dim must exist",
            shard_placement_fn=lambda p: Shard(2))
    rejects(Block(), r"dp_mesh_dims names \['nope'\]", dp_mesh_dims=DataParallelMeshDims(shard="nope"))
    rejects(Block(), r"Linear\.weight is not a DTensor on the mesh passed to fully_shard",
            dp_mesh_dims=DataParallelMeshDims(shard="dp_shard"))
    with pytest.raises(NotImplementedError, match="exactly one shard dim"):
        fully_shard(Block(), mesh=init_device_mesh("cpu", (1, 1), mesh_dim_names=("a", "b")),
                    dp_mesh_dims=DataParallelMeshDims(shard=("a", "b")))
    with pytest.raises(ValueError, match="non-empty list"):
        fully_shard([], mesh=ctx.mesh)
    block = Block()
    with pytest.raises(ValueError, match="same module twice"):
        fully_shard([block, block], mesh=ctx.mesh)
    with pytest.raises(TypeError, match="offload_policy must be"):
        fully_shard(Block(), mesh=ctx.mesh, offload_policy=MixedPrecisionPolicy())
    with pytest.raises(ValueError, match="should be a bool"):
        net.set_reshard_after_forward(1)
    with pytest.raises(ValueError, match="positive int, got 0"):
        net.set_reduce_scatter_max_input_buffers(0)
    with pytest.raises(TypeError, match="must be an int, got bool"):
        net.set_reduce_scatter_max_input_buffers(True)
    with pytest.raises(AssertionError, match="cannot be deep-copied"):
        copy.deepcopy(net)
    net(torch.randn(2, IN)).sum().backward()
    with pytest.raises(RuntimeError, match="reset_iter_state must be called on the root"):
        net.layers[0].reset_iter_state()
    net.reset_iter_state()


def _case_post_optim_event(ctx: Ctx) -> None:
    """``set_post_optim_event``: the root's next forward waits for the event before its first all-gather,
    once (CPU has no events, so a stand-in records when ``wait`` is called)."""
    calls: list[str] = []

    class Event:
        def wait(self) -> None:
            calls.append("wait")

    net = Net()
    shard_units(net, fully_shard, mesh=ctx.mesh)
    real = comm.all_gather

    def spy(*args, **kwargs):
        calls.append("all_gather")
        return real(*args, **kwargs)

    with mock.patch.object(comm, "all_gather", spy):
        net.set_post_optim_event(Event())
        net(torch.randn(2, IN)).sum().backward()
        net(torch.randn(2, IN)).sum().backward()
    assert calls.count("wait") == 1, calls
    assert calls[0] == "wait", f"an all-gather ran before the event was waited on: {calls[:3]}"


def _case_bad_input_sharded(ctx: Ctx) -> None:
    """Errors that need two shard ranks: Shard(d), d > 0, must divide evenly."""
    with pytest.raises(ValueError, match=r"Shard\(1\) for Linear\.weight, of shape \(6, 19\): dim 1 \(19\) must "
                                         r"divide evenly by the 2 shard ranks"):
        fully_shard(Block(), mesh=ctx.mesh, shard_placement_fn=lambda p: Shard(1) if p.ndim == 2 else None)


# --- 13. explicit prefetch lists ----------------------------------------------------------------------------
def _gathers_before_blocks(ctx: Ctx, model: nn.Module) -> list[int]:
    """All-gathers issued by the time each block's forward runs, in one forward + backward of Net
    (gradients dropped). Prefetching shows as the next unit's gather issued before this one runs."""
    seen: list[int] = []
    with comm_record.count() as c:
        hooks = [b.register_forward_pre_hook(lambda *_: seen.append(c.total_calls("all_gather")))
                 for b in model.layers]  # after the engine's own pre-hook, which is prepended
        try:
            NET.loss(model, [t.chunk(ctx.world)[ctx.rank] for t in NET.batch(0)]).backward()
        finally:
            for hook in hooks:
                hook.remove()
    model.zero_grad()
    return seen


# Root, then blocks 0-2: the root's gather (1) and the prefetched block 0's (2) come before block 0 runs.
_IMPLICIT_PREFETCH = [3, 4, 4]  # each unit prefetches the next in forward order


def _case_prefetch(ctx: Ctx) -> None:
    for ahead, raf in ((1, True), (2, True), (1, False)):
        ref = NET.build()
        model = copy.deepcopy(ref)
        units = shard_units(model, fully_shard, mesh=ctx.mesh, reshard_after_forward=raf)
        blocks = list(model.layers)
        model.set_modules_to_forward_prefetch(blocks[:ahead])
        for i, block in enumerate(blocks):
            block.set_modules_to_forward_prefetch(blocks[i + 1:i + 1 + ahead])
            block.set_modules_to_backward_prefetch(blocks[max(i - ahead, 0):i][::-1])
        run = train(model, ref, NET)
        assert_parity(model, ref, run)
        for c in run.steps:  # a prefetched unit is gathered once, not twice
            assert c.calls == _comm(ctx, {("all_gather", "dp_shard"): 2 * units if raf else units,
                                          ("reduce_scatter", "dp_shard"): units}), (ahead, raf, c.calls)
        # and the lists take effect: two ahead, blocks 0 and 1 are in flight before block 0 runs
        expected = [4, 4, 4] if ahead == 2 else _IMPLICIT_PREFETCH
        _eq(_gathers_before_blocks(ctx, model), [_n(ctx, n) for n in expected],
            f"all-gathers issued before each block runs, prefetching {ahead} ahead")


# --- 14. eval / no_grad forward ------------------------------------------------------------------------------
def _case_eval(ctx: Ctx) -> None:
    x = torch.randn(4, 7, generator=torch.Generator().manual_seed(7))
    for first in ("train", "eval"):  # a no_grad forward after training steps, or before any
        ref = NET.build()
        model = copy.deepcopy(ref)
        units = shard_units(model, fully_shard, mesh=ctx.mesh)
        opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
        if first == "train":
            assert_parity(model, ref, train(model, ref, NET, steps=2, optims=(opt, ref_opt)))
        for mode in (torch.no_grad, torch.inference_mode):
            model.eval()
            with mode(), comm_record.count() as c:
                out = model(x)
            plain = [name for name, p in model.named_parameters() if not isinstance(p, DTensor)]
            assert not plain, f"still unsharded after a {mode.__name__} forward: {plain}"
            assert c.calls == _comm(ctx, {("all_gather", "dp_shard"): units}), c.calls
            with torch.no_grad():
                assert_close(out, ref(x), rtol=TOL, atol=TOL)
            model.train()
        assert_parity(model, ref, train(model, ref, NET, steps=5, optims=(opt, ref_opt)))
        # a no_grad forward records no forward order; training afterwards still prefetches
        _eq(_gathers_before_blocks(ctx, model), [_n(ctx, n) for n in _IMPLICIT_PREFETCH],
            f"all-gathers issued before each block runs (implicit prefetch), first forward in {first} mode")


# --- 15. one rank is plain training ------------------------------------------------------------------------
def _case_one_rank_exact(ctx: Ctx) -> None:
    for task in (NET, GPT):
        ref = task.build()
        model = copy.deepcopy(ref)
        shard_units(model, fully_shard, mesh=ctx.mesh)
        assert_parity(model, ref, train(model, ref, task), rtol=0, atol=0)


def _case_one_rank_forced(ctx: Ctx) -> None:
    """The test-only switch ([Note: forcing the collectives of one rank]): on one rank every unit
    takes the collective path (all-gather, reduce-scatter through gloo) instead of aliasing, and
    the numbers stay exactly plain training's (a one-rank collective copies; dividing by 1 is
    exact). tests/test_cuda.py runs the same switch on CUDA, under the FSDP streams."""
    calls = Counter()
    real = {name: getattr(comm, name) for name in ("_all_gather_single", "_reduce_scatter_single")}

    def spy(name: str) -> Callable:
        def call(*args, **kwargs):
            calls[name] += 1
            return real[name](*args, **kwargs)
        return call

    for task in (NET, GPT):
        ref = task.build()
        model = copy.deepcopy(ref)
        shard_units(model, fully_shard, mesh=ctx.mesh)
        with comm_record.force_collectives(), mock.patch.multiple(comm, **{n: spy(n) for n in real}):
            run = train(model, ref, task)
        groups = [g for m in model.modules() if isinstance(m, FSDPModule) for g in m._fsdp_state.groups]
        _eq([g.alias for g in groups if g is not None], [False] * len(groups), "units aliasing under the switch")
        assert_parity(model, ref, run, rtol=0, atol=0)
    assert calls["_all_gather_single"] > 0 and calls["_reduce_scatter_single"] > 0, calls
    with comm_record.force_collectives(False):
        assert not comm_record.forced()


def _case_native_layout(ctx: Ctx) -> None:
    """NCCL's reduce-scatter layout on gloo ([Note: the native reduce-scatter layout]): every unit's
    gradients copied in by one ``chunk_cat`` ([Note: the gradients copied in at once]), uneven
    shapes padded by it; float64 parity, and bf16 gradients cast by it to fp32 bit for bit as
    PyTorch's ``fully_shard`` (the same cast, padding and reduce-scatter)."""
    real, taken = comm.ReduceScatterInput.copy_chunks, []

    def counted(buffer: comm.ReduceScatterInput, tensors: list[torch.Tensor]) -> bool:
        taken.append(real(buffer, tensors))
        return taken[-1]

    with comm_record.native_reduce_scatter(), mock.patch.object(comm.ReduceScatterInput, "copy_chunks", counted):
        for task in (NET, GPT):
            ref = task.build()
            model = copy.deepcopy(ref)
            shard_units(model, fully_shard, mesh=ctx.mesh)
            assert_parity(model, ref, train(model, ref, task))
        bf16 = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        base = GPT.build()
        ours, theirs = copy.deepcopy(base), copy.deepcopy(base)
        shard_units(ours, fully_shard, mesh=ctx.mesh, mp_policy=MixedPrecisionPolicy(**bf16))
        shard_units(theirs, torch_fully_shard, mesh=ctx.mesh, mp_policy=TorchMixedPrecision(**bf16))
        run_ours, run_theirs = train(ours, None, GPT), train(theirs, None, GPT)
    assert taken and all(taken), taken  # every unit took the one call
    _eq([loss for loss, _ in run_ours.losses], [loss for loss, _ in run_theirs.losses], "bf16 losses")
    _assert_same(gather_params(ours), gather_params(theirs), "bf16 parameters")


def _case_local_cast(ctx: Ctx) -> None:
    """[Note: the unsharded parameter keeps its identity] in meshpar/fsdp/sharded_param.py: parameters
    whose whole value is local (replicated below shard_threshold; all of them on one rank) and cast for
    compute still get their gradients when their unit reshards after forward. Every unit's parameters
    are cast float64 -> float32 here, against the model in float32: the same float32 arithmetic,
    summed over the ranks' halves of the batch in another order, so
    1e-5 relative (float32's 6e-8 per addition over a few hundred terms) bounds the difference."""
    mp = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    tokens = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(0))
    inputs, targets = local_slice(tokens[:, :-1], ctx.rank, ctx.world), local_slice(tokens[:, 1:], ctx.rank, ctx.world)
    for threshold in (10**9, 0):  # every parameter replicated; every parameter sharded (on one rank: single)
        with default_dtype():
            model = build_model("llama", n_layers=2, vocab_size=256)
        ref = copy.deepcopy(model).float()
        shard_units(model, fully_shard, mesh=ctx.mesh, mp_policy=mp, shard_threshold=threshold)
        for m, x in ((model, inputs), (ref, tokens[:, :-1])):
            logits = m(x).float()
            F.cross_entropy(logits.flatten(0, 1), (targets if m is model else tokens[:, 1:]).flatten()).backward()
        missing = [n for n, p in model.named_parameters() if p.grad is None]
        _eq(missing, [], f"parameters without a gradient (shard_threshold {threshold})")
        for (name, p), ref_p in zip(model.named_parameters(), ref.parameters(), strict=True):
            assert_close(p.grad.full_tensor().float(), ref_p.grad, rtol=1e-5, atol=1e-7, msg=name)


def _case_released(ctx: Ctx) -> None:
    """A trained model goes when its last reference does: every sharded parameter and shard is
    collected (a gradient hook holding its group strongly kept each model alive for good)."""
    import gc

    for mp in (MixedPrecisionPolicy(), MixedPrecisionPolicy(param_dtype=torch.float32)):  # alias and cast paths
        with default_dtype():
            model = build_model("llama", n_layers=2, vocab_size=256)
        shard_units(model, fully_shard, mesh=ctx.mesh, mp_policy=mp)
        tokens = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
        F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
        refs = [weakref.ref(p) for p in model.parameters()] + [weakref.ref(p.to_local()) for p in model.parameters()]
        del model
        gc.collect()
        _eq(sum(r() is not None for r in refs), 0, f"parameters and shards alive after the model went ({mp})")


# --- 16. the parity comparison fails on planted bugs -----------------------------------------------------
def _case_catches_bugs(ctx: Ctx) -> None:
    """``assert_parity`` at its float64 tolerance fails when the engine skips its divide by the
    data-parallel size (every gradient 2x: AdamW is nearly scale-free, so only its eps shows it,
    ~1e-7 on the parameters after five steps) and when one rank's gradient is doubled before the
    reduce-scatter (the average tilts toward that rank's half of the batch)."""
    take = ShardedParam.take_unsharded_grad

    def doubled_on_rank_1(self: ShardedParam):
        grad = take(self)
        return grad * 2 if grad is not None and ctx.rank == 1 else grad

    bugs = {"no divide by the data-parallel size": mock.patch.object(Reducer, "_divide_factor", lambda self: 1.0),
            "rank 1's gradient doubled": mock.patch.object(ShardedParam, "take_unsharded_grad", doubled_on_rank_1)}
    for bug, patch in bugs.items():
        ref = NET.build()
        model = copy.deepcopy(ref)
        shard_units(model, fully_shard, mesh=ctx.mesh)
        with patch:
            run = train(model, ref, NET)
        must_fail(lambda model=model, ref=ref, run=run: assert_parity(model, ref, run), bug)


# --- 17. every reduction starts from its hook, however often the unsharded parameters are remade ----------
def _case_hooks_survive_new_unsharded(ctx: Ctx) -> None:
    """``model.to(dtype)`` remakes the unsharded parameters (so does casting a replicated one for
    mixed precision, each unshard). Every new one must get the gradient hook that starts its
    group's reduction during backward: a group left for the end of backward on one rank only
    issues its collectives in another order than its peers, and gloo hangs or aborts
    ([Note: hook the object, not its id] in meshpar/fsdp/reduce.py). So: no group may
    reach the end of backward with gradients still to reduce, over dtype flips and over
    mixed-precision steps with replicated parameters, and the run must actually have reused
    an address for a new unsharded parameter (else it proved nothing)."""
    late: list[list[str]] = []
    in_finish = [False]
    finish, post = ParamGroup.finish_backward, ParamGroup.post_backward

    def spy_finish(self: ParamGroup) -> None:
        in_finish[0] = True
        try:
            finish(self)
        finally:
            in_finish[0] = False

    def spy_post(self: ParamGroup) -> None:
        if in_finish[0]:
            late.append([f"{type(m).__name__}.{attr}" for m, attr in (q.places[0] for q in self.all_params)])
        post(self)

    reused = 0
    with mock.patch.object(ParamGroup, "finish_backward", spy_finish), \
            mock.patch.object(ParamGroup, "post_backward", spy_post):
        for setting in ("dtype flips", "mixed precision, replicated"):
            model = Net()
            mp = MixedPrecisionPolicy(param_dtype=torch.float32) if setting != "dtype flips" else None
            kwargs = {"mp_policy": mp, "shard_threshold": 10**6} if mp else {}  # every parameter replicated
            shard_units(model, fully_shard, mesh=ctx.mesh, **kwargs)
            seen: dict[int, weakref.ref] = {}  # id -> the last unsharded parameter seen with it (not kept alive)

            def note(module: nn.Module, _args: tuple, seen: dict[int, weakref.ref] = seen) -> None:
                nonlocal reused
                for p in module.parameters(recurse=False):  # in forward: the engine's unsharded ones
                    reused += id(p) in seen and seen[id(p)]() is not p
                    seen[id(p)] = weakref.ref(p)

            for m in model.modules():
                if isinstance(m, nn.Linear):
                    m.register_forward_pre_hook(note)  # after the engine's own pre-hook, which is prepended
            for i in range(20):
                dtype = torch.float32 if setting == "dtype flips" and i % 2 else torch.float64
                model.to(dtype)
                model(torch.randn(2, IN, dtype=dtype)).sum().backward()
                model.zero_grad()
    assert not late, f"groups reduced at the end of backward (their hooks were lost): {late}"
    assert reused, "no new unsharded parameter reused an old one's address: the hazard was not exercised"


# --- the jobs ----------------------------------------------------------------------------------------------
# --- the optimizer on local shards (meshpar/training/optim.py) -----------------------------------------
def _case_local_shard_adamw(ctx: Ctx) -> None:
    """meshpar's AdamW steps each rank's local shards as plain tensors ([Note: the optimizer on local
    shards]): the fused kernel torch.optim.AdamW runs through DTensor's dispatch, on the same tensors,
    so the same bits; against one process to TOL; its state stays DTensors. At 4 ranks hybrid
    (Replicate, Shard(0)) placements. A gradient placed unlike its parameter goes through DTensor's
    dispatch: the same update as torch's AdamW."""
    mesh = ctx.mesh if ctx.world == 2 else init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    runs = []
    for cls in (torch.optim.AdamW, ShardLocalAdamW):
        ref = NET.build()
        model = copy.deepcopy(ref)
        shard_units(model, fully_shard, mesh=mesh)
        opt = cls(model.parameters(), lr=NET.lr, weight_decay=0.1, fused=True)
        run = train(model, ref, NET, optims=(opt, torch.optim.AdamW(ref.parameters(), lr=NET.lr, weight_decay=0.1)))
        assert_parity(model, ref, run)
        runs.append((model, opt, run))
    (torch_model, torch_opt, torch_run), (model, opt, run) = runs
    _eq([a for a, _ in run.losses], [a for a, _ in torch_run.losses], "losses")
    for (name, p), q in zip(model.named_parameters(), torch_model.parameters(), strict=True):
        assert torch.equal(p.to_local(), q.to_local()), name
        for key, value in opt.state[p].items():
            if key != "step":
                assert isinstance(value, DTensor) and value.placements == p.placements, (name, key, type(value))
            theirs = torch_opt.state[q][key]
            assert torch.equal(*(t.to_local() if isinstance(t, DTensor) else t for t in (value, theirs))), (name, key)
    # a gradient placed unlike its parameter: the whole gradient, replicated, for a sharded weight
    updated = []
    for cls in (torch.optim.AdamW, ShardLocalAdamW):
        torch.manual_seed(0)
        weight = nn.Parameter(distribute_tensor(torch.randn(6, 3), ctx.mesh, [Shard(0)]))
        weight.grad = distribute_tensor(torch.randn(6, 3), ctx.mesh, [Replicate()])
        cls([weight], lr=0.1, fused=True).step()
        updated.append(weight.full_tensor())
    assert torch.equal(*updated)


def _setup(tmp: Path) -> Ctx:
    torch.set_default_dtype(torch.float64)  # models and batches: tests/parity.py [Note: parity in float64]
    world = dist.get_world_size()
    return Ctx(dist.get_rank(), world, init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",)), tmp)


CASES = CaseSet({
    "units": (_case_units, (1, 2, 4)),
    "reshard_after_forward": (_case_reshard_after_forward, (1, 2, 4)),
    "hybrid": (_case_hybrid, (4,)),
    "accumulation": (_case_accumulation, (1, 2, 4)),
    "comm_accounting": (_case_comm_accounting, (1, 2, 4)),
    "tied_gpt2": (_case_tied_gpt2, (1, 2, 4)),
    "bf16": (_case_bf16, (1, 2, 4)),
    "threshold": (_case_threshold, (1, 2, 4)),
    "meta_init": (_case_meta_init, (1, 2, 4)),
    "state_dict": (_case_state_dict, (1, 2, 4)),
    "dcp": (_case_dcp, (2, 4)),
    "bad_input": (_case_bad_input, (1,)),
    "bad_input_sharded": (_case_bad_input_sharded, (2,)),
    "post_optim_event": (_case_post_optim_event, (1, 2)),
    "prefetch": (_case_prefetch, (1, 2, 4)),
    "eval": (_case_eval, (1, 2, 4)),
    "one_rank_exact": (_case_one_rank_exact, (1,)),
    "one_rank_forced": (_case_one_rank_forced, (1,)),
    "native_layout": (_case_native_layout, (2, 4)),
    "local_cast": (_case_local_cast, (1, 2)),
    "released": (_case_released, (1, 2)),
    "catches_bugs": (_case_catches_bugs, (2,)),
    "hooks_survive_new_unsharded": (_case_hooks_survive_new_unsharded, (2,)),
    "local_shard_adamw": (_case_local_shard_adamw, (2, 4)),
    "nested_counts": (_case_nested_counts, (1,)),  # last: when it fails it leaves a stale counter behind
}, setup=_setup, timeout=240)


# they check structure, not numbers
_NOT_PARITY = ("nested_counts", "released", "bad_input", "bad_input_sharded", "state_dict", "post_optim_event",
               "hooks_survive_new_unsharded")


def _worlds(case: str) -> Callable:
    """Parametrize over the case's world sizes; a case that compares numbers is marked ``parity``."""
    worlds = pytest.mark.parametrize("world", CASES.worlds(case))
    return worlds if case in _NOT_PARITY else lambda test: pytest.mark.parity(worlds(test))


@_worlds("units")
def test_uneven_shapes_nested_units_and_root_only(world):
    CASES.check("units", world)


@_worlds("reshard_after_forward")
def test_reshard_after_forward(world):
    CASES.check("reshard_after_forward", world)


@_worlds("hybrid")
def test_hybrid_2x2(world):
    CASES.check("hybrid", world)


@_worlds("accumulation")
def test_gradient_accumulation_reduces_once_per_step(world):
    CASES.check("accumulation", world)


@_worlds("comm_accounting")
def test_comm_accounting_per_step(world):
    CASES.check("comm_accounting", world)


@_worlds("nested_counts")
def test_comm_count_blocks_nest(world):
    CASES.check("nested_counts", world)


@_worlds("tied_gpt2")
def test_tied_embeddings_gpt2(world):
    CASES.check("tied_gpt2", world)


@_worlds("bf16")
def test_bf16_matches_pytorch_fully_shard(world):
    CASES.check("bf16", world)


@_worlds("threshold")
def test_shard_threshold_replicates_small_parameters(world):
    CASES.check("threshold", world)


@_worlds("meta_init")
def test_meta_init_allocates_only_local_shards(world):
    CASES.check("meta_init", world)


@_worlds("state_dict")
def test_state_dict_is_dtensors_without_collectives(world):
    CASES.check("state_dict", world)


@_worlds("dcp")
def test_dcp_checkpoints_move_between_engines(world):
    CASES.check("dcp", world)


@_worlds("bad_input")
def test_bad_input_is_rejected(world):
    CASES.check("bad_input", world)


@_worlds("bad_input_sharded")
def test_bad_input_is_rejected_sharded(world):
    CASES.check("bad_input_sharded", world)


@_worlds("post_optim_event")
def test_post_optim_event_is_waited_on_before_the_next_all_gather(world):
    CASES.check("post_optim_event", world)


@_worlds("prefetch")
def test_explicit_prefetch_lists(world):
    CASES.check("prefetch", world)


@_worlds("eval")
def test_no_grad_forward_reshards_every_unit(world):
    CASES.check("eval", world)


@_worlds("one_rank_exact")
def test_one_rank_matches_plain_training_exactly(world):
    CASES.check("one_rank_exact", world)


@_worlds("native_layout")
def test_native_reduce_scatter_layout_copies_each_units_gradients_in_one_call(world):
    CASES.check("native_layout", world)


@_worlds("one_rank_forced")
def test_one_rank_collectives_forced_match_plain_training_exactly(world):
    CASES.check("one_rank_forced", world)


@_worlds("local_cast")
def test_local_parameters_cast_for_compute_keep_their_gradients(world):
    CASES.check("local_cast", world)


@_worlds("released")
def test_a_model_is_collected_after_its_last_reference(world):
    CASES.check("released", world)


@_worlds("catches_bugs")
def test_parity_catches_planted_bugs(world):
    CASES.check("catches_bugs", world)


@_worlds("hooks_survive_new_unsharded")
def test_hooks_survive_new_unsharded(world):
    CASES.check("hooks_survive_new_unsharded", world)


@_worlds("local_shard_adamw")
def test_adamw_on_local_shards_is_torchs_adamw_bit_for_bit(world):
    CASES.check("local_shard_adamw", world)
