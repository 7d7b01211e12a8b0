"""The Weights & Biases sink of ``metrics.wandb``: what metrics.jsonl records, logged to one W&B run.

[Note: one W&B run per training run]
Rank 0 opens the run with the resolved recipe as its config and logs each metrics.jsonl record at
its step. The run's id is kept in ``<output_dir>/wandb_run_id``: a run resumed from a checkpoint
reopens the same W&B run (``resume="allow"``), so a preempted job's steps land in one history. The
steps a crashed run logged after its last checkpoint are logged again by the resumed one with the
same values (a resumed run repeats them bit for bit); W&B keeps a step's first record. W&B's console
capture is off: meshpar's own lines and progress bar stay as they are.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

from meshpar.config.keys import MetricsConfig

ID_FILE = "wandb_run_id"


class WandbSink:
    def __init__(self, cfg: MetricsConfig, output_dir: Path, config: dict[str, Any], *, resumed: bool) -> None:
        import wandb  # an optional extra: checked before launch (meshpar/config/recipe.py)

        id_file = output_dir / ID_FILE
        run_id = id_file.read_text().strip() if resumed and id_file.is_file() else None
        run_id = run_id or secrets.token_hex(8)  # W&B takes any id of letters and digits
        id_file.write_text(run_id + "\n")
        self.run = wandb.init(project=cfg.wandb_project, entity=cfg.wandb_entity or None,
                              name=cfg.wandb_name or output_dir.resolve().name, mode=cfg.wandb_mode,
                              dir=str(output_dir), config=config, id=run_id, resume="allow",
                              settings=wandb.Settings(console="off"))

    def log(self, record: dict[str, Any]) -> None:
        """A metrics.jsonl record at its step: its numbers, validation figures under ``val/``, the rest
        under ``train/`` (the names of the TensorBoard sink); per-layer lists are left to metrics.jsonl."""
        values = {f"{'val' if key.startswith('val_') else 'train'}/{key}": value for key, value in record.items()
                  if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)}
        self.run.log(values, step=record["step"])

    def close(self) -> None:
        self.run.finish()
