"""``convert`` and ``verify``: a source read one tensor at a time into a sink written one tensor
at a time ([Note: streaming conversion]), checksummed; ``open_checkpoint`` recognizes the source."""

from __future__ import annotations

import hashlib
import math
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from torch import Tensor

from meshpar.convert.dcp import DCPSink, DCPSource
from meshpar.convert.files import _bytes_view, _complete, _steps
from meshpar.convert.hf import HFSink, HFSource
from meshpar.convert.layout import parse_layout
from meshpar.convert.progress import _human, _PeakMemory
from meshpar.convert.spec import ConvertError, check_model_tensors
from meshpar.convert.torch_file import TorchSink, TorchSource
from meshpar.runtime.progress import Progress

TARGETS = ("hf", "torch", "dcp")

# [Note: streaming conversion]
# A 70B checkpoint must convert on a host with far less RAM than the model, so nothing holds
# more than one tensor (a meshpar tensor: stacked experts count as one, [Note: stacked experts]).
# Reading: DCP's FileSystemReader is driven directly with one LoadPlan per tensor (its metadata
# read once), and it reads only that tensor's chunks: each chunk is torch.load-ed alone and
# copied into the destination, so a read costs the tensor plus its largest chunk. Hugging Face
# files are read with readinto() straight into the tensor.
# Writing: safetensors headers need every name, dtype and shape up front, and DCP's metadata
# has them all, so each shard's header is written first and the tensors' bytes follow as they
# come. DCP output is written item by item in DCP's own format (torch.save per chunk,
# appended to __<rank>_0.distcp, offsets recorded in .metadata by FileSystemWriter.finish),
# not through dcp.save, whose writer keeps every tensor of a file referenced until that file
# is closed. So the peak above the start is about the largest tensor plus one chunk in every
# direction but DCP -> torch, which holds the model (tests/test_convert.py asserts <= 2.5x the
# largest tensor + 64 MB; measured: docs/performance.md#checkpoints-and-conversion).


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
    note: str = ""  # a line on what was not converted (no tokenizer for a Hugging Face folder)

    def __str__(self) -> str:
        rate = self.bytes / max(self.seconds, 1e-9)
        return (f"meshpar convert: {self.tensors} tensors, {_human(self.bytes)} in {self.seconds:.2f} s "
                f"({_human(rate)}/s), peak memory +{_human(self.peak_bytes)} (largest tensor "
                f"{_human(self.largest_tensor_bytes)}){', verified' if self.verified else ''} -> {self.dst}"
                + (f"\n{self.note}" if self.note else ""))


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

    - ``"hf"``: sharded safetensors (``shard_size`` bytes per file at most), the index, config.json
      and the checkpoint's tokenizer (tokenizer.json, tokenizer_config.json), where it has one;
    - ``"torch"``: one torch.save file of ``{fqn: tensor}`` plus ``<name>.meshpar.json`` (with
      ``model_only=False``: every checkpoint key, non-tensor entries as DCP's bytes). It holds the
      whole output in memory;
    - ``"dcp"``: a meshpar checkpoint folder chunked for ``layout`` (degrees by dim name,
      default: the source's), optimizer state, non-tensor entries, recipe and tokenizer included.

    One tensor at a time ([Note: streaming conversion]); ``verify`` reloads the output and
    compares checksums. Prints a progress bar (stderr, on a terminal) and the summary line
    when ``progress``.
    """
    if to not in TARGETS:
        raise ConvertError(f"to = '{to}': choose one of {', '.join(TARGETS)}")
    source, dst = open_checkpoint(src), Path(dst)
    found = {k[6:]: shape for k, (shape, _) in source.tensors.items() if k.startswith("model.")}
    check_model_tensors(source.spec, found, str(source.path))
    folder = None if isinstance(source, TorchSource) else source.path  # where a tokenizer may lie
    if to == "hf":
        sink: DCPSink | HFSink | TorchSink = HFSink(dst, source.spec, shard_size, folder)
    elif to == "torch":
        sink = TorchSink(dst, source.info, model_only)
    else:
        sink = DCPSink(dst, source.info, source.spec, parse_layout(layout or source.info.get("layout")),
                       source.path / "recipe.toml" if isinstance(source, DCPSource) else None, folder)
    memory, start = _PeakMemory(), time.perf_counter()
    keys = sink.select(source.tensors)
    sizes = {k: math.prod(source.tensors[k][0]) * source.tensors[k][1].itemsize for k in keys}
    bar = Progress(sum(sizes.values()), enabled=progress and sys.stderr.isatty(), unit="B")
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
                      max(sizes.values(), default=0), memory.method, verify,
                      "\n".join(n for n in (getattr(source, "note", ""), getattr(sink, "note", "")) if n))
    if verify:
        _check(expected, open_checkpoint(dst), blobs)
    if progress:
        print(summary)
    return summary
