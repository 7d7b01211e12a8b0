"""Finding checkpoints on disk: the ``step_<N>`` folders under a checkpoint dir, which of them
are complete, the newest complete one, and what its ``meshpar.json`` records.

A folder is complete when it has both ``meshpar.json`` (written last) and DCP's ``.metadata``;
a save that did not finish leaves none, or only a ``.step_<N>.partial/`` folder, which nothing
here looks at ([Note: a checkpoint is complete or invisible] in meshpar/checkpoint/publish.py,
which makes them).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from meshpar.checkpoint.format import CheckpointError

MARKER = "meshpar.json"  # written last: its presence means complete
_STEP_DIR = re.compile(r"^step_(\d+)$")


def is_complete(path: Path) -> bool:
    return (path / MARKER).is_file() and (path / ".metadata").is_file()


def list_checkpoints(root: str | os.PathLike) -> list[tuple[int, Path, bool]]:
    """``(step, folder, complete)`` for every ``step_<N>`` folder under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        m = _STEP_DIR.match(child.name)
        if m and child.is_dir():
            found.append((int(m.group(1)), child, is_complete(child)))
    return sorted(found)


def latest(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under ``root``, or None."""
    complete = [path for _, path, ok in list_checkpoints(root) if ok]
    return complete[-1] if complete else None


def read_info(path: str | os.PathLike) -> dict[str, Any]:
    """``meshpar.json`` of a checkpoint folder."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path}: no such folder")
    if not is_complete(path):
        missing = [name for name in (MARKER, ".metadata") if not (path / name).is_file()]
        raise CheckpointError(f"checkpoint {path} is incomplete (no {' or '.join(missing)}): its save did not "
                              f"finish; load an earlier step_<N> folder")
    return json.loads((path / MARKER).read_text())
