"""The forkserver local ranks fork from, startable before this process imports torch.

[Note: ranks fork from a forkserver]
The ranks are forked from a multiprocessing forkserver that imported the entry point's module
(torch, the training stack) once: N ranks, and each restart, cost forks, not N imports of several
CPU-seconds. The launcher starts it first, naming the entry point as text, so the forkserver's
imports overlap the launcher's own (torch, the launch checks) instead of following them; this
module imports nothing but the standard library for that reason. It never touches CUDA. The ranks
are its children, and torch.multiprocessing sends each SIGINT when its parent dies; the agent would
also read every rank as exited (255). So the forkserver starts with the stop signals blocked: one
sent to every process of the job (SLURM) reaches the ranks, which save, and the agent, and does not
kill the forkserver. Each rank then gets back what a fresh ``python -u -m meshpar.train`` had
(meshpar/runtime/launch.py ``_rank``).
"""

from __future__ import annotations

import importlib
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import signal
from collections.abc import Callable

# What a scheduler or a terminal may send every process of a job (SLURM at the time limit, Ctrl-C):
# the forkserver blocks them.
SHIELDED = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2}
# The module that runs each forked rank (``_rank``): the forkserver imports it beside the entry point's.
RANK_MODULE = "meshpar.runtime.launch"


def resolve(entrypoint: str) -> Callable[[list[str]], int]:
    """``"package.module:function"`` -> the function (imported already in a forked rank)."""
    module, sep, name = entrypoint.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"entry point {entrypoint!r}: expected 'package.module:function'")
    return getattr(importlib.import_module(module), name)


def start_forkserver(entrypoint: str) -> None:
    """Start the forkserver the ranks fork from, importing ``entrypoint``'s module
    (``"package.module:function"``), and return at once (a no-op when this process's forkserver
    already runs: it keeps what it imported)."""
    multiprocessing.set_forkserver_preload([entrypoint.partition(":")[0], RANK_MODULE])
    # multiprocessing's resource tracker unblocks SIGINT and SIGTERM after starting: started first
    multiprocessing.resource_tracker.ensure_running()
    unblocked = signal.pthread_sigmask(signal.SIG_BLOCK, SHIELDED)  # inherited through exec and fork
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, unblocked)
