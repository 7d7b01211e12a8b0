"""Host overhead of a training step: meshpar's FSDP engine, PyTorch's ``fully_shard`` and plain PyTorch
on a model whose step is all dispatch and no arithmetic.

    python -m tests.benchmarks.bench_overhead [--ranks 1,2] [--blocks 48] [--dim 64] [--steps 20]
                                              [--warmup 5] [--dtype bfloat16] [--json runs/bench_overhead.json]

The model is the Llama of meshpar/models/llama with ``--blocks`` blocks of width ``--dim`` (4 heads,
feed-forward 2 x dim, vocabulary 256) fed one token per rank: its matmuls take microseconds, so a
step's time is the Python and dispatch each engine spends per parameter and per block. Engines, each
from the same initial values, one step of each in turn (load on the machine falls on all alike):

- ``meshpar``: ``meshpar.fully_shard`` on every block, then the root, and meshpar's optimizer
  (``meshpar.training.optim.build_optimizer``: fused AdamW);
- ``torch``: PyTorch's ``fully_shard`` the same way, and ``torch.optim.AdamW(fused=True)``;
- ``plain`` (1 rank only): the bare model, the same AdamW.

With ``--dtype bfloat16`` (the default, as GPU training runs) both FSDP engines compute in bf16
from fp32 shards (``param_dtype`` bf16, ``reduce_dtype`` fp32) and plain PyTorch runs its forward
under ``torch.autocast``; ``float32`` drops the casts from every engine.

Per engine and rank count it prints the median step (the slowest rank's, ranks starting together
at a barrier) and its parts timed alone: forward with the loss, backward, optimizer step; then,
from one more step under ``torch.profiler``, the engine's hooks (the time inside the labels it
opens around its work, ``meshpar::fsdp.*`` or ``FSDP::*``, nested ones counted once: the casts,
copies and collectives issued there included) and how many labels, the casts (``aten::_to_copy``
calls), the collectives issued (dispatcher ops of ``c10d``), and every aten op dispatched. The profiled step runs slower
than the timed ones: its figures size the parts, the timed ones are the result. Last, the ratios
the issue sets goals for: meshpar/torch (<= 1.0) and meshpar/plain (<= 1.3, 1 rank), each the
median of the rounds' ratios with their quartiles ([Note: paired ratios]).
Results: docs/performance.md#host-overhead.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshpar.models.llama import Transformer
from meshpar.models.llama.args import ModelArgs
from tests.distributed import run_distributed

ENGINES = ("plain", "meshpar", "torch")
# what each FSDP engine names the work of its hooks (torch adds the module's name in brackets)
LABEL_PREFIX = {"meshpar": "meshpar::fsdp.", "torch": "FSDP::"}


def _covered_us(events: list, prefix: str) -> tuple[float, int]:
    """(microseconds inside any event named ``prefix...``, nested ones counted once; how many)."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events if e.name.startswith(prefix))
    total, end = 0.0, float("-inf")
    for a, b in spans:
        if b > end:
            total += b - max(a, end)
            end = b
    return total, len(spans)


def model_args(blocks: int, dim: int) -> ModelArgs:
    return ModelArgs(dim=dim, n_layers=blocks, n_heads=4, n_kv_heads=2, ffn_dim=2 * dim, vocab_size=256,
                     max_seq_len=16)


