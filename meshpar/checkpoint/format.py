"""How meshpar's checkpoints meet DCP's files: fused projections as chunks, per-chunk CRCs.

DCP (``torch.distributed.checkpoint``) plans, writes and reads; meshpar/checkpoint/checkpointer.py decides
what a checkpoint holds and when it becomes visible. This module is the layer between: a save
planner and file writer that record a CRC-32 per chunk, a load planner that checks the chunks
a rank reads, and the chunk protocol for DTensors DCP cannot describe on its own.

[Note: corrupt and truncated files]
DCP stores no checksums. Each rank, after writing its files, records the CRC-32 of every
chunk it wrote (``crc/<rank>.json``), before it reports to the coordinator, so the record
is part of the checkpoint before it becomes visible. On load each rank checks the chunks it
is about to read, and only those: a truncated file or a changed byte is an error naming the
file and the tensor, never silently wrong weights. The CRC reads each chunk once more (from
the page cache when just written): 100M Llama + AdamW, 1.2 GB, one rank: save 1.9-2.0 s
with CRCs against 1.6 s without, load 1.0 s against 0.53 s. Checkpoints without ``crc/``
(written by ``meshpar convert`` or by other DCP users) are checked for missing and
truncated files only.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor, Replicate

from meshpar._torch import StridedShard
from meshpar.checkpoint.atomic import write_atomic


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: names the folder, file or tensor, and what to do."""


# --- fused projections ([Note: strided shards as chunks]) ----------------------------------------------
# [Note: strided shards as chunks]
# A fused projection sharded for tensor parallelism (GPT-2's q|k|v ``c_attn``,
# meshpar.tensor_parallel.FusedColwiseParallel) is a DTensor with ``StridedShard(0,
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


def _strided_as_pieces(tree: Any, prefix: str = "") -> Any:
    """``tree`` with every fused-projection DTensor (one StridedShard, the rest Replicate)
    wrapped as _StridedPieces. FSDP over tensor parallelism also uses StridedShard (on the
    data-parallel dim, beside a Shard on tp): each rank's piece is then one block, which DCP
    describes correctly, so those stay DTensors."""
    if isinstance(tree, dict):
        return {k: _strided_as_pieces(v, f"{prefix}.{k}" if prefix else k) for k, v in tree.items()}
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
    """DCP's file writer, plus a CRC-32 per written chunk in ``crc/<rank>.json``."""

    def __init__(self, path: Path, rank: int):
        # two writer threads: 100M Llama + AdamW (1.2 GB) on one rank saves in 1.6 s instead of
        # 2.4-3.5 s with DCP's default of one
        super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=2)
        self.rank = rank

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
