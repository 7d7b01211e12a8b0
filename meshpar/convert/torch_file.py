"""One ``torch.save`` file of ``{fqn: tensor}`` and its sidecar ``<name>.meshpar.json``: a source
loaded with mmap, and a sink that holds the whole output in memory for its one torch.save."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from meshpar.convert.files import _fresh, _read_json
from meshpar.convert.spec import ConvertError, spec_from_info
from meshpar.runtime.atomic import atomic_path


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
        with atomic_path(self.path) as tmp:
            torch.save(self.state, tmp)
        _sidecar(self.path).write_text(json.dumps(self.info, indent=2) + "\n")
