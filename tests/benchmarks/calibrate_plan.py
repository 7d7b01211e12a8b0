"""The planner's peak memory against a real training step's, per layout.

    python -m tests.benchmarks.calibrate_plan [--layouts all | 1,3,7] [--steps 2]

Each layout trains the debug Llama (4 blocks, dim 256; vocabulary 8192 so the loss is a real
part of the peak; the debug Qwen3 MoE and DeepSeek-V3 for the ep layouts) on gloo ranks (``tests/distributed.py``)
through meshpar's own code: the parallelize path (``meshpar.parallel.parallelize.build``), the
pipeline schedule, ``meshpar.training.step.train_step`` (the step ``meshpar train`` runs), fused
AdamW. ``meshpar.profiling.memory.AllocationTracker``
follows every tensor storage from before the first step; the measured peak is the second
step's (the steady state: AdamW state exists, FSDP has recorded its prefetch order, the
pipeline has its receive buffers), the largest over each pipeline stage's ranks. The
prediction is ``meshpar plan``'s peak for the same recipe at the same world size, with the
CPU profile (gloo's collective buffers). The table prints both and the error per layout;
the goal is every layout within 5%.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from meshpar.config import recipe as recipelib
from meshpar.distributed import mesh as meshlib
from meshpar.models import get_family
from meshpar.parallel.parallelize import build
from meshpar.parallel.pipeline import build_schedule
from meshpar.planner import plan
from meshpar.planner.cli import load_hardware
from meshpar.profiling.memory import AllocationTracker
from meshpar.training.loss import TokenLoss, last_head, layout_chunks
from meshpar.training.optim import build_optimizer
from meshpar.training.preflight import _check_batch
from meshpar.training.step import GradSync, Model, train_step
from tests.distributed import run_distributed

BASE = ["--model.size=debug", "--model.vocab_size=8192", "--train.seq_len=256", "--metrics.hardware=cpu",
        "--train.eval_every=0"]

# name -> (world size, overrides)
LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "1 rank": (1, ["--parallel.dp_shard=1", "--train.global_batch=4", "--train.micro_batch=4"]),
    "dp_shard 2": (2, ["--parallel.dp_shard=2", "--train.global_batch=8", "--train.micro_batch=4"]),
    "dp_shard 4, full AC": (4, ["--parallel.dp_shard=4", "--train.global_batch=16", "--train.micro_batch=4",
                                '--parallel.activation_checkpoint="full"']),
    "dp_shard 2, accum 2, keep": (2, ["--parallel.dp_shard=2", "--train.global_batch=16", "--train.micro_batch=4",
                                      "--parallel.reshard_after_forward=false"]),
    "dp_shard 2, accum 4, reduce every microbatch": (2, ["--parallel.dp_shard=2", "--train.global_batch=16",
                                                         "--train.micro_batch=2",
                                                         '--parallel.grad_reduce="microbatch"']),
    "dp_replicate 2": (2, ["--parallel.dp_replicate=2", "--parallel.dp_shard=1", "--train.global_batch=8",
                           "--train.micro_batch=4"]),
    "hybrid 2 x 2, bf16": (4, ["--parallel.dp_replicate=2", "--parallel.dp_shard=2", "--train.global_batch=16",
                               "--train.micro_batch=4", '--parallel.param_dtype="bfloat16"']),
    "tp 2": (2, ["--parallel.dp_shard=1", "--parallel.tp=2", "--train.global_batch=4", "--train.micro_batch=4"]),
    "dp_shard 2 x tp 2, selective AC": (4, ["--parallel.dp_shard=2", "--parallel.tp=2", "--train.global_batch=8",
                                            "--train.micro_batch=4", '--parallel.activation_checkpoint="selective"']),
    "dp_shard 2 x tp 2, full AC, bf16": (4, ["--parallel.dp_shard=2", "--parallel.tp=2", "--train.global_batch=2",
                                             "--train.micro_batch=1", '--parallel.activation_checkpoint="full"',
                                             '--parallel.param_dtype="bfloat16"']),
    "pp 2 x dp_shard 2, 1f1b": (4, ["--parallel.pp=2", "--parallel.dp_shard=2", "--train.global_batch=16",
                                    "--train.micro_batch=2"]),
    "pp 2 x dp_shard 2 x tp 2": (8, ["--parallel.pp=2", "--parallel.dp_shard=2", "--parallel.tp=2",
                                     "--train.global_batch=16", "--train.micro_batch=2"]),
    "pp 2 x dp_shard 2, 1f1b, loss in 4 chunks": (4, ["--parallel.pp=2", "--parallel.dp_shard=2",
                                                      "--train.global_batch=16", "--train.micro_batch=2",
                                                      "--train.loss_chunks=4"]),
    "pp 2 x dp_shard 2, reduce every microbatch": (4, ["--parallel.pp=2", "--parallel.dp_shard=2",
                                                       "--train.global_batch=16", "--train.micro_batch=2",
                                                       '--parallel.grad_reduce="microbatch"']),
    "pp 2 x tp 2, gpipe, full AC": (4, ["--parallel.pp=2", "--parallel.dp_shard=1", "--parallel.tp=2",
                                        "--train.global_batch=8", "--train.micro_batch=2",
                                        '--parallel.pp_schedule="gpipe"', '--parallel.activation_checkpoint="full"']),
    # context parallelism, each attention, plain causal and over packed documents (the masks' memory,
    # whatever the documents: random tokens end one at id 0), and a mixture of experts with ep
    **{f"cp 2 x dp_shard 2, {attention}{', documents' if docs else ''}": (4, [
        "--parallel.cp=2", "--parallel.dp_shard=2", "--train.global_batch=8", "--train.micro_batch=4",
        f'--parallel.cp_attention="{attention}"', *(['--model.attention="document"'] if docs else [])])
       for attention in ("allgather", "ring", "ulysses") for docs in (False, True)},
    "cp 2 x tp 2, ulysses, selective AC": (4, ["--parallel.cp=2", "--parallel.tp=2", "--parallel.dp_shard=1",
                                               "--train.global_batch=4", "--train.micro_batch=4",
                                               '--parallel.cp_attention="ulysses"',
                                               '--parallel.activation_checkpoint="selective"']),
    "qwen3_moe dp_shard 4, ep 4": (4, ["--model.family=qwen3_moe", "--parallel.dp_shard=4", "--parallel.ep=4",
                                       "--train.global_batch=16", "--train.micro_batch=4"]),
    "qwen3_moe dp_shard 2 x tp 2, ep 2": (4, ["--model.family=qwen3_moe", "--parallel.dp_shard=2", "--parallel.tp=2",
                                             "--parallel.ep=2", "--train.global_batch=8", "--train.micro_batch=4"]),
    "deepseek_v3 dp_shard 4, ep 2": (4, ["--model.family=deepseek_v3", "--parallel.dp_shard=4", "--parallel.ep=2",
                                         "--train.global_batch=16", "--train.micro_batch=4"]),
    "deepseek_v3 dp_shard 2 x tp 2, ep 2": (4, ["--model.family=deepseek_v3", "--parallel.dp_shard=2",
                                                "--parallel.tp=2", "--parallel.ep=2", "--train.global_batch=8",
                                                "--train.micro_batch=4"]),
    "deepseek_v3 dp_shard 2 x cp 2, ep 2": (4, ["--model.family=deepseek_v3", "--parallel.dp_shard=2",
                                                "--parallel.cp=2", "--parallel.ep=2", "--train.global_batch=8",
                                                "--train.micro_batch=4"]),
}


class _RandomBatches:
    """``BatchLoader.next_step`` with random tokens: what a step reads, without a corpus."""

    def __init__(self, accum: int, micro_batch: int, seq_len: int, vocab: int) -> None:
        self.shape, self.accum, self.vocab = (micro_batch, seq_len), accum, vocab
        self.generator = torch.Generator().manual_seed(0)

    def next_step(self):  # whole sequences: train_step gives each cp rank its tokens
        return [(torch.randint(0, self.vocab, self.shape, generator=self.generator),
                 torch.randint(0, self.vocab, self.shape, generator=self.generator)) for _ in range(self.accum)]


@dataclass
class Training:
    """What ``meshpar train`` builds on one gloo rank for a recipe, without data or LR schedule."""

    layout: meshlib.Layout
    accum: int
    args: object
    mesh: meshlib.Mesh
    pipeline: object
    model: Model
    optimizer: torch.optim.Optimizer
    loader: _RandomBatches
    sync: GradSync
    device: torch.device

    def step(self):
        """meshpar.train's step, without the LR schedule."""
        return train_step(self.model, self.loader.next_step, self.accum, self.sync, self.device, self.optimizer)


