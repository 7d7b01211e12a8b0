"""Collectives behind one function each, chosen per backend, with per-mesh-dim accounting.

Every collective meshpar issues goes through here, so one place decides how it runs on
each backend and one place counts it: each call reports its op, mesh dim and bytes to a
``CommRecord`` (meshpar/distributed/comm_record.py: ``count()`` blocks, the flight recorder):
the one passed as ``record=``, else the active one ([Note: the active record]), else none.

Notes: [Note: reduce-scatter on gloo], [Note: bytes counted].
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from meshpar.distributed._torch import chunk_cat
from meshpar.distributed.comm_record import (
    CommRecord,
    FlightEntry,
    active,
    comm_buffers,
    forced,
    native_layout,
    record_collective,
    resolve,
)
from meshpar.distributed.tracing import trace_range

# [Note: reduce-scatter on gloo]
# gloo implements reduce-scatter as an all-reduce of the whole input followed by a local slice:
# every rank receives N times what it keeps. ``all_to_all_single`` sends each rank exactly its
# chunk from every peer, and a local sum over the N received chunks gives the same result
# (bitwise at 2 ranks; at more, the local sum adds in rank order where gloo's all-reduce uses its
# own, so the last bit may differ), and faster (docs/performance.md#reduce-scatter-on-gloo). NCCL
# keeps its native reduce-scatter. No rank sends its own row to itself: its row goes straight into
# the output, so the send and receive buffers hold N - 1 rows each, and FSDP, with one reduction
# in flight under the next unit's backward, holds (2N - 1)/N of a unit's gradient, not (2N + 1)/N.

# [Note: bytes counted]
# ``bytes`` is the per-rank wire volume of a ring implementation, the figure the FSDP literature
# states its ideal in: all-gather and reduce-scatter move ``(N-1)/N`` of the full (padded) buffer,
# all-reduce twice that. So a fully sharded step of Psi parameters ideally counts
# ``3 * Psi * (N-1)/N * element_size`` bytes.

# torch 2.13 renamed the tensor-in / tensor-out collectives; older releases have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Work:
    """A collective in flight: ``wait()`` once before reading its output."""

    def __init__(self, handle: dist.Work | None, finish=None, entry: FlightEntry | None = None):
        self._handle, self._finish, self._entry = handle, finish, entry
        if handle is None and entry is not None:  # synchronous, or nothing to send: complete already
            entry.done = True

    @torch.no_grad()
    def wait(self) -> None:
        if self._handle is not None:
            self._handle.wait()
            self._handle = None
        if self._entry is not None:
            self._entry.done = True
        if self._finish is not None:
            self._finish()
            self._finish = None


def _is_gloo(group: dist.ProcessGroup, tensor: torch.Tensor) -> bool:
    return dist.get_backend(group) == "gloo" or tensor.device.type == "cpu"


@torch.no_grad()
def all_gather(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, *, dim: str,
               async_op: bool = False, custom: Callable | None = None, record: CommRecord | None = None) -> Work:
    """``output[N * n] <- concat over ranks of input[n]`` along dim 0. ``custom``: a user's
    all-gather (``FSDPModule.set_custom_all_gather``), called as PyTorch's engine calls it."""
    n, record = dist.get_world_size(group), resolve(record)
    entry = record_collective("all_gather", dim, output.numel() * output.element_size() * (n - 1) / n, record)
    with trace_range(f"meshpar::comm.all_gather[{dim}]"):
        if custom is not None:
            return Work(custom(output_tensor=output, input_tensor=input, group=group, async_op=async_op),
                        entry=entry)
        if n == 1 and not forced(record):
            output.copy_(input)
            return Work(None, entry=entry)
        return Work(_all_gather_single(output, input, group=group, async_op=async_op), entry=entry)