class _Trainer:
    """One engine's model, optimizer and this rank's one-token batch."""

    def __init__(self, engine: str, args: ModelArgs, dtype: torch.dtype, mesh: Any) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        from meshpar.config.recipe import OptimConfig
        from meshpar.fsdp import MixedPrecisionPolicy, fully_shard
        from meshpar.training.optim import build_optimizer

        self.engine, self.dtype = engine, dtype
        torch.manual_seed(0)
        model = Transformer(args)
        model.init_weights()
        lowered = dtype != torch.float32
        if engine != "plain":
            shard, policy = (fully_shard, MixedPrecisionPolicy) if engine == "meshpar" else \
                (torch_fully_shard, TorchPolicy)
            mp = policy(param_dtype=dtype, reduce_dtype=torch.float32) if lowered else policy()
            for block in model.layers.values():
                shard(block, mesh=mesh, mp_policy=mp)
            shard(model, mesh=mesh, mp_policy=mp)
        self.model = model
        if engine == "meshpar":
            self.opt = build_optimizer(model, OptimConfig(lr=1e-4, weight_decay=0.1))
        else:
            self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
        g = torch.Generator().manual_seed(1234 + dist.get_rank())
        tokens = torch.randint(0, args.vocab_size, (1, 2), generator=g)
        self.inputs, self.targets = tokens[:, :1], tokens[:, 1:]
        self.parts: dict[str, list[float]] = {"step": [], "forward": [], "backward": [], "optimizer": []}
        self.losses: list[float] = []

    def _forward(self) -> torch.Tensor:
        autocast = torch.autocast("cpu", dtype=self.dtype) if self.engine == "plain" and \
            self.dtype != torch.float32 else contextlib.nullcontext()
        with autocast:
            logits = self.model(self.inputs)
        return F.cross_entropy(logits.flatten(0, 1).float(), self.targets.flatten())

    def step(self, timed: bool = False) -> None:
        dist.barrier()  # every rank starts together; a step's time is the slowest rank's
        t0 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        loss = self._forward()
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        self.opt.step()
        t3 = time.perf_counter()
        self.losses.append(loss.item())
        if timed:
            for part, seconds in zip(self.parts, (t3 - t0, t1 - t0, t2 - t1, t3 - t2), strict=True):
                self.parts[part].append(seconds)

    def profile(self) -> dict[str, Any]:
        """One more step under torch.profiler: hook time, casts, collectives, aten ops."""
        from torch.profiler import ProfilerActivity, profile

        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            self.step()
        events = prof.events()
        ops = Counter(e.name for e in events if e.name.startswith("aten::"))
        hooks_us, labels = _covered_us(events, LABEL_PREFIX[self.engine]) if self.engine in LABEL_PREFIX else (0, 0)
        return dict(hooks_ms=hooks_us / 1e3, hook_calls=labels, casts=ops["aten::_to_copy"],
                    collectives=sum(1 for e in events if e.name.startswith("c10d::") and "barrier" not in e.name),
                    aten_ops=sum(ops.values()))


def _rank_job(engines: list[str], blocks: int, dim: int, dtype: str, steps: int, warmup: int) -> list[dict]:
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    args = model_args(blocks, dim)
    trainers = [_Trainer(e, args, getattr(torch, dtype), mesh) for e in engines if e != "plain" or world == 1]
    for _ in range(warmup):
        for t in trainers:
            t.step()
    gc.collect()
    gc.disable()  # a collection inside one engine's step would land on it alone
    try:
        for _ in range(steps):
            for t in trainers:
                t.step(timed=True)
    finally:
        gc.enable()
    return [dict(engine=t.engine, ranks=world, parts=t.parts, losses=t.losses, **t.profile()) for t in trainers]


def summarize(per_rank: list[list[dict]]) -> list[dict]:
    """One row per engine: each part's median over steps of the slowest rank; rank 0's counts; the
    slowest rank's step of each round (``rounds_ms``, for ``ratios``)."""
    rows = []
    for records in zip(*per_rank, strict=True):
        r0 = records[0]
        row = {k: v for k, v in r0.items() if k not in ("parts", "losses")}
        for part in r0["parts"]:
            slowest = [max(ts) for ts in zip(*(r["parts"][part] for r in records), strict=True)]
            row[f"{part}_ms"] = 1e3 * statistics.median(slowest)
            if part == "step":
                row["rounds_ms"] = [1e3 * t for t in slowest]
        row["loss_first"], row["loss_last"] = r0["losses"][0], r0["losses"][-1]
        rows.append(row)
    return rows


# [Note: paired ratios]
# The engines step in turn, one step each per round, so a round's steps share the machine's state
# of that moment (another process's load, the clock). The ratio of two engines is the median over
# rounds of each round's ratio, which that common factor cancels out of; the ratio of the two
# medians would keep it where the slow rounds of one engine are not those of the other. The
# quartiles of the rounds' ratios are printed beside it: how far one round's figure can be trusted.


