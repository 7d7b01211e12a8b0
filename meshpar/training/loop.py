"""The training loop of one rank: build the run, then train ``train.steps`` steps, each a flat
sequence of phases. meshpar/train.py (the ``python -m meshpar.train`` entry) sets up the process
group and the mesh and calls ``train_loop``; the step itself is meshpar/training/step.py.

    build: model on meta -> pipeline split -> parallelize -> optimizer + LR schedule -> data
      -> checkpointer -> resume (or Hugging Face weights)
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
import dataclasses
import functools
import json
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshpar.checkpoint import Checkpointer, RunState
from meshpar.config import recipe as recipelib
from meshpar.config.hardware import HardwareProfile
from meshpar.config.keys import replica_jobs
from meshpar.config.recipe import Recipe
from meshpar.data import BatchLoader
from meshpar.distributed import comm, comm_record
from meshpar.distributed import mesh as meshlib
from meshpar.parallel import float8 as float8lib
from meshpar.parallel.parallelize import build
from meshpar.parallel.pipeline import build_schedule
from meshpar.profiling.capture import StepProfiler, label
from meshpar.runtime import replicas
from meshpar.runtime.fault import EXIT_PREEMPTED, StopSignals, collective_timeout
from meshpar.runtime.process import RankInfo
from meshpar.runtime.progress import Progress, print_line
from meshpar.training.evaluate import evaluate, sample
from meshpar.training.loss import TokenLoss, last_head, layout_chunks
from meshpar.training.metrics import MetricsLogger, expert_load_fields, peak_memory_gb
from meshpar.training.nonfinite import NonFiniteGuard
from meshpar.training.optim import build_lr_schedule, build_optimizer
from meshpar.training.preflight import Preflight
from meshpar.training.step import (
    GradSync,
    Model,
    StepResult,
    model_sparse_layers,
    train_step,
)

# load_hf_weights(model state dict, folder, family, model args), filling the state in place:
# meshpar.convert's, passed in by meshpar/train.py because convert/ is a layer above training/
HFLoader = Callable[[Mapping[str, torch.Tensor], str, str, Any], None]


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
               profile: HardwareProfile, info: RankInfo, signals: StopSignals, *,
               load_hf_weights: HFLoader) -> tuple[Model, torch.optim.Optimizer, list[dict[str, Any]], str | None]:
    """Build the run and train it from its checkpoint (or step 0) to ``train.steps``, or until
    every rank agrees on a stop signal, which saves first. Returns the model, the optimizer, the
    metrics records (the same on every rank) and the signal that stopped the run, or None."""
    t, corpus = recipe.train, checked.corpus
    output_dir = Path(t.output_dir)
    if info.is_rank0:
        _announce(recipe, checked, mesh, device, info, output_dir)
    model = _build_model(recipe, checked, mesh, device)
    n_params = _count_params(model, mesh)
    optimizer = build_optimizer(model.stages, recipe.optim)
    scheduler = build_lr_schedule(optimizer, recipe.optim, t.steps)
    loader = _train_loader(recipe, checked, mesh)
    run = RunState(model.stages, model.state_dict, optimizer, scheduler, loader)
    ckpt = _checkpointer(recipe, checked, mesh, info, output_dir)
    start_step = _restore(recipe, checked, ckpt, run, info, load_hf_weights)
    if model.after_step is not None:  # the parameters just set (init, checkpoint) get what each step's give
        model.after_step()
    if info.is_rank0:
        print(f"meshpar: {n_params:,} parameters, {checked.args.flops_per_token(t.seq_len) / 1e6:,.1f} MFLOP/token, "
              f"MFU against {profile.name}", flush=True)
        if recipe.model.float8 != "none":
            print(_float8_line(recipe, model, mesh), flush=True)
            if not recipe.parallel.compile:
                print("meshpar: warning: float8 without parallel.compile casts in separate kernels and is slower "
                      "than bf16; set parallel.compile = true", flush=True)

    progress_on = {"on": True, "off": False, "auto": sys.stderr.isatty()}[recipe.metrics.progress]
    progress = Progress(t.steps, enabled=progress_on and info.is_rank0, initial=start_step)
    metrics = MetricsLogger(output_dir, enabled=info.is_rank0, progress=progress, start_step=start_step,
                            tensorboard=recipe.metrics.tensorboard,
                            wandb=_wandb_sink(recipe, info, output_dir, start_step))
    records: list[dict[str, Any]] = []

    def log(record: dict[str, Any]) -> None:
        records.append(record)
        metrics.log(record)

    done_by = replicas.finished_elsewhere(recipe)
    if done_by is not None:  # back after the other replica groups finished: no quorum left to join
        if info.is_rank0:
            print(f"meshpar: replica group {recipe.fault.replica_id}: the run is done ({done_by} trained step "
                  f"{t.steps}); nothing left for this group", flush=True)
        start_step = t.steps
    groups = _replica_groups(recipe, run, start_step, device) if start_step < t.steps else None
    sync = GradSync.of(mesh, recipe.parallel, recipe.optim, groups=groups, jobs=replica_jobs(recipe))
    guard = NonFiniteGuard(t.on_nonfinite, t.max_skips, model.stages)
    moe_layers = model_sparse_layers(model.stages[0])  # block index of each, on every stage
    clock = _throughput(recipe, checked, profile, info, device, start_step)
    stopped_by = None
    # the checkpointer is closed however the loop ends: an async save's writer process must not outlive it
    with StepProfiler(recipe.profile, output_dir, mesh, first_step=start_step + 1,
                      tracked=(model.stages, optimizer)) as profiler, \
            contextlib.closing(ckpt) if ckpt is not None else contextlib.nullcontext(), \
            contextlib.closing(groups) if groups is not None else contextlib.nullcontext():
        step = start_step
        while step < t.steps:
            step = step + 1 if groups is None else _quorum_step(groups, step, clock, log, model)
            comm_record.set_step(step)
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


# --- building the run ---------------------------------------------------------------------------------
def _wandb_sink(recipe: Recipe, info: RankInfo, output_dir: Path, start_step: int):
    """Rank 0's W&B run when ``metrics.wandb`` is set ([Note: one W&B run per training run]), else None."""
    if not (recipe.metrics.wandb and info.is_rank0):
        return None
    from meshpar.training.wandb_sink import WandbSink

    return WandbSink(recipe.metrics, output_dir, dataclasses.asdict(recipe), resumed=start_step > 0)


