"""Run a function on N gloo ranks, each in its own process, with a deadline.

    results = run_distributed(fn, 4, arg1, arg2, timeout=120)

``fn`` must be importable (defined at module level). Each rank gets torchrun's environment
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, ...) and, unless
``init_process_group=False``, an initialized gloo default process group. The return values
come back in rank order. If any rank raises, the error lists every failing rank's
traceback; if the ranks do not finish within ``timeout`` seconds (a hang in a collective,
typically), they are killed and the error names the ranks that never reported.
Spawned processes start slowly on two cores, so loop sub-cases inside one call.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world_size: int, port: int, init_pg: bool, fn: Callable, args: tuple,
               results: mp.Queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    all_ok = False
    try:
        if init_pg:
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        # Plain pickle copies tensors into the message; the multiprocessing queue would pass
        # shared-memory handles that die with this process before the parent reads them.
        results.put((rank, True, pickle.dumps(fn(*args))))
        all_ok = True
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent, readable
        results.put((rank, False, traceback.format_exc()))
    finally:
        if init_pg and dist.is_initialized():
            # A gloo group destroyed while a peer still uses it occasionally aborts (SIGABRT) at
            # exit; meeting first avoids it. Skipped after a failure, where peers may be gone.
            if all_ok:
                dist.barrier()
            dist.destroy_process_group()


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 120,
                    init_process_group: bool = True) -> list[Any]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world_size, port, init_process_group, fn, args, results),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    outcomes: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outcomes) < world_size:
            # After a failure, peers blocked on the failed rank are given a few seconds, then killed.
            failed = any(not ok for ok, _ in outcomes.values())
            wait = min(deadline, time.monotonic() + 5) if failed else deadline
            try:
                rank, ok, value = results.get(timeout=max(wait - time.monotonic(), 0.01))
                outcomes[rank] = (ok, value)
            except queue_mod.Empty:
                if failed or time.monotonic() >= deadline:
                    break
                if all(not p.is_alive() for p in procs) and results.empty():
                    break  # a rank died without reporting (killed, segfault)
    finally:
        for p in procs:
            p.join(timeout=1)
            if p.is_alive():
                p.kill()
                p.join()

    errors = [f"--- rank {r} raised:\n{v}" for r, (ok, v) in sorted(outcomes.items()) if not ok]
    missing = [r for r in range(world_size) if r not in outcomes]
    if errors or missing:
        lines = [f"{len(errors)} of {world_size} ranks failed" + (
            f"; ranks {missing} never reported (hung past {timeout:.0f}s, or died: exit codes "
            f"{[procs[r].exitcode for r in missing]})" if missing else "")]
        raise AssertionError("\n".join(lines + errors))
    return [pickle.loads(outcomes[r][1]) for r in range(world_size)]


def once_per_world(run: Callable[[int], Any]) -> Callable[[int], Any]:
    """``run(world)`` at most once per world size: later calls return the first result, or
    raise its failure again, so one spawned job serves (or fails) every test that reads it."""
    done: dict[int, Any] = {}

    def results(world: int) -> Any:
        if world not in done:
            try:
                done[world] = run(world)
            except AssertionError as e:
                done[world] = e
        if isinstance(done[world], AssertionError):
            raise done[world]
        return done[world]

    return results
