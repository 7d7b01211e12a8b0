"""The pipeline bubble, measured from the schedule's own timings, against the theory.

    python -m tests.benchmarks.bench_pipeline [--ranks 2] [--microbatches 2,4,8] [--schedules gpipe,1f1b]

Each rank holds one stage of the debug Llama (pp = ranks, 1 thread per rank) and trains under
meshpar's schedule wrapper (meshpar.parallel.pipeline). A rank's busy time is the time spent inside its
stage's forward (module hooks) and backward (``Stage.backward_maybe_with_nosync``); its bubble
is ``1 - busy / step time``, the step timed from a barrier to the end of ``Pipeline.step``.
The table prints the mean over ranks next to the theoretical (p - 1) / (m + p - 1) for
p stages and m microbatches. Send/receive time counts as bubble, as it is idle compute.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshpar.models.llama import LLAMA_SIZES, Transformer
from meshpar.parallel.pipeline import build_schedule, split
from tests.distributed import run_distributed

SEQ, MICRO, STEPS, WARMUP = 256, 2, 5, 2


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _timed(stage, busy: list[float]) -> None:
    """Add the stage's forward and backward compute time to ``busy[0]``."""
    starts: list[float] = []
    stage.submod.register_forward_pre_hook(lambda *_: starts.append(time.perf_counter()))

    def forward_done(*_):
        busy[0] += time.perf_counter() - starts.pop()

    stage.submod.register_forward_hook(forward_done)
    backward = stage.backward_maybe_with_nosync

    def timed_backward(*args, **kwargs):
        start = time.perf_counter()
        try:
            return backward(*args, **kwargs)
        finally:
            busy[0] += time.perf_counter() - start

    stage.backward_maybe_with_nosync = timed_backward


def _rank_job(schedules: list[str], counts: list[int]) -> list[dict]:
    rank, pp = dist.get_rank(), dist.get_world_size()
    args = dataclasses.replace(LLAMA_SIZES["debug"], n_layers=2 * pp)
    rows = []
    for name in schedules:
        for m in counts:
            torch.manual_seed(0)
            with torch.device("meta"):
                whole = Transformer(args)
            stages = split(whole, rank, pp)
            for _, module in stages:
                module.to_empty(device="cpu")
                torch.manual_seed(0)
                module.init_weights()
            pipe = build_schedule(stages, pp, dist.group.WORLD, torch.device("cpu"), name, m, _loss)
            opt = torch.optim.AdamW([q for _, s in stages for q in s.parameters()], lr=1e-4, fused=True)
            busy = [0.0]
            for stage in pipe.stages:
                _timed(stage, busy)
            tokens = torch.randint(0, args.vocab_size, (m * MICRO, SEQ + 1), generator=torch.Generator().manual_seed(1))
            bubbles = []
            for step in range(WARMUP + STEPS):
                busy[0] = 0.0
                dist.barrier()
                start = time.perf_counter()
                pipe.step(tokens[:, :-1], tokens[:, 1:])
                elapsed = time.perf_counter() - start
                opt.step()
                opt.zero_grad(set_to_none=True)
                if step >= WARMUP:
                    bubbles.append(1 - busy[0] / elapsed)
            rows.append({"schedule": name, "m": m, "rank": rank, "bubble": statistics.median(bubbles)})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2, help="pipeline stages, one per rank")
    parser.add_argument("--microbatches", default="2,4,8")
    parser.add_argument("--schedules", default="gpipe,1f1b")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    counts = [int(x) for x in args.microbatches.split(",")]
    schedules = args.schedules.split(",")
    per_rank = run_distributed(_rank_job, args.ranks, schedules, counts, timeout=1200)
    p = args.ranks
    print(f"pipeline bubble, debug Llama ({2 * p} blocks), pp = {p}, {MICRO} x {SEQ} tokens per microbatch, "
          f"median of {STEPS} steps")
    print(f"{'schedule':<10}{'m':>4}{'measured':>10}{'theory':>9}  per rank")
    for rows in zip(*per_rank, strict=True):
        name, m = rows[0]["schedule"], rows[0]["m"]
        measured = statistics.mean(r["bubble"] for r in rows)
        theory = (p - 1) / (m + p - 1)
        print(f"{name:<10}{m:>4}{measured:>10.3f}{theory:>9.3f}  " + " ".join(f"{r['bubble']:.3f}" for r in rows))


if __name__ == "__main__":
    main()
