"""Offline checkpoint conversion, one tensor at a time: meshpar (DCP) <-> Hugging Face safetensors,
DCP <-> one ``torch.save`` file, DCP -> DCP re-chunked for another layout; checksummed
verification; ``describe`` for ``meshpar checkpoint info``; ``load_hf_weights`` to start
training from a Hugging Face folder.

    convert("ckpt/step_200", "out/llama-hf", to="hf", verify=True)    # + config.json, index
    convert("out/llama-hf", "ckpt0/step_0", to="dcp")                  # step 0, layout all 1s
    convert("ckpt/step_200", "ckpt8/step_200", to="dcp", layout={"dp_shard": 4, "tp": 2})
    convert("ckpt/step_200", "weights.pt", to="torch")                  # {fqn: tensor}
    print(describe("ckpt"))                                             # every step_*, newest complete

No process group and no GPU. A conversion is a *source* (a DCP folder, a Hugging Face folder
or a torch file) read one tensor at a time and a *sink* written one tensor at a time:
[Note: streaming conversion]. Per-family names, transposes and ``config.json`` live in
``meshpar/models/<family>/convert.py``.

Limits: DCP -> torch holds the whole output in memory (``torch.save`` writes one object);
every other direction streams. Non-tensor entries (LR schedule, data position, RNG, step)
are copied as DCP's serialized bytes and never unpickled. Layouts with ``cp > 1`` are
refused, as in training.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import io
import json
import math
import os
import re
import resource
import shutil
import struct
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo  # DCP's record of where an item lies
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
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.distributed.tensor.placement_types import _StridedShard

from meshpar.metrics import Progress
from meshpar.models.gpt2 import convert as gpt2_convert
from meshpar.models.llama import convert as llama_convert
from meshpar.tensor_parallel import FusedColwiseParallel, VocabParallelEmbedding

DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")  # meshpar.mesh.DIMS, outermost first
ADAPTERS = {"llama": llama_convert, "qwen2": llama_convert, "qwen3": llama_convert, "gpt2": gpt2_convert}
TARGETS = ("hf", "torch", "dcp")
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3",
                      torch.float8_e5m2: "F8_E5M2"}
TORCH_DTYPES = {v: k for k, v in SAFETENSORS_DTYPES.items()}

# [Note: streaming conversion]
# A 70B checkpoint must convert on a host with far less RAM than the model, so nothing holds
# more than one tensor. Reading: DCP's FileSystemReader is driven directly with one LoadPlan
# per tensor (its metadata read once), and it reads only that tensor's chunks: each chunk is
# torch.load-ed alone and copied into the destination, so a read costs the tensor plus its
# largest chunk. Hugging Face files are read with readinto() straight into the tensor.
# Writing: safetensors headers need every name, dtype and shape up front, and DCP's metadata
# has them all, so each shard's header is written first and the tensors' bytes follow as they
# come. DCP output is written item by item in DCP's own format (torch.save per chunk,
# appended to __<rank>_0.distcp, offsets recorded in .metadata by FileSystemWriter.finish),
# not through dcp.save, whose writer keeps every tensor of a file referenced until that file
# is closed. Measured (tests/benchmarks/bench_convert.py: 2.72 GB of fp32, largest tensor
# 1.07 GB, this 2-core VM), peak RSS above the start: DCP -> HF 2.00x the largest tensor (the
# tensor and its chunk), HF -> DCP 1.02x, DCP -> DCP for dp_shard 4 x tp 2 2.07x (the tensor
# and one cloned chunk), against 3.55x for DCP -> torch, which holds the model. 0.20-0.26 GB/s
# with the output fsynced; torch.save's zip writer (a CRC32 per record) alone writes DCP at
# ~0.36 GB/s here. tests/test_convert.py asserts <= 2.5x the largest tensor + 64 MB.

# [Note: measuring peak memory]
# Summary.peak_bytes is the kernel's RSS high-water mark (VmHWM) during the conversion minus
# the RSS at its start: before converting, "5" is written to /proc/self/clear_refs, which
# resets VmHWM to the current RSS (Linux >= 4.0). It counts everything the process touches:
# tensors, allocator slack, pages of mapped files. Where /proc is unavailable it falls back
# to getrusage's ru_maxrss, a lifetime peak (Summary.peak_method says which).


class ConvertError(Exception):
    """A checkpoint problem; the message names the folder, file or tensor, and the fix."""


# --- models: names, shapes, tensor-parallel placements ------------------------------------------

def _compile(patterns: Mapping[str, str] | frozenset[str]) -> list[tuple[re.Pattern, str]]:
    items = patterns.items() if isinstance(patterns, Mapping) else ((p, p) for p in patterns)
    return [(re.compile("^" + re.escape(src).replace(r"\{i\}", r"(?P<i>\d+)") + "$"), dst) for src, dst in items]


def _match(table: list[tuple[re.Pattern, str]], name: str) -> str | None:
    for pattern, template in table:
        m = pattern.match(name)
        if m:
            return template.replace("{i}", m.group("i")) if "i" in pattern.groupindex else template
    return None


@dataclass(frozen=True)
class ModelSpec:
    """A model family and its args: meshpar's names and shapes, the Hugging Face names, the plan."""

    family: str
    args: Any

    @property
    def adapter(self) -> Any:
        return ADAPTERS[self.family]

    @functools.cached_property
    def _meta(self) -> tuple[dict[str, torch.Size], list[str]]:
        """(state-dict shapes, tied names included; the children before ``layers``) of the model on meta."""
        from meshpar.models import get_family

        with torch.device("meta"):
            model = get_family(self.family).model_cls(self.args)
        children = [name for name, _ in model.named_children()]
        return {k: v.shape for k, v in model.state_dict().items()}, children[:children.index("layers")]

    @property
    def shapes(self) -> dict[str, torch.Size]:
        """Every state-dict tensor (tied names included) -> shape."""
        return self._meta[0]

    @functools.cached_property
    def _to_hf(self) -> list[tuple[re.Pattern, str]]:
        return _compile(self.adapter.KEYS)

    @functools.cached_property
    def _transposed(self) -> list[tuple[re.Pattern, str]]:
        return _compile(self.adapter.TRANSPOSED)

    @functools.cached_property
    def tied(self) -> dict[str, str]:
        return self.adapter.tied(self.args)

    @property
    def size_name(self) -> str:
        from meshpar.models import get_family

        return next((n for n, a in get_family(self.family).sizes.items() if a == self.args), "custom")

    def hf_name(self, fqn: str) -> str:
        name = _match(self._to_hf, fqn)
        if name is None:
            raise ConvertError(f"tensor '{fqn}' has no Hugging Face name in {self.adapter.__name__}.KEYS; add it there")
        return name

    def transposed(self, fqn: str) -> bool:
        return _match(self._transposed, fqn) is not None

    def hf_shape(self, fqn: str, shape: Sequence[int]) -> list[int]:
        return list(reversed(shape)) if self.transposed(fqn) else list(shape)

    def stage(self, fqn: str, pp: int) -> int:
        """The pipeline stage holding ``fqn`` under an even split, one stage per pp rank."""
        if pp == 1:
            return 0
        from meshpar.pipeline.split import stage_layers

        m = re.match(r"layers\.(\d+)\.", fqn)
        if m:
            layer = int(m.group(1))
            return next(s for s, r in enumerate(stage_layers(self.args.n_layers, pp)) if layer in r)
        return 0 if fqn.split(".")[0] in self._meta[1] else pp - 1  # [Note: where the ends of a model are]

    @functools.cached_property
    def plan(self) -> Any:
        return self.adapter.TP_PLAN(True)

    def tp_placement(self, fqn: str) -> Placement:
        """How the family's tensor-parallel plan table places parameter ``fqn`` on the tp mesh."""
        module, _, param = fqn.rpartition(".")
        m = re.match(r"layers\.\d+\.(.+)", module)
        style = self.plan.block.get(m.group(1)) if m else self.plan.root.get(module)
        if isinstance(style, FusedColwiseParallel):
            return style.placement  # _StridedShard(0, 3): [Note: fused projections]
        if isinstance(style, (ColwiseParallel, VocabParallelEmbedding)):
            return Shard(0)  # Linear weight [out/tp, in] and bias [out/tp]; embedding rows [V/tp, D]
        if isinstance(style, RowwiseParallel):
            return Shard(1) if param == "weight" else Replicate()
        return Replicate()


