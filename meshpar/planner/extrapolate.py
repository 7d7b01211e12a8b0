"""A stage of many alike blocks, simulated as two short stages and extrapolated exactly.

    n1, n2 = short_counts(n=80, period=1)          # (4, 5): the blocks each short stage keeps
    m = extrapolate(simulate(<4 blocks>), n1, simulate(<5 blocks>), n2, n=80, period=1, accum=2)

``period`` is how often the stage's blocks repeat: 1 when all are alike, ``ac_every`` when only
every so many are checkpointed, the whole stage (no short stages) when they follow no pattern,
as Qwen3-MoE's dense ``mlp_only_layers`` among sparse ones. The short stages keep the first and
last blocks of the real one (``kept``) and drop whole periods, so every block keeps its class.

[Note: why two short stages give the long one's figures]
Blocks alike in kind, parameters and wrappers run the same ops; at any op of block ``j`` (of
``n``) the live bytes are that op's own share, the same in every block of its class (``j``
modulo ``period``),
plus what lies outside the block, which grows by a fixed amount per block before ``j`` (saved
activations, in forward) or after it (gradients, in backward), and per block of the stage
(sharded parameters, accumulated gradients): ``a + b*j + c*n``. So each stretch of a phase that
``simulate._label_blocks`` labels peaks at ``a + b*j + c*n``, except within ``EDGE`` blocks of
either end, whose neighbours differ (prefetch, the stage's own layers), and which are still
affine in ``n`` at a fixed distance from their end. Over the middle blocks of a class, an affine
function of ``j`` peaks at the first or the last of them: all within ``EDGE + period`` blocks of
an end. So the phase's peak is the largest of the stretches within that window of either end,
each affine in ``n``: two simulations ``period`` blocks apart fix every one of them, and every
additive figure (start, end, saved, bytes sent), exactly, in integers.
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


def short_counts(n: int, period: int) -> tuple[int, int] | None:
    """The block counts of the two short stages for a stage of ``n`` blocks, or None when
    simulating ``n`` blocks costs no more."""
    n1 = 2 * (EDGE + period)
    n1 += (n - n1) % period  # the same class as n: the blocks dropped are whole periods
    n2 = n1 + period
    return (n1, n2) if n > n2 else None


def kept(n: int, short: int) -> list[int]:
    """Positions of the blocks a short stage keeps: the first ``short // 2``, the rest from the end."""
    head = short // 2
    return [*range(head), *range(n - (short - head), n)]


def extrapolate(m1: Measured, n1: int, m2: Measured, n2: int, *, n: int, period: int, accum: int) -> Measured:
    """The figures of a stage of ``n`` blocks from simulations of ``n1`` and ``n2 = n1 + period``
    of them ([Note: why two short stages give the long one's figures])."""
    steps, rest = divmod(n - n1, n2 - n1)
    if rest or n2 - n1 != period or m1.phases.keys() != m2.phases.keys():
        raise ValueError(f"cannot extrapolate {n1} and {n2} blocks to {n} with period {period}")
    window = EDGE + period

    def at(a, b):  # the value at n of a figure that was a at n1 blocks and b at n2
        return a + (b - a) * steps

    phases = {}
    for name, p1 in m1.phases.items():
        p2 = m2.phases[name]
        s1, s2 = _windowed(p1.segments, n1, window), _windowed(p2.segments, n2, window)
        if list(s1) != list(s2):
            raise ValueError(f"phase {name}: the stretches of {n1} and {n2} blocks differ: {list(s1)} vs {list(s2)}")
        segments = {k: (at(s1[k][0], s2[k][0]), {c: at(v, s2[k][1][c]) for c, v in s1[k][1].items()}) for k in s1}
        peak, at_peak = max(segments.values(), key=lambda s: s[0])  # the first of equals, as the tracker keeps
        comm = Counter({k: at(p1.comm.get(k, 0), p2.comm.get(k, 0)) for k in (*p2.comm, *p1.comm)})
        calls = Counter({k: at(p1.calls.get(k, 0), p2.calls.get(k, 0)) for k in (*p2.calls, *p1.calls)})
        phases[name] = Phase(at(p1.start, p2.start), at(p1.end, p2.end), peak, at(p1.saved, p2.saved), at_peak,
                             comm, segments, calls)
    return measured(phases, m1.n_run, accum)


def _windowed(segments: dict[Hashable, tuple], n: int, window: int) -> dict[Hashable, tuple]:
    """The stretches within ``window`` blocks of either end, labelled by their distance from it."""
    out = {}
    for label, value in segments.items():
        if label == "start":
            out[label] = value
            continue
        kind, j = label
        if j < window:
            out[(kind, "first", j)] = value
        elif j >= n - window:
            out[(kind, "last", n - 1 - j)] = value
    return out
