"""Training metrics: one readable line and one ``metrics.jsonl`` record per log step, MFU, memory;
the lines go above rank 0's progress bar (meshpar/runtime/progress.py).

[Note: MFU]
MFU = achieved model FLOP/s / (peak FLOP/s per device x devices). Model FLOPs per token
come from the model's args (6 x matmul parameters + attention), so recomputation under
activation checkpointing does not count as useful work. On CPU the local ranks share one
host's cores, so ``devices`` is the number of hosts; on GPUs it is the world size.
"""

from __future__ import annotations

import json
import resource
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from meshpar.runtime.progress import Progress


def peak_memory_gb(device: torch.device) -> float:
    """Peak memory of this rank: allocator peak on CUDA, the process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # Linux reports KiB


class MetricsLogger:
    """Writes ``<output_dir>/metrics.jsonl`` (and TensorBoard event files under
    ``<output_dir>/tensorboard``, and a W&B run, when asked) and the log lines; only rank 0 writes anything.

    A run resumed from a checkpoint at step ``start_step`` keeps the records up to that step
    and drops the later ones (written after the checkpoint, by the run that crashed), so the
    file reads as one run; a fresh run (``start_step`` 0) starts a new file.
    """

    def __init__(self, output_dir: Path, *, enabled: bool, progress: Progress, start_step: int = 0,
                 tensorboard: bool = False, wandb: Any = None):
        self.enabled, self.progress = enabled, progress
        self.path = output_dir / "metrics.jsonl"
        self._tb, self._wandb = None, wandb  # wandb: a WandbSink (meshpar/training/wandb_sink.py) or None
        if not enabled:
            return
        kept = []
        if start_step > 0 and self.path.is_file():
            for line in self.path.read_text().splitlines():
                try:
                    if json.loads(line).get("step", 0) <= start_step:
                        kept.append(line + "\n")
                except json.JSONDecodeError:  # a line cut short by the crash
                    pass
        self.path.write_text("".join(kept))
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

            self._tb = SummaryWriter(str(output_dir / "tensorboard"), purge_step=start_step + 1 if start_step else None)

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(f"{'val' if key.startswith('val_') else 'train'}/{key}", value, record["step"])
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(record)
        self.progress.print(format_record(record))

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.close()


def expert_load_fields(layers: Sequence[int], load: torch.Tensor, *, dropped: bool) -> dict[str, Any]:
    """metrics.jsonl's expert-load fields ([Note: expert load] in meshpar/training/step.py) from
    ``load[2, L, E]``: token slots routed to / dropped by each expert of each sparse layer, summed
    over the step's microbatches and the data-parallel ranks. ``layers``: the block index of each.
    One list per field, a value per layer; ``moe_dropped`` only when a capacity factor is set."""
    routed, over = load.tolist()  # one host copy, on a step that logs
    mean = sum(routed[0]) / len(routed[0])  # tokens x top_k / E: every layer routes every token
    peaks = [max(r) for r in routed]
    fields = {"moe_layers": list(layers), "moe_load_max": peaks, "moe_load_mean": mean,
              "moe_imbalance": [round(p / mean, 4) for p in peaks]}
    if dropped:
        fields["moe_dropped"] = [sum(d) for d in over]
    return fields


def _expert_summary(r: dict[str, Any]) -> str:
    """' | experts max/mean 1.46 (layer 3)[, 12 slots dropped]': the worst layer's imbalance and the
    dropped slots of all layers, for the progress line."""
    if "moe_imbalance" not in r:
        return ""
    worst = max(range(len(r["moe_layers"])), key=lambda i: r["moe_imbalance"][i])
    line = f" | experts max/mean {r['moe_imbalance'][worst]:.2f} (layer {r['moe_layers'][worst]})"
    if "moe_dropped" in r:  # over every sparse layer
        line += f", {sum(r['moe_dropped']):,} slots dropped"
    return line


def format_record(r: dict[str, Any]) -> str:
    if "val_loss" in r:
        return f"step {r['step']:>6} | val_loss {r['val_loss']:.4f}"
    if "skipped" in r:
        return f"step {r['step']:>6} | skipped: {r['skipped']}"
    if "healed" in r:  # fault.replicas = "torchft": this group received a live group's state
        return f"step {r['step']:>6} | healed {r['healed']}"
    aux = f" | aux_loss {r['aux_loss']:.4f}" if "aux_loss" in r else ""
    aux += f" | trained {100 * r['trained_frac']:.1f}%" if "trained_frac" in r else ""
    return (f"step {r['step']:>6} | loss {r['loss']:.4f}{aux} | grad_norm {r['grad_norm']:.3f} | lr {r['lr']:.2e} | "
            f"{r['tokens_per_s']:,.0f} tok/s | mfu {100 * r['mfu']:.2f}% | mem {r['mem_gb']:.2f} GB"
            f"{_expert_summary(r)}{' | replica groups ' + str(r['replica_groups']) if 'replica_groups' in r else ''}")
