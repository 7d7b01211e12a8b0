"""The CUDA streams FSDP's collectives run on, and the events that order them.

On CPU (gloo) there are none: collectives are async work handles run by gloo's threads, and
a handle's ``wait()`` orders them (state.py, [Note: overlap on CPU and GPU]). On CUDA every
root's units share one ``CudaStreams``.
The timeline and each buffer's lifetime: docs/fsdp.md#cuda-streams.

[Note: CUDA streams in FSDP]
Kernels on one stream run in order and the CPU runs ahead of the GPU, so a copy-in queued on the
compute stream could start its all-gather only after everything queued before it: no overlap.
So the copy-in and the all-gather run on their own streams and the reduce-scatter on a third, as
in PyTorch's engine, ordered by ``wait_stream`` and ``wait_event`` only (nothing synchronizes the
device). Collectives are issued with ``async_op=False`` under their stream (stream-ordered on
NCCL), so no tensor reaches the NCCL stream unordered and nothing needs ``record_stream``. A
buffer is freed only when no stream can still use it: the all-gather buffer is allocated on the
copy-in stream after it waited on compute, so its reuse queues behind the copy-out; the
reduce-scatter's buffers live on the compute stream until it has waited on the reduction's event
([Note: one reduction in flight]). So reserved memory does not grow from step to step
(tests/test_cuda.py measures it).
"""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from meshpar.distributed import comm


def _wait(work: comm.Work, event: torch.cuda.Event | None) -> None:
    """Finish a collective: its work handle, and on CUDA the compute stream waits on its event."""
    work.wait()
    if event is not None:
        torch.cuda.current_stream().wait_event(event)


class CudaStreams:
    """The copy-in, all-gather and reduce-scatter streams of one device (high priority, as the
    collectives gate the compute that waits on them)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.copy_in = torch.cuda.Stream(device, priority=-1)
        self.all_gather = torch.cuda.Stream(device, priority=-1)
        self.reduce_scatter = torch.cuda.Stream(device, priority=-1)

    @staticmethod
    def compute() -> torch.cuda.Stream:
        return torch.cuda.current_stream()

    def copy_in_after_compute(self) -> contextlib.AbstractContextManager:
        """The copy-in stream, after everything queued on the compute stream so far (W above:
        the sharded parameters are final, and every block an earlier copy-out freed is done)."""
        self.copy_in.wait_stream(self.compute())
        return torch.cuda.stream(self.copy_in)

    def all_gather_after_copy_in(self) -> contextlib.AbstractContextManager:
        self.all_gather.wait_stream(self.copy_in)
        return torch.cuda.stream(self.all_gather)

    def reduce_scatter_after_compute(self) -> contextlib.AbstractContextManager:
        self.reduce_scatter.wait_stream(self.compute())
        return torch.cuda.stream(self.reduce_scatter)


def streams_for(device: torch.device) -> CudaStreams | None:
    """``CudaStreams`` for a CUDA device, None elsewhere (CPU keeps async work handles).
    MESHPAR_FSDP_STREAMS=0 turns them off on CUDA too (copy-in on the compute stream, collectives
    as async work): the other side of the comparison in tests/benchmarks/bench_gpu_streams.py."""
    if device.type != "cuda" or os.environ.get("MESHPAR_FSDP_STREAMS", "1") == "0":
        return None
    return CudaStreams(device)
