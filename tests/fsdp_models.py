"""Tiny models, data and the parity loop behind tests/test_fsdp.py.

A ``Task`` is a model builder, a global batch per step and a loss; models and batches take
the default dtype, which the FSDP jobs set to float64 (tests/parity.py [Note: parity in
float64]), so ``assert_parity`` holds them to 1e-9. ``train`` steps a
sharded model (each data-parallel rank on its slice of the global batch, mean loss per
rank) next to a single-process reference that sees the whole batch, with AdamW on both,
and returns the global losses and one ``comm_record.count()`` per step and per microbatch.
``gather_params`` / ``assert_parity`` compare every parameter, gathered, with the reference.

``Net`` is built to be awkward for a dim-0 sharder: rows of 6, 19 and 3 divide neither 2
nor 4, and ``gain`` has one row, so every rank but the first holds an empty shard of it
(and at 4 ranks the last rank holds no rows of ``emb.weight`` or ``out.*``).
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

from meshpar.distributed import comm_record
from meshpar.models.gpt2.model import GPT2, GPT2Args
from tests.parity import TOL, upcast

IN, DIM, HIDDEN, OUT, BATCH = 7, 6, 19, 3, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(DIM, HIDDEN)  # weight [19, 6]
        self.b = nn.Linear(HIDDEN, DIM)  # weight [6, 19]

    def forward(self, x: Tensor) -> Tensor:
        return x + self.b(torch.tanh(self.a(x)))


class Net(nn.Module):
    """x[B, 7] -> [B, 3]: an embedding Linear, a [1, 6] gain, ``layers`` of Blocks, an output Linear."""

    def __init__(self, n_layers: int = 3) -> None:
        super().__init__()
        self.emb = nn.Linear(IN, DIM)  # weight [6, 7]
        self.gain = nn.Parameter(torch.ones(1, DIM) + 0.1 * torch.randn(1, DIM))  # fewer rows than ranks
        self.layers = nn.ModuleList([Block() for _ in range(n_layers)])
        self.out = nn.Linear(DIM, OUT)  # weight [3, 6]

    def forward(self, x: Tensor) -> Tensor:
        h = self.emb(x) * self.gain
        for layer in self.layers:
            h = layer(h)
        return self.out(h)


TINY_GPT2 = GPT2Args(dim=16, n_layers=2, n_heads=2, vocab_size=37, max_seq_len=8)  # 37 rows: uneven


@dataclass(frozen=True)
class Task:
    build: Callable[[], nn.Module]  # a fresh model, its values fixed by a seed
    batch: Callable[[int], tuple[Tensor, ...]]  # the global batch of a step, batch dim first
    loss: Callable[[nn.Module, tuple[Tensor, ...]], Tensor]  # mean over the batch given
    lr: float = 1e-2  # AdamW's


# [Note: GPT-2's key bias and Adam]
# Softmax ignores a constant added to every score of a query, so the gradient of the key
# bias (c_attn.bias[D:2D]) is zero in exact arithmetic: what remains is rounding noise,
# ~1e-11 in float32, which differs with the reduction order of any data-parallel layout.
# Adam divides it by its own root mean square (eps 1e-8), turning noise into updates of
# ~1e-3 * lr per step: in float32 at lr 1e-2 a 2x2 hybrid run drifted 1.4e-5 from the
# reference on that bias alone. In float64 the noise is ~1e-20 and harmless; lr 1e-3 stays.


def _build_net() -> Net:
    torch.manual_seed(0)
    return Net()


def _net_batch(step: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, IN, generator=g), torch.randn(BATCH, OUT, generator=g)


def _net_loss(model: nn.Module, batch: tuple[Tensor, ...]) -> Tensor:
    x, y = batch
    return F.mse_loss(upcast(model(x)), y)


def _build_gpt2() -> GPT2:
    model = GPT2(TINY_GPT2)
    torch.manual_seed(0)
    model.init_weights()
    return model


def _gpt2_batch(step: int) -> tuple[Tensor]:
    g = torch.Generator().manual_seed(200 + step)
    return (torch.randint(0, TINY_GPT2.vocab_size, (BATCH, TINY_GPT2.max_seq_len + 1), generator=g),)


def _gpt2_loss(model: nn.Module, batch: tuple[Tensor, ...]) -> Tensor:
    (tokens,) = batch
    logits = model(tokens[:, :-1])  # [B, T, V]
    return F.cross_entropy(upcast(logits).flatten(0, 1), tokens[:, 1:].flatten())


NET = Task(_build_net, _net_batch, _net_loss)
GPT = Task(_build_gpt2, _gpt2_batch, _gpt2_loss, lr=1e-3)  # [Note: GPT-2's key bias and Adam]


def shard_units(model: nn.Module, fully_shard: Callable, **kwargs) -> int:
    """``fully_shard`` each block in ``model.layers``, then the root; returns the unit count."""
    blocks = model.layers.values() if isinstance(model.layers, nn.ModuleDict) else model.layers
    for block in blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return len(blocks) + 1


def local_slice(t: Tensor, rank: int, world: int) -> Tensor:
    """This data-parallel rank's equal slice of a global batch."""
    return t.chunk(world)[rank]


