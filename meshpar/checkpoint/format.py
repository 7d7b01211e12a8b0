"""How meshpar's checkpoints meet DCP's files: fused projections as chunks, per-chunk CRCs.

DCP (``torch.distributed.checkpoint``) plans, writes and reads; meshpar/checkpoint/checkpointer.py decides
what a checkpoint holds and when it becomes visible. This module is the layer between: a save
planner and file writer that record a CRC-32 per chunk, a load planner that checks the chunks
a rank reads, and the chunk protocol for DTensors DCP cannot describe on its own.

Notes: [Note: corrupt and truncated files], [Note: loading never runs code from the file].
"""

from __future__ import annotations

import io
import json
import pickle
import re
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import ReadItem, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor, Replicate

from meshpar.distributed._torch import DCP_METADATA_GLOBALS, StridedShard, dtensor_like, local_tensor
from meshpar.runtime.atomic import write_atomic

# [Note: corrupt and truncated files]
# DCP stores no checksums. Each rank, after writing its files, records the CRC-32 of every
# chunk it wrote (``crc/<rank>.json``), before it reports to the coordinator, so the record
# is part of the checkpoint before it becomes visible. On load each rank checks the chunks it
# is about to read, and only those: a truncated file or a changed byte is an error naming the
# file and the tensor, never silently wrong weights. The CRC reads each chunk once more (from
# the page cache when just written; docs/performance.md#checkpoints-and-conversion).
# Checkpoints without ``crc/`` (written by ``meshpar convert`` or by other DCP users) are
# checked for missing and truncated files only.

