"""One matrix multiply per expert over tokens sorted by expert: ``grouped_mm(x, w, counts)``.

    x[S, D] (S token slots, sorted so expert e's rows are a contiguous run of counts[e])
    w[E, D, N] -> out[S, N]: rows of run e are x_run @ w[e]

Two kernels, the same result:
  "grouped"  ``torch.nn.functional.grouped_mm`` (public in torch 2.13, over the private
             ``torch._grouped_mm``): one launch for every expert. It runs on CUDA (sm80+) in bf16,
             and on CPU in bf16 / fp16 / fp32; rows and columns must be 16-byte aligned.
  "loop"     a Python loop of matmuls, one per expert: any dtype and device (float64 parity tests,
             fake tensors, fp32 on CUDA, where the kernel refuses).
The two give the same numbers bit for bit; the loop is slower on CPU and GPU
(tests/benchmarks/bench_grouped_mm.py; docs/performance.md#grouped-expert-matmuls).
``kernel="auto"`` picks "grouped" where it runs (``grouped_mm_supported``), else "loop".

Limits: ``counts`` is read on the host by the loop (a device sync on CUDA); the grouped kernel
takes cumulative int32 offsets and needs no sync.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

Kernel = Literal["auto", "grouped", "loop"]


def grouped_mm_supported(x: Tensor, w: Tensor) -> bool:
    """Whether the grouped kernel runs for x[S, D] @ w[E, D, N] here (see the module docstring).

    Meta and fake tensors take the loop: the kernel's meta function accepts bf16 only, and the
    planner's simulation must not depend on it."""
    if not hasattr(F, "grouped_mm") or x.dtype != w.dtype or x.device.type not in ("cpu", "cuda"):
        return False
    if any(type(t) not in (Tensor, torch.nn.Parameter) for t in (x, w)):
        return False  # fake tensors, DTensors and other subclasses
    if torch.compiler.is_compiling() and x.dtype != torch.bfloat16:
        return False  # dynamo traces on fake tensors, and the kernel's meta function takes bf16 only
    aligned = all(s * x.element_size() % 16 == 0 for s in (x.shape[-1], w.shape[-1]))
    if x.device.type == "cuda":
        return aligned and x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (8, 0)
    return aligned and x.dtype in (torch.bfloat16, torch.float16, torch.float32)


def grouped_mm(x: Tensor, w: Tensor, counts: Tensor, kernel: Kernel = "auto") -> Tensor:
    """x[S, D] @ w[E, D, N] per expert run -> [S, N]; ``counts[E]`` (int) sums to S."""
    if kernel == "grouped" or (kernel == "auto" and grouped_mm_supported(x, w)):
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)  # end row of each expert's run
        return F.grouped_mm(x, w, offs=offsets)
    runs = x.split(counts.tolist())
    # unbind, not w[e]: its backward stacks the E slices once, where each w[e]'s would write a zeroed
    # copy of all of w (E^2 x the weights' memory traffic)
    if not runs:
        return x.new_empty(0, w.shape[-1])
    return torch.cat([run @ we for we, run in zip(w.unbind(0), runs, strict=True)])
