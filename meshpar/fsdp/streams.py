"""The CUDA streams FSDP's collectives run on, and the events that order them.

On CPU (gloo) there are none: collectives are async work handles run by gloo's threads, and
a handle's ``wait()`` orders them (state.py, [Note: overlap on CPU and GPU]). On CUDA every
root's units share one ``CudaStreams``.

[Note: CUDA streams in FSDP]
Kernels on one stream run in order, and the CPU runs ahead of the GPU, often by several
units. If the next unit's copy-in were queued on the compute stream, its all-gather could
start only once the GPU had worked through everything queued before it: no overlap. So the
copy-in and the all-gather run on their own streams, and the reduce-scatter on a third, in
the layout PyTorch's own engine uses::

    compute    |fwd i-1 ...........|co i| fwd i ..........|co i+1| fwd i+1 .....
    copy-in       W ci i                     W ci i+1
    all-gather         [all-gather i]  E          [all-gather i+1]  E
                                       '--> compute waits E before co i

    compute    ... | bwd i ........| rs copy-in i | bwd i-1 .............| W   (post-reduce i)
    reduce-scatter                      W [reduce-scatter i]  E              '-- waits E

    W: the stream waits for everything queued on the compute stream so far
    E: an event recorded on the stream, that the compute stream waits on
    ci / co: copy-in (the shards into the flat all-gather buffer) / copy-out (the gathered
    rows into each unsharded parameter)

Ordering is by ``wait_stream`` and ``wait_event``; nothing synchronizes the device. The
collectives are issued with ``async_op=False`` under their stream (stream-ordered on NCCL: the
CPU does not block), so no tensor crosses to the NCCL stream unordered and nothing needs
``record_stream``.

Buffers are freed only when no stream can still use them. The caching allocator reuses a
freed block at once for later allocations on the stream that allocated it, so:

- The all-gather buffer is allocated on the copy-in stream, after that stream has waited on
  the compute stream (W). It is dropped after copy-out on the compute stream; the next
  allocation that can reuse it is another copy-in's, queued behind that copy-in's own W,
  hence behind the copy-out. A prefetch nobody used makes the compute stream wait on its
  all-gather before it is dropped, so the same holds.
- The reduce-scatter's input and output are allocated on the compute stream and kept until
  the compute stream has waited on the reduce-scatter's event (``ParamGroup.wait_for_reduce``,
  at most one reduction in flight: [Note: one reduction in flight]); only then are they freed.
- The unsharded parameters and gradients never leave the compute stream.

So reserved memory does not grow from step to step (tests/test_cuda.py measures it).
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