# [Note: loading never runs code from the file]
# A checkpoint may come from someone else, and three of its parts are pickles, which can run
# any code as they load. torch 2.13's DCP reads tensors with ``torch.load(weights_only=True)``
# (safe), but ``FileSystemReader.read_metadata`` is a plain ``pickle.load`` of ``.metadata`` and
# ``DefaultLoadPlanner.load_bytes`` is ``torch.load(weights_only=False)`` of each non-tensor
# entry (lr_schedule.*, data.*, train.*). So meshpar reads ``.metadata`` through ``SafeReader``,
# whose unpickler resolves only the classes DCP's metadata is made of
# (``meshpar.distributed._torch.DCP_METADATA_GLOBALS``, torch dtypes and layouts, paths), and loads the
# non-tensor entries with ``weights_only=True`` (numbers, strings, lists, dicts, tensors). A
# file that names anything else is refused with a CheckpointError before the object is built.


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: names the folder, file or tensor, and what to do."""


# --- fused projections ([Note: strided shards as chunks]) ----------------------------------------------
# [Note: strided shards as chunks]
# A fused projection sharded for tensor parallelism (GPT-2's q|k|v ``c_attn``,
# meshpar.parallel.tensor_parallel.styles.FusedColwiseParallel) is a DTensor with ``StridedShard(0,
# split_factor=3)``: rank r holds [q_r; k_r; v_r], three separate row blocks of the global
# tensor. DCP describes every DTensor shard as one block (torch 2.13), so it would record
# overlapping chunks and refuse the save. In the checkpoint's state dict such a tensor is a
# ``_StridedPieces``: DCP's chunk protocol (``__create_write_items__``,
# ``__create_chunk_list__``) with one chunk per block, so the saved tensor is the plain global
# tensor, and it loads into any layout, and a plain one loads into it.
class _StridedPieces:
    def __init__(self, name: str, t: DTensor):
        strided = [(i, p) for i, p in enumerate(t.placements) if isinstance(p, StridedShard)]
        others_ok = all(isinstance(p, Replicate) for i, p in enumerate(t.placements) if i != strided[0][0])
        if len(strided) != 1 or not others_ok:
            raise CheckpointError(f"{name}: placements {t.placements} are not supported in checkpoints (one "
                                  f"strided shard beside Replicate is); save from a layout without it")
        mesh_dim, placement = strided[0]
        dim, k = placement.dim, placement.split_factor
        n, r = t.device_mesh.size(mesh_dim), t.device_mesh.get_local_rank(mesh_dim)
        if t.shape[dim] % (k * n):
            raise CheckpointError(f"{name}: dim {dim} of {list(t.shape)} does not split into {k} x {n} blocks")
        self.name, self.t, self.global_shape = name, t, t.shape
        block = t.shape[dim] // (k * n)  # rows of one projection on one rank
        local = t.to_local()
        self.pieces = []  # (global offsets, sizes, local view)
        for j in range(k):
            offsets = [0] * t.ndim
            offsets[dim] = j * (t.shape[dim] // k) + r * block
            sizes = list(local.shape)
            sizes[dim] = block
            self.pieces.append((torch.Size(offsets), torch.Size(sizes), local.narrow(dim, j * block, block)))

    @property
    def shape(self) -> torch.Size:
        return self.global_shape

    def size(self) -> torch.Size:
        return self.global_shape

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        props = TensorProperties.create_from_tensor(self.pieces[0][2])
        return [WriteItem(index=MetadataIndex(fqn, off), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(off, size), properties=props,
                                                      size=self.global_shape))
                for off, size, _ in self.pieces]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(off, size) for off, size, _ in self.pieces]

    def piece(self, offsets: torch.Size) -> torch.Tensor:
        for off, _, view in self.pieces:
            if off == offsets:
                return view
        raise CheckpointError(f"{self.name}: no block at offsets {list(offsets)}")


# [Note: checkpoints hold plain tensors]
# A parameter may be a tensor subclass that wraps one plain tensor of the same shape and dtype (torchao's
# float8 weights keep their master weight so: ``model.float8``). Pickled as it is, its checkpoint would
# need the class to load (torch.load's weights-only unpickler refuses it) and would not load into a run
# without float8. Such a wrapper (``__tensor_flatten__`` naming one inner tensor) is saved and loaded as
# that inner tensor, a view of the same storage, so DCP writes into the wrapper's data in place: a
# float8 run's checkpoint is the plain run's, in either direction. Subclasses of several inner tensors
# are left to DCP as they are.
def _plain(t: torch.Tensor) -> torch.Tensor:
    """A one-tensor wrapper subclass as its inner tensor (a DTensor's local one too): [Note: checkpoints
    hold plain tensors]."""
    if isinstance(t, DTensor):
        inner = _plain(local_tensor(t))
        return t if inner is local_tensor(t) else dtensor_like(inner, t)
    if type(t) is torch.Tensor or not hasattr(t, "__tensor_flatten__"):
        return t
    names, _ = t.__tensor_flatten__()
    inner = getattr(t, names[0]) if len(names) == 1 else None
    return inner if inner is not None and inner.shape == t.shape and inner.dtype == t.dtype else t


def _strided_as_pieces(tree: Any, prefix: str = "") -> Any:
    """``tree`` with every fused-projection DTensor (one StridedShard, the rest Replicate)
    wrapped as _StridedPieces, and one-tensor wrappers unwrapped ([Note: checkpoints hold plain
    tensors]). FSDP over tensor parallelism also uses StridedShard (on the data-parallel dim,
    beside a Shard on tp): each rank's piece is then one block, which DCP describes correctly,
    so those stay DTensors."""
    if isinstance(tree, dict):
        return {k: _strided_as_pieces(v, f"{prefix}.{k}" if prefix else k) for k, v in tree.items()}
    if isinstance(tree, torch.Tensor):
        tree = _plain(tree)
    if isinstance(tree, DTensor):
        strided = [p for p in tree.placements if isinstance(p, StridedShard)]
        if strided and all(isinstance(p, (StridedShard, Replicate)) for p in tree.placements):
            return _StridedPieces(prefix, tree)
    return tree


class _SavePlanner(DefaultSavePlanner):
    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict.get(index.fqn)
        if isinstance(obj, _StridedPieces):
            return obj.piece(index.offset).clone()  # a view would drag its whole storage into the file
        return super().lookup_object(index)


# --- per-chunk checksums ([Note: corrupt and truncated files]) -------------------------------------------
def crc_of_range(path: Path, offset: int, length: int, block: int = 1 << 22) -> int | None:
    """CRC-32 of ``length`` bytes at ``offset``; None when the file is shorter than that."""
    crc = 0
    with open(path, "rb") as f:
        f.seek(offset)
        left = length
        while left:
            chunk = f.read(min(block, left))
            if not chunk:
                return None
            crc = zlib.crc32(chunk, crc)
            left -= len(chunk)
    return crc


def crc_key(relative_path: str, offset: int, length: int) -> str:
    """The key of one written chunk in ``crc/<rank>.json``."""
    return f"{relative_path}:{offset}:{length}"


def write_crcs(root: Path, rank: int, crcs: dict[str, int | None]) -> None:
    """``crc/<rank>.json``: the CRC-32 of every chunk ``rank`` wrote, by ``crc_key``. Checkpoints
    saved by training and by ``meshpar convert`` both write it, so loads check both alike."""
    (root / "crc").mkdir(exist_ok=True)
    write_atomic(root / "crc" / f"{rank}.json", json.dumps(crcs))


class _Writer(FileSystemWriter):
    """DCP's file writer, plus a CRC-32 per written chunk in ``crc/<rank>.json``, and
    ``publish``, run on the coordinator once ``.metadata`` is written: inside DCP's last
    collective step, so an error there (a full disk) fails the save on every rank."""

    def __init__(self, path: Path, rank: int, publish: Callable[[], None] | None = None):
        # two writer threads, not DCP's default of one: a rank's save is faster
        # (docs/performance.md#checkpoints-and-conversion)
        super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=2)
        self.rank, self.publish = rank, publish

    def finish(self, metadata: Metadata, results) -> None:
        super().finish(metadata, results)
        if self.publish is not None:
            self.publish()

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)
        results = future.wait()
        root = Path(self.path)
        crcs = {}
        for r in results:
            info = r.storage_data
            crcs[crc_key(info.relative_path, info.offset, info.length)] = crc_of_range(
                root / info.relative_path, info.offset, info.length)
        write_crcs(root, self.rank, crcs)
        return future


class _CheckedLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner that, once this rank's reads are known, checks the chunks they touch."""

    def __init__(self, path: Path):
        super().__init__(allow_partial_load=False)
        self.path = path

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        # DCP's load set-up rebuilds the state dict and drops objects it does not know (torch
        # 2.13 turns them into None): hand it placeholders, then put the blocks back by key
        # (in place: DCP writes the non-tensor values it loads into this very dict)
        swapped: list[tuple[dict, str, _StridedPieces]] = []

        def stand_in(tree: dict) -> None:
            for k, v in tree.items():
                if isinstance(v, dict):
                    stand_in(v)
                elif isinstance(v, _StridedPieces):
                    swapped.append((tree, k, v))
                    tree[k] = 0

        stand_in(state_dict)
        super().set_up_planner(state_dict, metadata, is_coordinator)
        for container, key, pieces in swapped:
            container[key] = pieces
            self.state_dict[pieces.name] = pieces

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict.get(index.fqn)
        if isinstance(obj, _StridedPieces):
            return obj.piece(index.offset)
        return super().lookup_tensor(index)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        # DCP's own is torch.load(weights_only=False) ([Note: loading never runs code from the file])
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            found = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
            what = f"it names {found.group(1)}" if found else str(e).splitlines()[0]
            raise CheckpointError(f"checkpoint {self.path}: entry {fqn} is not plain data ({what}); meshpar "
                                  f"loads only numbers, strings, lists, dicts and tensors, so that a checkpoint "
                                  f"cannot run code: the file is damaged or was made to do harm") from None
        if not self.flatten_state_dict:
            self.state_dict[fqn] = obj
            return
        *parents, last = self.mappings[fqn]  # its path in the nested state dict, as DCP flattened it
        container = self.original_state_dict
        for key in parents:
            container = container[key]
        container[last] = obj

    def create_local_plan(self):
        plan = super().create_local_plan()
        # A checkpoint written by another tool (PyTorch's own DCP saves) has no crc/: its chunks
        # are checked for presence and length only.
        checked = (self.path / "crc").is_dir()
        crcs: dict[str, int | None] = {}
        for f in sorted((self.path / "crc").glob("*.json")):
            crcs.update(json.loads(f.read_text()))
        seen = set()
        for item in plan.items:
            info = self.metadata.storage_data[item.storage_index]
            key = f"{info.relative_path}:{info.offset}:{info.length}"
            if key in seen:
                continue
            seen.add(key)
            file = self.path / info.relative_path
            where = f"checkpoint {self.path}: file {info.relative_path} (tensor {item.storage_index.fqn})"
            if not file.is_file():
                raise CheckpointError(f"{where} is missing; the checkpoint is damaged: load an earlier one")
            got = crc_of_range(file, info.offset, info.length)
            if got is None:
                raise CheckpointError(f"{where} is truncated: it has {file.stat().st_size} bytes, the chunk "
                                      f"ends at byte {info.offset + info.length}; load an earlier checkpoint")
            if not checked:
                continue
            if key not in crcs:
                raise CheckpointError(f"{where}: no checksum recorded for this chunk (crc/ is incomplete); "
                                      f"load an earlier checkpoint")
            if got != crcs[key]:
                raise CheckpointError(f"{where} is corrupted: CRC-32 {got:08x}, {crcs[key]:08x} when written; "
                                      f"load an earlier checkpoint")
        return plan