class ReduceScatterInput:
    """The input of one reduce-scatter over ``n`` ranks, laid out for the backend that runs it.

    Rows are the ``n`` chunks of ``per_rank`` elements, row ``i`` bound for rank ``i``. On
    NCCL (native reduce-scatter) the rows are one ``[n, per_rank]`` buffer. On gloo this rank's
    own row is written straight into ``output`` and only the ``n - 1`` others are buffered: see
    [Note: reduce-scatter on gloo] and, for the switch to the native layout, [Note: the native
    reduce-scatter layout]. Fill with ``copy_rows``, then call
    ``reduce_scatter_rows``; the summed chunk lands in ``output``. Laid out under ``record`` (else
    the active one), which ``reduce_scatter_rows`` then reports to unless given another.
    """

    def __init__(self, per_rank: int, group: dist.ProcessGroup, *, dtype: torch.dtype, device: torch.device,
                 custom: Any = None, record: CommRecord | None = None):
        """``custom``: a user's reduce-scatter (``FSDPModule.set_custom_reduce_scatter``); it allocates
        both buffers and gets the plain ``[n, per_rank]`` layout."""
        self.n, self.rank, self.per_rank = dist.get_world_size(group), dist.get_rank(group), per_rank
        self.custom, self.record = custom, resolve(record)
        self.exchange = custom is None and self.n > 1 and not native_layout(self.record) and (
            dist.get_backend(group) == "gloo" or torch.device(device).type == "cpu")
        self.shortcut = self.n == 1 and custom is None and not forced(self.record)  # the row is the output
        rows = self.n - 1 if self.exchange else self.n
        with comm_buffers():
            if custom is not None:
                self.output = custom.allocate((per_rank,), dtype=dtype, device=device)
                self.send = custom.allocate((rows * per_rank,), dtype=dtype, device=device).view(rows, per_rank)
            else:
                self.output = torch.empty(per_rank, dtype=dtype, device=device)
                self.send = None if self.shortcut else torch.empty(rows, per_rank, dtype=dtype, device=device)

    @torch.no_grad()
    def copy_rows(self, offset: int, rows: torch.Tensor) -> None:
        """Columns ``offset : offset + k`` of every row, from ``rows`` (``[n, k]``)."""
        k = rows.shape[1]
        if self.shortcut:
            self.output[offset:offset + k].copy_(rows[0])
        elif not self.exchange:
            self.send[:, offset:offset + k].copy_(rows)
        else:
            r = self.rank
            self.output[offset:offset + k].copy_(rows[r])
            self.send[:r, offset:offset + k].copy_(rows[:r])
            self.send[r:, offset:offset + k].copy_(rows[r + 1:])

    @torch.no_grad()
    def copy_chunks(self, tensors: list[torch.Tensor]) -> bool:
        """Every row, whole, from the dim-0 chunks of ``tensors`` (each ``[rows, inner]``, one dtype;
        chunk i of each, padded to ceil(rows / n) rows, in row i, one after another), in one call:
        [Note: the gradients copied in at once]. False, with nothing written, where this buffer's
        layout has no whole ``[n, per_rank]`` rows (the gloo exchange's) or a tensor does not fit."""
        if self.exchange or not tensors or len({t.dtype for t in tensors}) != 1 \
                or any(t.dim() != 2 or t.numel() == 0 for t in tensors):
            return False
        rows = self.output.view(1, -1) if self.shortcut else self.send
        if sum(-(-t.shape[0] // self.n) * t.shape[1] for t in tensors) != rows.shape[1]:
            return False
        chunk_cat(tensors, self.n, rows)
        return True

    @torch.no_grad()
    def div_(self, factor: float) -> None:
        """Every row divided by ``factor``, in place (this rank's own row is in ``output`` on gloo)."""
        if self.exchange or self.shortcut:
            self.output.div_(factor)
        if self.send is not None:
            self.send.div_(factor)

    @torch.no_grad()
    def zero_rows(self, offset: int, k: int) -> None:
        self.output[offset:offset + k].zero_()
        if self.send is not None:
            self.send[:, offset:offset + k].zero_()

    @property
    def nbytes(self) -> int:
        """The full ``n``-row input's bytes, the figure [Note: bytes counted] counts from."""
        return self.n * self.per_rank * self.output.element_size()


@torch.no_grad()
def reduce_scatter_rows(input: ReduceScatterInput, group: dist.ProcessGroup, *, dim: str,
                        async_op: bool = False, record: CommRecord | None = None) -> Work:
    """``input.output <- sum over ranks of row (this rank)``; see [Note: reduce-scatter on gloo]."""
    n = input.n
    entry = record_collective("reduce_scatter", dim, input.nbytes * (n - 1) / n, record or input.record)
    with trace_range(f"meshpar::comm.reduce_scatter[{dim}]"):
        if input.custom is not None:
            return Work(input.custom(output_tensor=input.output, input_tensor=input.send.view(-1), group=group,
                                     op=dist.ReduceOp.SUM, async_op=async_op), entry=entry)
        if input.shortcut:
            return Work(None, entry=entry)
        if not input.exchange:
            return Work(_reduce_scatter_single(input.output, input.send.view(-1), group=group, async_op=async_op),
                        entry=entry)
        # Rank i sends its row j to rank j (j != i) and receives one row from each peer: no row
        # goes to or comes from this rank itself, so both buffers hold n - 1 rows.
        splits = [input.per_rank] * n
        splits[input.rank] = 0
        with comm_buffers():
            received = torch.empty_like(input.send)
        handle = dist.all_to_all_single(received.view(-1), input.send.view(-1), splits, splits, group=group,
                                        async_op=async_op)

        def finish() -> None:
            # Sum the n rows in rank order, accumulating in place (rank 0: in the output, which
            # holds row 0; others: in the first received row), so no further buffer is needed.
            r, out = input.rank, input.output
            acc = out if r == 0 else received[0]
            for i in range(1, n):
                acc.add_(out if i == r else received[i if i < r else i - 1])
            if r != 0:
                out.copy_(acc)
            input.send = None  # free the sent rows as soon as they are delivered

        return Work(handle, finish, entry)


@torch.no_grad()
def all_to_all(output: torch.Tensor, input: torch.Tensor, output_splits: list[int], input_splits: list[int],
               group: dist.ProcessGroup, *, dim: str, async_op: bool = False, record: CommRecord | None = None) -> Work:
    """Rows of ``input`` in runs of ``input_splits[j]`` go to rank j; ``output`` receives runs of
    ``output_splits[i]`` rows from rank i, in rank order (uneven splits). Counted as the bytes this
    rank sends to other ranks (its own run stays local)."""
    n, rank, record = dist.get_world_size(group), dist.get_rank(group), resolve(record)
    row = input[0].numel() * input.element_size() if input.shape[0] else 0
    entry = record_collective("all_to_all", dim, row * (sum(input_splits) - input_splits[rank]), record)
    with trace_range(f"meshpar::comm.all_to_all[{dim}]"):
        if n == 1 and not forced(record):
            output.copy_(input)
            return Work(None, entry=entry)
        return Work(dist.all_to_all_single(output, input, output_splits, input_splits, group=group,
                                           async_op=async_op), entry=entry)


class _AllToAllRows(torch.autograd.Function):
    """``all_to_all`` as an autograd function: backward sends the gradients back along the same
    splits swapped (and is counted the same way, in the record forward reported to)."""

    @staticmethod
    def forward(ctx, input: torch.Tensor, output_splits: list[int], input_splits: list[int],
                group: dist.ProcessGroup, dim: str, label: str | None) -> torch.Tensor:
        ctx.splits, ctx.group, ctx.dim, ctx.label = (output_splits, input_splits), group, dim, label
        ctx.record = active()
        output = input.new_empty((sum(output_splits), *input.shape[1:]))
        with _labelled(label):
            all_to_all(output, input.contiguous(), output_splits, input_splits, group, dim=dim,
                       record=ctx.record).wait()
        return output

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        output_splits, input_splits = ctx.splits
        grad_input = grad.new_empty((sum(input_splits), *grad.shape[1:]))
        with _labelled(ctx.label):
            all_to_all(grad_input, grad.contiguous(), input_splits, output_splits, ctx.group, dim=ctx.dim,
                       record=ctx.record).wait()
        return grad_input, None, None, None, None, None


def _labelled(label: str | None) -> contextlib.AbstractContextManager:
    return trace_range(f"meshpar::{label}") if label else contextlib.nullcontext()


def all_to_all_rows(input: torch.Tensor, output_splits: list[int], input_splits: list[int],
                    group: dist.ProcessGroup, *, dim: str, label: str | None = None) -> torch.Tensor:
    """Differentiable ``all_to_all`` of ``input``'s rows (dim 0); returns the received rows.
    ``label``: a trace range ``meshpar::<label>`` around the exchange, forward and backward (the
    expert dispatch passes ``moe.dispatch[<layer>]`` / ``moe.combine[<layer>]``), enclosing the
    ``meshpar::comm.all_to_all[<dim>]`` range."""
    return _AllToAllRows.apply(input, output_splits, input_splits, group, dim, label)


def world_max(value: int, *, record: CommRecord | None = None) -> int:
    """The largest of every rank's ``value``: one all-reduce of one int64 over the world, on the CPU
    group (no device sync). How ranks agree on a decision (a stop signal, a non-finite step)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    t = torch.tensor([value])
    all_reduce(t, dist.group.WORLD, dim="world", op=dist.ReduceOp.MAX, record=record).wait()
    return int(t.item())


@torch.no_grad()
def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup, *, dim: str, async_op: bool = False,
               op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM, record: CommRecord | None = None) -> Work:
    """Reduce ``tensor`` over ``group`` in place (a sum unless ``op`` says otherwise)."""
    n, record = dist.get_world_size(group), resolve(record)
    entry = record_collective("all_reduce", dim, 2 * tensor.numel() * tensor.element_size() * (n - 1) / n, record)
    with trace_range(f"meshpar::comm.all_reduce[{dim}]"):
        if n == 1 and not forced(record):
            return Work(None, entry=entry)
        return Work(dist.all_reduce(tensor, op=op, group=group, async_op=async_op), entry=entry)


@torch.no_grad()
def send_recv(send: torch.Tensor, recv: torch.Tensor, group: dist.ProcessGroup, *, to: int, frm: int, dim: str,
              tag: int = 0, record: CommRecord | None = None) -> Work:
    """One hop of a ring: ``send`` to group rank ``to`` while ``recv`` fills from group rank ``frm``, both
    in flight until ``wait()`` (ring attention posts a hop, then computes). Counted as the bytes sent."""
    record = resolve(record)
    entry = record_collective("send_recv", dim, send.numel() * send.element_size(), record)
    with trace_range(f"meshpar::comm.send_recv[{dim}]"):
        if dist.get_world_size(group) == 1 and not forced(record):
            recv.copy_(send)
            return Work(None, entry=entry)
        sent = dist.isend(send, dist.get_global_rank(group, to), group=group, tag=tag)
        received = dist.irecv(recv, dist.get_global_rank(group, frm), group=group, tag=tag)
        return Work(received, sent.wait, entry)