def build_training(recipe: recipelib.Recipe) -> Training:
    """The parallelized model (``meshpar.parallel.parallelize.build``), its pipeline schedule, fused AdamW,
    random batches and gradient sync, on this gloo rank (also tests/benchmarks/bench_moe.py's)."""
    t, p = recipe.train, recipe.parallel
    layout = meshlib.resolve(p, dist.get_world_size())
    accum = _check_batch(recipe, layout)
    family = get_family(recipe.model.family)
    args = family.model_args(recipe.model)
    if recipe.model.attention == "document":  # random tokens: id 0 ends a document
        args = dataclasses.replace(args, document_eos=0)
    mesh = meshlib.build(layout, "cpu")
    device = torch.device("cpu")
    chunks = layout_chunks(t.loss_chunks, t.micro_batch, t.seq_len, args.vocab_size, layout, p.loss_parallel)
    stages = build(family, args, mesh, p, device, t.seed, head_in_loss=chunks > 1)
    loss = TokenLoss(last_head(m for _, m in stages), chunks)
    pipeline = None
    if layout.pp > 1:
        pipeline = build_schedule(stages, layout.pp, mesh["pp"], device, p.pp_schedule, accum, loss,
                                  reduce_every_microbatch=p.grad_reduce == "microbatch")
    model = Model(torch.nn.ModuleList(m for _, m in stages), pipeline, layout.tp > 1 and p.loss_parallel, loss=loss,
                  moe=family.moe)
    loader = _RandomBatches(accum, t.micro_batch, t.seq_len, args.vocab_size)
    return Training(layout, accum, args, mesh, pipeline, model, build_optimizer(model.stages, recipe.optim), loader,
                    GradSync.of(mesh, p, recipe.optim), device)


