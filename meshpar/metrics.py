"""Training metrics: one readable line and one ``metrics.jsonl`` record per log step, MFU, memory,
and a progress bar on rank 0 (``Progress``, also ``meshpar convert``'s).

[Note: MFU]
MFU = achieved model FLOP/s / (peak FLOP/s per device x devices). Model FLOPs per token
come from the model's args (6 x matmul parameters + attention), so recomputation under
activation checkpointing does not count as useful work. On CPU the local ranks share one
host's cores, so ``devices`` is the number of hosts; on GPUs it is the world size.

[Note: progress bars in terminals and log files]
What a user sees: on a terminal, a live bar with the ETA under the log lines; in a log file
(stdout and stderr redirected, as under SLURM, read with ``tail -f``), the log lines only.
``metrics.progress = "auto"`` turns the bar on when stderr is a terminal. The bar is tqdm's,
chosen over rich's by running both on a 100-step loop (tqdm 4.70, rich 15.0):
  terminal       both draw a live bar under the log lines.
  file           tqdm, if not disabled, writes a carriage-return frame per update into the
                 file (1.8 KB per 100 steps); rich draws nothing live and writes its bar once,
                 at the end. Disabled ("auto" off a terminal), both leave the log lines alone.
  `> train.log`  stdout a file, stderr a terminal: ``tqdm.write`` lifts the bar, writes the
                 line to the file and redraws the bar; rich's Live redirects stdout into its
                 console, so the log file stayed empty (0 bytes) and the lines went to stderr.
rich also reads ``[...]`` in a line as markup and wraps lines at the terminal's width; tqdm
writes lines as they are, and has no dependencies.
"""

from __future__ import annotations

import json
import resource
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import torch
from tqdm import tqdm


def peak_memory_gb(device: torch.device) -> float:
    """Peak memory of this rank: allocator peak on CUDA, the process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # Linux reports KiB


class Progress:
    """A live progress bar on ``stream`` (tqdm's) under the log lines ``print`` writes to stdout:
    [Note: progress bars in terminals and log files]. Disabled, it draws nothing and ``print``
    is a plain print. ``unit="B"`` counts bytes (1000-based prefixes)."""

    def __init__(self, total: int, enabled: bool, *, initial: int = 0, unit: str = "step",
                 stream: TextIO | None = None):
        self.done = initial
        self._bar = tqdm(total=total, initial=initial, unit=unit, unit_scale=unit == "B", disable=not enabled,
                         file=stream if stream is not None else sys.stderr, dynamic_ncols=True)

    def update(self, done: int) -> None:
        """``done`` steps (or bytes) of ``total`` are done."""
        self._bar.update(done - self.done)
        self.done = done

    def postfix(self, **values) -> None:
        """Figures shown after the bar (``tokens=1234``), drawn with its next update."""
        self._bar.set_postfix(values, refresh=False)

    def print(self, line: str) -> None:
        print_line(line)

    def close(self) -> None:
        self._bar.close()


def print_line(line: str) -> None:
    """``line`` on stdout, above any live progress bar (lifted and redrawn when both share a terminal)."""
    with tqdm.external_write_mode():
        print(line, flush=True)


class MetricsLogger:
    """Writes ``<output_dir>/metrics.jsonl`` (and TensorBoard event files under
    ``<output_dir>/tensorboard`` when asked) and the log lines; only rank 0 writes anything.

    A run resumed from a checkpoint at step ``start_step`` keeps the records up to that step
    and drops the later ones (written after the checkpoint, by the run that crashed), so the
    file reads as one run; a fresh run (``start_step`` 0) starts a new file.
    """

    def __init__(self, output_dir: Path, *, enabled: bool, progress: Progress, start_step: int = 0,
                 tensorboard: bool = False):
        self.enabled, self.progress = enabled, progress
        self.path = output_dir / "metrics.jsonl"
        self._tb = None
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
        self.progress.print(format_record(record))

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def expert_load_fields(layers: Sequence[int], load: torch.Tensor, *, dropped: bool) -> dict[str, Any]:
    """metrics.jsonl's expert-load fields ([Note: expert load] in meshpar/step.py) from
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
    aux = f" | aux_loss {r['aux_loss']:.4f}" if "aux_loss" in r else ""
    return (f"step {r['step']:>6} | loss {r['loss']:.4f}{aux} | grad_norm {r['grad_norm']:.3f} | lr {r['lr']:.2e} | "
            f"{r['tokens_per_s']:,.0f} tok/s | mfu {100 * r['mfu']:.2f}% | mem {r['mem_gb']:.2f} GB"
            f"{_expert_summary(r)}")