def _announce(recipe: Recipe, checked: Preflight, mesh: meshlib.Mesh, device: torch.device, info: RankInfo,
              output_dir: Path) -> None:
    """Rank 0: the resolved recipe written to ``output_dir`` and printed under the run's one-line summary."""
    output_dir.mkdir(parents=True, exist_ok=True)
    resolved = recipelib.dumps(recipe)
    (output_dir / "recipe.toml").write_text(resolved)
    ranks = f"{info.world_size} rank{'s' if info.world_size > 1 else ''}"
    print(f"meshpar: {checked.family.name} {recipe.model.size} | {ranks} on {device.type} | layout {mesh.layout} | "
          f"data {checked.corpus.name} | {checked.accum} microbatches/step\n--- resolved recipe "
          f"({output_dir / 'recipe.toml'}) ---\n{resolved}---", flush=True)


def _build_model(recipe: Recipe, checked: Preflight, mesh: meshlib.Mesh, device: torch.device) -> Model:
    """This rank's stages, parallelized and initialized, and the pipeline schedule that runs them.
    Layout-independent values (meshpar.models.init): every layout starts from the same model."""
    p, m, t = recipe.parallel, recipe.model, recipe.train
    chunks = layout_chunks(t.loss_chunks, t.micro_batch, t.seq_len, checked.args.vocab_size, mesh.layout,
                           p.loss_parallel)
    stages = build(checked.family.model_cls, checked.args, checked.family.plan(checked.args), mesh, p, device, t.seed,
                   float8=m.float8, float8_emulate=m.float8_emulate, head_in_loss=chunks > 1)
    loss = TokenLoss(last_head(m for _, m in stages), chunks)
    pipeline = None
    if mesh.layout.pp > 1:
        pipeline = build_schedule(stages, mesh.layout.pp * p.pp_virtual_stages, mesh["pp"], device, p.pp_schedule,
                                  checked.accum, loss, reduce_every_microbatch=p.grad_reduce == "microbatch")
    modules = torch.nn.ModuleList(m for _, m in stages)
    after_step = None
    if float8lib.float8_all_gather(m.float8, mesh.layout):
        after_step = functools.partial(float8lib.precompute_scales, modules)
    around_step = functools.partial(float8lib.around_step, m.float8, mesh["tp"] if mesh.layout.tp > 1 else None)
    return Model(modules, pipeline, mesh.layout.tp > 1 and p.loss_parallel, after_step, around_step, loss)


