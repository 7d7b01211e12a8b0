"""The training loop, one rank's view: ``python -m meshpar.train RECIPE [--section.key=value ...]``.

This is what ``torchrun ... -m meshpar.train`` runs on a cluster and what ``meshpar train``
starts on each local rank. The data flow (docs/architecture.md):

    recipe -> layout (checked before any process group) -> data (cached tokens)
      -> process group + mesh -> model on meta -> pipeline split -> parallelize (TP, activation
      checkpointing, compile, FSDP) -> to_empty + init_weights -> optimizer + LR schedule
      -> loop: meshpar.training.step.train_step (batch -> forward/backward per microbatch or the
         pipeline schedule -> gradient sync -> clip across every mesh dim -> optimizer step)
      -> metrics -> maybe save
    (a complete checkpoint in checkpoint.dir, or checkpoint.load_from, is loaded before the
    first step, resharded to this layout: meshpar/checkpoint/checkpointer.py)

The step is meshpar/training/step.py, the one the planner also runs, on fake tensors; see
[Note: losses do not depend on the layout] there.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from meshpar.checkpoint import Checkpointer, CheckpointError, RunState, optimizer_state, param_names
from meshpar.config import recipe as recipelib
from meshpar.config.hardware import HardwareProfile, load_profile
from meshpar.config.recipe import Recipe, RecipeError
from meshpar.data import BatchLoader
from meshpar.distributed import comm, comm_record
from meshpar.distributed import mesh as meshlib
from meshpar.parallel.context_parallel.apply import shard_sequence
from meshpar.parallel.parallelize import build
from meshpar.parallel.pipeline import build_schedule
from meshpar.parallel.tensor_parallel.plan import loss_parallel_context
from meshpar.profiling.capture import StepProfiler, label
from meshpar.runtime.fault import (
    EXIT_PREEMPTED,
    StopSignals,
    collective_timeout,
    is_collective_failure,
    report_collective_failure,
)
from meshpar.runtime.process import RankInfo, init_process_group, leave, rank_info, select_device
from meshpar.runtime.progress import Progress, print_line
from meshpar.training.metrics import MetricsLogger, expert_load_fields, peak_memory_gb
from meshpar.training.nonfinite import NonFiniteError, NonFiniteGuard
from meshpar.training.optim import build_lr_schedule, build_optimizer
from meshpar.training.preflight import Preflight, preflight
from meshpar.training.step import GradSync, Model, cross_entropy, model_sparse_layers, plain, train_step


@torch.no_grad()
def evaluate(model: Model, tokens, recipe: Recipe, mesh: meshlib.Mesh, device: torch.device) -> float:
    """Mean loss over the first ``eval_batches`` global batches of held-out data."""
    t = recipe.train
    loader = BatchLoader(tokens, seq_len=t.seq_len, global_batch=t.global_batch, micro_batch=t.micro_batch,
                         dp_rank=mesh.dp_rank, dp_size=mesh.layout.dp, seed=t.seed, shuffle=False)
    model.stages.eval()
    total = torch.zeros((), device=device)
    n = 0
    with loss_parallel_context(model.loss_parallel):
        for _ in range(t.eval_batches):
            microbatches = list(loader.next_step())
            if mesh.layout.cp > 1:  # this cp rank's tokens of every sequence
                microbatches = [(shard_sequence(x, mesh["cp"]), shard_sequence(y, mesh["cp"])) for x, y in microbatches]
            if model.pipeline is not None:
                inputs, targets = (torch.cat(x).to(device) for x in zip(*microbatches, strict=True))
                loss = model.pipeline.eval(inputs, targets)
                total += 0.0 if loss is None else plain(loss)
                n += 1
                continue
            for inputs, targets in microbatches:
                total += plain(cross_entropy(model.stages[0](inputs.to(device)), targets.to(device)))
                n += 1
    model.stages.train()
    total /= n
    if mesh.layout.pp > 1:  # the loss lives on the last stage's rank
        dist.all_reduce(total, group=mesh["pp"].get_group())
    dist.all_reduce(total, op=dist.ReduceOp.AVG, group=mesh["dp"].get_group())
    if mesh.layout.cp > 1:
        dist.all_reduce(total, op=dist.ReduceOp.AVG, group=mesh["cp"].get_group())
    return total.item()


@dataclass
class RunResult:
    records: list[dict[str, Any]]  # the metrics records, the same on every rank
    state_dict: dict[str, torch.Tensor] | None  # final full parameters on CPU, when asked for
    optim_state: dict[str, torch.Tensor] | None = None  # and AdamW's: "<param name>.<exp_avg|exp_avg_sq|step>"
    stopped_by: str | None = None  # the signal that stopped the run early (a checkpoint was saved), or None


def train(recipe: Recipe, *, return_state: bool = False) -> RunResult:
    """Run ``recipe`` on this rank. ``return_state`` also returns the final parameters and
    optimizer state, gathered to full tensors (for tests)."""
    info = rank_info()
    checked = preflight(recipe, info.world_size)
    device = select_device(recipe.train.device, info)
    profile = load_profile(recipe.metrics.hardware, device.type)
    timeout = collective_timeout(recipe.fault.timeout, device.type)
    init_process_group(device, info, timeout)
    comm_record.set_flight_recorder(recipe.fault.flight_recorder)
    signals = StopSignals(recipe.fault.signals)
    try:
        mesh = meshlib.build(checked.layout, device.type)
        model, optimizer, records, stopped_by = _train_loop(recipe, checked, mesh, device, profile, info, signals)
        result = RunResult(records, None, stopped_by=stopped_by)
        if return_state:  # gathered: a collective per DTensor, for tests only; this rank's stages
            result.state_dict = {k: _full(v) for k, v in model.state_dict().items()}
            result.optim_state = {f"{name}.{k}": _full(v) for name, state in
                                  optimizer_state(optimizer, param_names(model.stages)).items()
                                  for k, v in state.items()}
        dist.barrier()  # gloo groups torn down while a peer still talks can abort at exit
        return result
    except NonFiniteError:
        dist.barrier()  # every rank raised it at the same step: meet before tearing gloo down
        raise
    except Exception as e:
        if is_collective_failure(e):  # name the op, dim, step and the ranks that did not come, then fail
            report_collective_failure(e, rank=info.rank, world=info.world_size, step=comm_record.current_step(),
                                      timeout=timeout)
        raise
    finally:
        signals.close()
        comm_record.set_step(None)
        dist.destroy_process_group()


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()


def _train_loop(recipe: Recipe, checked: Preflight, mesh: meshlib.Mesh, device: torch.device, profile: HardwareProfile,
                info: RankInfo, signals: StopSignals) -> tuple[Model, torch.optim.Optimizer, list[dict[str, Any]],
                                                               str | None]:
    t, family, args, corpus, accum = recipe.train, checked.family, checked.args, checked.corpus, checked.accum
    output_dir = Path(t.output_dir)
    if info.is_rank0:
        output_dir.mkdir(parents=True, exist_ok=True)
        resolved = recipelib.dumps(recipe)
        (output_dir / "recipe.toml").write_text(resolved)
        ranks = f"{info.world_size} rank{'s' if info.world_size > 1 else ''}"
        print(f"meshpar: {family.name} {recipe.model.size} | {ranks} on {device.type} | layout {mesh.layout} | "
              f"data {corpus.name} | {accum} microbatches/step\n--- resolved recipe "
              f"({output_dir / 'recipe.toml'}) ---\n{resolved}---", flush=True)

    # layout-independent values (meshpar.models.init): every layout starts from the same model
    stages = build(family.model_cls, args, family.tp_plan, mesh, recipe.parallel, device, t.seed)
    p = recipe.parallel
    loss_parallel = mesh.layout.tp > 1 and p.loss_parallel
    pipeline = None
    if mesh.layout.pp > 1:
        pipeline = build_schedule(stages, mesh.layout.pp * p.pp_virtual_stages, mesh["pp"], device, p.pp_schedule,
                                  accum, cross_entropy, reduce_every_microbatch=p.grad_reduce == "microbatch")
    model = Model(torch.nn.ModuleList(m for _, m in stages), pipeline, loss_parallel)
    n_params = _count_params(model, mesh)
    optimizer = build_optimizer(model.stages, recipe.optim)
    scheduler = build_lr_schedule(optimizer, recipe.optim, t.steps)
    mixture = len(corpus.sources) > 1  # [Note: mixtures]
    loader = BatchLoader(corpus.sources if mixture else corpus.train, seq_len=t.seq_len, global_batch=t.global_batch,
                         micro_batch=t.micro_batch, dp_rank=mesh.dp_rank, dp_size=mesh.layout.dp, seed=t.seed,
                         weights=corpus.weights if mixture else None)
    run = RunState(model.stages, model.state_dict, optimizer, scheduler, loader)
    ckpt = _checkpointer(recipe, checked, mesh, info, output_dir)
    start_step = _restore(recipe, checked, ckpt, run, info)

    if info.is_rank0:
        print(f"meshpar: {n_params:,} parameters, {args.flops_per_token(t.seq_len) / 1e6:,.1f} MFLOP/token, "
              f"MFU against {profile.name}", flush=True)
    progress_on = {"on": True, "off": False, "auto": sys.stderr.isatty()}[recipe.metrics.progress]
    progress = Progress(t.steps, enabled=progress_on and info.is_rank0, initial=start_step)
    metrics = MetricsLogger(output_dir, enabled=info.is_rank0, progress=progress, start_step=start_step,
                            tensorboard=recipe.metrics.tensorboard)
    flops_per_token = args.flops_per_token(t.seq_len)
    n_devices = info.world_size if device.type == "cuda" else info.world_size // info.local_world_size
    peak = profile.peak_flops(getattr(torch, recipe.parallel.param_dtype)) * n_devices
    tokens_per_step = t.global_batch * t.seq_len
    sync = GradSync.of(mesh, recipe.parallel, recipe.optim)
    guard = NonFiniteGuard(t.on_nonfinite, t.max_skips, model.stages)
    moe_layers = model_sparse_layers(model.stages[0])  # block index of each, on every stage
    records: list[dict[str, Any]] = []
    last_time, last_step = time.perf_counter(), start_step
    stopped_by = None

    profiler = StepProfiler(recipe.profile, output_dir, mesh, first_step=start_step + 1,
                            tracked=(model.stages, optimizer))
    with profiler:
        for step in range(start_step + 1, t.steps + 1):
            comm_record.set_step(step)
            guard.step = step
            done = train_step(model, loader.next_step, accum, sync, device, optimizer, scheduler, guard=guard)
            loss_sum, grad_norm, lr = done.loss, done.grad_norm, done.lr
            if done.skipped:  # [Note: non-finite steps]
                lr = scheduler.get_last_lr()[0]  # not stepped with: the rate the next step will use
                record = {"step": step, "skipped": "non-finite gradient"}
                records.append(record)
                metrics.log(record)
            progress.update(step)

            if step % t.log_every == 0 or step == t.steps:
                if sync.pp_groups:  # the loss lives on the last stage's rank
                    comm.all_reduce(loss_sum, sync.pp_groups[0], dim="pp")
                comm.all_reduce(loss_sum, mesh["dp"].get_group(), dim="dp", op=dist.ReduceOp.AVG)
                if mesh.layout.cp > 1:  # each cp rank's mean over its tokens: the same count on each
                    comm.all_reduce(loss_sum, mesh["cp"].get_group(), dim="cp", op=dist.ReduceOp.AVG)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                now = time.perf_counter()
                tokens_per_s = tokens_per_step * (step - last_step) / (now - last_time)
                last_time, last_step = now, step
                record = {"step": step, "loss": loss_sum.item(), "grad_norm": grad_norm.item(), "lr": lr,
                          "tokens_per_s": tokens_per_s, "mfu": flops_per_token * tokens_per_s / peak,
                          "mem_gb": peak_memory_gb(device)}
                if done.aux_loss is not None:  # mixture of experts: apart from the loss ([Note: auxiliary losses])
                    aux = done.aux_loss.clone()
                    if sync.pp_groups:  # each stage's layers: [Note: auxiliary losses under pipelining]
                        comm.all_reduce(aux, sync.pp_groups[0], dim="pp")
                    comm.all_reduce(aux, mesh["dp"].get_group(), dim="dp", op=dist.ReduceOp.AVG)
                    record["aux_loss"] = aux.item()
                if done.expert_load is not None:  # [Note: expert load] in meshpar/training/step.py
                    load = done.expert_load.clone()
                    if sync.pp_groups:
                        comm.all_reduce(load, sync.pp_groups[0], dim="pp")
                    comm.all_reduce(load, mesh["dp"].get_group(), dim="dp")
                    record.update(expert_load_fields(moe_layers, load, dropped=args.capacity_factor > 0))
                records.append(record)
                metrics.log(record)
            if t.eval_every and (step % t.eval_every == 0 or step == t.steps):
                record = {"step": step, "val_loss": evaluate(model, corpus.val, recipe, mesh, device)}
                records.append(record)
                metrics.log(record)
                last_time = time.perf_counter()  # validation time is not training throughput
            saved = ckpt is not None and recipe.checkpoint.every and (step % recipe.checkpoint.every == 0
                                                                      or step == t.steps)
            if saved:
                with label("checkpoint.save"):
                    ckpt.save(run, step)
                last_time = time.perf_counter()  # nor is saving
            profiler.step()
            if step < t.steps and step % recipe.fault.agree_every == 0:  # [Note: stopping on a signal]
                stopped_by = signals.agree()
                if stopped_by is not None:
                    _stop(ckpt, run, step, signals, saved, info)
                    break
    if ckpt is not None:
        ckpt.wait()  # the last save is complete before the run reports success
    metrics.close()
    progress.close()
    return model, optimizer, records, stopped_by


def _stop(ckpt: Checkpointer, run: RunState, step: int, signals: StopSignals, saved: bool, info: RankInfo) -> None:
    """Every rank, on an agreed stop signal: make step ``step`` a complete checkpoint, say so."""
    with label("checkpoint.save"):
        if not saved:
            ckpt.wait()
            ckpt.save(run, step)
        ckpt.wait()  # synchronous: the process exits next
    dist.barrier()  # rank 0 has committed it: no rank exits (and gets its peers killed) before that
    signals.saved()
    signal_name = signals.stopped_by
    if info.is_rank0:
        print_line(f"meshpar: stopped by {signal_name} after step {step}: checkpoint {ckpt.root / f'step_{step}'}; "
                   f"exit code {EXIT_PREEMPTED}; run the same command to resume")


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


def _restore(recipe: Recipe, checked: Preflight, ckpt: Checkpointer | None, run: RunState, info: RankInfo) -> int:
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
        from meshpar.convert import load_hf_weights
        load_hf_weights(run.model_state(), recipe.checkpoint.hf_weights, recipe.model.family, checked.args)
        if info.is_rank0:
            print(f"meshpar: initialized from Hugging Face weights in {recipe.checkpoint.hf_weights}", flush=True)
    return 0


def _count_params(model: Model, mesh: meshlib.Mesh) -> int:
    """Parameters of the whole model (DTensors count their global size; stages are summed over pp)."""
    n = torch.tensor(sum(q.numel() for q in model.stages.parameters()), dtype=torch.int64)
    if mesh.layout.pp > 1:
        dist.all_reduce(n, group=mesh["pp"].get_group())
    return int(n.item())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m meshpar.train", description="Train one rank (use under "
                                     "torchrun, or run `meshpar train`, which starts local ranks itself).")
    parser.add_argument("recipe", type=Path)
    args, overrides = parser.parse_known_args(argv)
    try:
        recipe = recipelib.load(args.recipe, overrides)
        result = train(recipe)
    except RecipeError as e:
        print(f"meshpar: error: {e}", file=sys.stderr)
        leave(2)
    except CheckpointError as e:  # a folder or file the message names; each failing rank says so
        print(f"meshpar: error: {e}", file=sys.stderr)
        leave(1)
    except NonFiniteError as e:  # every rank raises it; one says so
        if rank_info().is_rank0:
            print(f"meshpar: error: {e}", file=sys.stderr)
        leave(1)
    leave(EXIT_PREEMPTED if result.stopped_by is not None else 0)  # [Note: a rank leaves without finalization]

if __name__ == "__main__":
    main()
