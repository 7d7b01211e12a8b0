"""The training loop of one rank: build the run, then train ``train.steps`` steps, each a flat
sequence of phases. meshpar/train.py (the ``python -m meshpar.train`` entry) sets up the process
group and the mesh and calls ``train_loop``; the step itself is meshpar/training/step.py.

    build (meshpar/training/build.py): model on meta -> pipeline split -> parallelize -> optimizer
      + LR schedule -> data -> checkpointer -> resume (or Hugging Face weights)
    each step: train_step
      -> should_log:      the loss (and a mixture of experts' aux loss and expert loads) reduced
                          across ranks -> a metrics record
      -> should_evaluate: the validation loss -> a record
      -> should_save:     a checkpoint
      -> agreed_stop:     every rank agrees on a stop signal -> a checkpoint, and the loop ends

The decisions are small functions of the step (and, for ``agreed_stop``, the signals), so a
test checks the schedule without a process group (tests/test_training_loop.py).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshpar.checkpoint import Checkpointer, RunState
from meshpar.config.hardware import HardwareProfile
from meshpar.config.keys import replica_jobs
from meshpar.config.recipe import Recipe
from meshpar.distributed import comm, comm_record
from meshpar.distributed import mesh as meshlib
from meshpar.profiling.capture import StepProfiler, label
from meshpar.runtime import replicas
from meshpar.runtime.fault import EXIT_PREEMPTED, StopSignals, collective_timeout
from meshpar.runtime.process import RankInfo
from meshpar.runtime.progress import Progress, print_line
from meshpar.training import build
from meshpar.training.build import HFLoader
from meshpar.training.evaluate import evaluate, sample
from meshpar.training.metrics import MetricsLogger, expert_load_fields, peak_memory_gb
from meshpar.training.nonfinite import NonFiniteGuard
from meshpar.training.optim import build_lr_schedule, build_optimizer
from meshpar.training.preflight import Preflight
from meshpar.training.step import (
    GradSync,
    Model,
    StepResult,
    train_step,
)


# --- when a step logs, evaluates, saves, asks for a stop signal --------------------------------------
def should_log(step: int, every: int, last: int) -> bool:
    """A metrics record every ``every`` steps (train.log_every) and after the last step."""
    return step % every == 0 or step == last


def should_evaluate(step: int, every: int, last: int) -> bool:
    """The validation loss every ``every`` steps (train.eval_every; 0: never) and after the last."""
    return every > 0 and (step % every == 0 or step == last)


def should_save(step: int, every: int, last: int) -> bool:
    """A checkpoint every ``every`` steps (checkpoint.every; 0: never) and after the last; only
    a run with a checkpointer saves."""
    return every > 0 and (step % every == 0 or step == last)


def agreed_stop(step: int, every: int, last: int, signals: StopSignals) -> str | None:
    """The stop signal every rank agrees to stop on after ``step``, or None ([Note: stopping on a
    signal]). Asked every ``every`` steps (fault.agree_every; a collective, so every rank asks at
    the same steps) and not after the last step, where the run ends anyway."""
    if step >= last or step % every:
        return None
    return signals.agree()


# --- the metrics of a step, reduced across ranks (every rank takes part; the same on each) ----------
def _over_stages_and_dp(x: torch.Tensor, sync: GradSync, dp_op: dist.ReduceOp.RedOpType) -> torch.Tensor:
    if sync.pp_groups:  # each stage's share lives on its own rank
        comm.all_reduce(x, sync.pp_groups[0], dim="pp")
    comm.all_reduce(x, sync.dp.get_group(), dim="dp", op=dp_op)
    return x


def reduce_loss(loss: torch.Tensor, sync: GradSync) -> torch.Tensor:
    """The step's loss: from the last stage's rank (pp), averaged over dp, and over cp (each cp
    rank's mean over its tokens: the same count on each), and over the quorum's replica groups."""
    loss = _over_stages_and_dp(loss.clone(), sync, dist.ReduceOp.AVG)
    if sync.cp is not None:
        comm.all_reduce(loss, sync.cp.get_group(), dim="cp", op=dist.ReduceOp.AVG)
    if sync.groups is not None:
        sync.groups.mean(loss)
    return loss


def reduce_aux_loss(aux: torch.Tensor, sync: GradSync) -> torch.Tensor:
    """A mixture of experts' auxiliary loss: summed over stages (each stage's layers:
    [Note: auxiliary losses under pipelining]), averaged over dp."""
    return _over_stages_and_dp(aux.clone(), sync, dist.ReduceOp.AVG)


def reduce_expert_load(load: torch.Tensor, sync: GradSync) -> torch.Tensor:
    """Expert loads [2, L_sparse, E] ([Note: expert load] in meshpar/training/step.py): each
    stage's layers, summed over dp."""
    return _over_stages_and_dp(load.clone(), sync, dist.ReduceOp.SUM)


