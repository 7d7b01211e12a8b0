"""Per-rank runtime: which device, how many threads, and the default process group.

A rank learns its place from torchrun's environment (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``). A plain single
process gets a one-rank process group on an in-memory store, so one code path (DeviceMesh,
collectives) serves a laptop and a cluster.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from meshpar.recipe import RecipeError


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0


def rank_info() -> RankInfo:
    """This process's place, read from the environment before any process group exists."""
    env = os.environ
    world = int(env.get("WORLD_SIZE", 1))
    return RankInfo(rank=int(env.get("RANK", 0)), world_size=world, local_rank=int(env.get("LOCAL_RANK", 0)),
                    local_world_size=int(env.get("LOCAL_WORLD_SIZE", world)))


def select_device(spec: str, info: RankInfo) -> torch.device:
    """``train.device``: auto, cpu or cuda; CUDA ranks take the GPU of their local rank."""
    if spec == "cuda" and not torch.cuda.is_available():
        raise RecipeError("train.device = 'cuda' but no CUDA device is available; use 'auto' or 'cpu'")
    if spec == "cuda" or (spec == "auto" and torch.cuda.is_available()):
        device = torch.device("cuda", info.local_rank)
        torch.cuda.set_device(device)
        return device
    if "OMP_NUM_THREADS" not in os.environ:  # local ranks share the cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // info.local_world_size))
    return torch.device("cpu")


def init_process_group(device: torch.device, info: RankInfo) -> None:
    """gloo on CPU; NCCL for CUDA tensors with gloo kept for CPU-side collectives."""
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    if "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend, rank=info.rank, world_size=info.world_size, device_id=(
            device if device.type == "cuda" else None))
    else:
        if info.world_size != 1:
            raise RuntimeError("WORLD_SIZE > 1 without MASTER_ADDR: start ranks with torchrun or meshpar train")
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