def measure_rank(overrides: list[str], steps: int) -> tuple[int, int]:
    """On one gloo rank: (pipeline stage, peak live bytes of the last of ``steps`` training steps)."""
    run = build_training(recipelib.load(None, overrides))
    model, optimizer, pipeline, mesh, step = run.model, run.optimizer, run.pipeline, run.mesh, run.step
    for _ in range(steps - 1):
        step()
    # The tracker starts after the first step: the pipeline's first step infers shapes with
    # autograd.grad, which MemTracker's module hooks refuse. What that step left alive is
    # tracked from here on: the model, AdamW state, the pipeline's receive buffers.
    with AllocationTracker(model.stages, optimizer, *_receive_buffers(pipeline)) as tracker:
        step()
    return mesh["pp"].get_local_rank(), tracker.peak_bytes


def _receive_buffers(pipeline) -> list[torch.Tensor]:
    """The buffers torch.distributed.pipelining keeps per microbatch for received activations
    and gradients (attributes of torch 2.13's PipelineStage)."""
    if pipeline is None:
        return []
    out = []
    for stage in pipeline.stages:
        for infos in (*stage.args_recv_info.values(), *stage.grad_recv_info.values()):
            out += [i.buffer for i in infos if isinstance(getattr(i, "buffer", None), torch.Tensor)]
    return out


def predict(overrides: list[str], world: int) -> dict[int, int]:
    """meshpar plan's peak per pipeline stage."""
    recipe = recipelib.load(None, overrides)
    profile, _ = load_hardware("cpu")
    return {r.stage: r.peak_bytes for r in plan(recipe, world, profile).ranks}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layouts", default="all", help="'all' or 1-based indices, e.g. 1,3,7")
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args()
    names = list(LAYOUTS)
    chosen = names if args.layouts == "all" else [names[int(i) - 1] for i in args.layouts.split(",")]
    print(f"{'layout':<46} {'ranks':>5} {'stage':>5} {'measured MiB':>13} {'planned MiB':>12} {'error':>8}")
    worst = 0.0
    for name in chosen:
        world, extra = LAYOUTS[name]
        overrides = BASE + extra
        start = time.perf_counter()
        measured: dict[int, int] = {}
        for stage, peak in run_distributed(measure_rank, world, overrides, args.steps, timeout=600):
            measured[stage] = max(measured.get(stage, 0), peak)
        planned = predict(overrides, world)
        for stage in sorted(measured):
            error = planned[stage] / measured[stage] - 1
            worst = max(worst, abs(error))
            print(f"{name:<46} {world:>5} {stage:>5} {measured[stage] / 2**20:>13.2f} {planned[stage] / 2**20:>12.2f} "
                  f"{100 * error:>+7.2f}%   ({time.perf_counter() - start:.0f} s)", flush=True)
    print(f"largest error: {100 * worst:.2f}% (goal: within 5%)")


if __name__ == "__main__":
    main()
