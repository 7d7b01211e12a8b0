"""Building one rank's run, before its first step (meshpar/training/loop.py trains it): the model's
stages parallelized and initialized, its data loader, its checkpointer, and the step it resumes
from (a checkpoint, Hugging Face weights, or 0); what rank 0 prints at the start.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshpar.checkpoint import Checkpointer, RunState
from meshpar.config import recipe as recipelib
from meshpar.config.recipe import Recipe
from meshpar.data import BatchLoader
from meshpar.distributed import mesh as meshlib
from meshpar.parallel import float8 as float8lib
from meshpar.parallel.context_parallel import flex as flexlib
from meshpar.parallel.parallelize import build
from meshpar.parallel.pipeline import build_schedule
from meshpar.runtime import replicas
from meshpar.runtime.process import RankInfo
from meshpar.runtime.progress import print_line
from meshpar.training.loss import TokenLoss, last_head, layout_chunks
from meshpar.training.preflight import Preflight
from meshpar.training.step import Model

# load_hf_weights(model state dict, folder, family, model args), filling the state in place and returning a
# line on what it skipped (or ""): meshpar.convert's, passed in by meshpar/train.py because convert/ is a
# layer above training/
HFLoader = Callable[[Mapping[str, torch.Tensor], str, str, Any], str]


def wandb_sink(recipe: Recipe, info: RankInfo, output_dir: Path, start_step: int):
    """Rank 0's W&B run when ``metrics.wandb`` is set ([Note: one W&B run per training run]), else None."""
    if not (recipe.metrics.wandb and info.is_rank0):
        return None
    from meshpar.training.wandb_sink import WandbSink

    return WandbSink(recipe.metrics, output_dir, dataclasses.asdict(recipe), resumed=start_step > 0)


def announce(recipe: Recipe, checked: Preflight, mesh: meshlib.Mesh, device: torch.device, info: RankInfo,
             output_dir: Path) -> None:
    """Rank 0: the resolved recipe written to ``output_dir`` and printed under the run's one-line summary."""
    output_dir.mkdir(parents=True, exist_ok=True)
    resolved = recipelib.dumps(recipe)
    (output_dir / "recipe.toml").write_text(resolved)
    ranks = f"{info.world_size} rank{'s' if info.world_size > 1 else ''}"
    print(f"meshpar: {checked.family.label(recipe.model, checked.args)} | {ranks} on {device.type} | "
          f"layout {mesh.layout} | data {checked.corpus.name} | {checked.accum} microbatches/step\n--- resolved recipe "
          f"({output_dir / 'recipe.toml'}) ---\n{resolved}---", flush=True)


def build_model(recipe: Recipe, checked: Preflight, mesh: meshlib.Mesh, device: torch.device) -> Model:
    """This rank's stages, parallelized and initialized, and the pipeline schedule that runs them.
    Layout-independent values (meshpar.models.init): every layout starts from the same model."""
    p, m, t = recipe.parallel, recipe.model, recipe.train
    chunks = layout_chunks(t.loss_chunks, t.micro_batch, t.seq_len, checked.args.vocab_size, mesh.layout,
                           p.loss_parallel)
    stages = build(checked.family, checked.args, mesh, p, device, t.seed, float8=m.float8,
                   float8_emulate=m.float8_emulate, head_in_loss=chunks > 1)
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
    return Model(modules, pipeline, mesh.layout.tp > 1 and p.loss_parallel, after_step, around_step, loss,
                 checked.family.moe)


def float8_line(recipe: Recipe, model: Model, mesh: meshlib.Mesh) -> str:
    """What ``model.float8`` converted, for the start of the log: the mode, how FSDP gathers, what stayed."""
    m = recipe.model
    gather = "all-gather in float8" if float8lib.float8_all_gather(m.float8, mesh.layout) else (
        "all-gather in the parameter dtype" if float8lib.shards_over_ranks(mesh.layout) else "no FSDP all-gather")
    if mesh.layout.tp > 1:  # [Note: float8 TP styles and biases]
        gather += (", tensor-parallel activations gathered in float8 (layers without a bias)"
                   if m.float8 == "tensorwise" else ", tensor-parallel activations gathered in high precision")
    left = [name for stage in model.stages for name, mod in stage.named_modules() if type(mod) is torch.nn.Linear]
    experts = " | mixture-of-experts experts stay in high precision" if model.moe is not None else ""
    return (f"meshpar: float8 {m.float8}{' (emulated)' if m.float8_emulate else ''}, {gather} | left in high "
            f"precision: {', '.join(left) or 'none'}{experts}")


def cp_flex_line(recipe: Recipe, layout: meshlib.Layout, device: torch.device) -> str:
    """What ``parallel.cp_flex`` does in this run, for the start of the log."""
    p, local = recipe.parallel, recipe.train.seq_len // layout.cp
    if device.type != "cuda":
        return f"meshpar: parallel.cp_flex is for CUDA: this {device.type} run keeps its cp attention's kernels"
    if p.cp_attention == "ulysses":
        return "meshpar: parallel.cp_flex: Ulysses has no flex path (its attention is one whole-sequence call)"
    if not flexlib.takes(local, local):
        return (f"meshpar: parallel.cp_flex: {local} tokens per cp rank are not whole tiles of {flexlib.BLOCK}; "
                f"the cp attention keeps its kernels")
    return (f"meshpar: cp attention ({p.cp_attention}) on compiled flex_attention (parallel.cp_flex; not yet "
            f"checked on a GPU: scripts/gpu_checks.sh cp)")


def train_loader(recipe: Recipe, checked: Preflight, mesh: meshlib.Mesh) -> BatchLoader:
    """This rank's slice of each global batch; under torchft the slices of every replica group
    ([Note: replica groups under torchft])."""
    t, corpus = recipe.train, checked.corpus
    mixture = len(corpus.sources) > 1  # [Note: mixtures]
    dp_rank = mesh.dp_rank + (recipe.fault.replica_id * mesh.layout.dp if replicas.managed(recipe) else 0)
    return BatchLoader(corpus.sources if mixture else corpus.train, seq_len=t.seq_len, global_batch=t.global_batch,
                       micro_batch=t.micro_batch, dp_rank=dp_rank, dp_size=checked.layout.dp, seed=t.seed,
                       weights=corpus.weights if mixture else None)


def count_params(model: Model, mesh: meshlib.Mesh) -> int:
    """Parameters of the whole model (DTensors count their global size; stages are summed over pp)."""
    n = torch.tensor(sum(q.numel() for q in model.stages.parameters()), dtype=torch.int64)
    if mesh.layout.pp > 1:
        dist.all_reduce(n, group=mesh["pp"].get_group())
    return int(n.item())


def checkpointer(recipe: Recipe, checked: Preflight, mesh: meshlib.Mesh, info: RankInfo,
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


def restore(recipe: Recipe, checked: Preflight, ckpt: Checkpointer | None, run: RunState, info: RankInfo,
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
        note = load_hf_weights(run.model_state(), recipe.checkpoint.hf_weights, recipe.model.family, checked.args)
        if info.is_rank0:
            print(f"meshpar: initialized from Hugging Face weights in {recipe.checkpoint.hf_weights}"
                  + (f"\n{note}" if note else ""), flush=True)
    return 0