def ratio_rounds(rows: list[dict]) -> dict[str, list[float]]:
    """meshpar/torch at every rank count, meshpar/plain at 1 rank: each round's ratio of step times
    (one value, the ratio of the medians, where a row has no rounds)."""
    by = {(r["engine"], r["ranks"]): r for r in rows}
    out = {}
    for (engine, n), row in sorted(by.items()):
        if engine != "meshpar":
            continue
        for peer in ("torch", "plain"):
            other = by.get((peer, n))
            if other is None:
                continue
            mine, theirs = row.get("rounds_ms"), other.get("rounds_ms")
            if mine and theirs and len(mine) == len(theirs):
                out[f"meshpar/{peer}, {n} rank(s)"] = [a / b for a, b in zip(mine, theirs, strict=True)]
            else:
                out[f"meshpar/{peer}, {n} rank(s)"] = [row["step_ms"] / other["step_ms"]]
    return out


def ratios(rows: list[dict]) -> dict[str, float]:
    """meshpar/torch at every rank count, meshpar/plain at 1 rank: the median of the rounds' ratios
    ([Note: paired ratios])."""
    return {name: statistics.median(values) for name, values in ratio_rounds(rows).items()}


def _quartiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q1, _, q3 = statistics.quantiles(values, n=4)
    return q1, q3


GOALS = {"meshpar/torch": 1.0, "meshpar/plain": 1.3}


def print_report(rows: list[dict], args: argparse.Namespace) -> None:
    print(f"\n== host overhead: Llama of {args.blocks} blocks, dim {args.dim}, one token per rank, {args.dtype}; "
          f"{args.warmup} warmup + {args.steps} timed steps; ms per step, medians of the slowest rank")
    head = (f"{'N':>2} {'engine':<8}{'step':>8}{'fwd':>8}{'bwd':>8}{'optim':>8} | {'hooks':>7}{'hook calls':>11}"
            f"{'casts':>7}{'colls':>7}{'aten ops':>9}")
    print(head)
    print("-" * len(head))
    for r in rows:
        hooks = f"{r['hooks_ms']:7.1f}" if r["engine"] != "plain" else f"{'-':>7}"
        print(f"{r['ranks']:>2} {r['engine']:<8}{r['step_ms']:8.2f}{r['forward_ms']:8.2f}{r['backward_ms']:8.2f}"
              f"{r['optimizer_ms']:8.2f} | {hooks}{r['hook_calls']:>11}{r['casts']:>7}{r['collectives']:>7}"
              f"{r['aten_ops']:>9}")
    print("(right of |: one profiled step, rank 0: the engine's hook CPU ms, aten::_to_copy calls, c10d ops, "
          "aten ops)")
    print("ratios: the median over rounds of each round's ratio (one step of every engine a round), its quartiles")
    for name, values in ratio_rounds(rows).items():
        goal, value = GOALS[name.split(",")[0]], statistics.median(values)
        q1, q3 = _quartiles(values)
        verdict = "met" if value <= goal else "NOT MET"
        print(f"  {name:<28} {value:6.3f}  ({q1:.3f}-{q3:.3f})  (goal <= {goal})  {verdict}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="1,2", help="comma-separated rank counts")
    parser.add_argument("--blocks", type=int, default=48)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20, help="timed steps")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--engines", default=",".join(ENGINES), help=f"subset of {', '.join(ENGINES)}")
    parser.add_argument("--json", default="runs/bench_overhead.json", help="where to write the results")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per rank count")
    args = parser.parse_args(argv)
    engines = [e.strip() for e in args.engines.split(",")]
    if unknown := set(engines) - set(ENGINES):
        parser.error(f"unknown engines {sorted(unknown)}; choose from {', '.join(ENGINES)}")
    if args.steps < 1 or args.warmup < 1:
        parser.error("--steps and --warmup must be >= 1 (the warmup builds each engine's lazy state)")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows: list[dict] = []
    for n in [int(x) for x in args.ranks.split(",")]:
        t0 = time.perf_counter()
        rows += summarize(run_distributed(_rank_job, n, engines, args.blocks, args.dim, args.dtype, args.steps,
                                          args.warmup, timeout=args.timeout))
        print(f"[{n} rank(s): {time.perf_counter() - t0:.0f} s]", flush=True)
    print_report(rows, args)
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"torch": torch.__version__, "args": vars(args), "rows": rows,
                                "ratios": ratios(rows), "ratio_rounds": ratio_rounds(rows)}, indent=1))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