def spec_from_info(info: Mapping[str, Any], where: Path) -> ModelSpec:
    family = info.get("family")
    if family not in ADAPTERS:
        raise ConvertError(f"{where}: unknown model family '{family}'; meshpar converts {', '.join(ADAPTERS)}")
    return ModelSpec(family, ADAPTERS[family].args_from_dict(info["model_args"]))


def check_model_tensors(spec: ModelSpec, found: Mapping[str, Sequence[int]], where: str) -> None:
    """ConvertError naming the first tensor missing, unexpected or of the wrong shape for ``spec``."""
    for fqn, shape in spec.shapes.items():
        if fqn not in found:
            raise ConvertError(f"{where}: tensor 'model.{fqn}' is missing; a {spec.family} model with these "
                               f"model_args has it (shape {list(shape)}). The checkpoint is incomplete or was saved "
                               f"from another model: check meshpar.json's family and model_args")
        if list(found[fqn]) != list(shape):
            raise ConvertError(f"{where}: tensor 'model.{fqn}' has shape {list(found[fqn])}, but the {spec.family} "
                               f"model in meshpar.json's model_args needs {list(shape)}: the checkpoint was saved "
                               f"from another model shape; fix model_args or convert the matching checkpoint")
    extra = sorted(set(found) - set(spec.shapes))
    if extra:
        raise ConvertError(f"{where}: tensors {', '.join('model.' + e for e in extra[:5])} are not parameters of "
                           f"the {spec.family} model in meshpar.json; check its family and model_args")


# --- chunks: which part of a tensor each rank holds --------------------------------------------

def _chunks(seq: Sequence[int], n: int) -> list[Sequence[int]]:
    """``seq`` in n pieces as torch.chunk cuts a dimension (ceil-sized, trailing ones short or empty)."""
    size = -(-len(seq) // n) if len(seq) else 0
    return [seq[i * size:(i + 1) * size] for i in range(n)]


def index_lists(shape: Sequence[int], mesh_shape: Sequence[int], coord: Sequence[int],
                placements: Sequence[Placement]) -> list[Sequence[int]]:
    """The global indices, per tensor dim, of the local shard at mesh ``coord``: DTensor's
    left-to-right sharding with torch.chunk sizes. ``_StridedShard(d, sf)`` cuts dim d in sf
    pieces and gives this rank its chunk of each (GPT-2's fused q|k|v, FSDP over a TP shard)."""
    idx: list[Sequence[int]] = [range(n) for n in shape]
    for n, c, placement in zip(mesh_shape, coord, placements, strict=True):
        if isinstance(placement, _StridedShard):
            pieces = _chunks(idx[placement.dim], placement.split_factor)
            idx[placement.dim] = [i for piece in pieces for i in _chunks(piece, n)[c]]
        elif isinstance(placement, Shard):
            idx[placement.dim] = _chunks(idx[placement.dim], n)[c]
    return idx


def _runs(seq: Sequence[int]) -> list[tuple[int, int]]:
    """Contiguous runs of an increasing index list: [(start, length)]."""
    if isinstance(seq, range):
        return [(seq.start, len(seq))] if len(seq) else []
    runs: list[list[int]] = []
    for i in seq:
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1][1] += 1
        else:
            runs.append([i, 1])
    return [(s, n) for s, n in runs]


