"""Numerically honest parity (STYLE #13): float64, tight tolerances, and proof that they bite.

[Note: parity in float64]
A parallel layout adds the same numbers in another order than the single-process reference,
and so does another CPU kernel path (AVX-512, AVX2 or the scalar ``default``, chosen with
ATEN_CPU_CAPABILITY). In float32 that is ~1e-7 relative, and AdamW divides each gradient
element by the root of its own second moment (eps 1e-8): on elements whose gradient is near
zero, rounding noise becomes an update of order lr. After a few steps fp32 parameters then
differ by 1e-5 between machines, so a fp32 tolerance is either loose or flaky. In float64
the same noise is ~1e-16 relative and AdamW's eps bounds its amplification: an update moves
by at most lr * |dg| / eps ~ 1e-3 * 1e-16 / 1e-8 = 1e-11 per step (|dg|: 1e-16 of a
gradient of scale <= 1). So parity runs in float64
with ``TOL`` = 1e-9 on losses, gradients and parameters, which holds on any CPU, while a real
bug (a missing divide by the data-parallel size, one rank's gradient doubled) moves a
parameter by 1e-7 .. 1e-3 and fails it: each parity file keeps one test that plants such a
bug and asserts that its comparison raises (``must_fail``).

Where a test must run in float32 or bf16 (mixed precision, ``meshpar train`` launched as a
command), its tolerance is derived in a comment next to it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

TOL = 1e-9  # see [Note: parity in float64]
PARITY_DTYPE = torch.float64


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype = PARITY_DTYPE) -> Iterator[None]:
    """New floating-point tensors and modules in ``dtype`` inside the block (or a decorated
    function); the previous default is restored after, so one test does not leak it to the next."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def in_float64(fn: Callable, *args: object) -> object:
    """``fn(*args)`` with float64 as the default dtype; for a spawned rank:
    ``run_distributed(in_float64, world, train_on_rank, recipe)``."""
    with default_dtype():
        return fn(*args)


def upcast(x: torch.Tensor) -> torch.Tensor:
    """Logits for a loss in at least float32: bf16 goes up, a float64 model stays float64."""
    return x if x.dtype == torch.float64 else x.float()


def must_fail(check: Callable[[], object], bug: str) -> str:
    """``check()`` is a parity comparison run on a deliberately wrong result: it must raise an
    AssertionError, else the comparison could not tell ``bug`` from rounding. Returns the message."""
    try:
        check()
    except AssertionError as e:
        return str(e)
    raise AssertionError(f"the parity comparison passed with a planted bug ({bug}): its tolerance is too loose")
