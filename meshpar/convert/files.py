"""File helpers shared by the sources and sinks: JSON, fresh destinations, fsync, timestamps,
raw tensor bytes, the ``step_*`` folders of a checkpoint directory, and the tokenizer files that
travel with a model."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from meshpar.checkpoint.checkpointer import TOKENIZER_FILES as CHECKPOINT_TOKENIZER_FILES
from meshpar.convert.spec import ConvertError
from meshpar.runtime.atomic import write_atomic

# what a checkpoint holds (meshpar/checkpoint/checkpointer.py), and what a Hugging Face folder may add
TOKENIZER_FILES = (*CHECKPOINT_TOKENIZER_FILES, "special_tokens_map.json")


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


def copy_tokenizer(src: Path, dst: Path, model_max_length: int | None = None) -> bool:
    """Copy the tokenizer of folder ``src`` (tokenizer.json and, where present, tokenizer_config.json
    and special_tokens_map.json) into ``dst``; False, copying nothing, when ``src`` has no tokenizer.json.
    ``model_max_length``: the output is a Hugging Face folder, whose tokenizer_config.json is always
    written, with the model's context length (and PreTrainedTokenizerFast where it names no class)."""
    if not (src / "tokenizer.json").is_file():
        return False
    for name in TOKENIZER_FILES:
        if (src / name).is_file() and not (name == "tokenizer_config.json" and model_max_length is not None):
            write_atomic(dst / name, (src / name).read_bytes())
    if model_max_length is not None:
        config = _read_json(src / "tokenizer_config.json") if (src / "tokenizer_config.json").is_file() else {}
        config = {"tokenizer_class": "PreTrainedTokenizerFast", **config, "model_max_length": model_max_length}
        write_atomic(dst / "tokenizer_config.json", json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return True
