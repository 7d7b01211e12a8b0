"""Where an async save writes: a thread of the training process, or a process of its own.

``checkpoint.async = "thread"`` is DCP's ``async_save`` as it comes: the state copied to host memory
on the calling thread, then planned, written and committed on a thread. ``"process"`` is DCP's
process-based ``async_save``: the state copied into shared memory (pinned on a GPU), handed to one
background process per rank that DCP starts at the first save and keeps, which writes it. The
step waits for the copy in both; the checkpointer (checkpointer.py) waits for the upload before
the next save. [Note: a save in another process].
"""

from __future__ import annotations

import contextlib
import signal
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from meshpar.distributed._torch import stop_dcp_save_process
from meshpar.runtime.forkserver import SHIELDED

# [Note: a save in another process]
# DCP pickles the staged state dict (shared-memory tensors travel as handles, not bytes), the
# storage writer and the planner to its background process, which runs ``dcp.save`` there on a
# gloo group of its own (one such process per rank, a world of the same ranks). So all that the
# commit needs crosses as data: ``_Writer.publish`` is a picklable ``Publish`` (publish.py),
# and the coordinator's writer runs it inside DCP's last step, after every rank's data is written,
# exactly as a synchronous save does; what needs the trainer's objects (the log, ``keep``) runs in
# the trainer when the upload's future completes. A test's patch of a class in the trainer does
# not reach that process (it imports meshpar afresh); a module-level class put in its place does.
# The process is started with the stop signals blocked (it inherits the mask of the thread that
# starts it, DCP's executor thread, created here), so a SIGTERM sent to every process of the job
# reaches the ranks, which finish the save in flight and save synchronously, and not the writer.
# Hence ``terminate()`` cannot end it either: ``close`` asks it to stop, then kills it, and must
# run before the rank's interpreter exits (multiprocessing would otherwise wait on it forever).
# The staging buffers are kept from save to save (DCP's stager caches them by source storage):
# no allocation of shared memory after the first save, at the cost of one host copy of the state.

STOP_WAIT_S = 10.0  # how long ``close`` waits for an idle writer process to exit before killing it


class Background:
    """Starts async saves in ``mode`` ("thread" or "process") over ``group``; ``close`` when done."""

    def __init__(self, mode: str, group: Any):
        self.mode, self.group = mode, group
        self._stager: DefaultStager | None = None

    def start(self, state: dict[str, Any], writer: Any, planner: Any) -> Future:
        """Copy ``state`` (returns once copied), and write it in the background: the upload's future."""
        if self.mode == "thread":
            return dcp.async_save(state, storage_writer=writer, planner=planner, process_group=self.group)
        if self._stager is None:
            gpu = torch.cuda.is_available()
            self._stager = DefaultStager(StagingOptions(use_pinned_memory=gpu, use_shared_memory=True,
                                                        use_async_staging=False, use_non_blocking_copy=gpu))
        with _signals_blocked():
            return dcp.async_save(state, storage_writer=writer, planner=planner, process_group=self.group,
                                  async_checkpointer_type=AsyncCheckpointerType.PROCESS, async_stager=self._stager)

    def close(self) -> None:
        """Stop the writer process (a save still in flight is abandoned: its folder stays ``.partial``)
        and free the staging buffers. Idempotent."""
        if self.mode == "process":
            stop_dcp_save_process(STOP_WAIT_S)
        if self._stager is not None:
            self._stager.close()
            self._stager = None


@contextlib.contextmanager
def _signals_blocked():
    """The stop signals blocked on this thread (and on threads and processes started in the block)."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, SHIELDED)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
