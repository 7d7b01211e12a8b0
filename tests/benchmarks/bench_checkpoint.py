"""meshpar's sharded checkpoint (DCP) beside ``torch.save`` / ``torch.load`` of the same state.

    python -m tests.benchmarks.bench_checkpoint [--ranks 1,2,4] [--dir /tmp/meshpar-bench-ckpt] [--dim 768]
    python -m tests.benchmarks.bench_checkpoint --stall [--ranks 1,2] [--steps-between 4] [--saves 2]

A Llama of about 100M parameters (bench_fsdp's ``100m``: dim 768, 14 blocks, vocab 8192),
sharded with ``meshpar.fully_shard`` over N gloo ranks, one fused-AdamW step taken so the
optimizer state exists: parameters + exp_avg + exp_avg_sq = 12 bytes per parameter in fp32.
For each N it times, as the slowest rank after a barrier:

- save: ``Checkpointer.save`` (synchronous): DCP's plan exchange, each rank's shard files
  (fsync'd), the per-chunk CRCs, the commit;
- load: ``Checkpointer.load`` into the same sharded model: plan, CRC check of the chunks read,
  read, reshard-free copy into the local shards.

The peer is one process saving and loading the same state, full-size and unsharded, with
``torch.save`` / ``torch.load`` (fsync'd too). Throughput is checkpoint bytes / seconds.
Reads come from the page cache for both (the files were just written; dropping caches needs
root), so load figures are memory-bandwidth bound on this machine, not disk-bound.

``--stall``: the training stall per save for ``checkpoint.async`` = false (sync), "thread" and
"process", on the same model. Each rank trains (one fused-AdamW step at a time, as above) and
saves every ``--steps-between`` steps, as the training loop does: the stall is the time the loop
is blocked in ``Checkpointer.save`` (the copy, and the wait for the previous save) plus the final
``wait``, per save, the slowest rank's. A first save, not counted, starts the writer process.
"steps +" is how much longer the steps between saves took than without saving (the background
writer shares the CPU with training), per save.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshpar.checkpoint import Checkpointer, RunState
from meshpar.config.recipe import CheckpointConfig, OptimConfig
from meshpar.data import BatchLoader
from meshpar.fsdp import fully_shard
from meshpar.models.llama import LLAMA_SIZES, Transformer
from meshpar.training.optim import build_lr_schedule, build_optimizer
from tests.distributed import run_distributed


def _model_args(dim: int):
    return dataclasses.replace(LLAMA_SIZES["debug"], dim=dim, n_layers=14, n_heads=12, n_kv_heads=4,
                               ffn_dim=2048, vocab_size=8192)


def _build(dim: int, mesh=None):
    torch.manual_seed(0)
    model = Transformer(_model_args(dim))
    model.init_weights()
    if mesh is not None:
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = build_optimizer(model, OptimConfig())
    scheduler = build_lr_schedule(optimizer, OptimConfig(), 100)
    tokens = torch.randint(0, 8192, (4, 65), generator=torch.Generator().manual_seed(1))
    loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer, scheduler


def _slowest(seconds: float) -> float:
    t = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _rank_job(root: str, dim: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    model, optimizer, scheduler = _build(dim, mesh)
    loader = BatchLoader(np.arange(100_000) % 8192, seq_len=64, global_batch=world * 4, micro_batch=4,
                         dp_rank=dist.get_rank(), dp_size=world, seed=0)
    run = RunState(torch.nn.ModuleList([model]), model.state_dict, optimizer, scheduler, loader)
    ckpt = Checkpointer(CheckpointConfig(every=1, keep=1), Path(root), rank=dist.get_rank(), world_size=world,
                        info={"family": "llama", "size": "bench", "model_args": {}, "layout": {}}, recipe_toml="",
                        log=lambda line: None)
    dist.barrier()
    start = time.perf_counter()
    ckpt.save(run, 1)
    save_s = _slowest(time.perf_counter() - start)
    dist.barrier()
    start = time.perf_counter()
    ckpt.load(Path(root) / "step_1", run)
    load_s = _slowest(time.perf_counter() - start)
    size = sum(f.stat().st_size for f in (Path(root) / "step_1").rglob("*") if f.is_file())
    return dict(ranks=world, save_s=save_s, load_s=load_s, bytes=size)


def _train_step(model, optimizer, tokens: torch.Tensor) -> None:
    loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _stall_job(root: str, dim: int, steps_between: int, saves: int) -> dict:
    """{mode: (stall s, copy s, wait s, extra step s), per save, slowest rank} for sync, thread, process."""
    from torch.distributed.device_mesh import init_device_mesh

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    model, optimizer, scheduler = _build(dim, mesh)
    loader = BatchLoader(np.arange(100_000) % 8192, seq_len=64, global_batch=world * 4, micro_batch=4,
                         dp_rank=rank, dp_size=world, seed=0)
    run = RunState(torch.nn.ModuleList([model]), model.state_dict, optimizer, scheduler, loader)
    tokens = torch.randint(0, 8192, (4, 65), generator=torch.Generator().manual_seed(2 + rank))

    def steps() -> float:
        start = time.perf_counter()
        for _ in range(steps_between):
            _train_step(model, optimizer, tokens)
        return time.perf_counter() - start

    dist.barrier()
    baseline = min(steps() for _ in range(2))  # steps_between steps, nothing saving
    out = {}
    for mode in ("sync", "thread", "process"):
        cfg = CheckpointConfig(every=1, keep=1, async_save=False if mode == "sync" else mode)
        ckpt = Checkpointer(cfg, Path(root) / mode, rank=rank, world_size=world,
                            info={"family": "llama", "size": "bench", "model_args": {}, "layout": {}},
                            recipe_toml="", log=lambda line: None)
        ckpt.save(run, 0)  # not counted: the writer process starts here
        ckpt.wait()
        dist.barrier()
        copy = wait = extra = 0.0
        for i in range(1, saves + 1):
            start = time.perf_counter()
            ckpt.wait()  # inside save() too: timed apart to tell the copy from the wait
            waited = time.perf_counter()
            ckpt.save(run, i)
            copy += time.perf_counter() - waited
            wait += waited - start
            extra += steps() - baseline
        start = time.perf_counter()
        ckpt.wait()
        wait += time.perf_counter() - start
        ckpt.close()
        shutil.rmtree(Path(root) / mode, ignore_errors=True)
        per_save = [_slowest(x / saves) for x in (copy + wait, copy, wait, extra)]
        out[mode] = tuple(per_save)
    return dict(ranks=world, stall=out)


def _print_stall(rows: list[dict]) -> None:
    print(f"{'stall per save':<22}{'stall ms':>10}{'copy ms':>9}{'wait ms':>9}{'steps + ms':>12}{'x sync':>8}")
    for r in rows:
        sync = r["stall"]["sync"][0]
        for mode, (stall, copy, wait, extra) in r["stall"].items():
            label = f"{mode}, {r['ranks']} rank{'s' if r['ranks'] > 1 else ''}"
            print(f"{label:<22}{stall * 1e3:>10,.0f}{copy * 1e3:>9,.0f}{wait * 1e3:>9,.0f}{extra * 1e3:>12,.0f}"
                  f"{stall / sync:>8.3f}")
    print("(stall: the loop blocked in save() and the next wait(); x sync: stall / the sync stall; steps +: the "
          "steps between saves took this much longer than without saving)")


def _torch_save_job(root: str, dim: int) -> dict:
    model, optimizer, scheduler = _build(dim)
    state = {"model": model.state_dict(), "optim": optimizer.state_dict(), "lr_schedule": scheduler.state_dict()}
    path = Path(root) / "state.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    save_s = time.perf_counter() - start
    start = time.perf_counter()
    loaded = torch.load(path, weights_only=True)
    model.load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optim"])
    load_s = time.perf_counter() - start
    return dict(ranks=1, save_s=save_s, load_s=load_s, bytes=path.stat().st_size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default=None, help="world sizes (default 1,2,4; with --stall 1,2)")
    parser.add_argument("--dir", default="/tmp/meshpar-bench-ckpt", help="scratch folder (removed after)")
    parser.add_argument("--dim", type=int, default=768, help="model width (768: ~100M parameters)")
    parser.add_argument("--stall", action="store_true", help="the training stall per save, sync / thread / process")
    parser.add_argument("--steps-between", type=int, default=4, help="--stall: training steps between saves")
    parser.add_argument("--saves", type=int, default=2, help="--stall: saves timed per mode")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    params = sum(p.numel() for p in Transformer(_model_args(args.dim)).parameters())
    print(f"llama, {params:,} parameters; state = parameters + AdamW (exp_avg, exp_avg_sq), fp32")
    args.ranks = args.ranks or ("1,2" if args.stall else "1,2,4")
    if args.stall:
        try:
            _print_stall([run_distributed(_stall_job, int(n), f"{args.dir}/stall{n}", args.dim, args.steps_between,
                                          args.saves, timeout=1800)[0] for n in args.ranks.split(",")])
        finally:
            shutil.rmtree(args.dir, ignore_errors=True)
        return
    rows = []
    try:
        peer = run_distributed(_torch_save_job, 1, f"{args.dir}/torch", args.dim, timeout=600)[0]
        for n in (int(x) for x in args.ranks.split(",")):
            rows.append(run_distributed(_rank_job, n, f"{args.dir}/dcp{n}", args.dim, timeout=600)[0])
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    gb = 1e9
    print(f"{'engine':<28}{'MB':>9}{'save s':>9}{'GB/s':>7}{'load s':>9}{'GB/s':>7}{'save x':>8}{'load x':>8}")
    for label, r in [("torch.save/load, 1 process", peer)] + [
            (f"meshpar DCP, {r['ranks']} rank{'s' if r['ranks'] > 1 else ''}", r) for r in rows]:
        print(f"{label:<28}{r['bytes'] / 1e6:>9,.0f}{r['save_s']:>9.2f}{r['bytes'] / r['save_s'] / gb:>7.2f}"
              f"{r['load_s']:>9.2f}{r['bytes'] / r['load_s'] / gb:>7.2f}"
              f"{r['save_s'] / peer['save_s']:>8.2f}{r['load_s'] / peer['load_s']:>8.2f}")
    print("(x: time relative to torch.save / torch.load; below 1 is faster)")


if __name__ == "__main__":
    main()
