"""Models, data, the training loop and the result comparison behind tests/test_fsdp_compat.py.

Everything here is engine-agnostic: a scenario builds a model from these pieces, applies
``E.fully_shard`` (torch's or meshpar's), trains with ``train`` and writes what it observed
into a ``Record``; ``assert_same_record`` then holds meshpar's record to torch's. Models take
the default dtype (float64 in the compat job, float32 in the mixed-precision scenario) and
have awkward row counts (7, 19, 3, 1) so that shards are uneven at 2 ranks and empty at 4.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.testing import assert_close

from tests.fsdp_models import DIM, HIDDEN, IN, OUT, Block, Net
from tests.parity import upcast

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
        return x.view_as(x)

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
