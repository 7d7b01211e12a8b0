"""Unshard and reshard of a parameter group: one all-gather of one flat buffer.

Copy-in: every parameter's local rows, padded and cast to ``param_dtype``, into this rank's slot
of the flat buffer; the all-gather (async, or stream-ordered on CUDA); copy-out: each
parameter's rows from every rank into its unsharded buffer. Replicated parameters, and every
parameter on one data-parallel rank, are cast or viewed from their local tensor instead.
Reshard swaps the sharded parameters back in and frees the unsharded storage.

``Unsharder`` is the part of a ``ParamGroup`` (param_group.py) that does this: it reads the
group's parameters, flat layout and settings (``UnshardedGroup``) and owns the state of its
unshards; the flat layout is described in param_group.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from meshpar.distributed import comm
from meshpar.distributed._torch import foreach_copy_, local_tensor, module_parameters, preserve_version_counter
from meshpar.distributed.comm_record import CommRecord, comm_buffers
from meshpar.distributed.tracing import trace_range
from meshpar.fsdp.policies import MixedPrecisionPolicy
from meshpar.fsdp.sharded_param import MeshInfo, ParamState, ShardedParam
from meshpar.fsdp.streams import CudaStreams, _wait


class UnshardedGroup(Protocol):
    """What an ``Unsharder`` reads of its group (``ParamGroup``), which sets all of it."""

    params: list[ShardedParam]  # sharded ones, in the flat buffer's order
    replicated: list[ShardedParam]  # below shard_threshold: cast or viewed, never gathered
    all_params: list[ShardedParam]
    mesh_info: MeshInfo
    mp: MixedPrecisionPolicy
    world: int
    single: bool  # [Note: one data-parallel rank]
    extended: list[ShardedParam]  # those with an all-gather extension (extensions.py)
    layout: tuple[torch.dtype, list[int]]  # the flat buffer's dtype and per-parameter segments
    custom_all_gather: object | None
    streams: CudaStreams | None
    post_forward: tuple[dist.ProcessGroup, int, str] | None  # int reshard_after_forward's group
    record: CommRecord | None  # what its collectives report to: [Note: the active record]

    def compute_dtype(self, p: ShardedParam) -> torch.dtype: ...


def _is_float8(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point and dtype.itemsize == 1


def _write_from_local(params: list[ShardedParam], dtypes: list[torch.dtype]) -> None:
    """One rank (and replicated parameters): each parameter's whole local tensor, cast to its dtype (or
    copied from CPU), into its unsharded storage, in one call for the unit (no all-gather buffer);
    the unsharded parameter keeps its identity and version counter as ``write_unsharded`` keeps them."""
    outs = [p.alloc_unsharded(dtype, 1) for p, dtype in zip(params, dtypes, strict=True)]
    with preserve_version_counter(tuple(p.unsharded for p in params)):
        sources = [p.local for p in params]
        sources = [x if x.shape == out.shape else x.view(out.shape) for x, out in zip(sources, outs, strict=True)]
        foreach_copy_(outs, sources, non_blocking=True)


# [Note: the steady cast]
# A group whose every parameter is cast from its whole local tensor (one rank, or a unit of only
# replicated parameters; [Note: one data-parallel rank]) repeats the same work at each unshard: resize each
# unsharded storage back, one ``_foreach_copy_`` from the same local tensors, the same unsharded
# parameters set on the same modules. After a full unshard ``_CastPlan`` keeps those objects, and
# the next unshards only check that each is still the one kept (the parameter's sharded and
# unsharded tensors, the policy giving its dtype, its hook); any change (``.to``, ``to_empty``, a load with
# ``assign=True``, a new policy) takes the full path above, which keeps a new plan.


class _CastPlan:
    """What a steady unshard of a cast group repeats ([Note: the steady cast])."""

    def __init__(self, group: UnshardedGroup, params: list[ShardedParam]) -> None:
        self.params = params
        self.kept = [(p.sharded, p.local, p.unsharded, p.unsharded_padded) for p in params]
        self.mp = group.mp  # frozen: the compute dtypes are this policy's and the parameters' (kept below)
        self.outs = [p.unsharded_padded for p in params]
        self.sources = [p.local if p.local.shape == out.shape else p.local.view(out.shape)
                        for p, out in zip(params, self.outs, strict=True)]
        self.storages = [(out.untyped_storage(), out.untyped_storage().nbytes()) for out in self.outs]
        self.slots = [[(module_parameters(module), attr) for module, attr in p.places] for p in params]
        self.unsharded = tuple(p.unsharded for p in params)

    @classmethod
    def of(cls, group: UnshardedGroup) -> _CastPlan | None:
        """After a full unshard: the plan, or None where it cannot serve."""
        params = group.replicated + (group.params if group.single else [])
        if not params or len(params) != len(group.all_params):
            return None  # the group's every parameter cast from its whole local tensor, or the full path
        if any(p.extension is not None or isinstance(p.unsharded, DTensor) or p.unsharded_padded is None
               or p.local.device != p.compute_device or p.local.dtype == group.compute_dtype(p)
               or p.unsharded.dtype != group.compute_dtype(p) for p in params):
            return None
        return cls(group, params)

    def run(self, mp: MixedPrecisionPolicy, hook_grad: Callable[[ShardedParam], None]) -> bool:
        """The steady unshard, or False (nothing done, the plan stale) when something kept has changed."""
        for p, (sharded, local, unsharded, padded) in zip(self.params, self.kept, strict=True):
            if p.sharded is not sharded or p.unsharded is not unsharded or p.unsharded_padded is not padded \
                    or local_tensor(sharded) is not local:
                return False
        if mp is not self.mp:  # a parameter's own dtype changed with its sharded tensor (above)
            return False
        with trace_range("meshpar::fsdp.cast"), torch.no_grad():
            for storage, nbytes in self.storages:
                if storage.nbytes() != nbytes:  # nbytes: size() is a Python method calling it
                    storage.resize_(nbytes)
            with preserve_version_counter(self.unsharded):
                foreach_copy_(self.outs, self.sources, non_blocking=True)
        for p, slots, unsharded in zip(self.params, self.slots, self.unsharded, strict=True):
            wanted = p.sharded.requires_grad
            if unsharded.requires_grad != wanted:
                unsharded.requires_grad_(wanted)
            for slot, attr in slots:
                slot[attr] = unsharded
            p.state = ParamState.UNSHARDED
            hooked = p.hooked
            if wanted and (hooked is None or hooked() is not unsharded):
                hook_grad(p)
        return True

    def reshard(self) -> None:
        """``to_sharded`` and ``free_unsharded`` of every parameter kept."""
        for p, slots, (sharded, *_), (storage, _) in zip(self.params, self.slots, self.kept, self.storages,
                                                         strict=True):
            for slot, attr in slots:
                slot[attr] = sharded
            p.state = ParamState.SHARDED
            storage.resize_(0)


@dataclass
class Piece:
    """One stretch of each rank's row of the flat all-gather: a plain parameter's padded chunk
    (``input`` None) or input ``index`` of an extension's."""

    param: ShardedParam
    index: int | None
    input: torch.Tensor | None
    dtype: torch.dtype
    numel: int
    seg: int = 0  # elements of the flat buffer's dtype it takes (its numel unless bytes, 8-aligned)

    def __post_init__(self) -> None:
        self.seg = self.seg or self.numel


