"""Hugging Face folders (config.json + safetensors): a source that reads each tensor with
readinto() straight into place, and a sink that writes each shard's header first and the tensors'
bytes as they come ([Note: streaming conversion]), then the config and the model's tokenizer. A
stacked expert tensor is read from, and written as, one Hugging Face tensor per expert
([Note: stacked experts]); a tensor the folder stores quantised is decoded on the way in and written
plain ([Note: quantised tensors on import])."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from meshpar.convert.files import _bytes_view, _fresh, _now, _read_json, copy_tokenizer
from meshpar.convert.layout import parse_layout
from meshpar.convert.spec import ConvertError, Decode, ModelSpec
from meshpar.models import FAMILIES
from meshpar.runtime.atomic import fsync

SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3",
                      torch.float8_e5m2: "F8_E5M2"}
TORCH_DTYPES = {v: k for k, v in SAFETENSORS_DTYPES.items()}


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


def safetensors_files(path: Path) -> list[Path]:
    """A Hugging Face folder's weight files: model.safetensors.index.json's, else every *.safetensors."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(_read_json(index).get("weight_map", {}).values()))
    else:
        files = [f.name for f in sorted(path.glob("*.safetensors"))]
    if not files:
        raise ConvertError(f"{path}: no model.safetensors.index.json and no *.safetensors files; a Hugging "
                           "Face folder needs its weights as safetensors (convert .bin files with transformers)")
    missing = [f for f in files if not (path / f).exists()]
    if missing:
        raise ConvertError(f"{path}: {missing[0]} is listed in model.safetensors.index.json but absent; "
                           "download it again")
    return [path / f for f in files]