def _float8_line(recipe: Recipe, model: Model, mesh: meshlib.Mesh) -> str:
    """What ``model.float8`` converted, for the start of the log: the mode, how FSDP gathers, what stayed."""
    m = recipe.model
    gather = "all-gather in float8" if float8lib.float8_all_gather(m.float8, mesh.layout) else (
        "all-gather in the parameter dtype" if float8lib.shards_over_ranks(mesh.layout) else "no FSDP all-gather")
    if mesh.layout.tp > 1:  # [Note: float8 TP styles and biases]
        gather += (", tensor-parallel activations gathered in float8 (layers without a bias)"
                   if m.float8 == "tensorwise" else ", tensor-parallel activations gathered in high precision")
    left = [name for stage in model.stages for name, mod in stage.named_modules() if type(mod) is torch.nn.Linear]
    experts = " | mixture-of-experts experts stay in high precision" if hasattr(model.stages[0], "moe_layers") else ""
    return (f"meshpar: float8 {m.float8}{' (emulated)' if m.float8_emulate else ''}, {gather} | left in high "
            f"precision: {', '.join(left) or 'none'}{experts}")


def _train_loader(recipe: Recipe, checked: Preflight, mesh: meshlib.Mesh) -> BatchLoader:
    """This rank's slice of each global batch; under torchft the slices of every replica group
    ([Note: replica groups under torchft])."""
    t, corpus = recipe.train, checked.corpus
    mixture = len(corpus.sources) > 1  # [Note: mixtures]
    dp_rank = mesh.dp_rank + (recipe.fault.replica_id * mesh.layout.dp if replicas.managed(recipe) else 0)
    return BatchLoader(corpus.sources if mixture else corpus.train, seq_len=t.seq_len, global_batch=t.global_batch,
                       micro_batch=t.micro_batch, dp_rank=dp_rank, dp_size=checked.layout.dp, seed=t.seed,
                       weights=corpus.weights if mixture else None)


def _replica_groups(recipe: Recipe, run: RunState, start_step: int,
                    device: torch.device) -> replicas.ReplicaGroups | None:
    """Under ``fault.replicas = "torchft"`` this rank's seat in the replica groups, at the step it
    resumed from; a group behind receives ``run`` from a live one."""
    if not replicas.managed(recipe):
        return None
    parts = (run.model_state, run.optimizer, run.scheduler, run.loader)
    return replicas.ReplicaGroups.join(recipe.fault, recipe.parallel.dp_replicate,
                                       functools.partial(replicas.heal_state, *parts),
                                       lambda state: replicas.load_heal_state(state, *parts), step=start_step,
                                       device=device, timeout=collective_timeout(recipe.fault.timeout, device.type))