def dp_mean(value: float) -> float:
    """The mean of a per-rank scalar over every rank (the data-parallel world in these tests)."""
    t = torch.tensor(value, dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


@dataclass
class Run:
    losses: list[tuple[float, float]]  # per step: (mean of the ranks' losses, the reference's loss)
    steps: list[comm_record.CommCounter]  # collectives per optimizer step (forward, backward, step)
    micro: list[list[comm_record.CommCounter]]  # collectives per microbatch (forward + backward)


def train(model: nn.Module, ref: nn.Module | None, task: Task, *, steps: int = 5, accumulate: int = 1,
          optims: tuple | None = None) -> Run:
    """AdamW steps on ``model`` (this rank's slice, ``accumulate`` microbatches, gradient sync on the
    last only) and on ``ref`` (the whole batch). ``optims``: existing (opt, ref_opt) to continue."""
    rank, world = dist.get_rank(), dist.get_world_size()
    opt, ref_opt = optims or (torch.optim.AdamW(model.parameters(), lr=task.lr),
                              ref and torch.optim.AdamW(ref.parameters(), lr=task.lr))
    run = Run([], [], [])
    for step in range(steps):
        batch = task.batch(step)
        local = [local_slice(t, rank, world) for t in batch]
        total, micro = 0.0, []
        for i, mb in enumerate(zip(*(t.chunk(accumulate) for t in local), strict=True)):
            if accumulate > 1:
                model.set_requires_gradient_sync(i == accumulate - 1)
            with comm_record.count() as c:
                loss = task.loss(model, mb) / accumulate
                loss.backward()
            micro.append(c)
            total += loss.item()
        with comm_record.count() as c:  # not nested: see test_fsdp.test_comm_count_blocks_nest
            opt.step()
            opt.zero_grad()
        ref_loss = math.nan
        if ref is not None:
            rl = task.loss(ref, batch)
            rl.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            ref_loss = rl.item()
        run.losses.append((dp_mean(total), ref_loss))
        run.steps.append(_sum(*micro, c))
        run.micro.append(micro)
    return run


def _sum(*counters: comm_record.CommCounter) -> comm_record.CommCounter:
    total = comm_record.CommCounter()
    for c in counters:
        total.calls.update(c.calls)
        total.bytes.update(c.bytes)
    return total


def gather_params(model: nn.Module) -> dict[str, Tensor]:
    """Every parameter as a full tensor; each must be a DTensor (sharded or replicated)."""
    params = dict(model.named_parameters())
    plain = [name for name, p in params.items() if not isinstance(p, DTensor)]
    assert not plain, f"parameters that are not DTensors after the step: {plain}"
    return {name: p.full_tensor().detach() for name, p in params.items()}


def assert_parity(model: nn.Module, ref: nn.Module, run: Run, *, rtol: float = TOL, atol: float = TOL) -> None:
    """The loss at every step and every gathered parameter match the reference (float64: 1e-9)."""
    full = gather_params(model)
    ref_params = {name: p.detach() for name, p in ref.named_parameters()}
    assert full.keys() == ref_params.keys() and full, sorted(full)
    got, want = zip(*run.losses, strict=True)
    assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64), rtol=rtol,
                 atol=atol, msg=lambda m: f"losses per step {got} vs reference {want}: {m}")
    for name, t in full.items():
        assert_close(t, ref_params[name], rtol=rtol, atol=atol, msg=lambda m, name=name: f"{name}: {m}")


def chunk_numel(t: Tensor, world: int) -> int:
    """Elements each rank sends for ``t`` in an all-gather: its torch.chunk rows, ceil(rows / world)."""
    return torch.chunk(t, world)[0].numel()


def unit_params(model: nn.Module) -> list[list[Tensor]]:
    """The parameters of each unit in ``shard_units``' layout: each block, then the root's rest."""
    blocks = list(model.layers.values() if isinstance(model.layers, nn.ModuleDict) else model.layers)
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    root = [p for p in model.parameters() if id(p) not in in_blocks]
    return [list(b.parameters()) for b in blocks] + [root]
