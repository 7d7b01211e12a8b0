"""meshpar's sharded checkpoint (DCP) beside ``torch.save`` / ``torch.load`` of the same state.

    python -m tests.benchmarks.bench_checkpoint [--ranks 1,2,4] [--dir /tmp/meshpar-bench-ckpt] [--dim 768]

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
    parser.add_argument("--ranks", default="1,2,4")
    parser.add_argument("--dir", default="/tmp/meshpar-bench-ckpt", help="scratch folder (removed after)")
    parser.add_argument("--dim", type=int, default=768, help="model width (768: ~100M parameters)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    params = sum(p.numel() for p in Transformer(_model_args(args.dim)).parameters())
    print(f"llama, {params:,} parameters; state = parameters + AdamW (exp_avg, exp_avg_sq), fp32")
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