class HFSource:
    """A Hugging Face folder (config.json + safetensors) seen as meshpar names: ``model.<fqn>``.

    Every tensor of the folder must have a place in the model config.json describes, except the
    adapter's ``IGNORED_HF`` (buffers and copies that carry nothing) and the tensors its optional
    ``skipped_hf(config)`` names for this config.json ({pattern: what they are}: weights the model
    does not build, such as DeepSeek-V3's multi-token-prediction layer), which are dropped from the
    folder's view and reported in ``note``, one line ("" when none).

    A parameter the folder holds quantised (the adapter's ``QUANTIZED``, e.g. gpt-oss's MXFP4 experts)
    is read from its sources and decoded one dim-0 row at a time, in config.json's ``torch_dtype``
    (transformers 5: ``dtype``; float32 where it names none): [Note: quantised tensors on import]."""

    kind = "hf"
    byte_keys: list[str] = []

    def __init__(self, path: Path) -> None:
        self.path = path
        config = _read_json(path / "config.json")
        family = config.get("model_type")
        if family not in FAMILIES:
            raise ConvertError(f"{path / 'config.json'}: model_type '{family}' is not a family meshpar converts "
                               f"({', '.join(FAMILIES)}); convert a model of one of them, or train it as "
                               "model.family = 'hf'")
        try:
            self.spec = ModelSpec(family, FAMILIES[family].adapter.args_from_hf_config(family, config))
            skipped = getattr(self.spec.adapter, "skipped_hf", lambda config: {})(config)
        except (KeyError, ValueError, TypeError) as e:
            raise ConvertError(f"{path / 'config.json'}: {e}") from e
        # what quantised tensors are decoded into: config.json's dtype; None where it names no floating dtype
        self.dtype_name = str(config.get("torch_dtype") or config.get("dtype") or "float32")
        dtype = getattr(torch, self.dtype_name, None)
        self.dtype = dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None
        self.where_hf: dict[str, tuple[Path, dict[str, Any], int]] = {}  # hf name -> (file, entry, data start)
        for file in self._files():
            header, start = _st_header(file)
            self.where_hf.update({name: (file, entry, start) for name, entry in header.items()})
        self.note = self._skip(skipped)
        self._check_expert_count()
        # fqn -> the hf names it is read from (one per expert if stacked; its sources if quantised)
        self.names: dict[str, list[str]] = {}
        self.tensors: dict[str, tuple[torch.Size, torch.dtype]] = {}
        self.quantized: dict[str, Decode] = {}  # fqn -> decode, where the folder holds fqn quantised
        for fqn, shape in self.spec.shapes.items():
            source = self.spec.tied.get(fqn, fqn)
            quantized = self.spec.quantized(source)
            if (quantized and not self._present(self.spec.hf_name(source))
                    and any(self._present(name) for name in quantized[0])):
                self.names[fqn], self.quantized[fqn] = self._sources(fqn, shape, *quantized), quantized[1]
                self.tensors["model." + fqn] = (shape, self.dtype)
                continue
            self.names[fqn] = names = self._find(source)
            want = self.spec.hf_shape(fqn, shape)
            for name in names:
                entry = self.where_hf[name][1]
                if want != entry["shape"]:
                    raise ConvertError(f"{path}: tensor '{name}' (meshpar '{fqn}') has shape {entry['shape']}, but "
                                       f"config.json's model needs {want}; the weights do not match config.json")
                if entry["dtype"] != self.where_hf[names[0]][1]["dtype"]:
                    raise ConvertError(f"{path}: tensor '{name}' is {entry['dtype']} but '{names[0]}' is "
                                       f"{self.where_hf[names[0]][1]['dtype']}; the experts of '{fqn}' are stacked "
                                       "into one tensor, so they need one dtype: re-save the folder in one dtype")
            self.tensors["model." + fqn] = (shape, TORCH_DTYPES[self.where_hf[names[0]][1]["dtype"]])
        self._check_unused()
        self.info = {"format": 1, "step": 0, "family": family, "size": self.spec.size_name,
                     "model_args": dataclasses.asdict(self.spec.args), "layout": parse_layout(None), "world_size": 1,
                     "saved_at": _now()}

    def _files(self) -> list[Path]:
        return safetensors_files(self.path)

    def _skip(self, skipped: Mapping[str, str]) -> str:
        """Drop the tensors ``skipped`` ({pattern: what they are}) matches from ``where_hf``; a line saying so."""
        said = []
        for pattern, what in skipped.items():
            names = [n for n in self.where_hf if re.fullmatch(pattern, n)]
            for name in names:
                del self.where_hf[name]
            if names:
                said.append(f"{len(names)} tensors, {what}")
        return f"meshpar: {self.path}: skipped {'; '.join(said)}" if said else ""

    def _present(self, name: str) -> str | None:
        """The folder's name for Hugging Face tensor ``name`` (it may lack the adapter's ``HF_PREFIX``), or None."""
        prefix = getattr(self.spec.adapter, "HF_PREFIX", "")
        return next((c for c in (name, name.removeprefix(prefix)) if c in self.where_hf), None)

    def _find(self, fqn: str) -> list[str]:
        found = []
        for name in self.spec.hf_names(fqn):
            hit = self._present(name)
            if hit is None:
                raise self._missing(fqn, name)
            found.append(hit)
        return found

    def _sources(self, fqn: str, shape: torch.Size, sources: list[str], decode: Decode) -> list[str]:
        """The folder's names of the tensors ``fqn`` is decoded from, checked by decoding their first
        dim-0 rows on meta: ConvertError naming a source missing or one that does not decode to ``shape``
        ([Note: quantised tensors on import])."""
        names = [self._present(source) for source in sources]
        if None in names:
            missing = sources[names.index(None)]
            raise ConvertError(f"{self.path}: tensor '{missing}' is missing: meshpar '{fqn}' is stored quantised "
                               f"as {', '.join(sources)}, and the folder holds only some of them, so it is incomplete; "
                               "download its safetensors files again")
        entries = [self.where_hf[name][1] for name in names]
        stored = ", ".join(f"'{n}' {e['dtype']} {e['shape']}" for n, e in zip(names, entries, strict=True))
        if any(e["shape"][:1] != list(shape[:1]) for e in entries):
            raise ConvertError(f"{self.path}: meshpar '{fqn}' {list(shape)} is decoded row by row along dim 0 from "
                               f"{stored}, whose dim 0 differs: the weights do not match config.json")
        if self.dtype is None:
            raise ConvertError(f"{self.path / 'config.json'}: torch_dtype '{self.dtype_name}' is not a floating-point "
                               f"torch dtype, which meshpar '{fqn}', stored quantised, is decoded into; set it to "
                               "bfloat16 or float32")
        rows = [torch.empty([1, *e["shape"][1:]], dtype=TORCH_DTYPES[e["dtype"]], device="meta") for e in entries]
        try:
            got = list(decode(*rows, dtype=self.dtype).shape[1:])
        except (ValueError, RuntimeError, KeyError) as e:
            raise ConvertError(f"{self.path}: meshpar '{fqn}' cannot be decoded from {stored} ({e}); the weights do "
                               "not match config.json") from e
        if got != list(shape[1:]):
            raise ConvertError(f"{self.path}: meshpar '{fqn}' decoded from {stored} has shape "
                               f"{[shape[0], *got]}, but config.json's model needs {list(shape)}; the weights do not "
                               "match config.json")
        return names

    def _folder_experts(self) -> int:
        """How many experts per layer the folder's tensor names hold (0 for a dense model)."""
        return 1 + max((j for n in self.where_hf if (j := self.spec.expert_of(n)) is not None), default=-1)

    def _check_expert_count(self) -> None:
        """ConvertError naming a tensor when the folder holds another number of experts than config.json says."""
        have, want = self._folder_experts(), getattr(self.spec.args, "n_experts", 0)
        if not have or have == want:
            return
        fqn = next(f for f in self.spec.shapes if self.spec.stacked(f))  # the first sparse layer's w1
        name = self.spec.hf_names(fqn, max(have, want))[min(have, want)]  # its first expert too many or too few
        what = f"tensor '{name}' has no place" if have > want else f"tensor '{name}' is missing"
        key = self.spec.adapter.EXPERTS_KEY
        raise ConvertError(f"{self.path}: config.json says {key} = {want} but the folder holds {have} experts per "
                           f"layer ({what}); set {key} = {have} in config.json, or use the config.json these weights "
                           "came with")

    def _missing(self, fqn: str, name: str) -> ConvertError:
        j = self.spec.expert_of(name)
        if j is None:
            return ConvertError(f"{self.path}: tensor '{name}' (meshpar '{fqn}') is missing; config.json describes "
                                f"a {self.spec.family} model that has it, so the folder is incomplete or config.json "
                                "belongs to another model")
        n = self.spec.args.n_experts
        return ConvertError(f"{self.path}: tensor '{name}' (expert {j} of meshpar '{fqn}') is missing, though the "
                            f"folder holds {n} experts per layer elsewhere, as config.json says: the folder is "
                            "incomplete; download its safetensors files again")

    def _check_unused(self) -> None:
        used = {name for names in self.names.values() for name in names}
        ignored = re.compile("^(" + "|".join(self.spec.adapter.IGNORED_HF) + ")$")
        extra = sorted(n for n in self.where_hf if n not in used and not ignored.match(n))
        if extra:
            raise ConvertError(f"{self.path}: tensors {', '.join(extra[:5])} have no place in the {self.spec.family} "
                               "model config.json describes; check config.json (attention_bias, num_hidden_layers)")

    def where(self, key: str) -> str:
        return ", ".join(sorted({self.where_hf[n][0].name for n in self.names[key.removeprefix("model.")]}))

    def _read_into(self, name: str, t: Tensor, row: int = 0) -> None:
        """Tensor ``name``'s bytes into ``t``: the whole of it, or its dim-0 rows from ``row`` on."""
        file, entry, start = self.where_hf[name]
        begin, end = entry["data_offsets"]
        if row:
            begin += row * (end - begin) // entry["shape"][0]
        with open(file, "rb") as f:
            f.seek(start + begin)
            if f.readinto(_bytes_view(t)) != t.nbytes:
                raise ConvertError(f"{file}: ends inside tensor '{name}'; the file is truncated, download it again")

    def _rows(self, name: str, start: int, stop: int) -> Tensor:
        """Rows ``start:stop`` (dim 0) of the folder's tensor ``name``, read alone."""
        entry = self.where_hf[name][1]
        t = torch.empty([stop - start, *entry["shape"][1:]], dtype=TORCH_DTYPES[entry["dtype"]])
        self._read_into(name, t, start)
        return t

    def read(self, key: str) -> Tensor:
        fqn = key.removeprefix("model.")
        names = self.names[fqn]
        if fqn in self.quantized:  # [Note: quantised tensors on import]: one row (expert) decoded at a time
            shape, dtype = self.tensors[key]
            t = torch.empty(shape, dtype=dtype)
            for j in range(shape[0]):
                t[j:j + 1] = self.quantized[fqn](*(self._rows(name, j, j + 1) for name in names), dtype=dtype)
            return t
        if self.spec.stacked(fqn):  # [Note: stacked experts]: expert j's bytes straight into t[j]
            shape, dtype = self.tensors[key]
            t = torch.empty(shape, dtype=dtype)
            for j, name in enumerate(names):
                self._read_into(name, t[j])
            return t
        _, entry, _ = self.where_hf[names[0]]
        t = torch.empty(entry["shape"], dtype=TORCH_DTYPES[entry["dtype"]])
        self._read_into(names[0], t)
        return t.t().contiguous() if self.spec.transposed(fqn) else t


