"""Models, data, the training loop, the comparison and the harness behind tests/test_fsdp_compat.py.

Everything here is engine-agnostic: a scenario builds a model from these pieces, applies
``E.fully_shard`` (torch's or meshpar's), trains with ``train`` and writes what it observed
into a ``Record``; ``both`` runs it under each engine and ``assert_same_record`` holds
meshpar's record to torch's (``engines``: torch's twice when MESHPAR_COMPAT_SELF=1). Models take
the default dtype (float64 in the compat job, float32 in the mixed-precision scenario) and
have awkward row counts (7, 19, 3, 1) so that shards are uneven at 2 ranks and empty at 4.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.testing import assert_close

from tests.fsdp_models import DIM, HIDDEN, IN, OUT, Block, Net
from tests.parity import TOL, upcast

VOCAB, SEQ, BATCH = 19, 5, 12  # 19 embedding rows: uneven at 2 and 4 ranks; 3 microbatches of every rank's rows


class Lm(nn.Module):
    """tokens[B, T] -> logits[B, T, 19]: embedding, Blocks, LayerNorm, head (tied to the embedding
    when ``tied``). ``hidden_only``: forward stops after the norm (the chunked-loss layout)."""

    def __init__(self, n_layers: int = 2, tied: bool = False, hidden_only: bool = False) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([Block() for _ in range(n_layers)])
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        if tied:
            self.head.weight = self.tok.weight
        self.hidden_only = hidden_only

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.tok(tokens)
        for layer in self.layers:
            h = layer(h)
        h = self.norm(h)
        return h if self.hidden_only else self.head(h)


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return x.clone()  # not a view: FSDP warns that a view output may skip its pre-backward hook

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        raise RuntimeError("planted failure in backward")


class Faulty(Block):
    """A Block that raises in forward (``fail_forward``) or in backward (``fail_backward``)."""

    fail_forward = False
    fail_backward = False

    def forward(self, x: Tensor) -> Tensor:
        if self.fail_forward:
            raise RuntimeError("planted failure in forward")
        h = super().forward(x)
        return _RaiseInBackward.apply(h) if self.fail_backward else h


class Scaled(Block):
    """A Block with a frozen float32 parameter beside its default-dtype ones."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(0.5 + torch.rand(HIDDEN, dtype=torch.float32), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.b(torch.tanh(self.a(x) * self.scale.to(x.dtype)))


class Gated(Net):
    """Net whose ``gain`` can be left out of a step (``use_gain``), with a second forward-like method."""

    use_gain = True

    def forward(self, x: Tensor) -> Tensor:
        h = self.emb(x) * self.gain if self.use_gain else self.emb(x)
        for layer in self.layers:
            h = layer(h)
        return self.out(h)

    def generate(self, x: Tensor) -> Tensor:  # uses the root's parameters outside forward
        return self.out(self.emb(x) * self.gain)


@dataclass
class Inputs:
    """Forward inputs nested in a dataclass, a dict and a list (for ``cast_forward_inputs``)."""

    x: Tensor
    extra: dict[str, list[Tensor]]


class Stage(nn.Module):
    """A pipeline-chunk-like root: optional ``first`` module, ``layers``, optional ``last`` module."""

    def __init__(self, first: nn.Module | None, layers: nn.ModuleList, last: nn.Module | None) -> None:
        super().__init__()
        self.first, self.layers, self.last = first, layers, last

    def forward(self, h: Tensor) -> Tensor:
        h = self.first(h) if self.first is not None else h
        for layer in self.layers:
            h = layer(h)
        return self.last(h) if self.last is not None else h


class Nested(Net):
    def forward(self, inputs: Inputs) -> Tensor:  # x * extra["scale"][0]: both cast, or a dtype error
        return super().forward(inputs.x * inputs.extra["scale"][0])


def build(cls: Callable[..., nn.Module] = Net, seed: int = 0, **kwargs) -> nn.Module:
    torch.manual_seed(seed)
    return cls(**kwargs)


def net_batch(step: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, IN, generator=g), torch.randn(BATCH, OUT, generator=g)


def lm_batch(step: int) -> tuple[Tensor]:
    g = torch.Generator().manual_seed(200 + step)
    return (torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g),)


def net_loss(model: nn.Module, batch: tuple[Tensor, ...]) -> Tensor:
    x, y = batch
    return F.mse_loss(upcast(model(x)), y)


