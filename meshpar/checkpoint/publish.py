"""How a saved step becomes the checkpoint ``step_<N>``, all at once, and which older ones then go.

    writer = _Writer(partial, rank, publish=Publish(root, step, recipe_toml, tokenizer_files, info))
    prune(root, step, keep=3, protect=resume_folder)   # rank 0, once step_<step> exists

``Publish`` runs on rank 0 inside DCP's last step (checkpointer.py's save; in DCP's writer process
under ``checkpoint.async = "process"``, background.py); ``prune`` in the trainer after it.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from meshpar.checkpoint.folders import MARKER, list_checkpoints
from meshpar.runtime.atomic import fsync_dir, write_atomic

# [Note: a checkpoint is complete or invisible]
# Every rank writes into ``<dir>/.step_<N>.partial/``. DCP's last step runs on the coordinator
# (rank 0) only after every rank has reported its writes; there it writes ``.metadata``, then
# (``_Writer.publish``, a ``_Publish``: in rank 0's writer process under ``async = "process"``)
# ``recipe.toml``, the tokenizer files and ``meshpar.json``, and renames the folder to
# ``step_<N>`` (one ``os.replace``); DCP then tells every rank the outcome, so once ``save``
# (``wait``, when async) returns on any rank, ``step_<N>`` exists. An error on any rank or in
# any of these (a full disk, a folder gone read-only) fails the save on every rank with a
# CheckpointError naming the step, and rank 0 removes the ``.partial`` folder; a crash or kill
# leaves it, and no loader looks at it (the next run removes it). ``latest()`` (folders.py) takes the newest
# folder that has both ``meshpar.json`` and ``.metadata``. Older checkpoints are removed only
# after the rename ([Note: what checkpoint.keep deletes]), so the last good checkpoint is never
# at risk.

# [Note: what checkpoint.keep deletes]
# After publishing step N, rank 0 keeps the newest ``keep`` complete checkpoints with steps up
# to N and deletes the older ones, except the checkpoint a restart of this run would resume
# from (``resume_path()``: ``checkpoint.load_from``'s, else the newest in ``dir``): a run
# resumed from ``load_from = <dir>/step_4`` resumes from it again when restarted, so it stays.
# Checkpoints above N (an earlier, longer run's, in the same ``dir``) are neither deleted nor
# counted: this run did not write them and has nothing newer to replace them with.


@dataclasses.dataclass(frozen=True)
class Publish:
    """Rank 0, inside DCP's last step: make ``.step_<step>.partial`` the checkpoint ``step_<step>``
    ([Note: a checkpoint is complete or invisible]). Plain data, so that it runs as well in DCP's
    writer process ([Note: a save in another process] in background.py)."""

    root: Path
    step: int
    recipe_toml: str
    tokenizer_files: Mapping[str, bytes]
    info: dict[str, Any]  # meshpar.json, but for the time it is written

    def __call__(self) -> None:
        partial, final = self.root / f".step_{self.step}.partial", self.root / f"step_{self.step}"
        write_atomic(partial / "recipe.toml", self.recipe_toml)
        for name, data in self.tokenizer_files.items():
            write_atomic(partial / name, data)
        info = dict(self.info, saved_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
        write_atomic(partial / MARKER, json.dumps(info, indent=1))
        if final.exists():  # the same step saved again (a rerun): set the old one aside first
            old = self.root / f".step_{self.step}.replaced"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            try:
                os.replace(partial, final)
            except OSError:
                os.replace(old, final)  # the old one stays the checkpoint of this step
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(partial, final)
        fsync_dir(self.root)


def prune(root: Path, step: int, keep: int, protect: Path | None) -> None:
    """Delete the complete checkpoints in ``root`` older than the newest ``keep`` with steps up to
    ``step``, but never ``protect`` (resolved): [Note: what checkpoint.keep deletes]."""
    upto = [path for s, path, ok in list_checkpoints(root) if ok and s <= step]
    for path in upto[:-keep]:
        if path.resolve() != protect:
            shutil.rmtree(path, ignore_errors=True)
