"""A mixture-of-experts step's bookkeeping, in one place the training step calls: the routers'
auxiliary loss joined to each microbatch's backward, the expert loads summed over the step, the
routing graphs let go after each backward, and the aux-free bias update after the optimizer step.
It asks the family's ``moe`` part (meshpar/models/moe/part.py), never the model's attributes.

    tally = ExpertTally(model.moe, accum)      # None for a dense family: the step skips it all
    out = tally.join(stage, stage(inputs))     # each microbatch, before the loss
    tally.after_backward(stage, tokens)
    with tally.around_schedule(runners, tokens): pipeline.step_microbatches(...)
    tally.aux, tally.load                      # StepResult's aux_loss and expert_load
    update_biases(model.moe, model.stages, dp) # after the optimizer step

Notes: [Note: auxiliary losses], [Note: auxiliary losses under pipelining], [Note: expert load].
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from meshpar.distributed import comm

if TYPE_CHECKING:
    from meshpar.models.moe.part import MoEPart

# [Note: auxiliary losses]
# A mixture-of-experts forward leaves its routers' load-balancing loss ([Note: load-balancing loss] in
# meshpar/models/moe/model.py), which the family's ``moe`` part returns weighted (``aux_loss``). The
# step backpropagates cross-entropy + aux_loss, each divided by ``accum``, the auxiliary loss joined
# through ``_JoinAux`` on the logits (a plain scalar added to a tensor-parallel loss, a DTensor,
# would mix the two kinds in backward), and reports them apart: ``loss`` is the cross-entropy alone,
# comparable with dense models and with validation. A recompute under activation checkpointing
# leaves each layer's loss again, a graph nothing consumes: the checkpoint wrapper drops it ([Note:
# a recompute's side outputs] in meshpar/parallel/activation_checkpoint.py), and the tally lets go
# of the layers' graphs after each backward (``MoEPart.forget``), so nothing of a step outlives it
# (tests/test_moe_metrics.py). With aux-free balancing the biases move after each optimizer step
# by the expert loads summed over the data-parallel ranks (``update_biases``).

# [Note: auxiliary losses under pipelining]
# A pipeline schedule backpropagates the last stage's loss and, on every other stage, the gradient
# its output receives; a stage's auxiliary loss is in neither. While the schedule runs, each stage's
# forward output passes through ``_JoinAux`` (the stage's ``on_output`` hook, ``around_schedule``):
# the identity in forward, and in backward it also hands the auxiliary loss the gradient 1/accum, so
# each microbatch's auxiliary loss joins the backward that reaches its stage's output, whichever
# schedule (split backward passes included: one graph). The hook also sums each microbatch's
# auxiliary loss and expert loads on this rank; train.py adds them over the pp ranks (the expert
# loads are sized for the whole model, zero for layers on other stages) before the data-parallel mean.

# [Note: expert load]
# After each microbatch's forward, each mixture-of-experts layer holds the token slots its router
# sent to each expert (before any capacity drop). The tally sums them over its microbatches into
# ``load[0]`` ([L_sparse, E], this rank), and into ``load[1]`` the slots over each expert's
# capacity ceil(capacity_factor * slots / E) in that forward: those the model dropped
# (``ChosenSlots.drop_over_capacity`` keeps counts.clamp(max=capacity)). Device tensors, no host
# sync: train.py sums them over the data-parallel ranks and reads them on the steps it logs, with
# the loss (meshpar.training.metrics.expert_load_fields). They are counted after each forward, not
# read from the aux-free ``expert_load`` buffers, which activation checkpointing's recompute counts
# twice.


class _JoinAux(torch.autograd.Function):
    """``output`` unchanged; its backward also sends the gradient ``scale`` into ``aux`` (a scalar):
    [Note: auxiliary losses under pipelining]."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale, ctx.aux = scale, (aux.dtype, aux.device)
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        dtype, device = ctx.aux
        return grad, torch.tensor(ctx.scale, dtype=dtype, device=device), None


class ExpertTally:
    """One step's auxiliary loss and expert loads on this rank, summed over its microbatches (and
    pipeline stages): ``aux`` a scalar, ``load`` [2, L_sparse, E]; None until a sparse layer ran."""

    def __init__(self, moe: MoEPart, accum: int) -> None:
        self.moe, self.accum = moe, accum
        self.aux: torch.Tensor | None = None
        self.load: torch.Tensor | None = None

    def join(self, stage: torch.nn.Module, output: torch.Tensor) -> torch.Tensor:
        """A whole model's forward ``output`` with its auxiliary loss joined to its backward ([Note:
        auxiliary losses]); the loss's value joins ``aux``."""
        aux = self.moe.aux_loss(stage)
        if aux is None:
            return output
        self.aux = aux.detach() / self.accum + (0 if self.aux is None else self.aux)
        return _JoinAux.apply(output, aux, 1.0 / self.accum)

    def after_backward(self, stage: torch.nn.Module, tokens: int) -> None:
        """After a microbatch's backward over ``tokens`` tokens: its expert loads join ``load``, and the
        layers' routing graphs go."""
        if not self.moe.sparse_layers(stage):
            return
        count = self.moe.expert_load(stage, tokens)
        self.load = count if self.load is None else self.load + count
        self.moe.forget(stage)

    @contextlib.contextmanager
    def around_schedule(self, runners: Sequence[Any], tokens: int) -> Iterator[None]:
        """While a pipeline schedule runs: every stage's auxiliary loss joins its backward, and is summed
        with its expert loads ([Note: auxiliary losses under pipelining]); ``runners``: the schedule's
        ``meshpar.parallel.pipeline.Stage``s, ``tokens`` per microbatch. Zeros on a rank whose stages
        hold no sparse layer of a model that has some: train.py reduces over pp."""
        stages = [r.submod for r in runners]
        args = stages[0].args  # every stage keeps the whole model's args
        sparse = self.moe.model_sparse_layers(args)
        if not sparse:
            yield
            return
        first = next(iter(stages[0].parameters()))
        self.aux = torch.zeros((), device=first.device)
        self.load = torch.zeros((2, len(sparse), self.moe.n_experts(args)), device=first.device, dtype=torch.int64)

        def join(stage: torch.nn.Module, output: torch.Tensor) -> torch.Tensor:
            if not torch.is_grad_enabled():
                return output
            if self.moe.sparse_layers(stage):
                self.load += self.moe.expert_load(stage, tokens)
            aux = self.moe.aux_loss(stage)
            if aux is None:
                return output
            self.aux += aux.detach().to(self.aux.dtype) / self.accum
            return _JoinAux.apply(output, aux, 1.0 / self.accum)

        for runner in runners:  # [Note: forwards outside the schedule]: only the schedule's own
            runner.on_output = join
        try:
            yield
        finally:
            for runner in runners:
                runner.on_output = None
            for stage in stages:  # [Note: auxiliary losses]: a recompute's graph, let go
                self.moe.forget(stage)


def update_biases(moe: MoEPart, stages: torch.nn.ModuleList, dp: DeviceMesh | None) -> None:
    """Aux-free balancing ([Note: auxiliary losses]): sum each stage's expert loads over the
    data-parallel ranks, so every replica moves its biases alike, then update them."""
    for stage in stages:
        if not moe.balances_by_bias(stage.args):
            continue
        loads = moe.bias_loads(stage)
        if dp is not None and dp.size() > 1:
            comm.all_reduce(loads, dp.get_group(), dim="dp")
        moe.update_bias(stage, loads)