def lm_loss(model: nn.Module, batch: tuple[Tensor, ...]) -> Tensor:
    (tokens,) = batch
    return F.cross_entropy(upcast(model(tokens[:, :-1])).flatten(0, 1), tokens[:, 1:].flatten())


def chunked_lm_loss(model: nn.Module, batch: tuple[Tensor, ...], chunks: int = 3) -> Tensor:
    """The head applied outside the model's forward, on ``chunks`` slices of the hidden states."""
    (tokens,) = batch
    hidden, targets = model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()
    total = sum(F.cross_entropy(upcast(model.head(h)), t, reduction="sum")
                for h, t in zip(hidden.chunk(chunks), targets.chunk(chunks), strict=True))
    return total / targets.numel()


def local(batch: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """This rank's slice of a global batch (every rank is a data-parallel rank here)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    return tuple(t.chunk(world)[rank] for t in batch)


class Record(dict):
    """What a scenario observed, by name: tensors (losses, gathered parameters and gradients)
    and plain values (dtypes, placements, which gradients are None, errors)."""

    def loss(self, key: str, loss: Tensor) -> None:
        self[f"{key}.loss"] = loss.detach().clone()

    def params(self, key: str, model: nn.Module) -> None:
        """Every parameter gathered, with its placements and dtype; each must be a DTensor."""
        for name, p in model.named_parameters():
            assert isinstance(p, DTensor), f"{key}: {name} is a {type(p).__name__} after the step, not a DTensor"
            self[f"{key}.{name}"] = p.full_tensor().detach().clone()
            self[f"{key}.{name}.layout"] = (str(tuple(p.placements)), str(p.dtype), p.requires_grad)

    def grads(self, key: str, model: nn.Module) -> None:
        """Every gradient gathered ("None" where a parameter has none)."""
        for name, p in model.named_parameters():
            self[f"{key}.{name}.grad"] = "None" if p.grad is None else p.grad.full_tensor().detach().clone()


def train(model: nn.Module, record: Record, key: str, *, steps: int = 3, loss_fn: Callable = net_loss,
          batch: Callable[[int], tuple[Tensor, ...]] = net_batch, opt: torch.optim.Optimizer | None = None,
          first: int = 0, grads: bool = True) -> torch.optim.Optimizer:
    """AdamW ``steps`` on this rank's slice of ``batch(first + i)``, recording each loss and
    (``grads``) every gradient, then the parameters. Returns the optimizer, to go on with."""
    opt = opt or torch.optim.AdamW(model.parameters(), lr=1e-2)
    for i in range(first, first + steps):
        loss = loss_fn(model, local(batch(i)))
        loss.backward()
        record.loss(f"{key}.{i}", loss)
        if grads:
            record.grads(f"{key}.{i}", model)
        opt.step()
        opt.zero_grad()
    record.params(key, model)
    return opt


def train_accumulating(model: nn.Module, record: Record, switch: Callable[[bool], None], *, steps: int = 2,
                       micro: int = 3) -> None:
    """AdamW ``steps`` of ``micro`` microbatches each (this rank's slice of ``net_batch``);
    ``switch(last)`` before each microbatch sets the engine's accumulation switches. Records
    every microbatch's loss, each step's gradients, then the parameters."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        x, y = local(net_batch(step))
        for i, mb in enumerate(zip(x.chunk(micro), y.chunk(micro), strict=True)):
            switch(i == micro - 1)
            loss = net_loss(model, mb) / micro
            loss.backward()
            record.loss(f"{step}.{i}", loss)
        record.grads(str(step), model)
        opt.step()
        opt.zero_grad()
    record.params("end", model)


def assert_same_record(got: Record, want: Record, tol: float, what: str = "meshpar vs torch") -> None:
    """``got`` has ``want``'s keys; tensors agree in dtype and to ``tol`` (0: bit for bit), other
    values exactly. Every mismatch is listed (key: max difference), not just the first."""
    assert want, f"{what}: the reference recorded nothing"
    missing, extra = sorted(want.keys() - got.keys()), sorted(got.keys() - want.keys())
    assert not missing and not extra, f"{what}: keys only in torch's record {missing}, only in ours {extra}"
    bad = []
    for key, w in want.items():
        g = got[key]
        if isinstance(w, Tensor) and isinstance(g, Tensor):
            try:
                assert g.dtype == w.dtype, f"dtype {g.dtype} vs {w.dtype}"
                assert_close(g, w, rtol=tol, atol=tol)
            except AssertionError as e:
                diff = (g.double() - w.double()).abs().max().item() if g.shape == w.shape else math.nan
                bad.append(f"{key}: max diff {diff:.3g} ({str(e).splitlines()[0]})")
        elif type(g) is not type(w) or g != w:
            bad.append(f"{key}: {g!r} vs {w!r}")
    assert not bad, f"{what}: {len(bad)} of {len(want)} values differ (tol {tol}):\n" + "\n".join(bad[:20])


# --- the harness: one scenario under both engines -----------------------------------------------------
SELF = os.environ.get("MESHPAR_COMPAT_SELF") == "1"  # torch against torch: the sanity mode


def engines() -> tuple[ModuleType, ModuleType]:
    """(reference, engine under test): torch's and meshpar's, or torch's twice in sanity mode."""
    import meshpar.fsdp as meshpar_fsdp

    return torch_fsdp, (torch_fsdp if SELF else meshpar_fsdp)


@dataclass
class Ctx:
    rank: int
    world: int
    mesh: DeviceMesh  # 1-D ("dp_shard",) at 1 and 2 ranks; 2x2 ("dp_replicate", "dp_shard") at 4
    tmp: Path  # shared by the ranks of one job


def both(scenario: Callable[..., Record], ctx: Ctx, *args, tol: float = TOL) -> tuple[Record, Record]:
    """``scenario(E, ctx, *args)`` under torch's engine, then under meshpar's; their records must agree."""
    ref, ours = engines()
    want = scenario(ref, ctx, *args)
    got = scenario(ours, ctx, *args)
    assert_same_record(got, want, tol, f"{getattr(scenario, '__name__', scenario)}{args}: meshpar vs torch")
    return got, want


def subcases(runs: dict[str, Callable[[], object]]) -> None:
    """Run every sub-case even when one fails, then fail with all their errors (first line each)."""
    errors = []
    for label, run in runs.items():
        try:
            run()
        except Exception as e:  # noqa: BLE001 - reported together below
            errors.append(f"[{label}] {type(e).__name__}: {str(e).strip()}")
    assert not errors, f"{len(errors)} of {len(runs)} sub-cases failed:\n" + "\n".join(errors)


def each(scenario: Callable[..., Record], ctx: Ctx, labels: tuple, **kwargs) -> None:
    """``both(scenario, ctx, label)`` for each label, every one run (see ``subcases``)."""
    subcases({str(label): functools.partial(both, scenario, ctx, label, **kwargs) for label in labels})


def shard_blocks(E: ModuleType, model: nn.Module, mesh: DeviceMesh, **kwargs) -> nn.Module:
    """``E.fully_shard`` each of ``model.layers``, then the root (the usual layout)."""
    for block in model.layers:
        E.fully_shard(block, mesh=mesh, **kwargs)
    return E.fully_shard(model, mesh=mesh, **kwargs)


def none_grads(model: nn.Module) -> list[str]:
    """The parameters whose ``.grad`` is None, by name."""
    return sorted(name for name, p in model.named_parameters() if p.grad is None)


def setup(tmp: Path) -> Ctx:
    """The compat jobs' ``CaseSet`` setup: float64 (tests/parity.py [Note: parity in float64]) and the
    mesh: 1-D ``dp_shard`` at 1 and 2 ranks, 2x2 ``(dp_replicate, dp_shard)`` at 4."""
    torch.set_default_dtype(torch.float64)
    world = dist.get_world_size()
    shape, names = ((world,), ("dp_shard",)) if world <= 2 else ((2, 2), ("dp_replicate", "dp_shard"))
    return Ctx(dist.get_rank(), world, init_device_mesh("cpu", shape, mesh_dim_names=names), tmp)


def scenario_case(scenario: Callable[..., Record], *labels: object, tol: float = TOL) -> Callable[[Ctx], None]:
    """A ``CaseSet`` case running ``both(scenario, ctx, label)`` for each label (or once, without)."""
    def case(ctx: Ctx) -> None:
        if labels:
            each(scenario, ctx, labels, tol=tol)
        else:
            both(scenario, ctx, tol=tol)
    return case
