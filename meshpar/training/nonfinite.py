"""``train.on_nonfinite``: what a step does when its gradients are not finite.

[Note: non-finite steps]
A bad batch, an overflow or a broken kernel makes a loss or a gradient NaN or infinite; an
AdamW step on it writes NaN into the moments and every later step trains on garbage. The
global gradient norm that clipping computes is non-finite when any gradient is (a non-finite
loss makes non-finite gradients, so the loss needs no check of its own), and clipping then
leaves the gradients unscaled (meshpar/distributed/clip.py). The norm is not quite the same number on
every rank: a gradient replicated over tp is counted from each rank's own copy, and a NaN in
one copy reaches only the ranks that sum it. So the ranks agree first, with one all-reduce
(MAX) of one flag over every rank on the CPU group, after one host read of the norm, small
next to a step (docs/performance.md#faults-and-preemption).

- ``stop``: every rank raises ``NonFiniteError`` before the optimizer steps, so neither the
  parameters, the optimizer state nor any checkpoint ever holds the bad step. The message
  names the step and the first parameter with a non-finite gradient on each rank that has
  one (one ``all_gather_object`` when it fires, none otherwise).
- ``skip``: gradients are dropped, the optimizer and the LR schedule do not step (the step's
  data is consumed), metrics.jsonl gets ``{"step": N, "skipped": "non-finite gradient"}``,
  and ``train.max_skips`` consecutive skips stop the run as ``stop`` would. The count of
  consecutive skips restarts after a resume.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from meshpar.distributed import comm


class NonFiniteError(RuntimeError):
    """The run stopped on a non-finite gradient (``train.on_nonfinite``); nothing bad was saved."""


def first_nonfinite_grads(stages: nn.ModuleList) -> list[str | None]:
    """Per rank, the name of its first parameter whose gradient (its local shard) holds a NaN or
    an infinity, or None. Collective over every rank."""
    mine = None
    for name, p in stages.named_parameters():
        g = p.grad
        if g is None:
            continue
        local = g.to_local() if isinstance(g, DTensor) else g
        if not bool(torch.isfinite(local).all()):
            mine = name
            break
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [mine]
    found: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(found, mine)
    return found


class NonFiniteGuard:
    """Decides, after clipping, whether a step's optimizer update happens; see [Note: non-finite steps]."""

    def __init__(self, mode: str, max_skips: int, stages: nn.ModuleList):
        if mode not in ("stop", "skip"):
            raise ValueError(f"on_nonfinite = {mode!r}: must be 'stop' or 'skip'")
        self.mode, self.max_skips, self.stages = mode, max_skips, stages
        self.step: int | None = None  # the training step being taken (set by the loop, for messages)
        self.consecutive = 0
        self.skipped: list[int] = []  # steps skipped in this process

    def allows_step(self, grad_norm: torch.Tensor) -> bool:
        """True: take the optimizer step. False: skip it (``skip``). Raises ``NonFiniteError`` (``stop``,
        or too many skips in a row). The same answer on every rank."""
        norm = float(grad_norm)
        if not comm.world_max(int(not math.isfinite(norm))):
            self.consecutive = 0
            return True
        culprits = first_nonfinite_grads(self.stages)
        where = "; ".join(f"{name} on rank {r}" for r, name in enumerate(culprits) if name is not None) or \
            "none of the gradients themselves (the norm overflowed)"
        what = f"step {self.step}: non-finite gradients (first: {where}; gradient norm on this rank {norm})"
        if self.mode == "stop":
            raise NonFiniteError(f"{what}; the optimizer did not step and no checkpoint of this state was written. "
                                 f"Resume from the last checkpoint (perhaps with a lower optim.lr), or set "
                                 f"train.on_nonfinite = \"skip\" to skip such steps")
        self.consecutive += 1
        self.skipped.append(self.step)
        if self.consecutive >= self.max_skips:
            raise NonFiniteError(f"{what}; {self.consecutive} steps in a row skipped (train.max_skips = "
                                 f"{self.max_skips}): the run is diverging; resume from a checkpoint before step "
                                 f"{self.step - self.consecutive + 1}")
        return False
