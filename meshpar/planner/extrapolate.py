"""A stage of many alike blocks, simulated as two short stages and extrapolated exactly.

    head, period = pattern(blocks)                  # (0, 1): all 80 blocks alike; (3, 1): 3 dense, then MoE
    n1, n2 = short_counts(n=80, period=1)           # (3, 4): the blocks each short stage keeps
    m = extrapolate(simulate(<3 blocks>), n1, simulate(<4 blocks>), n2, n=80, period=1, accum=2)

``period`` is how often the stage's blocks repeat after its first ``head``: 1 when all are alike,
``ac_every`` when only every so many are checkpointed; ``head`` counts the blocks before the
repetition starts, as DeepSeek-V3's dense first layers before its sparse ones (or Qwen3-MoE's dense
``mlp_only_layers`` among sparse ones, where they come first). The short stages keep the head and
the first and last blocks of the repeating run (``kept``) and drop whole periods from its middle,
so every block keeps its class.

[Note: why two short stages give the long one's figures]
Blocks alike in kind, parameters and wrappers run the same ops; at any op of block ``j`` (of
``n``) the live bytes are that op's own share, the same in every block of its class (``j - head``
modulo ``period``), plus what lies outside the block, which grows by a fixed amount per block
before ``j`` (saved activations, in forward) or after it (gradients, in backward), and per block
of the stage (sharded parameters, accumulated gradients): ``a + b*j + c*n``. So each stretch of
a phase that ``simulate._label_blocks`` labels peaks at ``a + b*j + c*n``, except within ``EDGE``
blocks of either end of the repeating run, whose neighbours differ (prefetch, the stage's own
layers, a head block), and which are still affine in ``n`` at a fixed distance from their end; so
are the head's blocks, at a fixed distance from the start. Over the middle blocks of a class, an affine
function of ``j`` peaks at the first or the last of them: all within ``head + EDGE + period``
blocks of the start or ``EDGE + period`` of the end. So the phase's peak is the largest of the
stretches within those windows, each affine in ``n``: two simulations ``period`` blocks apart fix
every one of them, and every additive figure (start, end, saved, bytes sent), exactly, in
integers. The shorter stage holds one period of middle blocks (a few more blocks when the class
of ``n`` asks for them), which are then both the first and the last middle ones: its two windows
overlap there, and a stretch in both counts in both.
tests/test_plan_extrapolate.py compares it with simulating every block, field by field.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence

from meshpar.planner.simulate import Measured, Phase, measured

EDGE = 1  # blocks at each end of a stage that run unlike the middle ones (tests/test_plan_extrapolate.py)


def period(blocks: Sequence[Hashable]) -> int:
    """The smallest ``p`` with ``blocks[j] == blocks[j + p]`` for every ``j``: how often a stage's
    blocks repeat (each block described by its kind, wrappers and parameters: ``dry_run``)."""
    n = len(blocks)
    return next((p for p in range(1, n) if all(blocks[j] == blocks[j + p] for j in range(n - p))), max(n, 1))


def pattern(blocks: Sequence[Hashable]) -> tuple[int, int]:
    """(head, period): the first ``head`` blocks kept whole, the rest repeating every ``period``,
    chosen so that the short stages hold the fewest blocks; (0, ``period(blocks)``) when no head
    leaves a repeating run long enough for short stages (``short_counts`` is None)."""
    n, best = len(blocks), None
    for head in range(n):
        p = period(blocks[head:])
        counts = short_counts(n, p, head)
        if counts is not None and (best is None or sum(counts) < best[0]):
            best = (sum(counts), head, p)
    return (best[1], best[2]) if best else (0, period(blocks))


def short_counts(n: int, period: int, head: int = 0) -> tuple[int, int] | None:
    """The block counts of the two short stages for a stage of ``n`` blocks, or None when the
    stage is no longer than the longer of them."""
    n1 = head + 2 * EDGE + period  # the head, an edge block at each end, one period between
    n1 += (n - n1) % period  # the same class as n: the blocks dropped are whole periods
    n2 = n1 + period
    return (n1, n2) if n > n2 else None


def kept(n: int, short: int, head: int = 0) -> list[int]:
    """Positions of the blocks a short stage keeps: the head and half the rest from the start,
    the others from the end."""
    first = head + (short - head) // 2
    return [*range(first), *range(n - (short - first), n)]


def extrapolate(m1: Measured, n1: int, m2: Measured, n2: int, *, n: int, period: int, accum: int,
                head: int = 0) -> Measured:
    """The figures of a stage of ``n`` blocks from simulations of ``n1`` and ``n2 = n1 + period``
    of them ([Note: why two short stages give the long one's figures])."""
    steps, rest = divmod(n - n1, n2 - n1)
    if rest or n2 - n1 != period or m1.phases.keys() != m2.phases.keys():
        raise ValueError(f"cannot extrapolate {n1} and {n2} blocks to {n} with period {period}")
    first, last = head + EDGE + period, EDGE + period

    def at(a, b):  # the value at n of a figure that was a at n1 blocks and b at n2
        return a + (b - a) * steps

    phases = {}
    for name, p1 in m1.phases.items():
        p2 = m2.phases[name]
        s1, s2 = _windowed(p1.segments, n1, first, last), _windowed(p2.segments, n2, first, last)
        if s1.keys() != s2.keys():
            raise ValueError(f"phase {name}: the stretches of {n1} and {n2} blocks differ: {list(s1)} vs {list(s2)}")
        # in n2's order, that of the long stage: n1's windows overlap
        segments = {k: (at(s1[k][0], s2[k][0]), {c: at(v, s2[k][1][c]) for c, v in s1[k][1].items()}) for k in s2}
        peak, at_peak = max(segments.values(), key=lambda s: s[0])  # the first of equals, as the tracker keeps
        comm = Counter({k: at(p1.comm.get(k, 0), p2.comm.get(k, 0)) for k in (*p2.comm, *p1.comm)})
        calls = Counter({k: at(p1.calls.get(k, 0), p2.calls.get(k, 0)) for k in (*p2.calls, *p1.calls)})
        phases[name] = Phase(at(p1.start, p2.start), at(p1.end, p2.end), peak, at(p1.saved, p2.saved), at_peak,
                             comm, segments, calls)
    return measured(phases, m1.n_run, accum)


def _windowed(segments: dict[Hashable, tuple], n: int, first: int, last: int) -> dict[Hashable, tuple]:
    """The stretches within ``first`` blocks of the start or ``last`` of the end, labelled by their
    distance from it (a stretch in both windows, in both)."""
    out = {}
    for label, value in segments.items():
        if label == "start":
            out[label] = value
            continue
        kind, j = label
        if j < first:
            out[(kind, "first", j)] = value
        if j >= n - last:
            out[(kind, "last", n - 1 - j)] = value
    return out
