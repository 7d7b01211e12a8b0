"""Pipeline schedules on ``torch.distributed.pipelining``, driving meshpar's FSDP engine per stage.

    check_microbatches("1f1b", n_microbatches=8, pp=4, virtual=1, local_batch=16)
    pipe = build_schedule(stages, n_stages=4, pp_group=mesh["pp"], device=device, name="1f1b",
                          n_microbatches=8, loss_fn=cross_entropy)
    loss = pipe.step(inputs, targets)    # the mean loss on ranks holding the last stage, else None

Schedules (``SCHEDULES``): ``gpipe`` (all forwards, then all backwards), ``1f1b``,
``interleaved_1f1b`` (``virtual`` stages per rank, loop placement), ``zero_bubble``
(interleaved ZB1P: backward split into input and weight passes, loop placement) and
``zbv`` (zero bubble on a V placement, exactly 2 stages per rank).

Limits: one positional input per stage and one output tensor (hidden states or logits);
every microbatch the same shape (``local_batch % n_microbatches == 0``); written against
the stage / schedule hooks of torch 2.13 (``PipelineStage.backward_maybe_with_nosync`` and
``perform_reduce_grad``), which are not public API and moved between releases.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

from meshpar.config.recipe import RecipeError
from meshpar.distributed.tracing import trace_range
from meshpar.fsdp import FSDPModule
from meshpar.profiling.labels import label_p2p_ops, p2p_labels


@dataclass(frozen=True)
class ScheduleSpec:
    cls: type
    style: str  # stage placement, meshpar.parallel.pipeline.split.stage_ids: "loop" or "v"
    multi: bool  # takes a list of stages per rank (virtual stages) rather than exactly one
    split_backward: bool = False  # backward as separate input and weight passes (gradients reduced once per step)


SCHEDULES: dict[str, ScheduleSpec] = {
    "gpipe": ScheduleSpec(ScheduleGPipe, "loop", multi=False),
    "1f1b": ScheduleSpec(Schedule1F1B, "loop", multi=False),
    "interleaved_1f1b": ScheduleSpec(ScheduleInterleaved1F1B, "loop", multi=True),
    "zero_bubble": ScheduleSpec(ScheduleInterleavedZeroBubble, "loop", multi=True, split_backward=True),
    "zbv": ScheduleSpec(ScheduleZBVZeroBubble, "v", multi=True, split_backward=True),
}

# [Note: microbatch counts each schedule runs]
# What torch's schedules accept (tests/test_pipeline.py's microbatch_counts case holds
# check_microbatches to real steps at pp 2, n 1-6):
#   gpipe             any n >= 1
#   1f1b              n >= pp (its constructor refuses fewer)
#   interleaved_1f1b  with rounds = max(1, n // pp): n % rounds == 0, i.e. n <= 2 pp - 1 or a
#   zero_bubble       multiple of n // pp (n = 5 at pp 2 fails; 4, 6, 8 run)
#   zbv               any n >= 1, exactly 2 stages per rank
# Every schedule splits the batch with torch.tensor_split, which makes uneven microbatches
# when n does not divide it; p2p buffers are sized from microbatch 0 and a mean of unequal
# means is not the batch mean, so meshpar requires local_batch % n == 0.


def _rounds_ok(n: int, pp: int) -> bool:
    rounds = max(1, n // pp)
    return n % rounds == 0


def _fits(name: str, n: int, pp: int) -> bool:
    if name == "1f1b":
        return n >= pp
    if name in ("interleaved_1f1b", "zero_bubble"):
        return _rounds_ok(n, pp)
    return n >= 1


def check_microbatches(name: str, n_microbatches: int, pp: int, virtual: int = 1,
                       local_batch: int | None = None, key: str = "parallel.pp_microbatches") -> None:
    """Raise a RecipeError unless schedule ``name`` runs ``n_microbatches`` microbatches on ``pp``
    ranks with ``virtual`` stages each; see [Note: microbatch counts each schedule runs].
    ``local_batch``: sequences per rank per step, which n must divide. The error names
    ``parallel.pp_schedule``, ``parallel.pp_virtual_stages`` or, for the count, ``key`` (the
    recipe key the count comes from)."""
    if name not in SCHEDULES:
        raise RecipeError(f"parallel.pp_schedule = '{name}': unknown schedule; choose one of "
                          f"{', '.join(SCHEDULES)}", "parallel.pp_schedule")
    spec = SCHEDULES[name]
    if not spec.multi and virtual != 1:
        raise RecipeError(f"parallel.pp_virtual_stages = {virtual}: schedule '{name}' runs one stage per rank; "
                          f"set it to 1 or use interleaved_1f1b / zero_bubble", "parallel.pp_virtual_stages")
    if spec.style == "v" and virtual != 2:
        raise RecipeError(f"parallel.pp_virtual_stages = {virtual}: schedule '{name}' needs exactly 2 stages per rank; "
                          f"set it to 2", "parallel.pp_virtual_stages")
    ok = n_microbatches >= 1 and _fits(name, n_microbatches, pp)
    if ok and (local_batch is None or local_batch % n_microbatches == 0):
        return
    if ok:
        why = f"it must divide the {local_batch} sequences each rank takes per step"
    elif name == "1f1b":
        why = f"1f1b needs at least pp ({pp}) microbatches"
    elif name in ("interleaved_1f1b", "zero_bubble"):
        why = f"{name} needs n <= {2 * pp - 1} or n a multiple of n // pp (here {n_microbatches // pp})"
    else:
        why = "it must be at least 1"
    fits = [n for n in range(1, 8 * pp + 1) if _fits(name, n, pp) and (local_batch is None or local_batch % n == 0)]
    problem = f"{n_microbatches} pipeline microbatches per step do not fit schedule '{name}' on pp = {pp}: {why}"
    if key == "train.micro_batch" and local_batch is not None:  # meshpar's recipes: n = local batch / micro_batch
        sizes = [local_batch // n for n in fits]
        raise RecipeError(f"train.micro_batch = {local_batch // n_microbatches}: {problem}; micro_batch values that "
                          f"fit the {local_batch} sequences per data-parallel rank: "
                          f"{', '.join(map(str, sizes)) or 'none: raise train.global_batch'}", key)
    raise RecipeError(f"{key}: {problem}; counts that fit: {fits or 'none up to ' + str(8 * pp)}", key)


# [Note: one reduce-scatter per step under pipelining]
# A schedule runs each microbatch's backward separately, and meshpar's FSDP engine reduces a
# unit's gradients when its last gradient of a backward pass accumulates (a
# post-accumulate-grad hook), so left alone a step would reduce-scatter once per microbatch.
# The stage below toggles the engine's own switches around every backward:
#   * a full backward (gpipe, 1f1b, interleaved_1f1b, and the first stage of zero-bubble
#     schedules) runs with sync off and reshard-after-backward off, except the stage's last
#     microbatch: there sync is on, so the existing hooks reduce-scatter each unit once, the
#     accumulated gradients of the earlier microbatches plus this one, overlapped with the
#     rest of that backward, and reshard (the engine's end-of-backward callback waits);
#   * the split passes of zero-bubble schedules run with sync off throughout: the weight
#     pass writes ``.grad`` through ``torch.autograd.grad`` and fires no hook. Before each
#     split pass every unit is unsharded: the passes take the module's current parameters
#     (``submod.parameters()``) as the weights, which must be the unsharded ones autograd saw.
# After a stage's last backward the schedule calls ``perform_reduce_grad``; there, with sync
# on, ``FSDPModule.reduce_grads`` reduce-scatters whatever a unit still holds unreduced (all of it after
# split passes, nothing after a synced full backward), then reshards. Either way each unit
# reduce-scatters exactly once per step. Gradients are averaged over microbatches by the loss
# (each microbatch's mean loss / n, ``scale_grads=False``), as meshpar.train does for
# accumulation, so nothing rescales the sharded gradients afterwards.
# With ``parallel.grad_reduce = "microbatch"`` a full backward runs with sync on every time (each
# unit reduce-scatters once per microbatch into its sharded gradient; nothing unsharded is held
# between microbatches), reshard-after-backward still only on the last.


# [Note: backward prefetch on stages after the first]
# The engine's implicit backward prefetch gathers "the unit before this one in forward
# order", and a stage root runs its pre-forward first, so the first block prefetches the
# root. That is right when the root holds the embedding (used last in backward), but on the
# last stage the root holds the final norm and output, whose backward is already done and
# resharded by then: the prefetch gathered it a second time each step. Stages after the
# first therefore get explicit lists: each block prefetches the block before it, the first
# block nothing (public FSDPModule.set_modules_to_backward_prefetch; blocks in module order).


# [Note: forwards outside the schedule]
# The first ``schedule.step`` runs torch's metadata inference: one forward (and backward) per stage
# on inputs made from the shapes alone, uninitialized. A model that keeps state from its forwards
# (a mixture-of-experts layer adds its expert loads to a buffer for aux-free balancing) must not
# count it, and the step's tally of auxiliary losses and expert loads must not see it. So the
# stage tells its own forwards apart: ``forward_one_chunk`` (and the planner's stand-in) run under
# ``scheduled()``; only those pass their output through ``on_output`` (meshpar.training.step sets it while a
# step runs: [Note: auxiliary losses under pipelining]), and a forward with gradients enabled
# outside them gets the module's buffers restored before the next scheduled forward: after its
# backward too, whose recomputes (activation checkpointing) count loads as well.


class Stage(PipelineStage):
    """A ``PipelineStage`` whose module may hold meshpar FSDP units:
    [Note: one reduce-scatter per step under pipelining]. ``on_output(module, output) -> output``
    sees the output of each scheduled forward: [Note: forwards outside the schedule]."""

    def __init__(self, module: nn.Module, stage_index: int, n_stages: int, device: torch.device,
                 group: dist.ProcessGroup, reduce_every_microbatch: bool = False):
        super().__init__(module, stage_index, n_stages, device, group=group)
        self.on_output: Callable[[nn.Module, Any], Any] | None = None
        self._scheduled = False
        self._saved_buffers: list[torch.Tensor] | None = None
        module.register_forward_pre_hook(self._before_forward)
        module.register_forward_hook(self._after_forward)
        self.units = [m for m in module.modules() if isinstance(m, FSDPModule)]
        self.reduce_every_microbatch = reduce_every_microbatch  # parallel.grad_reduce = "microbatch"
        if stage_index > 0:  # [Note: backward prefetch on stages after the first]
            blocks = [m for m in self.units if m is not module]
            for i, block in enumerate(blocks):
                block.set_modules_to_backward_prefetch(blocks[i - 1:i])

    def _set_sync(self, sync: bool, reshard: bool | None = None) -> None:
        for unit in self.units:
            unit.set_requires_gradient_sync(sync, recurse=False)
            unit.set_reshard_after_backward(sync if reshard is None else reshard, recurse=False)

    @contextlib.contextmanager
    def scheduled(self) -> Iterator[None]:
        """Forwards inside are the schedule's own: [Note: forwards outside the schedule]."""
        self._scheduled = True
        try:
            yield
        finally:
            self._scheduled = False

    def _before_forward(self, module: nn.Module, args: tuple) -> None:
        saved = self._saved_buffers
        if not self._scheduled and saved is None and torch.is_grad_enabled():
            self._saved_buffers = [b.detach().clone() for b in module.buffers()]
        elif self._scheduled and saved is not None:  # the unscheduled forward's backward is done
            with torch.no_grad():
                for buffer, value in zip(module.buffers(), saved, strict=True):
                    if not torch.equal(buffer, value):  # the unchanged (RoPE tables) were saved for backward
                        buffer.copy_(value)
            self._saved_buffers = None

    def _after_forward(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if self._scheduled and self.on_output is not None:
            return self.on_output(module, output)
        return output

    def forward_one_chunk(self, fwd_chunk_id: int, *args, **kwargs):
        with trace_range(f"meshpar::pp.forward[{self.stage_index},{fwd_chunk_id}]"), self.scheduled():
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(self, bwd_chunk_id: int, *args, **kwargs):
        with trace_range(f"meshpar::pp.backward[{self.stage_index},{bwd_chunk_id}]"):
            return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)

    # point-to-point transfers, labelled meshpar::pp.<send|recv>_<forward|backward>[stage,microbatch]
    def _tagged(self, ops: list[dist.P2POp], what: str, chunk: int) -> list[dist.P2POp]:
        return label_p2p_ops(ops, f"pp.{what}[{self.stage_index},{chunk}]")

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        return self._tagged(super().get_fwd_recv_ops(fwd_chunk_id), "recv_forward", fwd_chunk_id)

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        return self._tagged(super().get_fwd_send_ops(fwd_chunk_id), "send_forward", fwd_chunk_id)

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        return self._tagged(super().get_bwd_recv_ops(bwd_chunk_id), "recv_backward", bwd_chunk_id)

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        return self._tagged(super().get_bwd_send_ops(bwd_chunk_id), "send_backward", bwd_chunk_id)

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs, last_backward=False):
        if self.units:
            if backward_type != "full":  # split pass: weights are read from the module, unsharded
                for unit in self.units:
                    unit.unshard()
            last = backward_type == "full" and last_backward
            # reducing every microbatch keeps the parameters gathered until the last one all the same
            self._set_sync(last or (backward_type == "full" and self.reduce_every_microbatch), reshard=last)
        return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        self._set_sync(True)
        for unit in self.units:
            unit.reduce_grads()
        super().perform_reduce_grad(grad_scale_factor)


