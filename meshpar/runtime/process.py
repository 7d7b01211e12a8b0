"""Per-rank runtime: which device, how many threads, and the default process group.

A rank learns its place from torchrun's environment (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``). A plain single
process gets a one-rank process group on an in-memory store, so one code path (DeviceMesh,
collectives) serves a laptop and a cluster.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import sys
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from meshpar.config.recipe import RecipeError


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


def init_process_group(device: torch.device, info: RankInfo, timeout: datetime.timedelta | None = None) -> None:
    """gloo on CPU; NCCL for CUDA tensors with gloo kept for CPU-side collectives. ``timeout``:
    how long a collective waits for its peers (``fault.timeout``; every group made later inherits it)."""
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    if timeout is not None:
        # Groups made later (each DeviceMesh dim, the async-save group) take c10d's module default,
        # not the world group's timeout: make that default ours, so no group waits 30 minutes.
        c10d.default_pg_timeout = c10d.default_pg_nccl_timeout = timeout
    if "MASTER_ADDR" in os.environ:
        device_id = device if device.type == "cuda" else None
        store = _attempt_store(timeout)
        dist.init_process_group(backend, rank=info.rank, world_size=info.world_size, timeout=timeout,
                                device_id=device_id, store=store)
    else:
        if info.world_size != 1:
            raise RuntimeError("WORLD_SIZE > 1 without MASTER_ADDR: start ranks with torchrun or meshpar train")
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


def _attempt_store(timeout: datetime.timedelta | None) -> dist.Store | None:
    """Under torchelastic with the agent's store (torchrun, ``meshpar train``): a view of that store
    private to this restart attempt; otherwise None (``env://`` as usual).

    [Note: one store, many attempts]
    The agent's store outlives its workers, and torch 2.13's ``env://`` rendezvous gives every
    attempt the same keys. After a restart, gloo could read a dead rank's listening address
    left by the previous attempt before the new rank wrote its own ("connectFullMesh failed ...
    Connection refused", or a hang). Prefixing the keys with the attempt number
    (``TORCHELASTIC_RESTART_COUNT``) gives each attempt a clean namespace (tests/test_preemption.py).
    """
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    client = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False,
                           timeout=timeout or datetime.timedelta(minutes=30))
    return dist.PrefixStore(f"meshpar/attempt_{env.get('TORCHELASTIC_RESTART_COUNT', '0')}", client)


def leave(code: int) -> NoReturn:
    """End this rank's process with ``code`` once its work is done, skipping interpreter teardown.

    [Note: a rank leaves without finalization]
    ``destroy_process_group`` does not end gloo's groups: DTensor's caches keep every mesh, and
    so every group and its gloo threads, alive. Their C++ destructors would then run during
    interpreter and static teardown, where gloo's threads race the objects they use: a finished
    rank can abort ("terminate called without an active exception"), rarely, and torchelastic
    reports it failed. Everything a rank must leave behind is written and closed before this
    (metrics, checkpoints, traces), so the process flushes its output and ends with
    ``os._exit``, as multiprocessing's children do.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
