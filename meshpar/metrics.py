"""Training metrics: one readable line and one ``metrics.jsonl`` record per log step, MFU, memory,
and a progress bar on rank 0.

[Note: MFU]
MFU = achieved model FLOP/s / (peak FLOP/s per device x devices). Model FLOPs per token
come from the model's args (6 x matmul parameters + attention), so recomputation under
activation checkpointing does not count as useful work. On CPU the local ranks share one
host's cores, so ``devices`` is the number of hosts; on GPUs it is the world size.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import torch


def peak_memory_gb(device: torch.device) -> float:
    """Peak memory of this rank: allocator peak on CUDA, the process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # Linux reports KiB


class Progress:
    """A one-line progress bar redrawn in place; log lines are printed above it."""

    def __init__(self, total: int, enabled: bool, stream: TextIO = sys.stderr, width: int = 30):
        self.total, self.enabled, self.stream, self.width = total, enabled, stream, width
        self.start = time.perf_counter()
        self.done = 0

    def update(self, done: int) -> None:
        self.done = done
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.start
        eta = elapsed / max(done, 1) * (self.total - done)
        filled = self.width * done // self.total
        bar = "#" * filled + "." * (self.width - filled)
        self.stream.write(f"\r\033[K[{bar}] {done}/{self.total} steps  {elapsed:,.0f}s elapsed  eta {eta:,.0f}s")
        self.stream.flush()

    def print(self, line: str) -> None:
        if self.enabled:
            self.stream.write("\r\033[K")
        print(line, flush=True)
        self.update(self.done)

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()


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


def format_record(r: dict[str, Any]) -> str:
    if "val_loss" in r:
        return f"step {r['step']:>6} | val_loss {r['val_loss']:.4f}"
    return (f"step {r['step']:>6} | loss {r['loss']:.4f} | grad_norm {r['grad_norm']:.3f} | lr {r['lr']:.2e} | "
            f"{r['tokens_per_s']:,.0f} tok/s | mfu {100 * r['mfu']:.2f}% | mem {r['mem_gb']:.2f} GB")
