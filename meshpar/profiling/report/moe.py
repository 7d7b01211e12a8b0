"""Expert parallelism's all-to-all time per MoE layer, from the ranges meshpar/parallel/expert_parallel.py sets.

[Note: all-to-all per MoE layer]
Each token exchange of an expert-parallel layer runs inside ``meshpar::moe.dispatch[<layer>]``
(slots to their expert's rank) or ``meshpar::moe.combine[<layer>]`` (results back), with
``layer`` the block index; each encloses one ``meshpar::comm.<op>[<dim>]`` range (all_to_all on
ep). Which pass a range belongs to comes from the op it sits in (the first enclosing event that is
not a ``meshpar::`` label): an autograd node (``_AllToAllRowsBackward``) is ``backward``; the
forward op (``_AllToAllRows``) is ``forward``, or ``recompute`` when it runs inside the autograd
engine (``autograd::engine::evaluate_function: ...``: activation checkpointing runs the forward
again in backward). On CPU the engine runs backward on the thread that called it, so every range
is on the main thread, the one this report reads; on CUDA backward runs on the engine's device
thread, which the report does not read (for any collective).

A range's time is measured as the per-collective figures are ([Note: the mesh dim of a
collective]): the wall time during which that (op, dim) collective was in progress (its gloo
worker events), here within the range and within a step, as a union of intervals; exposed is the
part not under main-thread compute, data or a pipeline receive. The exchange is waited for inside
its range, so the range holds all of it. Ranges count as calls when they overlap a step. The
per-layer times add up to at most the collective's own time: the small exchange of the token counts
before each forward dispatch has no layer range and stays in the collective's remainder.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from meshpar.profiling.report.attribution import _COMM_LABEL
from meshpar.profiling.report.intervals import Intervals, _intersect, _length, _subtract, _union

_RANGE = re.compile(r"meshpar::moe\.(dispatch|combine)\[(\d+)\]")  # meshpar/parallel/expert_parallel.py
_NODE = re.compile(r".*Backward\d*")  # an autograd node's op: _AllToAllRowsBackward, MulBackward0
_ENGINE = "autograd::engine::evaluate_function:"
PARTS = tuple(f"{p} {x}" for p in ("forward", "recompute", "backward") for x in ("dispatch", "combine"))


@dataclass
class LayerAllToAll:
    """One MoE layer's token exchanges on one rank over its traced steps: [Note: all-to-all per MoE layer]."""

    layer: int  # the block index
    op: str  # the collective the ranges enclose, with its mesh dim: all_to_all, ep
    dim: str
    calls: int  # ranges, over the traced steps (like CommLine.calls)
    time_ms: float  # per step: the collective in progress within the ranges
    exposed_ms: float  # per step: of which not under main-thread compute
    part_calls: dict[str, int]  # by PARTS ("forward dispatch", ...): ranges over the traced steps
    part_ms: dict[str, float]  # by PARTS: ms per step


def _ranges(on_main: list[dict]) -> list[tuple[int, str, tuple[float, float], tuple[str, str] | None]]:
    """(layer, part, span, (op, dim) of the enclosed collective) per ``meshpar::moe.*`` range of
    the main thread (sorted by start, longest first: events on one thread nest)."""
    out: list = []
    stack: list[tuple[float, str, int | None]] = []  # open events: (end, name, index in out of a range)
    for e in on_main:
        while stack and stack[-1][0] <= e["ts"]:
            stack.pop()
        name, end = e["name"], e["ts"] + e["dur"]
        if m := _RANGE.fullmatch(name):
            ops = [n for _, n, _ in reversed(stack) if not n.startswith("meshpar::")]
            kind = ("backward" if ops and _NODE.fullmatch(ops[0]) else
                    "recompute" if any(n.startswith(_ENGINE) for n in ops) else "forward")
            out.append([int(m[2]), f"{kind} {m[1]}", (e["ts"], end), None])
            stack.append((end, name, len(out) - 1))
            continue
        if c := _COMM_LABEL.fullmatch(name):
            i = next((i for _, _, i in reversed(stack) if i is not None), None)
            if i is not None and out[i][3] is None:
                out[i][3] = (c[1], c[2])
        stack.append((end, name, None))
    return [tuple(r) for r in out]


def layer_sums(on_main: list[dict], per_kind: dict[tuple[str, str], Intervals], steps: Intervals,
               not_exposed: Intervals) -> dict[int, dict[str, Any]]:
    """One trace's raw sums per layer (microseconds; ``steps`` and ``not_exposed`` as in
    analysis._analyze), combined per rank by ``layer_lines``."""
    spans: dict[int, dict[str, Intervals]] = defaultdict(lambda: defaultdict(list))
    out: dict[int, dict[str, Any]] = {}
    for layer, part, span, collective in _ranges(on_main):
        row = out.setdefault(layer, {"collective": None, "calls": defaultdict(int), "us": {}})
        row["collective"] = row["collective"] or collective
        if _intersect([span], steps):
            row["calls"][part] += 1
        spans[layer][part].append(span)
    for layer, row in out.items():
        running = _intersect(_union(per_kind.get(row["collective"], [])), steps)
        for part, ivs in spans[layer].items():
            row["us"][part] = _length(_intersect(running, _union(ivs)))
        inside = _intersect(running, _union([s for ivs in spans[layer].values() for s in ivs]))
        row["total_us"], row["exposed_us"] = _length(inside), _length(_subtract(inside, not_exposed))
        row["calls"] = dict(row["calls"])
    return out


def layer_lines(parts: list[dict[int, dict[str, Any]]], n_steps: int) -> list[LayerAllToAll]:
    """A rank's lines, layer by layer, from its trace files' ``layer_sums``; times per step."""
    lines = []
    for layer in sorted({k for p in parts for k in p}):
        rows = [p[layer] for p in parts if layer in p]
        op, dim = next((r["collective"] for r in rows if r["collective"]), None) or ("?", "?")
        calls = {k: sum(r["calls"].get(k, 0) for r in rows) for k in PARTS}
        ms = {k: sum(r["us"].get(k, 0.0) for r in rows) / 1e3 / n_steps for k in PARTS}
        lines.append(LayerAllToAll(layer, op, dim, sum(calls.values()),
                                   sum(r["total_us"] for r in rows) / 1e3 / n_steps,
                                   sum(r["exposed_us"] for r in rows) / 1e3 / n_steps,
                                   {k: v for k, v in calls.items() if v}, {k: v for k, v in ms.items() if calls[k]}))
    return lines