# --- reading files from someone else ([Note: loading never runs code from the file]) -----------------------
def _layout(name: str) -> torch.layout:
    """What a pickled ``torch.layout`` is rebuilt with (torch's ``_get_layout``), for layouts only."""
    value = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(value, torch.layout):
        raise pickle.UnpicklingError(f"{name!r} is not a torch layout")
    return value


class _MetadataUnpickler(pickle.Unpickler):
    """Rebuilds DCP's ``Metadata`` and nothing else: every global the pickle names must be one
    of DCP's metadata classes, a torch dtype or layout, ``torch.Size`` or a path."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch.serialization", "_get_layout"):
            return _layout
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in DCP_METADATA_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which DCP's metadata never holds")


class SafeReader(FileSystemReader):
    """DCP's FileSystemReader, with ``.metadata`` read by ``_MetadataUnpickler``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        # torch 2.13's own, with the unpickler swapped; ``rank``: DCP's per-rank metadata files
        rank = kwargs.get("rank")
        path = Path(self.path) / (".metadata" if rank is None else f"__{rank}.metadata")
        with open(path, "rb") as f:
            try:
                metadata = _MetadataUnpickler(f).load()
            except pickle.UnpicklingError as e:
                raise CheckpointError(f"checkpoint {path.parent}: {path.name} is not DCP metadata ({e}); meshpar "
                                      f"does not unpickle it, since that could run code from the file: the file "
                                      f"is damaged or was made to do harm") from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"checkpoint {path.parent}: {path.name} holds a {type(metadata).__name__}, not "
                                  f"DCP metadata; the file is damaged or not a DCP checkpoint")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
