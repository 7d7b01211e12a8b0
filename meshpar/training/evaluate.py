"""What the training loop measures besides the training loss: the validation loss every
``train.eval_every`` steps (over every token, or over the trained targets of fine-tuning data), and
a greedy sample every ``train.sample_every`` steps (meshpar/training/loop.py calls both).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshpar.config.recipe import Recipe
from meshpar.data import BatchLoader
from meshpar.data.packing import IGNORE, Conversations
from meshpar.distributed import mesh as meshlib
from meshpar.parallel.context_parallel.layout import shard_sequence
from meshpar.parallel.tensor_parallel.plan import loss_parallel_context
from meshpar.runtime.process import RankInfo
from meshpar.runtime.progress import Progress
from meshpar.training.loss import plain
from meshpar.training.step import Model


@torch.no_grad()
def evaluate(model: Model, tokens, recipe: Recipe, mesh: meshlib.Mesh, device: torch.device) -> float:
    """Mean loss over the first ``eval_batches`` global batches of held-out data (fine-tuning data:
    over their trained targets)."""
    t = recipe.train
    loader = BatchLoader(tokens, seq_len=t.seq_len, global_batch=t.global_batch, micro_batch=t.micro_batch,
                         dp_rank=mesh.dp_rank, dp_size=mesh.layout.dp, seed=t.seed, shuffle=False)
    if isinstance(tokens, Conversations):
        return _evaluate_trained(model, loader, recipe, mesh, device)
    model.stages.eval()
    total = torch.zeros((), device=device)
    n = 0
    with loss_parallel_context(model.loss_parallel), model.around_step():  # float8's gloo all-gathers, as in training
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
                total += plain(model.loss(model.stages[0](inputs.to(device)), targets.to(device)))
                n += 1
    model.stages.train()
    total /= n
    if mesh.layout.pp > 1:  # the loss lives on the last stage's rank
        dist.all_reduce(total, group=mesh["pp"].get_group())
    dist.all_reduce(total, op=dist.ReduceOp.AVG, group=mesh["dp"].get_group())
    if mesh.layout.cp > 1:
        dist.all_reduce(total, op=dist.ReduceOp.AVG, group=mesh["cp"].get_group())
    return total.item()


def _evaluate_trained(model: Model, loader: BatchLoader, recipe: Recipe, mesh: meshlib.Mesh,
                      device: torch.device) -> float:
    """``evaluate`` on fine-tuning data: the summed loss of trained targets over their count (pp = 1,
    as document attention requires)."""
    model.stages.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)  # [summed loss, trained targets]
    with loss_parallel_context(model.loss_parallel), model.loss.weight(1.0), model.around_step():
        for _ in range(recipe.train.eval_batches):
            for inputs, targets in loader.next_step():
                if mesh.layout.cp > 1:
                    inputs, targets = shard_sequence(inputs, mesh["cp"]), shard_sequence(targets, mesh["cp"])
                targets = targets.to(device)
                total[0] += plain(model.loss(model.stages[0](inputs.to(device)), targets)).double()
                total[1] += (targets != IGNORE).sum()
    model.stages.train()
    dist.all_reduce(total, group=mesh["dp"].get_group())
    if mesh.layout.cp > 1:
        dist.all_reduce(total, group=mesh["cp"].get_group())
    return (total[0] / total[1].clamp(min=1)).item()


def sample(model: torch.nn.Module, tokenizer: Any, recipe: Recipe, step: int, info: RankInfo, output_dir: Path,
            progress: Progress) -> None:
    """train.sample_every: the model's greedy continuation of train.sample_prompt, run by every rank
    (pp = 1: the one stage is the model), printed and appended to samples.jsonl by rank 0."""
    from meshpar.models.decode import generate, prompt_ids

    t = recipe.train
    prompt = prompt_ids(tokenizer, t.sample_prompt)
    out = generate(model, prompt, max(1, min(t.sample_tokens, t.seq_len - len(prompt))),
                   stop=tokenizer.eos_id)  # None for the byte tokenizer: no end token
    if info.is_rank0:
        text = tokenizer.decode(out)
        with (output_dir / "samples.jsonl").open("a") as f:
            f.write(json.dumps({"step": step, "prompt": t.sample_prompt, "tokens": out, "text": text}) + "\n")
        progress.print(f"step {step:>6} | sample: {t.sample_prompt + text!r}")
