"""Where each rank's step time goes: one trace's raw sums, then a summary per rank.

[Note: where step time goes]
A step is the main thread's ``meshpar::step`` span. Every instant of it gets exactly one
bucket, the first that applies, so the five add up to the step time:

    data          inside ``meshpar::data``
    exposed comm  communication in progress and the main thread in no compute op: a collective
                  running on a gloo worker thread, being issued on the main thread (``c10d::*``,
                  ``_c10d_functional::*``), or a p2p send in flight (gloo shows send / recv on the
                  main thread as spans from issue to completion); and the main thread blocked in
                  a wait (``meshpar::fsdp.*_wait``, ``_c10d_functional::wait_tensor``,
                  ``meshpar::pp.send_*.wait``)
    optimizer     inside ``meshpar::optimizer`` (gradient clipping and the optimizer step; the
                  non-FSDP gradient all-reduce in there counts as exposed comm where it waits)
    compute       in a main-thread torch op that is not communication (aten::*, autograd nodes)
    bubble/idle   the rest: under pipelining the receive waits for a neighbouring stage (gloo
                  recv spans on the main thread, or ``meshpar::pp.recv_*.wait``, also reported as
                  ``p2p_wait``), and everywhere
                  main-thread time in no op with no communication in progress (Python between ops)

``comm`` is the wall time during which any collective was in progress; ``hidden`` is the part
of it under main-thread compute. Approximations: compute is what the CPU's main thread runs
(a CUDA trace's kernels are not read, so on GPU compute is launch time); a gloo worker event
lasts from when the worker takes the collective until it ends, so waiting for late peers (rank
skew) reads as communication, as it does for NCCL kernels; and Python time between ops while
a collective is in flight reads as exposed.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshpar.profiling.report.attribution import _attribute, _is_comm, own_groups
from meshpar.profiling.report.intervals import Intervals, _intersect, _length, _subtract, _union
from meshpar.profiling.report.moe import LayerAllToAll, layer_lines, layer_sums
from meshpar.profiling.report.traces import ProfileReportError, find_traces, load_trace

BUCKETS = ("compute", "exposed_comm", "bubble", "data", "optimizer")  # partition the step: [Note: where step time goes]
_WAIT_LABELS = ("meshpar::fsdp.all_gather_wait", "meshpar::fsdp.reduce_scatter_wait", "_c10d_functional::wait_tensor")
_SHORT = {"pp": "pp", "dp_replicate": "dpr", "dp_shard": "dps", "cp": "cp", "tp": "tp"}


def _is_p2p_wait(name: str, kind: str) -> bool:
    """A wait on a pipeline transfer batch holding a ``kind`` (``recv_`` or ``send_``) op:
    ``meshpar::pp.recv_forward[1,0].wait`` (meshpar/profiling/labels.py); a batch holding a receive
    is a receive wait."""
    if not (name.startswith("meshpar::pp.") and name.endswith(".wait")):
        return False
    return "recv_" in name if kind == "recv_" else "recv_" not in name


@dataclass
class CommLine:
    """One collective on one mesh dim, on one rank, over its traced steps."""

    op: str
    dim: str
    calls: int  # ``meshpar::comm.<op>[<dim>]`` labels in the trace
    other_calls: int  # collectives not issued by meshpar's engine: DTensor (tp), p2p (pp), torch's own (?)
    time_ms: float  # per step: wall time in progress
    exposed_ms: float  # per step: of which not under main-thread compute
    accounted_calls: int | None = None  # the header's (meshpar's engine) count, None if not a meshpar collective
    accounted_bytes: float | None = None


@dataclass
class RankSummary:
    """One rank: milliseconds per step, means over its traced steps."""

    rank: int
    coordinates: dict[str, int]
    label: str  # "r5 pp1 dp0 tp1"
    steps: list[int]  # the step numbers traced
    step_ms: float
    buckets: dict[str, float]  # BUCKETS, which add up to step_ms
    comm_ms: float
    hidden_comm_ms: float
    per_step: list[dict[str, float]]
    comm: list[CommLine]
    top_ops: list[tuple[str, float, float]]  # (name, self ms per step, calls per step)
    files: list[str]
    dropped: list[dict[str, Any]] = field(default_factory=list)  # what each file's size cap dropped
    moe_layers: list[LayerAllToAll] = field(default_factory=list)  # [Note: all-to-all per MoE layer]


@dataclass
class Report:
    folder: str
    world_size: int
    layout: dict[str, int]
    steps: list[int]  # [first, last] over every file
    ranks: list[RankSummary]
    top_ops: list[tuple[str, float, float]]  # mean over ranks: (name, self ms per step, calls per step)


def summarize(path: str | Path, *, top: int = 10) -> Report:
    """Per rank and step: compute, communication (per collective and mesh dim), exposed
    communication, bubble / idle, data loading, optimizer and the top ops; see
    [Note: where step time goes]. With expert parallelism also the all-to-all time per MoE
    layer: [Note: all-to-all per MoE layer] (meshpar/profiling/report/moe.py)."""
    files = find_traces(path)
    by_rank: dict[int, list[dict[str, Any]]] = defaultdict(list)
    headers = []
    for f in files:
        trace = load_trace(f)
        headers.append(trace["meshpar"])
        if (trace["meshpar"]["layout"], trace["meshpar"]["world_size"]) != (headers[0]["layout"],
                                                                            headers[0]["world_size"]):
            raise ProfileReportError(f"{f} and {files[0]} come from runs with different layouts: keep one run's "
                                     f"traces in a folder")
        by_rank[int(trace["meshpar"]["rank"])].append(_analyze(trace, f))
    ranks = [_rank_summary(parts, top) for _, parts in sorted(by_rank.items())]
    ops: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])  # mean over ranks of per-step self ms, calls
    for parts in by_rank.values():
        n = sum(len(p["per_step"]) for p in parts) * len(by_rank)
        for p in parts:
            for name, (us, calls) in p["ops"].items():
                ops[name][0] += us / 1e3 / n
                ops[name][1] += calls / n
    top_ops = sorted(((k, v[0], v[1]) for k, v in ops.items()), key=lambda x: -x[1])[:top]
    steps = [min(h["steps"][0] for h in headers), max(h["steps"][1] for h in headers)]
    return Report(str(files[0].parent), int(headers[0]["world_size"]), dict(headers[0]["layout"]), steps,
                  ranks, top_ops)


def _analyze(trace: dict[str, Any], path: Path) -> dict[str, Any]:
    """The raw sums of one trace file (microseconds), combined per rank by ``_rank_summary``."""
    header = trace["meshpar"]
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e and "ts" in e]
    steps = [e for e in events if e["name"] == "meshpar::step"]
    if not steps:
        raise ProfileReportError(f"{path}: no meshpar::step events (was the trace cut before a step ended?)")
    pid, main = steps[0]["pid"], steps[0]["tid"]
    events = [e for e in events if e.get("pid") == pid]
    on_main = sorted((e for e in events if e["tid"] == main), key=lambda e: (e["ts"], -e["dur"]))
    workers = [e for e in events if e["tid"] != main and e["name"].startswith("gloo:")]
    pipelined = int(header["layout"].get("pp", 1)) > 1

    def spans(pred) -> Intervals:
        return _union([(e["ts"], e["ts"] + e["dur"]) for e in on_main if pred(e)])

    data = spans(lambda e: e["name"] == "meshpar::data")
    optimizer = spans(lambda e: e["name"] == "meshpar::optimizer")
    comm_ops = spans(lambda e: _is_comm(e["name"]))
    compute = _subtract(spans(lambda e: e.get("cat") == "cpu_op" and not _is_comm(e["name"])), comm_ops)
    recv_wait = spans(lambda e: pipelined and (e["name"] == "gloo:recv" or _is_p2p_wait(e["name"], "recv_")))
    waits = spans(lambda e: e["name"] in _WAIT_LABELS or _is_p2p_wait(e["name"], "send_"))

    per_kind, calls = _attribute(on_main, workers, own_groups(trace))
    running = _union([iv for ivs in per_kind.values() for iv in ivs] + comm_ops)
    exposed = _subtract(_subtract(_union(running + waits), compute), recv_wait)
    step_spans = _union([(e["ts"], e["ts"] + e["dur"]) for e in steps])
    per_step = []
    for s in sorted((e["ts"], e["ts"] + e["dur"]) for e in steps):
        rest, row = [s], {"step_ms": (s[1] - s[0]) / 1e3}
        for name, ivs in (("data", data), ("exposed_comm", exposed), ("optimizer", optimizer), ("compute", compute)):
            row[name] = _length(_intersect(rest, ivs)) / 1e3
            rest = _subtract(rest, ivs)
        row["bubble"] = _length(rest) / 1e3
        row["comm"] = _length(_intersect([s], running)) / 1e3
        row["hidden_comm"] = _length(_intersect(_intersect([s], running), compute)) / 1e3
        row["p2p_wait"] = _length(_intersect(rest, recv_wait)) / 1e3  # part of bubble
        per_step.append(row)
    not_exposed = _union(compute + data + recv_wait)
    comm = {}
    for key in set(per_kind) | {k[:2] for k in calls}:
        ivs = _intersect(_union(per_kind.get(key, [])), step_spans)
        comm[key] = [calls[(*key, "meshpar")], calls[(*key, "other")], _length(ivs),
                     _length(_subtract(ivs, not_exposed))]
    accounted = {}
    for key, v in header.get("comm", {}).items():
        m = re.fullmatch(r"(\w+)\[(.+)\]", key)
        if m:
            accounted[(m[1], m[2])] = (int(v["calls"]), float(v["bytes"]))
    return {"header": header, "file": str(path), "per_step": per_step, "comm": comm, "accounted": accounted,
            "ops": _self_times(events), "moe": layer_sums(on_main, per_kind, step_spans, not_exposed)}


def _self_times(events: list[dict]) -> dict[str, list[float]]:
    """{op name: [self time in us, calls]} over the torch ops (``cpu_op``) of every thread."""
    out: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    by_tid: dict[Any, list[dict]] = defaultdict(list)
    for e in events:
        if e.get("cat") == "cpu_op":
            by_tid[e["tid"]].append(e)
    for evs in by_tid.values():
        stack: list[list] = []  # [end, name, self]
        for e in sorted(evs, key=lambda e: (e["ts"], -e["dur"])):
            while stack and stack[-1][0] <= e["ts"]:
                _, name, own = stack.pop()
                out[name][0] += own
            if stack:
                stack[-1][2] -= e["dur"]
            out[e["name"]][1] += 1
            stack.append([e["ts"] + e["dur"], e["name"], e["dur"]])
        for _, name, own in stack:
            out[name][0] += own
    return out


def _rank_summary(parts: list[dict[str, Any]], top: int) -> RankSummary:
    header = parts[0]["header"]
    per_step = [row for p in parts for row in p["per_step"]]
    n = len(per_step)

    def mean(key: str) -> float:
        return sum(row[key] for row in per_step) / n

    comm, accounted, ops = ({k: [sum(x) for x in zip(*(p[part][k] for p in parts if k in p[part]), strict=True)]
                             for k in {k for p in parts for k in p[part]}} for part in ("comm", "accounted", "ops"))
    lines = [CommLine(op, dim, int(v[0]), int(v[1]), v[2] / 1e3 / n, v[3] / 1e3 / n,
                      int(accounted[(op, dim)][0]) if (op, dim) in accounted else None,
                      accounted[(op, dim)][1] if (op, dim) in accounted else None)
             for (op, dim), v in sorted(comm.items(), key=lambda kv: -kv[1][2])]
    lines += [CommLine(op, dim, 0, 0, 0.0, 0.0, int(c), b)
              for (op, dim), (c, b) in accounted.items() if (op, dim) not in comm]
    top_ops = [(name, us / 1e3 / n, c / n) for name, (us, c) in sorted(ops.items(), key=lambda kv: -kv[1][0])[:top]]
    coords = {k: int(v) for k, v in header["coordinates"].items()}
    steps = sorted({s for p in parts for s in range(p["header"]["steps"][0], p["header"]["steps"][1] + 1)})
    return RankSummary(int(header["rank"]), coords, rank_label(int(header["rank"]), coords, header["layout"]), steps,
                       mean("step_ms"), {b: mean(b) for b in BUCKETS}, mean("comm"), mean("hidden_comm"), per_step,
                       lines, top_ops, [p["file"] for p in parts],
                       [p["header"]["dropped"] for p in parts if "dropped" in p["header"]],
                       layer_lines([p["moe"] for p in parts], n))


def rank_label(rank: int, coords: dict[str, int], layout: dict[str, int]) -> str:
    """``r5 pp1 dp0 tp1``: the rank and its coordinate on every mesh dim larger than one
    (``dp`` when dp_shard is the only data-parallel dim, else ``dpr`` / ``dps``)."""
    both = layout.get("dp_replicate", 1) > 1 and layout.get("dp_shard", 1) > 1
    names = dict(_SHORT) if both else {**_SHORT, "dp_replicate": "dp", "dp_shard": "dp"}
    return " ".join([f"r{rank}"] + [f"{names.get(d, d)}{coords.get(d, 0)}" for d, n in layout.items() if n > 1])
