"""Checkpoints: sharded save / resume / reshard through DCP, and the file layer under it.

Reading order: ``checkpointer.py`` (what a checkpoint holds, save, load) -> ``publish.py`` (a
save made visible at once: [Note: a checkpoint is complete or invisible]) -> ``folders.py`` (the
``step_<N>`` folders: which are complete, ``latest``, ``meshpar.json``) -> ``state.py`` (a run's tensors by global name:
parameters, optimizer state, generator state) -> ``format.py`` (the DCP file layer: per-chunk
CRCs, fused projections stored as chunks). Every file goes through meshpar/runtime/atomic.py's
crash-safe writes. Offline conversion between layouts and formats is meshpar/convert/.
"""

from meshpar.checkpoint.checkpointer import FORMAT, Checkpointer, RunState
from meshpar.checkpoint.folders import MARKER, is_complete, latest, list_checkpoints, read_info
from meshpar.checkpoint.format import CheckpointError, _Writer  # noqa: F401 - _Writer: tests patch it
from meshpar.checkpoint.state import optimizer_state, param_names

__all__ = ["FORMAT", "MARKER", "CheckpointError", "Checkpointer", "RunState", "is_complete", "latest",
           "list_checkpoints", "optimizer_state", "param_names", "read_info"]
