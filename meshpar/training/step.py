"""One training step, written once: what ``meshpar train`` runs and ``meshpar plan`` simulates.

    sync = GradSync.of(mesh, recipe.parallel, recipe.optim)
    done = train_step(model, loader.next_step, accum, sync, device, optimizer, scheduler)
    done.loss, done.grad_norm, done.lr        # this rank's loss (a tensor: no host sync), the norm, the LR
    done.aux_loss                             # a mixture-of-experts model's auxiliary loss, or None
    done.expert_load                          # and its expert loads [2, L_sparse, E], or None

A flat function, in the order it runs, each phase labelled for the profiler
(``meshpar::step``, ``data``, ``forward``, ``backward``, ``optimizer``):

    batch -> forward/backward per microbatch, each loss / accum   (or the pipeline schedule's step)
          -> replicas all-reduce, tensor-parallel partial gradients reduce   (without FSDP)
          -> clip the gradient norm across every mesh dim (pp groups included)
          -> optimizer step, LR schedule step, zero_grad

FSDP reduce-scatters during the last microbatch's backward, or every microbatch's with
``parallel.grad_reduce = "microbatch"``; under pipelining the stage switches sync itself
([Note: one reduce-scatter per step under pipelining]).

The planner (``meshpar/planner/simulate.py``) runs this same function on fake tensors, so the
simulated step cannot drift from the real one; it passes ``phase``, a ``model.pipeline`` that runs
one microbatch at a time, and no optimizer ([Note: what the simulation leaves to arithmetic]).

A mixture-of-experts family's bookkeeping (auxiliary loss, expert loads, bias update) is
meshpar/training/experts.py's, called where each happens.

Notes: [Note: losses do not depend on the layout].
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from meshpar.config.recipe import OptimConfig, ParallelConfig
from meshpar.distributed.clip import clip_grad_norm_
from meshpar.distributed.mesh import Mesh
from meshpar.fsdp import FSDPModule
from meshpar.parallel.context_parallel.layout import shard_sequence
from meshpar.parallel.data_parallel import all_reduce_gradients
from meshpar.parallel.tensor_parallel.plan import loss_parallel_context, reduce_partial_grads
from meshpar.profiling.capture import label
from meshpar.training.experts import ExpertTally, update_biases
from meshpar.training.loss import TokenLoss, plain
from meshpar.training.nonfinite import NonFiniteGuard

if TYPE_CHECKING:
    from meshpar.models.moe.part import MoEPart

# [Note: losses do not depend on the layout]
# Batch sizes are global. Every microbatch has the same number of tokens, each rank's loss
# is a mean over its tokens divided by the accumulation depth, and gradients are averaged
# over the data-parallel ranks, so the gradient is the mean over the whole global batch for
# any split of it across ranks and microbatches. Fine-tuning data, where only some targets
# train, weighs each by the global count instead ([Note: the loss over trained tokens] in
# meshpar/training/loss.py).

Microbatch = tuple[torch.Tensor, torch.Tensor]  # (inputs, targets), int64 [micro_batch, seq_len]


class Schedule(Protocol):
    """What a step needs of a pipeline: ``meshpar.parallel.pipeline.Pipeline`` (or the planner's stand-in)."""

    stages: Sequence[Any]  # this rank's ``meshpar.parallel.pipeline.Stage``s

    def step_microbatches(self, microbatches: Sequence[Microbatch]) -> torch.Tensor | None: ...


@dataclass
class Model:
    """This rank's part of the model: its pipeline stages (one, the whole model, when pp = 1)."""

    stages: torch.nn.ModuleList
    pipeline: Schedule | None  # the schedule when pp > 1
    loss_parallel: bool  # logits are vocab-sharded DTensors: the loss runs under loss_parallel
    # after each optimizer step, and before the first (float8 scales: parallel/float8.py ``precompute_scales``)
    after_step: Callable[[], None] | None = None
    # what forward and backward run under (float8 all-gathers over gloo: parallel/float8.py ``around_step``)
    around_step: Callable[[], AbstractContextManager] = contextlib.nullcontext
    # a microbatch's mean loss from the last stage's output (whole logits, or chunk by chunk: training/loss.py)
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = TokenLoss()
    moe: MoEPart | None = None  # the family's mixture-of-experts part (training/experts.py), None when dense

    def state_dict(self) -> dict[str, Any]:
        """Parameter names of the whole model: stages hold disjoint blocks under their global names."""
        out: dict[str, Any] = {}
        for stage in self.stages:
            out.update(stage.state_dict())
        return out


@dataclass(frozen=True)
class GradSync:
    """How a step reduces and clips this rank's gradients (from the layout, ``[parallel]``, ``[optim]``)."""

    replicate: DeviceMesh  # Mesh.replicas (dp_replicate, x cp): replicas all-reduce when FSDP does not shard
    tp: bool  # tensor parallel: replicated parameters' partial gradients reduce (FSDP does it itself)
    every_microbatch: bool  # parallel.grad_reduce = "microbatch": FSDP reduce-scatters after each
    max_norm: float  # optim.grad_clip; inf when 0 (clipping off: the norm is still measured)
    pp_groups: list[dist.ProcessGroup] = field(default_factory=list)  # the norm sums over stages
    dp: DeviceMesh | None = None  # mesh["dp"]: expert loads sum over it ([Note: auxiliary losses])
    cp: DeviceMesh | None = None  # mesh["cp"] when context parallel: each rank takes its tokens of every sequence
    # under fault.replicas = "torchft": meshpar.runtime.replicas.ReplicaGroups, the groups' average
    # and commit vote, and how many groups the job has; else None and 1
    groups: Any = None
    jobs: int = 1

    @classmethod
    def of(cls, mesh: Mesh, parallel: ParallelConfig, optim: OptimConfig, *, groups: Any = None,
           jobs: int = 1) -> GradSync:
        return cls(mesh.replicas, mesh.layout.tp > 1, parallel.grad_reduce == "microbatch",
                   optim.grad_clip if optim.grad_clip > 0 else math.inf,
                   [mesh["pp"].get_group()] if mesh.layout.pp > 1 else [], mesh["dp"],
                   mesh["cp"] if mesh.layout.cp > 1 else None, groups, jobs)


@dataclass
class StepResult:
    loss: torch.Tensor  # this rank's loss (zero on pipeline ranks without the last stage)
    grad_norm: torch.Tensor  # before clipping, over the whole model
    lr: float | None  # the learning rate the optimizer stepped with (None without an optimizer)
    skipped: bool = False  # the optimizer did not step: a non-finite gradient ([Note: non-finite steps])
    aux_loss: torch.Tensor | None = None  # this rank's auxiliary loss, not in ``loss`` ([Note: auxiliary losses])
    expert_load: torch.Tensor | None = None  # [2, L_sparse, E] slots routed / dropped, this rank ([Note: expert load])
    trained: int | None = None  # fine-tuning: the global batch's trained targets (None: every target)
    retry: bool = False  # the replica groups did not commit the step (torchft): run it again


def labelled(name: str, microbatch: int | None = None) -> AbstractContextManager:
    """The default ``phase``: ``meshpar::<name>`` in a profiler trace."""
    return label(name)


def train_step(model: Model, next_batch: Callable[[], Sequence[Microbatch]], accum: int, sync: GradSync,
               device: torch.device, optimizer: torch.optim.Optimizer | None = None,
               scheduler: torch.optim.lr_scheduler.LRScheduler | None = None, *,
               phase: Callable[..., AbstractContextManager] = labelled,
               guard: NonFiniteGuard | None = None) -> StepResult:
    """One optimizer step over the microbatches ``next_batch()`` returns (``accum`` per step;
    the planner runs fewer, still dividing by ``accum``). ``phase(name, microbatch=None)`` wraps
    each phase: "step", "data", "forward" and "backward" (with the microbatch index), "optimizer".
    Without ``optimizer`` the step ends after clipping; ``scheduler`` steps with the optimizer.
    ``guard`` (``train.on_nonfinite``) may skip the optimizer step or stop the run after clipping."""
    with phase("step"):
        with loss_parallel_context(model.loss_parallel), model.around_step():
            with phase("data"):
                microbatches = next_batch()
                # a batch, not the model: meshpar.data.loader.Step counts trained targets; a plain list does not
                trained = getattr(microbatches, "trained", None)
                if sync.cp is not None:  # this cp rank's tokens of every sequence ([Note: balanced sequence split])
                    microbatches = [(shard_sequence(x, sync.cp), shard_sequence(y, sync.cp)) for x, y in microbatches]
            # the loss object, not the model: TokenLoss weighs by trained targets ([Note: the loss over
            # trained tokens]); a caller's own loss function may not
            weigh = getattr(model.loss, "weight", None)
            with weigh(token_weight(trained, accum, sync)) if weigh is not None else contextlib.nullcontext():
                loss_sum, aux_sum, load = _forward_backward(model, microbatches, accum, sync, device, phase)
        with phase("optimizer"):
            maybe_reduce_replicas(model.stages, sync)
            params = [q for q in model.stages.parameters() if q.requires_grad]
            if sync.groups is not None:  # the mean over the replica groups in the quorum (torchft)
                sync.groups.average(params)
                if not sync.groups.commit():
                    if optimizer is not None:
                        optimizer.zero_grad(set_to_none=True)
                    return StepResult(loss_sum, torch.zeros(()), None, skipped=True, retry=True)
            grad_norm = clip_grad_norm_(params, sync.max_norm, extra_groups=sync.pp_groups)
            if guard is not None and not guard.allows_step(grad_norm):
                if optimizer is not None:
                    optimizer.zero_grad(set_to_none=True)
                return StepResult(loss_sum, grad_norm, None, skipped=True, aux_loss=aux_sum, expert_load=load,
                                  trained=trained)
            lr = maybe_optimizer_step(optimizer, scheduler)
            if optimizer is not None:
                if model.moe is not None:
                    update_biases(model.moe, model.stages, sync.dp)
                if model.after_step is not None:
                    model.after_step()
    return StepResult(loss_sum, grad_norm, lr, aux_loss=aux_sum, expert_load=load, trained=trained)


def token_weight(trained: int | None, accum: int, sync: GradSync) -> float | None:
    """Each trained token's loss weight in a microbatch ([Note: the loss over trained tokens]): None
    when every target trains; 0 when none of the global batch's do (the step then changes nothing)."""
    if trained is None:
        return None
    ranks = (sync.dp.size() if sync.dp is not None else 1) * (sync.cp.size() if sync.cp is not None else 1) * sync.jobs
    return accum * ranks / trained if trained else 0.0


def _forward_backward(model: Model, microbatches: Sequence[Microbatch], accum: int, sync: GradSync,
                      device: torch.device, phase: Callable[..., AbstractContextManager]
                      ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Every microbatch's forward and backward: (loss summed, auxiliary loss, expert loads) on this rank."""
    loss_sum = torch.zeros((), device=device)
    tally = ExpertTally(model.moe, accum) if model.moe is not None else None
    if model.pipeline is not None:  # the schedule runs every microbatch, forward and backward
        tokens = microbatches[0][0].numel()
        with tally.around_schedule(model.pipeline.stages, tokens) if tally else contextlib.nullcontext():
            loss = model.pipeline.step_microbatches(microbatches)
        if loss is not None:
            loss_sum = loss_sum + plain(loss)
    else:
        stage = model.stages[0]
        sharded = isinstance(stage, FSDPModule)
        for i, (inputs, targets) in enumerate(microbatches):
            if sharded:  # FSDP reduce-scatters in the last microbatch's backward (or in each)
                stage.set_requires_gradient_sync(sync.every_microbatch or i == len(microbatches) - 1)
            with phase("data"):
                inputs, targets = inputs.to(device), targets.to(device)
            with phase("forward", i):
                out = stage(inputs)
                if tally is not None:  # the auxiliary loss joins the backward
                    out = tally.join(stage, out)
                loss = model.loss(out, targets) / accum
                del out  # the logits (or h): backward needs the loss's saved tensors only
            with phase("backward", i):
                loss.backward()
            loss_sum += plain(loss.detach())
            if tally is not None:
                tally.after_backward(stage, inputs.numel())
    return loss_sum, tally.aux if tally else None, tally.load if tally else None


def maybe_reduce_replicas(stages: torch.nn.ModuleList, sync: GradSync) -> None:
    """Without FSDP, average gradients over the replicas and reduce tensor-parallel partial
    gradients; FSDP units did both in their reduce-scatter."""
    if isinstance(stages[0], FSDPModule):
        return
    all_reduce_gradients(stages, sync.replicate)
    if sync.tp:
        reduce_partial_grads(stages)


def maybe_optimizer_step(optimizer: torch.optim.Optimizer | None,
                         scheduler: torch.optim.lr_scheduler.LRScheduler | None) -> float | None:
    """Step the optimizer (and the LR schedule) and zero the gradients; the LR stepped with.
    The planner passes no optimizer: [Note: what the simulation leaves to arithmetic]."""
    if optimizer is None:
        return None
    lr = scheduler.get_last_lr()[0] if scheduler is not None else None
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return lr
