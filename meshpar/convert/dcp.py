"""meshpar checkpoint folders (DCP + meshpar.json): a source read one tensor at a time through
DCP's FileSystemReader (meshpar's SafeReader), and a sink written chunk by chunk for a target layout in DCP's own format
([Note: streaming conversion], [Note: chunks for a target layout])."""

from __future__ import annotations

import io
import json
import math
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import WriteResult

from meshpar.checkpoint.format import SafeReader, crc_key, crc_of_range, write_crcs
from meshpar.convert.files import _fresh, _now, _read_json, copy_tokenizer
from meshpar.convert.layout import layout_chunks
from meshpar.convert.spec import ConvertError, ModelSpec, spec_from_info
from meshpar.distributed._torch import dcp_storage_info
from meshpar.runtime.atomic import fsync, write_atomic


class _Collect(LoadPlanner):
    """The minimal LoadPlanner FileSystemReader.read_data needs: reads land in ``target``."""

    def __init__(self, target: Tensor | None = None) -> None:
        self.target, self.blob = target, b""

    def set_up_planner(self, *args: Any, **kwargs: Any) -> None: ...
    def create_local_plan(self) -> LoadPlan: raise NotImplementedError
    def create_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]: return plans
    def finish_plan(self, plan: LoadPlan) -> LoadPlan: return plan
    def commit_tensor(self, read_item: ReadItem, tensor: Tensor) -> None: ...

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.blob = value.getvalue()

    def resolve_tensor(self, read_item: ReadItem) -> Tensor:
        return self.target[tuple(slice(o, o + n) for o, n in zip(read_item.dest_offsets, read_item.lengths,
                                                                   strict=True))]


class DCPSource:
    """A meshpar checkpoint folder (DCP + meshpar.json), read one tensor at a time."""

    kind = "dcp"

    def __init__(self, path: Path) -> None:
        self.path = path
        if not (path / ".metadata").exists():
            raise ConvertError(f"{path}: no .metadata, so not a complete DCP checkpoint (the save did not finish, "
                               f"or this is not a checkpoint folder); pass a folder <dir>/step_<N> with .metadata "
                               f"and meshpar.json (`meshpar checkpoint info {path.parent}` lists them)")
        if not (path / "meshpar.json").exists():
            raise ConvertError(f"{path}: meshpar.json is missing, so the checkpoint is incomplete (it is written "
                               f"last); use an earlier complete step (`meshpar checkpoint info {path.parent}`)")
        self.info = _read_json(path / "meshpar.json")
        self.spec = spec_from_info(self.info, path / "meshpar.json")
        self.reader = SafeReader(path)  # [Note: loading never runs code from the file]
        try:
            self.metadata: Metadata = self.reader.read_metadata()
        except Exception as e:  # noqa: BLE001 - unpickling a damaged file raises anything
            raise ConvertError(f"{path / '.metadata'}: cannot read it ({type(e).__name__}: {e}); the file is "
                               "truncated or corrupted: use another checkpoint") from e
        self.reader.set_up_storage_reader(self.metadata, True)
        md = self.metadata.state_dict_metadata
        self.tensors = {k: (v.size, v.properties.dtype) for k, v in md.items() if isinstance(v, TensorStorageMetadata)}
        self.byte_keys = [k for k, v in md.items() if isinstance(v, BytesStorageMetadata)]

    def chunks(self, key: str) -> list[ChunkStorageMetadata]:
        return self.metadata.state_dict_metadata[key].chunks

    def where(self, key: str) -> str:
        """The files holding ``key``'s chunks (or its bytes)."""
        index = [MetadataIndex(key, c.offsets) for c in self.chunks(key)] if key in self.tensors else [
            MetadataIndex(key)]
        return ", ".join(sorted({self.metadata.storage_data[i].relative_path for i in index}))

    def _read(self, items: list[ReadItem], planner: _Collect, key: str) -> None:
        try:
            self.reader.read_data(LoadPlan(items), planner).wait()
        except Exception as e:  # noqa: BLE001 - torch.load of a damaged chunk raises anything
            raise ConvertError(f"{self.path}: cannot read '{key}' from {self.where(key)} ({type(e).__name__}: {e}); "
                               "the file is truncated or corrupted: use another checkpoint") from e

    def read(self, key: str) -> Tensor:
        shape, dtype = self.tensors[key]
        planner = _Collect(torch.empty(shape, dtype=dtype))
        items = [ReadItem(type=LoadItemType.TENSOR, dest_index=MetadataIndex(key, c.offsets), dest_offsets=c.offsets,
                          storage_index=MetadataIndex(key, c.offsets, i), lengths=c.sizes,
                          storage_offsets=torch.Size([0] * len(c.sizes))) for i, c in enumerate(self.chunks(key))]
        self._read(items, planner, key)
        return planner.target

    def read_bytes(self, key: str) -> bytes:
        planner = _Collect()
        empty = torch.Size([])
        self._read([ReadItem(type=LoadItemType.BYTE_IO, dest_index=MetadataIndex(key), dest_offsets=empty,
                             storage_index=MetadataIndex(key), storage_offsets=empty, lengths=empty)], planner, key)
        return planner.blob


