"""A stage of many alike blocks, simulated as two short stages and extrapolated exactly.

    head, period = pattern(blocks)                  # (0, 1): all 80 blocks alike; (3, 1): 3 dense, then MoE
    n1, n2 = short_counts(n=80, period=1)           # (3, 4): the blocks each short stage keeps
    m = extrapolate(simulate(<3 blocks>), n1, simulate(<4 blocks>), n2, n=80, period=1, accum=2)
    lent = slopes(<a middle stage's 3 blocks>, 3, <its 4 blocks>, 4, head=0)   # what a block adds
    m = borrow(simulate(<the first stage's 3 blocks>), 3, lent, n=80, head=0, accum=2)

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
a phase that ``tracker.label_blocks`` labels peaks at ``a + b*j + c*n``, except within ``EDGE``
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
from dataclasses import dataclass

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
        if label == "start" or label[0] == "mark":  # the phase's own work, outside every block
            out[label] = value
            continue
        kind, j = label
        if j < first:
            out[(kind, "first", j)] = value
        if j >= n - last:
            out[(kind, "last", n - 1 - j)] = value
    return out


# [Note: the end stages borrow a middle stage's slopes]
# What one more middle block adds to a stretch is the blocks' own doing (their parameters and
# gradients, the activations they save), the same in every stage that runs them. The first
# stage's own work (the embedding) comes before its first block's stretch in forward and after it
# in backward; the last stage's (final norm, output, loss) is a stretch of its own, ("mark",
# "head"), after its last block in forward, and its backward opens the backward's "start". So the
# first and last stages of a pipeline are each simulated once, as their shorter short stage, and
# extrapolated with the slopes of a middle stage's pair of the same repeating block: one
# simulation instead of two. A stretch takes the slope of the middle stage's stretch at the same
# place: the first window's counted from the repeating run's start (a head block's, as
# DeepSeek-V3's dense first layers, that of the run's first block, which like it has every block of
# the run after it), the last window's from the end; the head's that of the same microbatch's
# backward "start" (every block's forward done, nothing of theirs freed before backward). Only with
# period 1; where a stretch has no counterpart the stage simulates its own pair. Unmarked, the
# head would share its last block's stretch and grow unlike it (DeepSeek-V3's loss frees
# per-block tensors a middle stage's send keeps: docs/performance.md#the-simulations-own-costs).
# tests/test_plan_extrapolate.py compares the result with simulating every block.


@dataclass(frozen=True)
class Slopes:
    """What one more block adds to each figure of a middle stage (period 1), per phase: each
    stretch's (total, per category), the first window's labelled by distance from the repeating
    run's start; the phase's start, end, saved, comm and calls."""

    stretches: dict[str, dict[Hashable, tuple[int, dict[str, int]]]]
    figures: dict[str, tuple[int, int, int, Counter, Counter]]


def slopes(m1: Measured, n1: int, m2: Measured, n2: int, head: int) -> Slopes | None:
    """The slopes of a middle stage of period 1 from its short stages of ``n1`` and ``n2 = n1 + 1``
    blocks (``head`` blocks before the repeating run)."""
    if n2 - n1 != 1 or m1.phases.keys() != m2.phases.keys():
        return None
    stretches, figures = {}, {}
    for name, p1 in m1.phases.items():
        p2 = m2.phases[name]
        s1 = _windowed(p1.segments, n1, head + EDGE + 1, EDGE + 1)
        s2 = _windowed(p2.segments, n2, head + EDGE + 1, EDGE + 1)
        if s1.keys() != s2.keys():
            return None
        stretches[name] = {}
        for k, (b, cats) in s2.items():
            a, before = s1[k]
            if _in_head(k, head):
                continue
            stretches[name][_from_run(k, head)] = (b - a, {c: v - before[c] for c, v in cats.items()})
        comm = Counter({k: p2.comm.get(k, 0) - p1.comm.get(k, 0) for k in (*p2.comm, *p1.comm)})
        calls = Counter({k: p2.calls.get(k, 0) - p1.calls.get(k, 0) for k in (*p2.calls, *p1.calls)})
        figures[name] = (p2.start - p1.start, p2.end - p1.end, p2.saved - p1.saved, comm, calls)
    return Slopes(stretches, figures)


def borrow(m1: Measured, n1: int, lent: Slopes, *, n: int, head: int, accum: int) -> Measured | None:
    """The figures of a first or last stage of ``n`` blocks (period 1) from its short stage of ``n1``
    and a middle stage's ``lent`` slopes ([Note: the end stages borrow a middle stage's slopes]);
    None where a stretch has no slope to borrow or the stretches' order is not the long stage's."""
    if m1.phases.keys() != lent.figures.keys():
        return None
    steps = n - n1
    phases = {}
    for name, p1 in m1.phases.items():
        windowed = _in_long_order(_windowed(p1.segments, n1, head + EDGE + 1, EDGE + 1), n)
        if windowed is None:
            return None
        segments = {}
        for k, (value, cats) in windowed.items():
            place = (k[0], "first", 0) if _in_head(k, head) else _from_run(k, head)
            slope = lent.stretches[name].get(place)
            if k == ("mark", "head") and name.startswith("F"):  # as the backward's start of its microbatch
                slope = lent.stretches.get(f"B{name[1:]}", {}).get("start")
            if slope is None or slope[1].keys() != cats.keys():
                return None
            segments[k] = (value + steps * slope[0], {c: v + steps * slope[1][c] for c, v in cats.items()})
        peak, at_peak = max(segments.values(), key=lambda seg: seg[0])  # the first of equals, as the tracker
        start, end, saved, comm, calls = lent.figures[name]
        comm = Counter({k: p1.comm.get(k, 0) + steps * comm.get(k, 0) for k in (*p1.comm, *comm)})
        calls = Counter({k: p1.calls.get(k, 0) + steps * calls.get(k, 0) for k in (*p1.calls, *calls)})
        phases[name] = Phase(p1.start + steps * start, p1.end + steps * end, peak, p1.saved + steps * saved,
                             at_peak, comm, segments, calls)
    return measured(phases, m1.n_run, accum)


def _in_long_order(windowed: dict[Hashable, tuple], n: int) -> dict[Hashable, tuple] | None:
    """A short stage's windowed stretches in the order the stage of ``n`` blocks runs them (its
    windows do not overlap there): by block, forward ("in", "out") from the first, backward
    ("grad") from the last; None for a phase that mixes them or marks with blocks."""
    blocks = [k for k in windowed if isinstance(k, tuple) and len(k) == 3]
    kinds = {k[0] for k in blocks}
    marks = [k for k in windowed if isinstance(k, tuple) and k[0] == "mark"]
    if not blocks:
        return windowed
    order = list(windowed)
    after = marks and min(order.index(k) for k in marks) > max(order.index(k) for k in blocks)
    if (marks and not after) or not (kinds <= {"in", "out"} or kinds == {"grad"}):
        return None  # marks among the blocks (the head's comes after them), or both directions
    backward = kinds == {"grad"}

    def when(k: Hashable) -> int:
        if k == "start":
            return -1
        if k in marks:
            return n + marks.index(k)
        at = k[2] if k[1] == "first" else n - 1 - k[2]
        return n - 1 - at if backward else at

    return {k: windowed[k] for k in sorted(windowed, key=when)}  # stable: "in" before "out"


def _in_head(label: Hashable, head: int) -> bool:
    return isinstance(label, tuple) and len(label) == 3 and label[1] == "first" and label[2] < head


def _from_run(label: Hashable, head: int) -> Hashable:
    """A windowed label with the first window's blocks counted from the repeating run's start."""
    if isinstance(label, tuple) and len(label) == 3 and label[1] == "first":
        return (label[0], "first", label[2] - head)
    return label
