"""The all-gather extension protocol (meshpar/fsdp/extensions.py) against PyTorch's engine.

Each scenario runs under torch's engine, then meshpar's, on the same 2 ranks (the harness of
tests/test_fsdp_compat.py; float64): the losses, every rank's local gradient shards and shards
after the last step must agree, and the scenario itself checks that the engine called the hooks
(equal numbers alone do not prove it: an engine that all-gathers a ``TwoTensor`` as an opaque
tensor computes the same ones through its dispatch). Cases: ``TwoTensor`` with the protocol
patched onto its class, both signatures, ``reshard_after_forward`` True and False, mixed
precision; methods patched onto plain local tensors after meta init and ``to_empty`` (a bfloat16
all-gather, PyTorch's own monkey-patch test).
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.testing._internal.two_tensor import TwoTensor

from meshpar.distributed._torch import local_tensor, preserve_version_counter
from tests.distributed import CaseSet
from tests.fsdp_compat_models import Ctx, Record, assert_same_record, both, local, setup, subcases
from tests.parity import TOL

CALLS: Counter = Counter()  # hook calls of the scenario running now: pre, post, post with out=


# --- TwoTensor's protocol, patched onto its class (both signatures) --------------------------------------------
def _pre_v1(self: TwoTensor, mesh: Any) -> tuple[tuple[torch.Tensor, ...], Any]:
    CALLS["pre"] += 1
    return (self.a, self.b), None


def _pre_v2(self: TwoTensor, mesh: Any, outer_size: torch.Size, outer_stride: tuple[int, ...], module: nn.Module,
            mp_policy: Any) -> tuple[tuple[torch.Tensor, ...], Any]:
    CALLS["pre"] += 1
    assert isinstance(outer_size, torch.Size) and len(outer_stride) == len(outer_size), (outer_size, outer_stride)
    assert isinstance(module, nn.Linear), type(module)
    return (self.a, self.b), None


def _post(self: TwoTensor, outputs: tuple[torch.Tensor, ...], metadata: Any, param_dtype: torch.dtype, *,
          out: torch.Tensor | None = None) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
    a, b = outputs
    if out is not None:  # every unshard after the first: refill in place
        CALLS["post out="] += 1
        out = local_tensor(out) if hasattr(out, "device_mesh") else out
        if a.dtype == param_dtype:  # the outputs are the same storages as the first call's: nothing to copy
            assert a.untyped_storage().data_ptr() == out.a.untyped_storage().data_ptr(), "outputs moved"
        else:
            out.a.copy_(a)
            out.b.copy_(b)
        return None
    CALLS["post"] += 1
    return TwoTensor(a, b).to(param_dtype), (a, b)


@contextlib.contextmanager
def _patched(version: int) -> Iterator[None]:
    TwoTensor.fsdp_pre_all_gather = _pre_v1 if version == 1 else _pre_v2
    TwoTensor.fsdp_post_all_gather = _post
    try:
        yield
    finally:
        del TwoTensor.fsdp_pre_all_gather, TwoTensor.fsdp_post_all_gather


class _Mlp(nn.Module):
    """``hidden`` 7: in_proj's 7 rows split 4 + 3 over 2 ranks (an uneven shard)."""

    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.in_proj = nn.Linear(8, hidden, bias=False)
        self.out_proj = nn.Linear(hidden, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.relu(self.in_proj(x)))


def _two_tensor_model(hidden: int = 16, b: float = 0.5) -> nn.Module:
    """Weights ``TwoTensor(w, b * w)``."""
    torch.manual_seed(0)
    model = nn.Sequential(*[_Mlp(hidden) for _ in range(3)])
    for mlp in model:
        for lin in (mlp.in_proj, mlp.out_proj):
            lin.weight = nn.Parameter(TwoTensor(lin.weight.detach(), lin.weight.detach() * b))
    return model


