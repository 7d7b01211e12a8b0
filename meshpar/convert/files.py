"""File helpers shared by the sources and sinks: JSON, fresh destinations, fsync, timestamps,
raw tensor bytes, and the ``step_*`` folders of a checkpoint directory."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from meshpar.convert.spec import ConvertError


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConvertError(f"{path}: cannot read it ({e}); the file is truncated or not JSON") from e


def _fresh(path: Path) -> None:
    """Refuse to write into an existing file or non-empty folder: mixing outputs corrupts both."""
    if path.exists() and (path.is_file() or any(path.iterdir())):
        raise ConvertError(f"{path}: already exists; remove it or choose another destination")


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _bytes_view(t: Tensor) -> memoryview:
    """The raw little-endian bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def _steps(path: Path) -> list[Path]:
    found = [p for p in path.glob("step_*") if p.is_dir() and p.name[5:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[5:]))


def _complete(path: Path) -> bool:
    return (path / ".metadata").exists() and (path / "meshpar.json").exists()