# [Note: evaluation walks the stages in order]
# torch's ``schedule.eval()`` switches the schedule to forward-only, which re-runs its
# one-time shape inference (a real forward and backward per stage) at every switch between
# eval and training, and on torch 2.13 it deadlocks for ScheduleZBVZeroBubble. Evaluation
# needs no schedule: every rank walks the global stages in order, microbatch by microbatch,
# running the ones it holds; activations go to the next stage's rank with a header (dtype,
# shape) first, so no shapes are set up in advance. The lowest pending stage can always
# proceed, so this cannot deadlock; it runs one stage at a time (no overlap), which is fine
# for a few evaluation batches.

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_HEADER = 8  # int64 slots: dtype index, ndim, shape (up to 6 dims)


class Pipeline:
    """One rank's side of a pipeline: ``step(inputs, targets)`` per optimizer step, ``eval`` for
    validation."""

    def __init__(self, schedule, stages: list[Stage], n_microbatches: int, loss_fn: Callable):
        self.schedule, self.stages, self.n_microbatches, self.loss_fn = schedule, stages, n_microbatches, loss_fn
        self.has_first = any(s.is_first for s in stages)
        self.has_last = any(s.is_last for s in stages)

    def _check(self, inputs: torch.Tensor | None) -> None:
        if self.has_first and inputs.shape[0] % self.n_microbatches:
            raise ValueError(f"the batch of {inputs.shape[0]} sequences does not split into "
                             f"{self.n_microbatches} equal microbatches")

    def step(self, inputs: torch.Tensor | None, targets: torch.Tensor | None) -> torch.Tensor | None:
        """Forward and backward over this rank's batch, split into microbatches on dim 0.

        ``inputs`` are read on the rank holding stage 0 and ``targets`` on the rank holding the
        last stage (pass None, or anything, elsewhere). Returns the mean over microbatches of
        each microbatch's mean loss (a detached scalar) there, None on other ranks. Gradients
        end up as the mean over the batch, reduce-scattered once per FSDP unit.
        """
        self._check(inputs)
        losses: list[torch.Tensor] | None = [] if self.has_last else None
        args = (inputs,) if self.has_first else ()
        with p2p_labels():  # [Note: labelling collectives meshpar does not issue]
            self.schedule.step(*args, target=targets if self.has_last else None, losses=losses, return_outputs=False)
        return None if losses is None else torch.stack([loss.detach() for loss in losses]).sum()

    def step_microbatches(self, microbatches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor | None:
        """``step`` over a loader's (inputs, targets) microbatches: concatenated here, the
        schedule splits them into the same microbatches again (``meshpar.training.step.train_step``)."""
        with trace_range("meshpar::data"):
            inputs, targets = (torch.cat(x).to(self.stages[0].device) for x in zip(*microbatches, strict=True))
        return self.step(inputs, targets)

    @torch.no_grad()
    def eval(self, inputs: torch.Tensor | None, targets: torch.Tensor | None) -> torch.Tensor | None:
        """The loss ``step`` would return, forward only, without the schedule: [Note: evaluation
        walks the stages in order]. Every pp rank must call it."""
        self._check(inputs)
        n, first = self.n_microbatches, self.stages[0]
        group, me, rank_of = first.group, first.group_rank, first.stage_index_to_group_rank
        mine = {s.stage_index: s for s in self.stages}
        xs = inputs.chunk(n) if self.has_first else [None] * n
        ys = targets.chunk(n) if self.has_last else [None] * n
        total, sends = None, []
        for x, y in zip(xs, ys, strict=True):
            h = x
            for index in sorted(mine):
                stage = mine[index]
                if index > 0 and rank_of[index - 1] != me:
                    h = _recv(rank_of[index - 1], group, stage.device)
                h = stage.submod(h)
                if stage.is_last:
                    loss = self.loss_fn(h, y).detach() / n
                    total = loss if total is None else total + loss
                elif rank_of[index + 1] != me:
                    sends += _send(h, rank_of[index + 1], group)
        for work in sends:
            work.wait()
        return total


def _send(t: torch.Tensor, peer: int, group: dist.ProcessGroup) -> list:
    header = torch.zeros(_HEADER, dtype=torch.int64, device=t.device)
    header[:2 + t.ndim] = torch.tensor([_DTYPES.index(t.dtype), t.ndim, *t.shape])
    t = t.contiguous()
    with trace_range("meshpar::pp.send_eval"):
        return [dist.isend(header, group_dst=peer, group=group), dist.isend(t, group_dst=peer, group=group)]


def _recv(peer: int, group: dist.ProcessGroup, device: torch.device) -> torch.Tensor:
    header = torch.empty(_HEADER, dtype=torch.int64, device=device)
    with trace_range("meshpar::pp.recv_eval"):
        dist.recv(header, group_src=peer, group=group)
        dtype, ndim, *shape = header.tolist()
        t = torch.empty(shape[:ndim], dtype=_DTYPES[dtype], device=device)
        dist.recv(t, group_src=peer, group=group)
    return t


def build_schedule(stages: list[tuple[int, nn.Module]], n_stages: int, pp_group: dist.ProcessGroup | DeviceMesh,
                   device: torch.device, name: str, n_microbatches: int,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], *,
                   reduce_every_microbatch: bool = False) -> Pipeline:
    """This rank's schedule over its ``stages`` (``[(global index, module)]``, as ``split`` returns).
    ``reduce_every_microbatch``: FSDP units reduce-scatter after each microbatch's backward
    instead of once per step (``parallel.grad_reduce``; not for the zero-bubble schedules).

    ``loss_fn(outputs, targets)`` returns a microbatch's mean loss; the schedule divides it by
    ``n_microbatches`` before backward (see [Note: one reduce-scatter per step under pipelining]).
    """
    group = pp_group.get_group() if isinstance(pp_group, DeviceMesh) else pp_group
    pp = dist.get_world_size(group)
    check_microbatches(name, n_microbatches, pp, len(stages))
    spec = SCHEDULES[name]
    if n_stages != pp * len(stages):
        raise ValueError(f"{n_stages} stages over pp = {pp} ranks is not {len(stages)} per rank")
    if reduce_every_microbatch and spec.split_backward:
        raise ValueError(f"reduce_every_microbatch with the {name} schedule: its split backward reduces once per step")
    built = [Stage(module, index, n_stages, device, group, reduce_every_microbatch) for index, module in stages]

    def scaled_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return loss_fn(outputs, targets) / n_microbatches

    schedule = spec.cls(built if spec.multi else built[0], n_microbatches=n_microbatches, loss_fn=scaled_loss,
                        scale_grads=False)
    return Pipeline(schedule, built, n_microbatches, loss_fn)