def _plain(rec: Record, key: str, t: torch.Tensor) -> None:
    """A tensor, or a TwoTensor's two, as plain tensors the record compares."""
    if isinstance(t, TwoTensor):
        rec[f"{key}.a"], rec[f"{key}.b"] = t.a.detach().clone(), t.b.detach().clone()
    else:
        rec[f"{key}"] = t.detach().clone()


def _shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's dim-0 shard: a DTensor's local tensor, or the chunk of an unsharded reference's."""
    if hasattr(t, "device_mesh"):
        return local_tensor(t)
    return t.chunk(dist.get_world_size())[dist.get_rank()]


def _train(model: nn.Module, rec: Record, steps: int = 3) -> None:
    """AdamW steps on this rank's slice of a fixed batch; each loss, then every local gradient shard
    and, after the last step, every local parameter shard (the engines shard alike: rank by rank).
    An unsharded model is the reference: its gradients are averaged over the ranks here."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    for i in range(steps):
        g = torch.Generator().manual_seed(300 + i)
        (x,) = local((torch.randn(4, 8, generator=g),))
        loss = model(x).sum()
        loss.backward()
        _plain(rec, f"{i}.loss", loss)
        for name, p in model.named_parameters():
            if not hasattr(p, "device_mesh"):
                for t in (p.grad.a, p.grad.b) if isinstance(p.grad, TwoTensor) else (p.grad,):
                    dist.all_reduce(t)
                    t.div_(dist.get_world_size())
            _plain(rec, f"{i}.{name}.grad", _shard(p.grad))
        opt.step()
        opt.zero_grad()
    for name, p in model.named_parameters():
        _plain(rec, f"end.{name}", _shard(p))
        rec[f"end.{name}.class"] = type(_shard(p)).__name__


def _check_calls(E: ModuleType, steps: int, units: int) -> None:
    """Every unit's weights went through the hooks: one pre per all-gather, the first post without
    ``out=``, the later ones with it."""
    assert CALLS["pre"] >= 2 * units * steps, f"{E.__name__}: fsdp_pre_all_gather ran {CALLS['pre']} times"
    assert CALLS["post"] == 2 * units, f"{E.__name__}: fsdp_post_all_gather without out= ran {CALLS['post']} times"
    assert CALLS["post out="] > 0, f"{E.__name__}: fsdp_post_all_gather(out=...) never ran"


def _two_tensor(E: ModuleType, ctx: Ctx, version: int, reshard: bool, param_dtype: torch.dtype | None) -> Record:
    rec = Record()
    CALLS.clear()
    with _patched(version):
        model = _two_tensor_model()
        mp = E.MixedPrecisionPolicy(param_dtype=param_dtype)
        for mlp in model:
            E.fully_shard(mlp, mesh=ctx.mesh, reshard_after_forward=reshard, mp_policy=mp)
        E.fully_shard(model, mesh=ctx.mesh, reshard_after_forward=reshard, mp_policy=mp)
        _train(model, rec)
    _check_calls(E, 3, 3)
    return rec


def _uneven_v1(ctx: Ctx) -> None:
    """Uneven shards under v1, which PyTorch's engine cannot gather (the short shard's inputs are
    short): meshpar pads them ([Note: padding extension inputs]) and trains as the unsharded model
    with averaged gradients does. Both engines hand a TwoTensor's reduced gradient over as one plain
    tensor, so this reference has ``b == a`` (as PyTorch's own parity test of the protocol)."""
    import meshpar.fsdp as E

    def run(sharded: bool) -> Record:
        rec = Record()
        CALLS.clear()
        with _patched(1):
            model = _two_tensor_model(hidden=7, b=1.0)
            if sharded:
                for mlp in model:
                    E.fully_shard(mlp, mesh=ctx.mesh)
                E.fully_shard(model, mesh=ctx.mesh)
            _train(model, rec)
        if sharded:
            _check_calls(E, 3, 3)
        return rec

    got, want = run(True), run(False)
    for key in [k for k in want if k.endswith(".grad.a")]:  # the engine's gradients are plain: b == a here
        b = want.pop(key[:-1] + "b")
        assert torch.equal(want[key], b), key
        want[key[:-2]] = want.pop(key)
    assert_same_record(got, want, TOL, "meshpar, v1 on uneven shards, vs one model with averaged gradients")


def _case_two_tensor(ctx: Ctx) -> None:
    subcases({f"v{version}, reshard_after_forward={reshard}, param_dtype={dtype}":
              functools.partial(both, _two_tensor, ctx, version, reshard, dtype, tol=TOL)
              for version in (1, 2) for reshard in (True, False) for dtype in (None, torch.float32)}
             | {"v1, uneven": functools.partial(_uneven_v1, ctx)})


# --- methods patched onto plain local tensors, after meta init ----------------------------------------------------
def _bf16_pre(self: torch.Tensor, mesh: Any, outer_size: torch.Size, outer_stride: tuple[int, ...],
              module: nn.Module, mp_policy: Any) -> tuple[tuple[torch.Tensor, ...], Any]:
    CALLS["pre"] += 1
    rows = -(-outer_size[0] // mesh.size())  # the largest shard's: a v2 extension pads, as PyTorch's engine requires
    padded = self.new_zeros((rows, *self.shape[1:]), dtype=torch.bfloat16)
    padded[:self.shape[0]].copy_(self)
    return (padded,), None


@torch.no_grad()
def _bf16_post(self: torch.Tensor, outputs: tuple[torch.Tensor, ...], metadata: Any, param_dtype: torch.dtype, *,
               out: torch.Tensor | None = None) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
    (tensor,) = outputs
    assert tensor.dtype == torch.bfloat16, tensor.dtype
    if out is not None:
        CALLS["post out="] += 1
        with preserve_version_counter(out):
            out.copy_(tensor[:out.shape[0]])  # the gathered rows are padded ones; the parameter has its own
        return None
    CALLS["post"] += 1
    upcast = tensor.to(param_dtype)
    return upcast, (tensor, upcast)


def _monkey_patched(E: ModuleType, ctx: Ctx, hidden: int) -> Record:
    rec = Record()
    CALLS.clear()
    with torch.device("meta"):
        model = nn.Sequential(*[_Mlp(hidden) for _ in range(3)])
    for mlp in model:
        E.fully_shard(mlp, mesh=ctx.mesh)
    E.fully_shard(model, mesh=ctx.mesh)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    for p in model.parameters():
        nn.init.trunc_normal_(p)
    for p in model.parameters():  # on the local tensors to_empty made: instance methods, no subclass
        shard = local_tensor(p)
        shard.fsdp_pre_all_gather = _bf16_pre.__get__(shard)
        shard.fsdp_post_all_gather = _bf16_post.__get__(shard)
    _train(model, rec)
    _check_calls(E, 3, 3)
    return rec


def _int_reshard_refused(ctx: Ctx) -> str:
    """An int reshard_after_forward keeps 1/k of the gathered parameter, which an extension's outputs
    are not: refused (PyTorch's engine raises NotImplementedError in backward's all-gather)."""
    import meshpar.fsdp as E

    with _patched(2):
        model = _two_tensor_model()
        for mlp in model:
            E.fully_shard(mlp, reshard_after_forward=2)
        E.fully_shard(model)
        with pytest.raises(NotImplementedError, match=r"int reshard_after_forward with an all-gather extension"):
            model(torch.ones(2, 8))
    return "refused"


CASES = CaseSet({
    "two_tensor": (_case_two_tensor, 2),
    "monkey_patched": (lambda ctx: subcases({f"hidden {h}": functools.partial(both, _monkey_patched, ctx, h)
                                              for h in (16, 7)}), 2),
    "hybrid": (lambda ctx: both(_two_tensor, ctx, 2, True, torch.float32), 4),
    "int_reshard_refused": (lambda ctx: _int_reshard_refused(ctx), 4),
}, setup=setup, timeout=300)


@pytest.mark.parity
@pytest.mark.parametrize(("case", "world"), CASES.params())
def test_extension_matches_torch_fsdp(case, world):
    CASES.check(case, world)