def _quorum_step(groups: replicas.ReplicaGroups, step: int, clock: Throughput, log: Callable[[dict], None],
                 model: Model) -> int:
    """The next step under torchft: the quorum's. When this group was behind it has just received
    a live group's state at the quorum's step: say so, and count throughput from there."""
    following = groups.next_step()
    if following != step + 1:
        log({"step": following - 1, "healed": f"from a live replica group, at step {following - 1}"})
        clock.restart(following - 1)
        if model.after_step is not None:  # the parameters just received get what each step's give
            model.after_step()
    return following


def _throughput(recipe: Recipe, checked: Preflight, profile: HardwareProfile, info: RankInfo, device: torch.device,
                start_step: int) -> Throughput:
    """MFU against the profile's peak of the devices the run uses: every rank's GPU, or one CPU
    per node (a node's ranks share its cores)."""
    t = recipe.train
    n_devices = info.world_size if device.type == "cuda" else info.world_size // info.local_world_size
    peak = profile.peak_flops(getattr(torch, recipe.parallel.param_dtype)) * n_devices
    return Throughput(t.global_batch * t.seq_len, checked.args.flops_per_token(t.seq_len), peak, device, start_step)


def _count_params(model: Model, mesh: meshlib.Mesh) -> int:
    """Parameters of the whole model (DTensors count their global size; stages are summed over pp)."""
    n = torch.tensor(sum(q.numel() for q in model.stages.parameters()), dtype=torch.int64)
    if mesh.layout.pp > 1:
        dist.all_reduce(n, group=mesh["pp"].get_group())
    return int(n.item())


# --- checkpoints --------------------------------------------------------------------------------------
def _checkpointer(recipe: Recipe, checked: Preflight, mesh: meshlib.Mesh, info: RankInfo,
                  output_dir: Path) -> Checkpointer | None:
    """The run's checkpointer, or None when it neither saves nor could resume."""
    c = recipe.checkpoint
    root = Path(c.dir) if c.dir else output_dir / "checkpoints"
    if not (c.every or c.load_from or root.is_dir() or recipe.fault.signals):  # a stop signal saves too
        return None
    # meshpar.json's record of the model: JSON types (tuples are lists) so it compares with a loaded one
    # document_eos (model.attention) changes no weight: left out, so a run may switch it and resume
    args = {k: v for k, v in dataclasses.asdict(checked.args).items() if k != "document_eos"}
    record = json.loads(json.dumps({"family": recipe.model.family, "size": recipe.model.size,
                                    "model_args": args,
                                    "layout": dataclasses.asdict(mesh.layout)}))
    tokenizer = checked.corpus.tokenizer  # saved beside the weights: `meshpar convert --to hf` exports it
    return Checkpointer(c, root, rank=info.rank, world_size=info.world_size, info=record,
                        recipe_toml=recipelib.dumps(recipe), log=lambda line: print_line(f"meshpar: {line}"),
                        tokenizer_files=tokenizer.hf_files() if tokenizer is not None else None)


def _restore(recipe: Recipe, checked: Preflight, ckpt: Checkpointer | None, run: RunState, info: RankInfo,
             load_hf_weights: HFLoader) -> int:
    """Load the checkpoint to resume from, or Hugging Face weights to start from; the step reached."""
    path = ckpt.resume_path() if ckpt is not None else None
    if ckpt is not None:
        ckpt.remove_partial()
    if path is not None:
        step = ckpt.load(path, run)
        if step >= recipe.train.steps and info.is_rank0:
            print(f"meshpar: the checkpoint is at step {step}, train.steps = {recipe.train.steps}: nothing left to "
                  f"train (raise train.steps to continue)", flush=True)
        return step
    if recipe.checkpoint.hf_weights:
        load_hf_weights(run.model_state(), recipe.checkpoint.hf_weights, recipe.model.family, checked.args)
        if info.is_rank0:
            print(f"meshpar: initialized from Hugging Face weights in {recipe.checkpoint.hf_weights}", flush=True)
    return 0


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