class HFSink:
    """Writes sharded safetensors files header first, then each tensor's bytes as it arrives
    ([Note: streaming conversion]), then model.safetensors.index.json, config.json and the
    tokenizer of folder ``tokenizer`` (a checkpoint's, or a Hugging Face folder's), if it has one:
    ``note`` says so when it has none. A stacked expert tensor is written as its experts' entries,
    adjacent in one shard ([Note: stacked experts]). Every tensor is written plain, under its own
    Hugging Face name and in the dtype it has: a parameter the adapter's ``QUANTIZED`` lets a folder
    store quantised (gpt-oss's MXFP4 experts) is not quantised again ([Note: quantised tensors on import])."""

    takes_bytes = False

    def __init__(self, path: Path, spec: ModelSpec, shard_size: int, tokenizer: Path | None = None) -> None:
        refusal = getattr(spec.adapter, "hf_export_error", lambda args: None)(spec.args)
        if refusal:
            raise ConvertError(f"{path}: cannot write a Hugging Face folder: {refusal}")
        _fresh(path)
        path.mkdir(parents=True, exist_ok=True)
        self.path, self.spec, self.shard_size, self.tokenizer = path, spec, shard_size, tokenizer
        self.file: Any = None
        self.note = ""

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
                names = self.spec.hf_names(key[6:])
                nbytes = math.prod(shape) * dtype.itemsize // len(names)  # each expert's, where stacked
                for hf in names:
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
        fsync(*(self.path / name for name in set(self.weight_map.values())))
        index = {"metadata": {"total_size": self.total}, "weight_map": self.weight_map}
        (self.path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        config = self.spec.adapter.hf_config(self.spec.family, self.spec.args, self.dtype)
        (self.path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if self.tokenizer is None or not copy_tokenizer(self.tokenizer, self.path, self.spec.args.max_seq_len):
            where = f"{self.tokenizer} has no tokenizer.json" if self.tokenizer else "a torch file holds no tokenizer"
            self.note = (f"meshpar convert: no tokenizer written: {where} (runs with data.tokenizer = 'byte' or "
                         f"token files have none, nor do checkpoints from before meshpar kept tokenizers); to use "
                         f"the model with one, copy the tokenizer.json and tokenizer_config.json it was trained "
                         f"with into {self.path}")