def boxes(idx: Sequence[Sequence[int]]) -> Iterator[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """Index lists -> hyper-rectangles (global offsets, sizes, offsets in the local shard)."""
    per_dim = [_runs(seq) for seq in idx]
    local = [[sum(n for _, n in runs[:k]) for k in range(len(runs))] for runs in per_dim]

    def rec(d: int, off: tuple, size: tuple, loc: tuple) -> Iterator:
        if d == len(per_dim):
            yield off, size, loc
            return
        for (s, n), lo in zip(per_dim[d], local[d], strict=True):
            yield from rec(d + 1, (*off, s), (*size, n), (*loc, lo))

    yield from rec(0, (), (), ())


# [Note: chunks for a target layout]
# DCP -> DCP for a layout writes each tensor as the chunks the layout's ranks hold, so a job at
# that layout reads exactly its own chunks, each from its own rank's file __<rank>_0.distcp.
# A parameter (and its exp_avg, exp_avg_sq) is placed as meshpar's engine and PyTorch's
# fully_shard place it: the family's TP plan table gives the tp placement (column-wise
# Shard(0), row-wise Shard(1), GPT-2's fused c_attn _StridedShard(0, 3), the rest replicated),
# then FSDP cuts dim 0 of the TP-local tensor in dp_shard torch.chunk pieces (for a Shard(0)
# TP weight that is DTensor's _StridedShard(0, tp) on dp_shard: tp-major, then dp; equal to it
# where tp divides the dim, which meshpar checks before launch; dp pieces may be uneven). A
# non-contiguous local shard (fused c_attn) is written as one chunk per contiguous run.
# Replicas (dp_replicate, replicated tp) are written once, like DCP's dedup, in the file of
# the least-loaded rank holding them. pp moves whole tensors only: they go to the files of the
# stage of an even split, one stage per pp rank (meshpar.pipeline.stage_layers); virtual stages
# or explicit boundaries change only which file, not the chunks. Other tensors (0-d optimizer
# steps, RNG states) keep the source's chunks, or are written whole.

def parse_layout(layout: Mapping[str, int] | None) -> dict[str, int]:
    """All five degrees (missing ones 1), checked: positive integers, known dims, cp = 1."""
    degrees = {d: 1 for d in DIMS}
    for key, value in (layout or {}).items():
        if key not in degrees:
            raise ConvertError(f"layout: unknown dimension '{key}'; use {', '.join(DIMS)} (e.g. dp_shard=4,tp=2)")
        if not isinstance(value, int) or value < 1:
            raise ConvertError(f"layout: {key} = {value!r}; give a positive integer degree (no -1 offline)")
        degrees[key] = value
    if degrees["cp"] != 1:
        raise ConvertError("layout: cp > 1 is not built in meshpar; set cp = 1")
    return degrees


def _rank(layout: Mapping[str, int], pp: int, rep: int, shard: int, tp: int) -> int:
    return ((pp * layout["dp_replicate"] + rep) * layout["dp_shard"] + shard) * layout["cp"] * layout["tp"] + tp


def layout_chunks(shape: Sequence[int], layout: Mapping[str, int], tp_placement: Placement,
                  stage: int) -> dict[tuple[tuple[int, ...], tuple[int, ...]], list[int]]:
    """{(offsets, sizes): ranks holding that chunk} at ``layout``: [Note: chunks for a target layout]."""
    if tp_placement.is_shard() and tp_placement.dim >= len(shape):
        tp_placement = Replicate()
    placements = (tp_placement, Shard(0)) if shape else (Replicate(), Replicate())
    out: dict[tuple[tuple[int, ...], tuple[int, ...]], list[int]] = {}
    for t in range(layout["tp"]):
        for d in range(layout["dp_shard"]):
            idx = index_lists(shape, (layout["tp"], layout["dp_shard"]), (t, d), placements)
            for off, size, _ in boxes(idx):
                if math.prod(size):  # torch.chunk leaves trailing ranks empty on short dims
                    ranks = [_rank(layout, stage, r, d, t) for r in range(layout["dp_replicate"])]
                    out.setdefault((off, size), []).extend(ranks)
    return out


# --- DCP folders ------------------------------------------------------------------------------

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


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConvertError(f"{path}: cannot read it ({e}); the file is truncated or not JSON") from e


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
        self.reader = FileSystemReader(path)
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


def _fresh(path: Path) -> None:
    """Refuse to write into an existing file or non-empty folder: mixing outputs corrupts both."""
    if path.exists() and (path.is_file() or any(path.iterdir())):
        raise ConvertError(f"{path}: already exists; remove it or choose another destination")


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


def _fsync(*paths: Path) -> None:
    """Flush written files to disk: a conversion is finished when its output would survive a crash."""
    for path in paths:
        with open(path, "rb+") as f:
            os.fsync(f.fileno())


def _write_meshpar_json(path: Path, info: Mapping[str, Any]) -> None:
    """meshpar.json goes last and atomically: its presence marks the checkpoint complete."""
    tmp = path / "meshpar.json.tmp"
    tmp.write_text(json.dumps(info, indent=2) + "\n")
    os.replace(tmp, path / "meshpar.json")


class DCPSink:
    """Writes a meshpar checkpoint chunk by chunk for ``layout`` ([Note: streaming conversion],
    [Note: chunks for a target layout]): __<rank>_0.distcp per rank, .metadata, meshpar.json."""

    takes_bytes = True

    def __init__(self, path: Path, info: Mapping[str, Any], spec: ModelSpec, layout: dict[str, int],
                 recipe: Path | None = None) -> None:
        _fresh(path)
        path.mkdir(parents=True, exist_ok=True)
        self.path, self.spec, self.layout, self.recipe = path, spec, layout, recipe
        world = math.prod(layout.values())
        self.info = {**info, "layout": layout, "world_size": world, "saved_at": _now()}
        self.load = [0] * world  # bytes per rank file, to spread replicated chunks
        self.md: dict[str, Any] = {}
        self.results: list[WriteResult] = []

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
        self.load[rank] += length
        self.results.append(WriteResult(index=index, size_in_bytes=length,
                                        storage_data=_StorageInfo(name, offset, length)))

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
        _fsync(*(self.path / f"__{rank}_0.distcp" for rank, size in enumerate(self.load) if size))
        metadata = Metadata(state_dict_metadata=self.md, planner_data=planner_data or _planner_data(list(self.md)))
        FileSystemWriter(self.path).finish(metadata, [self.results])  # .metadata, atomically
        if self.recipe is not None and self.recipe.exists():  # the run's recipe, as saved (layout: meshpar.json)
            shutil.copyfile(self.recipe, self.path / "recipe.toml")
        _write_meshpar_json(self.path, self.info)


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# --- Hugging Face folders ---------------------------------------------------------------------

def _st_header(path: Path) -> tuple[dict[str, Any], int]:
    """A safetensors file's header (name -> dtype, shape, data_offsets) and where its data starts."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
    except (OSError, struct.error, ValueError) as e:
        raise ConvertError(f"{path}: not a readable safetensors file ({e}); re-download or re-export it") from e
    header.pop("__metadata__", None)
    return header, 8 + n


def _bytes_view(t: Tensor) -> memoryview:
    """The raw little-endian bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


class HFSource:
    """A Hugging Face folder (config.json + safetensors) seen as meshpar names: ``model.<fqn>``."""

    kind = "hf"
    byte_keys: list[str] = []

    def __init__(self, path: Path) -> None:
        self.path = path
        config = _read_json(path / "config.json")
        family = config.get("model_type")
        if family not in ADAPTERS:
            raise ConvertError(f"{path / 'config.json'}: model_type '{family}' is not a family meshpar converts "
                               f"({', '.join(ADAPTERS)}); convert a Llama, Qwen2, Qwen3 or GPT-2 model")
        try:
            self.spec = ModelSpec(family, ADAPTERS[family].args_from_hf_config(family, config))
        except (KeyError, ValueError, TypeError) as e:
            raise ConvertError(f"{path / 'config.json'}: {e}") from e
        self.where_hf: dict[str, tuple[Path, dict[str, Any], int]] = {}  # hf name -> (file, entry, data start)
        for file in self._files():
            header, start = _st_header(file)
            self.where_hf.update({name: (file, entry, start) for name, entry in header.items()})
        self.names: dict[str, str] = {}  # fqn -> hf name it is read from
        self.tensors: dict[str, tuple[torch.Size, torch.dtype]] = {}
        for fqn, shape in self.spec.shapes.items():
            self.names[fqn] = name = self._find(self.spec.tied.get(fqn, fqn))
            _, entry, _ = self.where_hf[name]
            if self.spec.hf_shape(fqn, shape) != entry["shape"]:
                raise ConvertError(f"{path}: tensor '{name}' (meshpar '{fqn}') has shape {entry['shape']}, but "
                                   f"config.json's model needs {self.spec.hf_shape(fqn, shape)}; the weights do "
                                   "not match config.json")
            self.tensors["model." + fqn] = (shape, TORCH_DTYPES[entry["dtype"]])
        self._check_unused()
        self.info = {"format": 1, "step": 0, "family": family, "size": self.spec.size_name,
                     "model_args": dataclasses.asdict(self.spec.args), "layout": parse_layout(None), "world_size": 1,
                     "saved_at": _now()}

    def _files(self) -> list[Path]:
        index = self.path / "model.safetensors.index.json"
        if index.exists():
            files = sorted(set(_read_json(index).get("weight_map", {}).values()))
        else:
            files = [f.name for f in sorted(self.path.glob("*.safetensors"))]
        if not files:
            raise ConvertError(f"{self.path}: no model.safetensors.index.json and no *.safetensors files; a Hugging "
                               "Face folder needs its weights as safetensors (convert .bin files with transformers)")
        missing = [f for f in files if not (self.path / f).exists()]
        if missing:
            raise ConvertError(f"{self.path}: {missing[0]} is listed in model.safetensors.index.json but absent; "
                               "download it again")
        return [self.path / f for f in files]

    def _find(self, fqn: str) -> str:
        name = self.spec.hf_name(fqn)
        prefix = getattr(self.spec.adapter, "HF_PREFIX", "")
        for candidate in (name, name.removeprefix(prefix) if prefix else name):
            if candidate in self.where_hf:
                return candidate
        raise ConvertError(f"{self.path}: tensor '{name}' (meshpar '{fqn}') is missing; config.json describes a "
                           f"{self.spec.family} model that has it, so the folder is incomplete or config.json belongs "
                           "to another model")

    def _check_unused(self) -> None:
        used = set(self.names.values())
        ignored = re.compile("^(" + "|".join(self.spec.adapter.IGNORED_HF) + ")$")
        extra = sorted(n for n in self.where_hf if n not in used and not ignored.match(n))
        if extra:
            raise ConvertError(f"{self.path}: tensors {', '.join(extra[:5])} have no place in the {self.spec.family} "
                               "model config.json describes; check config.json (attention_bias, num_hidden_layers)")

    def where(self, key: str) -> str:
        return self.where_hf[self.names[key.removeprefix("model.")]][0].name

    def read(self, key: str) -> Tensor:
        fqn = key.removeprefix("model.")
        file, entry, start = self.where_hf[self.names[fqn]]
        t = torch.empty(entry["shape"], dtype=TORCH_DTYPES[entry["dtype"]])
        begin, end = entry["data_offsets"]
        with open(file, "rb") as f:
            f.seek(start + begin)
            if f.readinto(_bytes_view(t)) != end - begin:
                raise ConvertError(f"{file}: ends inside tensor '{self.names[fqn]}'; the file is truncated, "
                                   "download it again")
        return t.t().contiguous() if self.spec.transposed(fqn) else t


class HFSink:
    """Writes sharded safetensors files header first, then each tensor's bytes as it arrives
    ([Note: streaming conversion]), then model.safetensors.index.json and config.json."""

    takes_bytes = False

    def __init__(self, path: Path, spec: ModelSpec, shard_size: int) -> None:
        _fresh(path)
        path.mkdir(parents=True, exist_ok=True)
        self.path, self.spec, self.shard_size = path, spec, shard_size
        self.file: Any = None

    def select(self, tensors: Mapping[str, tuple[torch.Size, torch.dtype]]) -> list[str]:
        keys = [k for k in tensors if k.startswith("model.") and k[6:] not in self.spec.tied]
        shards: list[list[str]] = [[]]
        size = 0
        for key in keys:
            shape, dtype = tensors[key]
            nbytes = math.prod(shape) * dtype.itemsize
            if shards[-1] and size + nbytes > self.shard_size:
                shards.append([])
                size = 0
            shards[-1].append(key)
            size += nbytes
        n = len(shards)
        self.queue: list[tuple[str, str, bytes | None]] = []  # (key, file, header to write first)
        self.weight_map: dict[str, str] = {}
        self.total = 0
        for i, shard in enumerate(shards):
            name, header, offset = f"model-{i + 1:05d}-of-{n:05d}.safetensors", {"__metadata__": {"format": "pt"}}, 0
            for key in shard:
                shape, dtype = tensors[key]
                if dtype not in SAFETENSORS_DTYPES:
                    raise ConvertError(f"tensor '{key}' is {dtype}, which safetensors cannot store")
                nbytes = math.prod(shape) * dtype.itemsize
                hf = self.spec.hf_name(key[6:])
                header[hf] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": self.spec.hf_shape(key[6:], shape),
                              "data_offsets": [offset, offset + nbytes]}
                offset += nbytes
                self.weight_map[hf] = name
            raw = json.dumps(header, separators=(",", ":")).encode()
            raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
            self.queue += [(key, name, struct.pack("<Q", len(raw)) + raw if j == 0 else None)
                           for j, key in enumerate(shard)]
            self.total += offset
        self.dtype = tensors[keys[0]][1] if keys else torch.float32
        self.queue.reverse()
        return keys

    def write(self, key: str, tensor: Tensor, chunks: Any = None) -> None:
        expected, name, header = self.queue.pop()
        assert key == expected, (key, expected)  # headers fixed the order
        if header is not None:
            if self.file is not None:
                self.file.close()
            self.file = open(self.path / name, "wb")  # noqa: SIM115 - open across write() calls, closed in finish
            self.file.write(header)
        t = tensor.t() if self.spec.transposed(key[6:]) else tensor
        self.file.write(_bytes_view(t.contiguous()))

    def finish(self, planner_data: Any = None) -> None:
        if self.file is not None:
            self.file.close()
        _fsync(*(self.path / name for name in set(self.weight_map.values())))
        index = {"metadata": {"total_size": self.total}, "weight_map": self.weight_map}
        (self.path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        config = self.spec.adapter.hf_config(self.spec.family, self.spec.args, self.dtype)
        (self.path / "config.json").write_text(json.dumps(config, indent=2) + "\n")


# --- torch.save files -------------------------------------------------------------------------

def _sidecar(path: Path) -> Path:
    return path.with_suffix(".meshpar.json")


class TorchSource:
    """A torch.save file of ``{fqn: tensor}`` (or every checkpoint key, ``model_only=False``) and
    its sidecar ``<name>.meshpar.json``; loaded with mmap, so tensors page in one at a time."""

    kind = "torch"

    def __init__(self, path: Path) -> None:
        self.path = path
        if not _sidecar(path).exists():
            raise ConvertError(f"{path}: {_sidecar(path).name} is missing beside it; it records the family and "
                               "model_args (convert writes it); copy it from the conversion that made the file")
        self.info = _read_json(_sidecar(path))
        self.spec = spec_from_info(self.info, _sidecar(path))
        try:
            state = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
        except Exception as e:  # noqa: BLE001 - a damaged zip raises anything
            raise ConvertError(f"{path}: torch.load failed ({type(e).__name__}: {e}); the file is truncated or "
                               "not a torch.save file") from e
        full = any(k.startswith("model.") for k in state)
        self.state = {k if full else "model." + k: v for k, v in state.items()}
        self.tensors = {k: (v.shape, v.dtype) for k, v in self.state.items() if isinstance(v, Tensor)}
        self.byte_keys = [k for k, v in self.state.items() if isinstance(v, bytes)]

    def where(self, key: str) -> str:
        return self.path.name

    def read(self, key: str) -> Tensor:
        return self.state[key]  # mapped: its pages are page cache, counted in RSS until the kernel drops them

    def read_bytes(self, key: str) -> bytes:
        return self.state[key]


class TorchSink:
    """Collects the tensors, then one torch.save: this direction holds the whole output in memory."""

    def __init__(self, path: Path, info: Mapping[str, Any], model_only: bool) -> None:
        _fresh(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path, self.info, self.model_only, self.state = path, info, model_only, {}
        self.takes_bytes = not model_only  # non-tensor entries are kept as DCP's bytes (torch.load them)

    def select(self, tensors: Mapping[str, Any]) -> list[str]:
        return [k for k in tensors if k.startswith("model.") or not self.model_only]

    def write(self, key: str, tensor: Tensor, chunks: Any = None) -> None:
        self.state[key.removeprefix("model.") if self.model_only else key] = tensor

    def write_bytes(self, key: str, blob: bytes) -> None:
        self.state[key] = blob

    def finish(self, planner_data: Any = None) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        torch.save(self.state, tmp)
        _fsync(tmp)
        os.replace(tmp, self.path)
        _sidecar(self.path).write_text(json.dumps(self.info, indent=2) + "\n")


def open_checkpoint(path: str | os.PathLike) -> DCPSource | HFSource | TorchSource:
    """A DCP checkpoint folder, a Hugging Face folder or a torch file, recognized by its files."""
    path = Path(path)
    if not path.exists():
        raise ConvertError(f"{path}: no such file or folder; check the path")
    if path.is_file():
        return TorchSource(path)
    if (path / "config.json").exists():
        return HFSource(path)
    if (path / ".metadata").exists() or (path / "meshpar.json").exists():
        return DCPSource(path)
    steps = _steps(path)
    if steps:
        complete = [s for s in steps if _complete(s)]
        hint = f"e.g. {complete[-1]}" if complete else "none of them is complete"
        raise ConvertError(f"{path}: a folder of checkpoints; pass one of them ({hint})")
    raise ConvertError(f"{path}: not a checkpoint (no .metadata + meshpar.json, no config.json, no step_* folders); "
                       "pass a checkpoint folder <dir>/step_<N>, a Hugging Face folder or a torch file")


def _steps(path: Path) -> list[Path]:
    found = [p for p in path.glob("step_*") if p.is_dir() and p.name[5:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[5:]))


def _complete(path: Path) -> bool:
    return (path / ".metadata").exists() and (path / "meshpar.json").exists()


# --- convert, verify --------------------------------------------------------------------------

def _rss() -> tuple[int, int] | None:
    """(current RSS, high-water mark) in bytes from /proc/self/status, or None off Linux."""
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
        return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


class _PeakMemory:
    """Peak RSS above the start of a conversion: [Note: measuring peak memory]."""

    def __init__(self) -> None:
        try:
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
            self.method, self.start = "VmHWM", _rss()[0]
        except (OSError, TypeError):
            self.method, self.start = "ru_maxrss (lifetime)", 0

    def peak(self) -> int:
        if self.method == "VmHWM":
            return max(_rss()[1] - self.start, 0)
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1000
    raise AssertionError


class _Bar(Progress):
    """meshpar.metrics.Progress counting bytes instead of steps."""

    def update(self, done: int) -> None:
        self.done = done
        if self.enabled:
            elapsed = time.perf_counter() - self.start
            eta = elapsed / max(done, 1) * (self.total - done)
            filled = self.width * done // max(self.total, 1)
            self.stream.write(f"\r\033[K[{'#' * filled}{'.' * (self.width - filled)}] {_human(done)} / "
                              f"{_human(self.total)}  {elapsed:,.0f}s elapsed  eta {eta:,.0f}s")
            self.stream.flush()


@dataclass(frozen=True)
class Summary:
    """What a conversion did. ``peak_bytes``: see [Note: measuring peak memory]."""

    dst: str
    tensors: int
    bytes: int  # tensor bytes written
    seconds: float
    peak_bytes: int  # RSS high-water mark above the RSS at the start (``peak_method``)
    largest_tensor_bytes: int
    peak_method: str = "VmHWM"
    verified: bool = False

    def __str__(self) -> str:
        rate = self.bytes / max(self.seconds, 1e-9)
        return (f"meshpar convert: {self.tensors} tensors, {_human(self.bytes)} in {self.seconds:.2f} s "
                f"({_human(rate)}/s), peak memory +{_human(self.peak_bytes)} (largest tensor "
                f"{_human(self.largest_tensor_bytes)}){', verified' if self.verified else ''} -> {self.dst}")


def digest(t: Tensor) -> str:
    """A checksum of a tensor's dtype, shape and bytes (sha256, 16 hex digits)."""
    h = hashlib.sha256(f"{t.dtype}{list(t.shape)}".encode())
    h.update(_bytes_view(t.contiguous()))
    return h.hexdigest()[:16]


def _check(expected: Mapping[str, str], out: DCPSource | HFSource | TorchSource, blobs: Mapping[str, str]) -> None:
    """Reload every tensor (and non-tensor entry) of ``out``, compare checksums; ConvertError naming mismatches."""
    bad = []
    for key, want in expected.items():
        if key not in out.tensors:
            bad.append(f"'{key}' is missing")
        elif (got := digest(out.read(key))) != want:
            bad.append(f"'{key}' differs (checksum {got} in {out.where(key)}, {want} in the source)")
    for key, want in blobs.items():
        if key not in out.byte_keys:
            bad.append(f"'{key}' is missing")
        elif hashlib.sha256(out.read_bytes(key)).hexdigest()[:16] != want:
            bad.append(f"'{key}' (non-tensor entry) differs")
    if bad:
        raise ConvertError(f"{out.path}: verification failed for {len(bad)} entries: " + "; ".join(bad[:10]) +
                           ". The output is damaged (disk, copy): convert again")


def verify(src: str | os.PathLike, dst: str | os.PathLike) -> int:
    """Compare ``dst`` with ``src`` (any two formats) tensor by tensor by checksum, in meshpar's
    orientation; returns the number of tensors compared. Keys only a checkpoint folder holds
    (optimizer state, non-tensor entries) are compared when ``dst`` holds any of them."""
    source, out = open_checkpoint(src), open_checkpoint(dst)
    whole = any(not k.startswith("model.") for k in (*out.tensors, *out.byte_keys))
    keys = [k for k in source.tensors if whole or k.startswith("model.")]
    expected = {k: digest(source.read(k)) for k in keys}
    blobs = {k: hashlib.sha256(source.read_bytes(k)).hexdigest()[:16] for k in source.byte_keys if whole}
    _check(expected, out, blobs)
    return len(expected)


def convert(src: str | os.PathLike, dst: str | os.PathLike, to: str, *, layout: Mapping[str, int] | None = None,
            verify: bool = False, progress: bool = True, shard_size: int = 5 * 10**9,
            model_only: bool = True) -> Summary:
    """Convert checkpoint ``src`` (a DCP folder, Hugging Face folder or torch file) to ``to``:

    - ``"hf"``: sharded safetensors (``shard_size`` bytes per file at most), the index and config.json;
    - ``"torch"``: one torch.save file of ``{fqn: tensor}`` plus ``<name>.meshpar.json`` (with
      ``model_only=False``: every checkpoint key, non-tensor entries as DCP's bytes). It holds the
      whole output in memory;
    - ``"dcp"``: a meshpar checkpoint folder chunked for ``layout`` (degrees by dim name,
      default: the source's), optimizer state and non-tensor entries included.

    One tensor at a time ([Note: streaming conversion]); ``verify`` reloads the output and
    compares checksums. Prints a progress bar (stderr, on a terminal) and the summary line
    when ``progress``.
    """
    if to not in TARGETS:
        raise ConvertError(f"to = '{to}': choose one of {', '.join(TARGETS)}")
    source, dst = open_checkpoint(src), Path(dst)
    found = {k[6:]: shape for k, (shape, _) in source.tensors.items() if k.startswith("model.")}
    check_model_tensors(source.spec, found, str(source.path))
    if to == "hf":
        sink: DCPSink | HFSink | TorchSink = HFSink(dst, source.spec, shard_size)
    elif to == "torch":
        sink = TorchSink(dst, source.info, model_only)
    else:
        sink = DCPSink(dst, source.info, source.spec, parse_layout(layout or source.info.get("layout")),
                       source.path / "recipe.toml" if isinstance(source, DCPSource) else None)
    memory, start = _PeakMemory(), time.perf_counter()
    keys = sink.select(source.tensors)
    sizes = {k: math.prod(source.tensors[k][0]) * source.tensors[k][1].itemsize for k in keys}
    bar = _Bar(sum(sizes.values()), enabled=progress and sys.stderr.isatty())
    expected, blobs, done = {}, {}, 0
    for key in keys:
        tensor = source.read(key)
        if verify:
            expected[key] = digest(tensor)
        sink.write(key, tensor, source.chunks(key) if isinstance(source, DCPSource) else None)
        del tensor  # before the next read: one tensor at a time
        done += sizes[key]
        bar.update(done)
    for key in source.byte_keys if sink.takes_bytes else ():
        blob = source.read_bytes(key)
        blobs[key] = hashlib.sha256(blob).hexdigest()[:16]
        sink.write_bytes(key, blob)
    sink.finish(source.metadata.planner_data if isinstance(source, DCPSource) else None)
    bar.close()
    summary = Summary(str(dst), len(keys), done, time.perf_counter() - start, memory.peak(),
                      max(sizes.values(), default=0), memory.method, verify)
    if verify:
        _check(expected, open_checkpoint(dst), blobs)
    if progress:
        print(summary)
    return summary


# --- meshpar checkpoint info ------------------------------------------------------------------

def _describe_one(path: Path) -> list[str]:
    info = _read_json(path / "meshpar.json") if (path / "meshpar.json").exists() else {}
    missing = [f for f in (".metadata", "meshpar.json") if not (path / f).exists()]
    state = "complete" if not missing else f"INCOMPLETE ({' and '.join(missing)} missing: the save did not finish)"
    lines = [f"checkpoint {path}: {state}"]
    if info:
        layout = " x ".join(f"{d} {n}" for d, n in info.get("layout", {}).items() if n > 1) or "single rank"
        lines.append(f"  step {info.get('step')} | {info.get('family')} {info.get('size')} | saved from {layout} "
                     f"(world size {info.get('world_size')}) | saved at {info.get('saved_at')}")
    if ".metadata" in missing:
        return lines
    try:
        md = FileSystemReader(path).read_metadata().state_dict_metadata
    except Exception as e:  # noqa: BLE001 - a damaged pickle raises anything
        raise ConvertError(f"{path / '.metadata'}: cannot read it ({type(e).__name__}: {e}); the file is truncated "
                           "or corrupted") from e
    tensors = {k: v for k, v in md.items() if isinstance(v, TensorStorageMetadata)}
    width = max((len(k) for k in md), default=10)
    lines.append(f"  {'tensor':<{width}}  {'shape':<16} {'dtype':<9} {'bytes':>11} {'chunks':>6}")
    totals: dict[str, list[int]] = {}
    for key, m in tensors.items():
        nbytes = math.prod(m.size) * m.properties.dtype.itemsize
        dtype = str(m.properties.dtype).removeprefix("torch.")
        lines.append(f"  {key:<{width}}  {str(list(m.size)):<16} {dtype:<9} {_human(nbytes):>11} {len(m.chunks):>6}")
        total = totals.setdefault(key.partition(".")[0], [0, 0])
        total[0] += 1
        total[1] += nbytes
    others = [k for k in md if k not in tensors]
    if others:
        lines.append(f"  non-tensor entries ({len(others)}): {', '.join(others)}")
    on_disk = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    per_group = ", ".join(f"{g} {n} ({_human(b)})" for g, (n, b) in totals.items())
    lines.append(f"  total: {len(tensors)} tensors, {_human(sum(b for _, b in totals.values()))} [{per_group}]; "
                 f"{_human(on_disk)} on disk")
    return lines


def describe(path: str | os.PathLike) -> str:
    """``meshpar checkpoint info``: step, layout saved from, world size, completeness, and every
    tensor (shape, dtype, bytes, chunks) with totals. A folder of ``step_*`` checkpoints lists
    them with their completeness and describes the newest complete one."""
    path = Path(path)
    if not path.is_dir():
        raise ConvertError(f"{path}: no such folder; pass a checkpoint folder or the folder holding step_* ones")
    if (path / ".metadata").exists() or (path / "meshpar.json").exists():
        return "\n".join(_describe_one(path))
    steps = _steps(path)
    if not steps:
        raise ConvertError(f"{path}: not a checkpoint (no .metadata, no meshpar.json, no step_* folders); pass "
                           "<dir>/step_<N> or <dir>")
    lines = [f"{len(steps)} checkpoint{'s' * (len(steps) > 1)} in {path}:"]
    lines += [f"  {s.name:<14} {'complete' if _complete(s) else 'INCOMPLETE'}" for s in steps]
    complete = [s for s in steps if _complete(s)]
    lines += ["", *_describe_one(complete[-1])] if complete else ["no complete checkpoint"]
    return "\n".join(lines)


# --- starting training from Hugging Face weights ----------------------------------------------

@torch.no_grad()
def load_hf_weights(state_dict: Mapping[str, Tensor], hf_dir: str | os.PathLike, family: str, args: Any) -> None:
    """Fill a meshpar model's state dict in place from a Hugging Face folder, one tensor at a time.

    Values may be plain tensors or DTensors (any mix of Shard, _StridedShard and Replicate on
    any mesh, e.g. after tensor parallelism and ``meshpar.fully_shard``): each rank reads only
    the rows and columns of its local shard (``safe_open(...).get_slice``), so no rank ever
    holds a whole tensor. ``config.json`` must describe the same model as ``family``/``args``
    (``max_seq_len`` may differ); a missing tensor or a wrong shape raises ConvertError naming it.
    """
    from safetensors import safe_open

    hf = HFSource(Path(hf_dir))
    spec = ModelSpec(family, args)
    theirs = dataclasses.replace(hf.spec.args, max_seq_len=args.max_seq_len)
    if hf.spec.family != family or theirs != args:
        diff = [f"{f.name} {getattr(theirs, f.name)} vs {getattr(args, f.name)}" for f in dataclasses.fields(args)
                if getattr(theirs, f.name) != getattr(args, f.name)]
        raise ConvertError(f"{hf_dir}: config.json describes a {hf.spec.family} model that differs from this "
                           f"{family} model ({'; '.join(diff) or 'family'}); set model.family / model.size / overrides "
                           "to match config.json")
    with contextlib.ExitStack() as stack:
        handles = {file: stack.enter_context(safe_open(file, framework="pt"))
                   for file in {file for file, _, _ in hf.where_hf.values()}}
        for fqn, value in state_dict.items():
            if fqn not in hf.names:
                raise ConvertError(f"state dict entry '{fqn}' is not a parameter of the {family} model; "
                                   "load_hf_weights takes model.state_dict()")
            _load_one(value, handles[hf.where_hf[hf.names[fqn]][0]].get_slice(hf.names[fqn]), spec.transposed(fqn))


def _load_one(value: Tensor, piece: Any, transposed: bool) -> None:
    """Copy this rank's part of ``value`` (a tensor or DTensor) from ``piece``, a safetensors slice."""
    if isinstance(value, DTensor):
        coord = value.device_mesh.get_coordinate()
        if coord is None:
            return  # this rank holds no shard
        idx = index_lists(value.shape, value.device_mesh.shape, coord, value.placements)
        local = value.to_local()
    else:
        idx, local = [range(n) for n in value.shape], value
    for off, size, loc in boxes(idx):
        where = [slice(o, o + n) for o, n in zip(off, size, strict=True)]
        block = piece[tuple(reversed(where))].t() if transposed else piece[tuple(where)]  # Conv1D: [in, out]
        local[tuple(slice(o, o + n) for o, n in zip(loc, size, strict=True))].copy_(block)
