"""Checkpoints: sharded save / resume / reshard through DCP, the file layer under it, and the
crash-safe writes every durable file of meshpar goes through.

Reading order: ``checkpointer.py`` (what a checkpoint holds, save, load, ``latest``;
[Note: a checkpoint is complete or invisible]) -> ``format.py`` (the DCP file layer: per-chunk
CRCs, fused projections stored as chunks) -> ``atomic.py`` (fsync-and-rename; [Note: fsync,
then rename, then fsync the folder]). Offline conversion between layouts and formats is
meshpar/convert/.
"""

from meshpar.checkpoint.checkpointer import (
    FORMAT,
    MARKER,
    Checkpointer,
    RunState,
    is_complete,
    latest,
    list_checkpoints,
    optimizer_state,
    param_names,
    read_info,
)
from meshpar.checkpoint.format import CheckpointError, _Writer  # noqa: F401 - _Writer: tests patch it

__all__ = ["FORMAT", "MARKER", "CheckpointError", "Checkpointer", "RunState", "is_complete", "latest",
           "list_checkpoints", "optimizer_state", "param_names", "read_info"]