def _planner_data(keys: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """DCP's flattening record (flat key -> nested path) for meshpar's layout of a state dict:
    model.<fqn>, optim.<fqn>.<state>, <section>.<name>. dcp.save writes the same."""
    def path(key: str) -> tuple[str, ...]:
        head, _, rest = key.partition(".")
        if head == "optim":
            fqn, _, state = rest.rpartition(".")
            return (head, fqn, state)
        return (head, rest)
    return {k: path(k) for k in keys}


class DCPSink:
    """Writes a meshpar checkpoint chunk by chunk for ``layout`` ([Note: streaming conversion],
    [Note: chunks for a target layout]): __<rank>_0.distcp per rank, .metadata, meshpar.json, a copy
    of the file ``recipe`` and of the tokenizer files of folder ``tokenizer``, where they exist."""

    takes_bytes = True

    def __init__(self, path: Path, info: Mapping[str, Any], spec: ModelSpec, layout: dict[str, int],
                 recipe: Path | None = None, tokenizer: Path | None = None) -> None:
        _fresh(path)
        path.mkdir(parents=True, exist_ok=True)
        self.path, self.spec, self.layout, self.recipe, self.tokenizer = path, spec, layout, recipe, tokenizer
        world = math.prod(layout.values())
        self.info = {**info, "layout": layout, "world_size": world, "saved_at": _now()}
        self.load = [0] * world  # bytes per rank file, to spread replicated chunks
        self.md: dict[str, Any] = {}
        self.results: list[WriteResult] = []
        self.crcs: list[dict[str, int]] = [{} for _ in range(world)]  # per rank file, as training writes them

    def select(self, tensors: Mapping[str, Any]) -> list[str]:
        return list(tensors)

    def _param(self, key: str, shape: torch.Size) -> str | None:
        """The parameter a model or optimizer-state tensor belongs to (None for anything else)."""
        head, _, rest = key.partition(".")
        fqn = rest if head == "model" else rest.rpartition(".")[0] if head == "optim" else None
        return fqn if fqn in self.spec.shapes and self.spec.shapes[fqn] == shape else None

    def _append(self, ranks: Sequence[int], index: MetadataIndex, data: Tensor | bytes) -> None:
        rank = min(ranks, key=self.load.__getitem__)
        name = f"__{rank}_0.distcp"
        with open(self.path / name, "ab") as f:  # opened per item: a 1024-rank layout needs no 1024 handles
            offset = f.tell()
            if isinstance(data, Tensor):
                torch.save(data, f)
            else:
                f.write(data)
            length = f.tell() - offset
        # read back (from the page cache) as training's saver does: no second copy of the chunk in memory
        self.crcs[rank][crc_key(name, offset, length)] = crc_of_range(self.path / name, offset, length)
        self.load[rank] += length
        self.results.append(WriteResult(index=index, size_in_bytes=length,
                                        storage_data=dcp_storage_info(name, offset, length)))

    def write(self, key: str, tensor: Tensor, chunks: Sequence[ChunkStorageMetadata] | None = None) -> None:
        fqn = self._param(key, tensor.shape)
        if fqn is not None:
            plan = layout_chunks(tensor.shape, self.layout, self.spec.tp_placement(fqn),
                                 self.spec.stage(fqn, self.layout["pp"]))
        else:
            whole = [((0,) * tensor.dim(), tuple(tensor.shape))]
            plan = {(tuple(c.offsets), tuple(c.sizes)): [0] for c in chunks} if chunks else dict.fromkeys(whole, [0])
        stored = []
        for i, ((off, size), ranks) in enumerate(plan.items()):
            piece = tensor[tuple(slice(o, o + n) for o, n in zip(off, size, strict=True))]
            if not piece.is_contiguous() or piece.untyped_storage().nbytes() != piece.nbytes:
                piece = piece.clone(memory_format=torch.contiguous_format)  # torch.save writes whole storages
            self._append(ranks, MetadataIndex(key, off, i), piece)
            stored.append(ChunkStorageMetadata(offsets=torch.Size(off), sizes=torch.Size(size)))
        self.md[key] = TensorStorageMetadata(TensorProperties(dtype=tensor.dtype), tensor.shape, stored)

    def write_bytes(self, key: str, blob: bytes) -> None:
        self._append([0], MetadataIndex(key), blob)
        self.md[key] = BytesStorageMetadata()

    def finish(self, planner_data: Mapping[str, Any] | None = None) -> None:
        fsync(*(self.path / f"__{rank}_0.distcp" for rank, size in enumerate(self.load) if size))
        metadata = Metadata(state_dict_metadata=self.md, planner_data=planner_data or _planner_data(list(self.md)))
        for rank, crcs in enumerate(self.crcs):
            if crcs:
                write_crcs(self.path, rank, crcs)
        FileSystemWriter(self.path).finish(metadata, [self.results])  # .metadata, atomically
        if self.recipe is not None and self.recipe.exists():  # the run's recipe, as saved (layout: meshpar.json)
            shutil.copyfile(self.recipe, self.path / "recipe.toml")
        if self.tokenizer is not None:
            copy_tokenizer(self.tokenizer, self.path)
        write_atomic(self.path / "meshpar.json", json.dumps(self.info, indent=2) + "\n")  # last: marks it complete