class Unsharder:
    """A parameter group's all-gather side: ``unshard``, ``wait``, ``reshard``.

    Owns the state of its group's unshards: ``state`` (the group's parameters sharded or unsharded),
    the all-gather in flight, the shards an int ``reshard_after_forward`` keeps for backward, and the
    steady cast's plan. Every parameter it unshards is handed to ``hook_grad`` (the reducing part's:
    reduce.py), which hooks its gradient once."""

    def __init__(self, group: UnshardedGroup, hook_grad: Callable[[ShardedParam], None]) -> None:
        self.group, self.hook_grad = group, hook_grad
        self.state = ParamState.SHARDED
        # all-gather in flight: (work, output, its world, the event that ends it on CUDA), and its
        # layout when it carries extension inputs
        self._gather: tuple[comm.Work, torch.Tensor, int, torch.cuda.Event | None] | None = None
        self._gather_pieces: list[Piece] | None = None
        # int reshard_after_forward: this rank's 1/k of each unsharded parameter between forward and
        # backward (backward gathers them within the group's ``post_forward`` group)
        self._post_forward_shards: list[torch.Tensor] | None = None
        self._cast_plan: _CastPlan | None = None  # [Note: the steady cast]

    def layout_changed(self) -> None:
        """The group's parameters or layout may have changed: the next unshard takes the full path."""
        self._cast_plan = None

    def unshard(self, async_op: bool = False) -> None:
        """Start the all-gather (``async_op``) or complete the unshard."""
        if self.state is ParamState.UNSHARDED:
            return
        g = self.group
        if self._gather is None and g.params and not g.single:
            custom = None
            if self._post_forward_shards is not None:  # backward after an int reshard_after_forward
                group, world, dim = g.post_forward
                rank, shards = dist.get_rank(group), self._post_forward_shards
                n, dtype = sum(t.numel() for t in shards), shards[0].dtype
                fill = lambda send: torch.cat(shards, out=send)
            else:
                group, world, dim = g.mesh_info.shard_group, g.world, g.mesh_info.shard_dim_name
                rank, custom = g.mesh_info.shard_rank, g.custom_all_gather
                if g.extended:  # what each extension's fsdp_pre_all_gather returns: extensions.py
                    dtype, pieces = self._extension_pieces()
                    n = sum(piece.seg for piece in pieces)
                    fill = lambda send: self._copy_in_pieces(send, pieces)
                else:
                    dtype, segments = g.layout
                    n = sum(segments)
                    fill = lambda send: self._copy_in(send, segments)
            # in place: this rank's input is its own slot of the output, so no separate send buffer
            # (one shard fewer at the peak; PyTorch's engine does the same)
            streams = g.streams
            with streams.copy_in_after_compute() if streams else contextlib.nullcontext():
                with comm_buffers():
                    if custom is not None:
                        recv = custom.allocate((world * n,), dtype=dtype, device=g.params[0].compute_device)
                    else:
                        recv = torch.empty(world * n, dtype=dtype, device=g.params[0].compute_device)
                send = recv[rank * n:(rank + 1) * n]
                fill(send)
            if streams is None:
                work = comm.all_gather(recv, send, group, async_op=True, dim=dim, custom=custom, record=g.record)
                event = None
            else:  # stream-ordered: [Note: CUDA streams in FSDP]
                with streams.all_gather_after_copy_in():
                    work = comm.all_gather(recv, send, group, async_op=False, dim=dim, custom=custom, record=g.record)
                    event = streams.all_gather.record_event()
            self._gather = (work, recv, world, event)
            self._gather_pieces = pieces if g.extended and self._post_forward_shards is None else None
        if not async_op:
            self._finish_unshard()

    def _copy_in(self, send: torch.Tensor, segments: list[int]) -> None:
        """This rank's chunks of every parameter, cast to param_dtype, into the flat ``send``."""
        params = self.group.params
        with trace_range("meshpar::fsdp.copy_in"):
            if send.dtype != torch.uint8 and all(p.local.device == send.device for p in params):
                # [Note: a unit's copies in one call]: each chunk, then its padding, left as it is
                sizes = [k for p, seg in zip(params, segments, strict=True)
                         for k in (p.local_shape.numel(), seg - p.local_shape.numel())]
                foreach_copy_(list(send.split(sizes)[::2]), [p.local.reshape(-1) for p in params],
                              non_blocking=True)
                return
            offset = 0
            for p, seg in zip(params, segments, strict=True):
                n = p.local_shape.numel()  # elements past n are padding
                dst = send[offset:offset + seg]
                if send.dtype == torch.uint8:
                    dst = dst.view(self.group.compute_dtype(p))
                dst[:n].copy_(p.local.reshape(-1), non_blocking=True)
                offset += seg

    # [Note: a unit's copies in one call]
    # Around its all-gather a unit copies each parameter's local chunk into the flat buffer
    # (copy-in) and each parameter's column block of the gathered rows into its unsharded storage
    # (copy-out). Where the buffer holds one dtype and every parameter is split on dim 0, each side
    # is one call: ``_foreach_copy_`` into the buffer's pieces, ``split_with_sizes_copy`` out of
    # it, as PyTorch's engine does; a copy per parameter made one dispatch (and on a GPU one kernel
    # launch) each (docs/performance.md#host-overhead). Bytes (mixed dtypes, float8), other shard
    # dims and CPU offload keep the loops.
    def _copy_out(self, rows: torch.Tensor, sizes: list[int]) -> None:
        """``rows`` ([world, sum(sizes)]): column block i into parameter i's unsharded storage,
        viewed ``[world, sizes[i]]`` (dim 0 split: rank r's chunk is rows r * c to (r + 1) * c)."""
        world, params = rows.shape[0], self.group.params
        outs = [p.alloc_unsharded(rows.dtype, p.n).view(world, size)
                for p, size in zip(params, sizes, strict=True)]
        with preserve_version_counter(tuple(p.unsharded for p in params)):
            torch.split_with_sizes_copy(rows, sizes, dim=1, out=outs)

    def _extension_pieces(self) -> tuple[torch.dtype, list[Piece]]:
        """The flat buffer's layout when some parameters define the all-gather extension: each such
        parameter's inputs (from its ``fsdp_pre_all_gather``), the others' padded chunks, in order.
        One dtype, or bytes with every piece 8-byte aligned, as ``refresh_layout`` lays out mixed dtypes."""
        g = self.group
        mesh = g.mesh_info.mesh
        shard_mesh = mesh if mesh.ndim == 1 else mesh[g.mesh_info.shard_dim_name]
        pieces = []
        for p in g.params:
            if p.extension is None:
                pieces.append(Piece(p, None, None, g.compute_dtype(p), p.padded_numel))
                continue
            local = p.local if p.local.device == p.compute_device else p.local.to(p.compute_device)
            for i, t in enumerate(p.extension.inputs(p, local, shard_mesh, p.places[0][0], g.mp)):
                pieces.append(Piece(p, i, t, t.dtype, t.numel()))
        dtypes = {piece.dtype for piece in pieces}
        # one dtype a backend reduces is gathered as itself; float8 (which gloo refuses: PyTorch's engine
        # fails there with "Invalid scalar type") and a mix travel as bytes
        if len(dtypes) == 1 and not _is_float8(next(iter(dtypes))):
            return dtypes.pop(), pieces
        for piece in pieces:
            piece.seg = -(-piece.numel * piece.dtype.itemsize // 8) * 8
        return torch.uint8, pieces

    def _copy_in_pieces(self, send: torch.Tensor, pieces: list[Piece]) -> None:
        with trace_range("meshpar::fsdp.copy_in"):
            offset = 0
            for piece in pieces:
                dst = send[offset:offset + piece.seg]
                if send.dtype == torch.uint8:
                    dst = dst[:piece.numel * piece.dtype.itemsize].view(piece.dtype)
                if piece.input is not None:
                    dst.copy_(piece.input)
                else:
                    n = piece.param.local_shape.numel()  # elements past n are padding
                    dst[:n].copy_(piece.param.local.reshape(-1), non_blocking=True)
                offset += piece.seg

    def _copy_out_pieces(self, recv: torch.Tensor, world: int, pieces: list[Piece]) -> None:
        """Each piece's column block of ``recv[world, ...]`` into its parameter: an extension's
        output buffers, then ``fsdp_post_all_gather``; a plain parameter's unsharded storage."""
        columns = recv.view(world, -1).split([piece.seg for piece in pieces], dim=1)
        outputs: dict[int, list[torch.Tensor]] = {}
        for piece, block in zip(pieces, columns, strict=True):
            if recv.dtype == torch.uint8:
                block = block[:, :piece.numel * piece.dtype.itemsize].view(piece.dtype)
            p = piece.param
            if piece.input is None:
                p.write_unsharded(block, world)
                continue
            if id(p) not in outputs:
                dtypes = [q.dtype for q in pieces if q.param is p]
                outputs[id(p)] = p.extension.output_buffers(dtypes, world, block.device)
            outputs[id(p)][piece.index].view(world, -1).copy_(block)
        for p in self.group.extended:
            param_dtype = self.group.mp.param_dtype or p.orig_dtype
            with trace_range("meshpar::fsdp.post_all_gather"):
                tensor = p.extension.unsharded(p.local, param_dtype, p.unsharded, p.shape[0])
            if tensor is not None:
                p.unsharded = p.as_unsharded_param(tensor)

    def _finish_unshard(self) -> None:
        g = self.group
        if self._gather is not None:
            work, recv, world, event = self._gather
            self._gather = None
            post_forward = self._post_forward_shards is not None
            self._post_forward_shards = None
            with trace_range("meshpar::fsdp.all_gather_wait"):
                _wait(work, event)
            extension_pieces, self._gather_pieces = self._gather_pieces, None
            with trace_range("meshpar::fsdp.copy_out"), torch.no_grad():
                if extension_pieces is not None:
                    self._copy_out_pieces(recv, world, extension_pieces)
                else:
                    # recv[world, sum_i size_i]; parameter i's padded chunks, in order, are its column block
                    segments = [p.padded_numel for p in g.params] if post_forward else g.layout[1]
                    sizes = [seg * g.world // world for seg in segments]
                    if recv.dtype != torch.uint8 and not any(p.shard_dim for p in g.params):
                        self._copy_out(recv.view(world, -1), sizes)
                    else:
                        pieces = recv.view(world, -1).split(sizes, dim=1)
                        for p, piece in zip(g.params, pieces, strict=True):
                            if recv.dtype == torch.uint8:
                                piece = piece.view(g.compute_dtype(p))[:, :p.padded_numel]
                            p.write_unsharded(piece, world)
        # the local tensor is the whole parameter: replicated ones, and all on one rank ([Note: one
        # data-parallel rank]); [Note: the unsharded parameter keeps its identity] in sharded_param.py
        plan = self._cast_plan
        if plan is not None:
            if plan.run(g.mp, self.hook_grad):
                self.state = ParamState.UNSHARDED
                return
            self._cast_plan = None
        with trace_range("meshpar::fsdp.cast"), torch.no_grad():
            cast: list[ShardedParam] = []
            dtypes: list[torch.dtype] = []
            for p in g.replicated + (g.params if g.single else []):
                dtype = g.compute_dtype(p)
                if p.local.device != p.compute_device or p.local.dtype != dtype:
                    cast.append(p)  # cast, or copied from CPU (offload), in place
                    dtypes.append(dtype)
                    continue
                current = p.unsharded.to_local() if isinstance(p.unsharded, DTensor) else p.unsharded
                if current is None or current.data_ptr() != p.local.data_ptr() or current.shape != p.local.shape:
                    p.unsharded, p.unsharded_padded = p.as_unsharded_param(p.local), None  # a view of the shard
            if cast:
                _write_from_local(cast, dtypes)
        for p in g.all_params:
            p.to_unsharded()
            self.hook_grad(p)
        self.state = ParamState.UNSHARDED
        self._cast_plan = _CastPlan.of(g)

    def wait(self) -> None:
        """Finish an all-gather in flight (``UnshardHandle.wait``): the unsharded parameters are then
        registered on the module."""
        if self._gather is not None:
            self._finish_unshard()

    def reshard(self, after_forward: bool = False) -> None:
        """Swap the sharded parameters back in and free the unsharded storage. ``after_forward``
        with an int ``reshard_after_forward`` first keeps this rank's 1/k of each parameter, so
        backward all-gathers within the k-rank group (the group's ``post_forward``)."""
        if self._gather is not None:  # a prefetch nobody used: finish it so the buffers are consistent
            work, _, _, event = self._gather
            _wait(work, event)  # on CUDA its buffer may then be reused: [Note: CUDA streams in FSDP]
            self._gather = None
        if self.state is ParamState.SHARDED:
            return
        g = self.group
        if after_forward and g.post_forward is not None and g.params and not g.single:
            group, k, _ = g.post_forward
            rank = dist.get_rank(group)
            self._post_forward_shards = [p.post_forward_piece(k, rank) for p in g.params]
        plan = self._cast_plan
        if plan is not None:
            plan.reshard()
        else:
            for p in g.all_params:
                p.to_sharded()
                p.free_unsharded()  # a view of the shard has no storage of its own: nothing to free
        self.state = ParamState.SHARDED

    def drop_post_forward(self) -> None:
        """Forget the shards kept for a backward that will not come (``ParamGroup.reset``)."""
        self._post_forward_shards = None
