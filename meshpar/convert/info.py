"""``meshpar checkpoint info``: a checkpoint's step, layout, completeness and every tensor."""

from __future__ import annotations

import math
import os
from pathlib import Path

from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from meshpar.checkpoint.format import SafeReader
from meshpar.convert.files import _complete, _read_json, _steps
from meshpar.convert.progress import _human
from meshpar.convert.spec import ConvertError


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
        md = SafeReader(path).read_metadata().state_dict_metadata
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