class Throughput:
    """Tokens/s and MFU between two metrics records, over training time only: validation and
    saving ``restart`` the clock."""

    def __init__(self, tokens_per_step: int, flops_per_token: float, peak_flops: float, device: torch.device,
                 step: int):
        self.tokens_per_step, self.flops_per_token, self.peak_flops = tokens_per_step, flops_per_token, peak_flops
        self.device, self.step, self.time = device, step, time.perf_counter()

    def tokens_per_s(self, step: int) -> float:
        """Since the last call (or the first step), up to the end of ``step``."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        rate = self.tokens_per_step * (step - self.step) / (now - self.time)
        self.time, self.step = now, step
        return rate

    def mfu(self, tokens_per_s: float) -> float:
        return self.flops_per_token * tokens_per_s / self.peak_flops

    def restart(self, step: int | None = None) -> None:
        """The clock from now (and from ``step``, when the run jumped to it)."""
        self.time = time.perf_counter()
        if step is not None:
            self.step = step


def step_record(step: int, done: StepResult, lr: float, sync: GradSync, clock: Throughput,
                moe_layers: list[int], args) -> dict[str, Any]:
    """The metrics record of a logged step (``args``: the model's; a mixture of experts' capacity
    factor says whether tokens were dropped). A collective: its reductions run on every rank."""
    loss = reduce_loss(done.loss, sync)
    tokens_per_s = clock.tokens_per_s(step)
    record = {"step": step, "loss": loss.item(), "grad_norm": done.grad_norm.item(), "lr": lr,
              "tokens_per_s": tokens_per_s, "mfu": clock.mfu(tokens_per_s), "mem_gb": peak_memory_gb(clock.device)}
    if done.aux_loss is not None:  # mixture of experts: apart from the loss ([Note: auxiliary losses])
        record["aux_loss"] = reduce_aux_loss(done.aux_loss, sync).item()
    if done.expert_load is not None:
        load = reduce_expert_load(done.expert_load, sync)
        record.update(expert_load_fields(moe_layers, load, dropped=args.capacity_factor > 0))
    if done.trained is not None:  # fine-tuning: the share of the step's targets that trained
        record["trained_frac"] = done.trained / clock.tokens_per_step
    return record


# --- the loop -----------------------------------------------------------------------------------------
def train_loop(recipe: Recipe, checked: Preflight, mesh: meshlib.Mesh, device: torch.device,
               profile: HardwareProfile, info: RankInfo, signals: StopSignals, *, load_hf_weights: HFLoader,
               comms: comm_record.CommRecord) -> tuple[Model, torch.optim.Optimizer, list[dict[str, Any]], str | None]:
    """Build the run and train it from its checkpoint (or step 0) to ``train.steps``, or until
    every rank agrees on a stop signal, which saves first. Returns the model, the optimizer, the
    metrics records (the same on every rank) and the signal that stopped the run, or None.
    ``comms``: the run's comm record, active around the call; each step's collectives carry its number."""
    t, corpus = recipe.train, checked.corpus
    output_dir = Path(t.output_dir)
    if info.is_rank0:
        build.announce(recipe, checked, mesh, device, info, output_dir)
    model = build.build_model(recipe, checked, mesh, device)
    n_params = build.count_params(model, mesh)
    optimizer = build_optimizer(model.stages, recipe.optim)
    scheduler = build_lr_schedule(optimizer, recipe.optim, t.steps)
    loader = build.train_loader(recipe, checked, mesh)
    run = RunState(model.stages, model.state_dict, optimizer, scheduler, loader)
    ckpt = build.checkpointer(recipe, checked, mesh, info, output_dir)
    start_step = build.restore(recipe, checked, ckpt, run, info, load_hf_weights)
    if model.after_step is not None:  # the parameters just set (init, checkpoint) get what each step's give
        model.after_step()
    if info.is_rank0:
        print(f"meshpar: {n_params:,} parameters, {checked.args.flops_per_token(t.seq_len) / 1e6:,.1f} MFLOP/token, "
              f"MFU against {profile.name}", flush=True)
        if recipe.model.float8 != "none":
            print(build.float8_line(recipe, model, mesh), flush=True)
            if not recipe.parallel.compile:
                print("meshpar: warning: float8 without parallel.compile casts in separate kernels and is slower "
                      "than bf16; set parallel.compile = true", flush=True)
        if recipe.parallel.cp_flex and mesh.layout.cp > 1:
            print(build.cp_flex_line(recipe, mesh.layout, device), flush=True)

    progress_on = {"on": True, "off": False, "auto": sys.stderr.isatty()}[recipe.metrics.progress]
    progress = Progress(t.steps, enabled=progress_on and info.is_rank0, initial=start_step)
    metrics = MetricsLogger(output_dir, enabled=info.is_rank0, progress=progress, start_step=start_step,
                            tensorboard=recipe.metrics.tensorboard,
                            wandb=build.wandb_sink(recipe, info, output_dir, start_step))
    records: list[dict[str, Any]] = []

    def log(record: dict[str, Any]) -> None:
        records.append(record)
        metrics.log(record)

    if replicas.nothing_left(recipe, announce=info.is_rank0):  # back after the other replica groups finished
        start_step = t.steps
    groups = None
    if start_step < t.steps:
        groups = replicas.ReplicaGroups.for_run(recipe, run, start_step, device,
                                                collective_timeout(recipe.fault.timeout, device.type))
    sync = GradSync.of(mesh, recipe.parallel, recipe.optim, groups=groups, jobs=replica_jobs(recipe))
    guard = NonFiniteGuard(t.on_nonfinite, t.max_skips, model.stages)
    moe_layers = model.moe.model_sparse_layers(checked.args) if model.moe is not None else []  # block indices
    clock = _throughput(recipe, checked, profile, info, device, start_step)
    stopped_by = None
    healed = functools.partial(_healed, clock, log, model)
    # the checkpointer is closed however the loop ends: an async save's writer process must not outlive it
    with StepProfiler(recipe.profile, output_dir, mesh, first_step=start_step + 1,
                      tracked=(model.stages, optimizer), record=comms) as profiler, \
            contextlib.closing(ckpt) if ckpt is not None else contextlib.nullcontext(), \
            contextlib.closing(groups) if groups is not None else contextlib.nullcontext():
        step, saved = start_step, False
        while step < t.steps:
            try:
                step = step + 1 if groups is None else groups.advance(step, healed)
            except replicas.QuorumLost as lost:
                stopped_by = _quorum_lost(lost, ckpt, run, step, start_step, saved, info)
                break
            comms.step = step
            guard.step = step
            position = loader.state_dict() if groups is not None else None
            done = train_step(model, loader.next_step, checked.accum, sync, device, optimizer, scheduler, guard=guard)
            if done.retry:  # the replica groups did not commit it: the same step again, on the same batch
                loader.load_state_dict(position)
                step -= 1
                continue
            lr = done.lr
            if done.skipped:  # [Note: non-finite steps]
                lr = scheduler.get_last_lr()[0]  # not stepped with: the rate the next step will use
                log({"step": step, "skipped": "non-finite gradient"})
            progress.update(step)
            if should_log(step, t.log_every, t.steps):
                record = step_record(step, done, lr, sync, clock, moe_layers, checked.args)
                if groups is not None:
                    record["replica_groups"] = groups.participants
                log(record)
            if should_evaluate(step, t.eval_every, t.steps):
                log({"step": step, "val_loss": evaluate(model, corpus.val, recipe, mesh, device)})
                clock.restart()  # validation time is not training throughput
            if should_evaluate(step, t.sample_every, t.steps):
                sample(model.stages[0], corpus.tokenizer, recipe, step, info, output_dir, progress)
                clock.restart()
            saved = ckpt is not None and should_save(step, recipe.checkpoint.every, t.steps)
            if saved:
                with label("checkpoint.save"):
                    ckpt.save(run, step)
                clock.restart()  # nor is saving
            profiler.step()
            stopped_by = agreed_stop(step, recipe.fault.agree_every, t.steps, signals)
            if stopped_by is not None:
                _stop(ckpt, run, step, signals, saved, info)
                break
        if ckpt is not None:
            ckpt.wait()  # the last save is complete before the run reports success (and before the close)
        if groups is not None and step >= t.steps and info.is_rank0:
            replicas.mark_finished(recipe, step)
    metrics.close()
    progress.close()
    return model, optimizer, records, stopped_by


def _healed(clock: Throughput, log: Callable[[dict], None], model: Model, step: int) -> None:
    """Under torchft, this group was behind and has just received a live group's state at ``step``:
    say so, count throughput from there."""
    log({"step": step, "healed": f"from a live replica group, at step {step}"})
    clock.restart(step)
    if model.after_step is not None:  # the parameters just received get what each step's give
        model.after_step()


def _throughput(recipe: Recipe, checked: Preflight, profile: HardwareProfile, info: RankInfo, device: torch.device,
                start_step: int) -> Throughput:
    """MFU against the profile's peak of the devices the run uses: every rank's GPU, or one CPU
    per node (a node's ranks share its cores)."""
    t = recipe.train
    n_devices = info.world_size if device.type == "cuda" else info.world_size // info.local_world_size
    peak = profile.peak_flops(getattr(torch, recipe.parallel.param_dtype)) * n_devices
    return Throughput(t.global_batch * t.seq_len, checked.args.flops_per_token(t.seq_len), peak, device, start_step)


def _quorum_lost(lost: replicas.QuorumLost, ckpt: Checkpointer | None, run: RunState, step: int, start_step: int,
                 saved: bool, info: RankInfo) -> str:
    """Every rank of a replica group that got no quorum: its last committed step ``step`` saved
    when its state is that step's (no heal had begun) and a checkpointer exists, then the run
    stops as on a stop signal: with the lighthouse back, the same command resumes. Otherwise the
    error, and the last checkpoint stays the one to resume from."""
    if not lost.intact or ckpt is None:
        raise lost
    if step > start_step and not saved:
        with label("checkpoint.save"):
            ckpt.wait()
            ckpt.save(run, step, blocking=True)
    ckpt.wait()
    dist.barrier()  # rank 0 has committed it before any rank exits
    if info.is_rank0:
        where = f"checkpoint {ckpt.root / f'step_{step}'}" if step > 0 else "no step trained yet"
        print_line(f"meshpar: {lost}\nmeshpar: stopped after step {step}: {where}; exit code {EXIT_PREEMPTED}; "
                   f"run the same command to resume once the lighthouse is back")
    return "lost quorum"


def _stop(ckpt: Checkpointer, run: RunState, step: int, signals: StopSignals, saved: bool, info: RankInfo) -> None:
    """Every rank, on an agreed stop signal: make step ``step`` a complete checkpoint, say so."""
    with label("checkpoint.save"):
        if not saved:
            ckpt.wait()
            ckpt.save(run, step, blocking=True)  # in this process: the process exits next
        ckpt.wait()  # the step's own save, when it was an async one
    dist.barrier()  # rank 0 has committed it: no rank exits (and gets its peers killed) before that
    signals.saved()
    signal_name = signals.stopped_by
    if info.is_rank0:
        print_line(f"meshpar: stopped by {signal_name} after step {step}: checkpoint {ckpt.root / f'step_{step}'}; "
                   f"exit code {EXIT_PREEMPTED}; run the same command to resume")
