"""Peak memory of a training step with the loss whole and in chunks (``train.loss_chunks``), measured
and planned.

    python -m tests.benchmarks.bench_loss [--vocab 32768] [--seq 2048] [--chunks 1,8,0] [--dtype bfloat16]

The debug Llama (4 blocks, dim 256) with a large vocabulary on one gloo rank, through meshpar's own
build and step (``tests/benchmarks/calibrate_plan.build_training``: the parallelize path, the
step ``meshpar train`` runs, fused AdamW; with bf16 the one-rank FSDP units cast to it). Per chunk
count: the second step's peak live bytes by category (``AllocationTracker``), the losses of both
steps, the median time of ``--timed`` more steps, and ``meshpar plan``'s peak for the same recipe. The
analytic saving printed beside the measured one: whole, the loss's peak holds the fp32 logits, the
log-softmax it saves and a gradient of their size, three tensors of N x V x 4 bytes (N tokens, V
the vocabulary), where the chunked loss holds one chunk's (a 1/chunks share) and one more head-weight
gradient (V x D in the compute dtype: the chunks' gradients summed). Results:
docs/performance.md#chunked-cross-entropy.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from meshpar.config import recipe as recipelib
from meshpar.distributed import mesh as meshlib
from meshpar.profiling.memory import AllocationTracker
from meshpar.training.loss import layout_chunks
from tests.benchmarks.calibrate_plan import BASE, build_training, predict
from tests.distributed import run_distributed

MIB = 2**20


def _overrides(vocab: int, seq: int, chunks: int, dtype: str) -> list[str]:
    return [*BASE, f"--model.vocab_size={vocab}", f"--train.seq_len={seq}", "--train.global_batch=1",
            "--train.micro_batch=1", "--parallel.dp_shard=1", f"--train.loss_chunks={chunks}",
            f'--parallel.param_dtype="{dtype}"']


def measure(overrides: list[str], timed: int) -> dict:
    """On one gloo rank: the second step's peak by category, the first two losses, the median of
    ``timed`` more steps' seconds."""
    run = build_training(recipelib.load(None, overrides))
    losses = [run.step().loss.item()]
    with AllocationTracker(run.model.stages, run.optimizer) as tracker:
        losses.append(run.step().loss.item())
    seconds = []
    for _ in range(timed):
        start = time.perf_counter()
        run.step()
        seconds.append(time.perf_counter() - start)
    return {"peak": tracker.peak(), "losses": losses, "step_s": statistics.median(seconds)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--chunks", default="1,4,8", help="train.loss_chunks values; 0: automatic")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--timed", type=int, default=1, help="steps timed after the measured one")
    a = parser.parse_args()
    dim = 256  # the debug size's
    logits = a.seq * a.vocab * 4
    head_grad = a.vocab * dim * torch.empty((), dtype=getattr(torch, a.dtype)).element_size()
    print(f"debug Llama, vocabulary {a.vocab}, {a.seq} tokens per microbatch, {a.dtype}; fp32 logits "
          f"N x V x 4 = {logits / MIB:.0f} MiB, a head-weight gradient {head_grad / MIB:.0f} MiB", flush=True)
    print(f"{'loss_chunks':>11} {'chunks':>6} {'peak MiB':>9} {'act+tmp':>8} {'planned':>8} {'saved':>7} "
          f"{'analytic':>8} {'loss 1':>8} {'loss 2':>8} {'step s':>7}", flush=True)
    whole = None
    for chunks in (int(c) for c in a.chunks.split(",")):
        overrides = _overrides(a.vocab, a.seq, chunks, a.dtype)
        got = run_distributed(measure, 1, overrides, a.timed, timeout=1200)[0]
        planned = predict(overrides, 1)[0]
        peak = got["peak"]
        total, act = peak["Total"], peak["Activation"] + peak["Temp"]
        recipe = recipelib.load(None, overrides)
        n = layout_chunks(chunks, 1, a.seq, a.vocab, meshlib.resolve(recipe.parallel, 1), True)
        whole = whole if whole is not None else total
        analytic = 0 if n == 1 else 3 * logits * (1 - 1 / n) - head_grad
        print(f"{chunks:>11} {n:>6} {total / MIB:>9.0f} {act / MIB:>8.0f} {planned / MIB:>8.0f} "
              f"{(whole - total) / MIB:>7.0f} {analytic / MIB:>8.0f} {got['losses'][0]:>8.5f} "
              f"{got['losses'][1]:>8.5f} {got['step_s']:>7.2f}", flush=True)


if __name__ == "__main__":
    main()
