"""Reading meshpar's profiler traces: where each rank's step time goes, and one timeline of all ranks.

    report = summarize("runs/llama_debug_3d")      # the run folder or its traces/ folder
    print(format_table(report)); write_json(report, "summary.json"); write_chart(report, "summary.png")
    merge("runs/llama_debug_3d")                   # -> traces/merged.json.gz, open in ui.perfetto.dev

The input is what meshpar/profiling.py writes: one gzipped Chrome trace per traced rank and
profiled window, ``traces/rank<r>.steps<a>-<b>.json.gz``, with a ``meshpar`` header (layout,
coordinates, steps, the engine's own communication accounting). Any subset of ranks may be
traced (``profile.ranks``); the report covers the ranks it finds.

[Note: where step time goes]
A step is the main thread's ``meshpar::step`` span. Every instant of it gets exactly one
bucket, the first that applies, so the five add up to the step time:

    data          inside ``meshpar::data``
    exposed comm  communication in progress and the main thread in no compute op: a collective
                  running on a gloo worker thread, being issued on the main thread (``c10d::*``,
                  ``_c10d_functional::*``), or a p2p send in flight (gloo shows send / recv on the
                  main thread as spans from issue to completion); and the main thread blocked in
                  a wait (``meshpar::fsdp.*_wait``, ``_c10d_functional::wait_tensor``)
    optimizer     inside ``meshpar::optimizer`` (gradient clipping and the optimizer step; the
                  non-FSDP gradient all-reduce in there counts as exposed comm where it waits)
    compute       in a main-thread torch op that is not communication (aten::*, autograd nodes)
    bubble/idle   the rest: under pipelining the receive waits for a neighbouring stage (gloo
                  recv spans on the main thread, also reported as ``p2p_wait``), and everywhere
                  main-thread time in no op with no communication in progress (Python between ops)

``comm`` is the wall time during which any collective was in progress; ``hidden`` is the part
of it under main-thread compute. Approximations: compute is what the CPU's main thread runs
(a CUDA trace's kernels are not read, so on GPU compute is launch time); a gloo worker event
lasts from when the worker takes the collective until it ends, so waiting for late peers (rank
skew) reads as communication, as it does for NCCL kernels; and Python time between ops while
a collective is in flight reads as exposed (a few % of the step on the debug runs).

[Note: the mesh dim of a collective]
An issue op on the main thread (the outermost ``c10d::*`` / ``_c10d_functional::*`` op) takes
its dim from the enclosing ``meshpar::comm.<op>[<dim>]`` label; without one,
``_c10d_functional::*`` (DTensor, tensor parallel) is ``tp``, c10d send / recv is ``pp`` and
anything else ``?`` (for example the loss all-reduce of a log step). The work itself runs on a
gloo worker thread, which serves one process group, hence one dim: each of its events votes for
the dim of the latest compatible issue op before it, the thread takes the majority, and its
events then match that dim's issue ops first in, first out, for the op name (gloo runs a
reduce-scatter as an all-to-all or an all-reduce; the report says reduce_scatter). Calls per
(op, dim) are counted from the labels (plus unlabelled issue ops); bytes come from the
header's accounting, since a trace records no sizes. Per-collective exposed times can overlap
each other when two collectives run at once; the rank's exposed total counts each instant once.

[Note: one clock for all ranks]
A trace's ``ts`` are microseconds since its ``baseTimeNanoseconds`` (the profiler's
wall-clock base, nanoseconds since the epoch), so ``base / 1000 + ts`` puts every rank on the
host's wall clock: exact for ranks on one host, as good as the hosts' clock synchronisation
across hosts. The merged trace starts at its earliest event (``ts`` 0) and records that
instant as ``meshpar.origin_epoch_us``.
"""

from __future__ import annotations

import bisect
import gzip
import json
import re
import sys
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from meshpar.profiling import cap_trace

BUCKETS = ("compute", "exposed_comm", "bubble", "data", "optimizer")  # partition the step: [Note: where step time goes]
_TRACE_NAME = re.compile(r"rank(\d+)\.steps(\d+)-(\d+)\.json(\.gz)?")
_COMM_LABEL = re.compile(r"meshpar::comm\.(\w+)\[(.+)\]")
_WAIT_LABELS = ("meshpar::fsdp.all_gather_wait", "meshpar::fsdp.reduce_scatter_wait", "_c10d_functional::wait_tensor")
_NOT_ISSUES = ("_c10d_functional::wait_tensor", "_c10d_functional::_wrap_tensor_autograd")
_KINDS = ("alltoall", "allgather", "reducescatter", "allreduce", "broadcast", "barrier", "send", "recv",
          "gather", "scatter", "reduce")
_OP_NAMES = {"alltoall": "all_to_all", "allgather": "all_gather", "reducescatter": "reduce_scatter",
             "allreduce": "all_reduce"}
_SHORT = {"pp": "pp", "dp_replicate": "dpr", "dp_shard": "dps", "cp": "cp", "tp": "tp"}

Intervals = list[tuple[float, float]]


class ProfileReportError(ValueError):
    """A trace folder or file the report cannot read; the message names the file and the fix."""


# --- the report --------------------------------------------------------------------------------------
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


@dataclass
class Report:
    folder: str
    world_size: int
    layout: dict[str, int]
    steps: list[int]  # [first, last] over every file
    ranks: list[RankSummary]
    top_ops: list[tuple[str, float, float]]  # mean over ranks: (name, self ms per step, calls per step)


def find_traces(path: str | Path) -> list[Path]:
    """The traces in a run's output folder, its ``traces/`` folder, or one trace file, in rank order."""
    path = Path(path)
    if not path.exists():
        raise ProfileReportError(f"{path}: no such file or folder")
    if path.is_file():
        return [path]
    folder = path / "traces" if (path / "traces").is_dir() else path
    found = [(m, p) for p in folder.iterdir() if (m := _TRACE_NAME.fullmatch(p.name))]
    if not found:
        raise ProfileReportError(
            f"no meshpar traces (rank<r>.steps<a>-<b>.json.gz) in {folder}: write them with "
            f"`meshpar train RECIPE --profile.enable=true` (or `enable = true` under [profile] in the recipe)")
    return [p for m, p in sorted(found, key=lambda mp: (int(mp[0][1]), int(mp[0][2])))]


def load_trace(path: Path) -> dict[str, Any]:
    """One trace, checked to be a meshpar one."""
    try:
        with (gzip.open(path, "rt") if path.suffix == ".gz" else open(path)) as f:
            trace = json.load(f)
    except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProfileReportError(f"{path}: not a readable Chrome trace ({e})") from None
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise ProfileReportError(f"{path}: not a Chrome trace (no traceEvents list)")
    if not isinstance(trace.get("meshpar"), dict):
        raise ProfileReportError(f"{path}: no `meshpar` header, so it was not written by meshpar's profiler; "
                                 f"write traces with `meshpar train RECIPE --profile.enable=true`")
    missing = [k for k in ("rank", "world_size", "layout", "coordinates", "steps") if k not in trace["meshpar"]]
    if missing:
        raise ProfileReportError(f"{path}: the `meshpar` header lacks {', '.join(missing)}; write the traces again "
                                 f"with this version of meshpar")
    return trace


def summarize(path: str | Path, *, top: int = 10) -> Report:
    """Per rank and step: compute, communication (per collective and mesh dim), exposed
    communication, bubble / idle, data loading, optimizer and the top ops; see
    [Note: where step time goes]."""
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


# --- one trace ---------------------------------------------------------------------------------------
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
    recv_wait = spans(lambda e: pipelined and e["name"] == "gloo:recv")
    waits = spans(lambda e: e["name"] in _WAIT_LABELS)

    per_kind, calls = _attribute(on_main, workers)
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
            "ops": _self_times(events)}


def _is_comm(name: str) -> bool:
    return name.startswith(("c10d::", "_c10d_functional::", "gloo:", "nccl:", "record_param_comms"))


def _kind(name: str) -> str:
    """``c10d::_allgather_base_``, ``gloo:all_gather`` -> ``allgather``."""
    n = name.rsplit(":", 1)[-1].replace("_", "").lower()
    return next((k for k in _KINDS if k in n), n)


def _runs_as(issue_kind: str, gloo_kind: str) -> bool:
    # gloo has no reduce-scatter: torch runs one as an all-reduce, meshpar as an all-to-all
    return issue_kind == gloo_kind or (issue_kind == "reducescatter" and gloo_kind in ("allreduce", "alltoall"))


def _attribute(on_main: list[dict], workers: list[dict]) -> tuple[dict, dict]:
    """Intervals of communication per (op, dim), and calls per (op, dim, "meshpar" or "other"):
    [Note: the mesh dim of a collective]."""
    labels = [e for e in on_main if _COMM_LABEL.fullmatch(e["name"])]
    label_starts = [e["ts"] for e in labels]
    calls: Counter = Counter((*_COMM_LABEL.fullmatch(e["name"]).groups(), "meshpar") for e in labels)
    issues, end = [], -1.0  # (ts, kind, op, dim) of the outermost issue ops
    for e in on_main:
        if not _is_comm(e["name"]) or e["name"] in _NOT_ISSUES or e["name"].startswith("gloo:") or e["ts"] < end:
            continue
        end, kind = e["ts"] + e["dur"], _kind(e["name"])
        i = bisect.bisect_right(label_starts, e["ts"]) - 1
        if i >= 0 and e["ts"] + e["dur"] <= labels[i]["ts"] + labels[i]["dur"] + 1e-3:
            op, dim = _COMM_LABEL.fullmatch(labels[i]["name"]).groups()
        else:
            op = _OP_NAMES.get(kind, kind)
            dim = "tp" if e["name"].startswith("_c10d_functional::") else "pp" if kind in ("send", "recv") else "?"
            calls[(op, dim, "other")] += 1
        issues.append((e["ts"], kind, op, dim))
    starts = [i[0] for i in issues]

    def latest(e: dict) -> tuple | None:  # the latest issue op before e that it can be the work of
        k, j = _kind(e["name"]), bisect.bisect_right(starts, e["ts"]) - 1
        while j >= 0 and not _runs_as(issues[j][1], k):
            j -= 1
        return issues[j] if j >= 0 else None

    votes: dict[int, Counter] = defaultdict(Counter)
    for e in workers:
        if (hit := latest(e)) is not None:
            votes[e["tid"]][hit[3]] += 1
    thread_dim = {tid: next((d for d, _ in c.most_common() if d != "?"), "?") for tid, c in votes.items()}
    per_kind: dict[tuple[str, str], Intervals] = defaultdict(list)
    for dim in set(thread_dim.values()) | {"?"}:
        queue, j = [i for i in issues if i[3] == dim], 0  # this dim's issue ops, first in first out
        for e in sorted((e for e in workers if thread_dim.get(e["tid"], "?") == dim), key=lambda e: e["ts"]):
            kind = _kind(e["name"])
            k = next((n for n in range(j, len(queue)) if queue[n][0] <= e["ts"] and _runs_as(queue[n][1], kind)),
                     None)
            op, j = (queue[k][2], k + 1) if k is not None else (_OP_NAMES.get(kind, kind), j)
            per_kind[(op, dim)].append((e["ts"], e["ts"] + e["dur"]))
    for e in on_main:  # gloo work run by the main thread itself: p2p send / recv
        if e["name"].startswith("gloo:"):
            kind = _kind(e["name"])
            hit = latest(e) if kind not in ("send", "recv") else None
            op, dim = hit[2:] if hit else (_OP_NAMES.get(kind, kind), "pp" if kind in ("send", "recv") else "?")
            per_kind[(op, dim)].append((e["ts"], e["ts"] + e["dur"]))
    return per_kind, calls


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
                       [p["header"]["dropped"] for p in parts if "dropped" in p["header"]])


def rank_label(rank: int, coords: dict[str, int], layout: dict[str, int]) -> str:
    """``r5 pp1 dp0 tp1``: the rank and its coordinate on every mesh dim larger than one
    (``dp`` when dp_shard is the only data-parallel dim, else ``dpr`` / ``dps``)."""
    both = layout.get("dp_replicate", 1) > 1 and layout.get("dp_shard", 1) > 1
    names = dict(_SHORT) if both else {**_SHORT, "dp_replicate": "dp", "dp_shard": "dp"}
    return " ".join([f"r{rank}"] + [f"{names.get(d, d)}{coords.get(d, 0)}" for d, n in layout.items() if n > 1])


# --- output ------------------------------------------------------------------------------------------
def _layout_text(report: Report) -> str:
    dims = " x ".join(f"{d} {n}" for d, n in report.layout.items() if n > 1) or "single rank"
    return f"layout {dims} ({report.world_size} ranks)"


def format_table(report: Report) -> str:
    """A row per rank (ms per step, mean over its traced steps, with % of the step), then
    communication per collective and mesh dim, then the top ops by self time."""
    first, last = report.steps
    out = [f"meshpar profile: {len(report.ranks)} of {report.world_size} ranks traced | {_layout_text(report)} | "
           f"steps {first}-{last} | ms per step: compute + exposed comm + bubble/idle + data + optimizer = step",
           f"{'rank':<18}{'step':>9}{'compute':>15}{'comm':>15}{'exposed comm':>15}{'bubble/idle':>15}"
           f"{'data':>15}{'optimizer':>15}"]
    for r in report.ranks:
        cells = [(r.buckets["compute"]), r.comm_ms, r.buckets["exposed_comm"], r.buckets["bubble"],
                 r.buckets["data"], r.buckets["optimizer"]]
        out.append(f"{r.label:<18}{r.step_ms:>9.1f}" + "".join(
            f"{v:>9.1f} {100 * v / r.step_ms:>3.0f}%" for v in cells))
    n = len(report.ranks)
    out += ["", "communication per collective and mesh dim, mean per traced rank and step: calls labelled by meshpar, "
                "as meshpar's engine counted", "them (with MB), and others (DTensor, pipeline p2p, torch's own; dim ? "
                "when unknown); recv[pp] waits count as bubble",
            f"{'collective':<28}{'meshpar calls':>14}{'engine calls':>13}{'engine MB':>10}{'other calls':>12}"
            f"{'time ms':>10}{'exposed ms':>12}"]
    rows: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0] * 6)
    engine = set()
    for r in report.ranks:
        for c in r.comm:
            engine.update([(c.op, c.dim)] if c.accounted_calls is not None else [])
            values = (c.calls, c.accounted_calls or 0, (c.accounted_bytes or 0) / 1e6, c.other_calls)
            row = rows[(c.op, c.dim)]
            for i, v in enumerate(values):
                row[i] += v / len(r.steps) / n
            row[4] += c.time_ms / n
            row[5] += c.exposed_ms / n
    for (op, dim), (calls, eng, mb, other, ms, exposed) in sorted(rows.items(), key=lambda kv: -kv[1][4]):
        eng_text = (f"{eng:>13.1f}{mb:>10.2f}") if (op, dim) in engine else f"{'-':>13}{'-':>10}"
        out.append(f"{f'{op}[{dim}]':<28}{calls:>14.1f}{eng_text}{other:>12.1f}{ms:>10.1f}{exposed:>12.1f}")
    out += ["", "top ops by self time (mean per traced rank and step)",
            f"{'op':<56}{'ms':>10}{'% step':>8}{'calls':>8}"]
    step = sum(r.step_ms for r in report.ranks) / n
    out += [f"{(name[:48] + ' (comm)' if _is_comm(name) else name)[:55]:<56}{ms:>10.1f}{100 * ms / step:>7.1f}%"
            f"{calls:>8.1f}" for name, ms, calls in report.top_ops]
    dropped = [d for r in report.ranks for d in r.dropped]
    if dropped:
        out.append(f"\nnote: the size cap dropped {sum(d['events'] for d in dropped):,} short events from "
                   f"{len(dropped)} trace(s): op totals undercount")
    return "\n".join(out)


def write_json(report: Report, path: str | Path) -> Path:
    path = Path(path)
    path.write_text(json.dumps(asdict(report), indent=1) + "\n")
    return path


_COLORS = {"compute": "#4c72b0", "exposed_comm": "#dd5143", "bubble": "#c9c9c9", "data": "#55a868",
           "optimizer": "#8172b3"}
_HIDDEN = "#f0a030"
_NAMES = {"compute": "compute", "exposed_comm": "exposed comm", "bubble": "bubble / idle", "data": "data",
          "optimizer": "optimizer"}


def write_chart(report: Report, path: str | Path) -> Path:
    """A PNG: one horizontal bar per rank, ms per step split into the buckets of
    [Note: where step time goes], with communication hidden under compute as a hatched band."""
    try:  # the Figure API renders with Agg and leaves pyplot's global backend alone
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError:
        raise ProfileReportError("the chart needs matplotlib: pip install 'meshpar[profile]'") from None
    path = Path(path)
    ranks = report.ranks
    height = 1.8 + 0.42 * len(ranks)
    fig = Figure(figsize=(12, height), dpi=100)
    ax = fig.subplots()
    ys = range(len(ranks))
    order = ("compute", "exposed_comm", "optimizer", "data", "bubble")
    left = [0.0] * len(ranks)
    for b in order:
        widths = [r.buckets[b] for r in ranks]
        ax.barh(ys, widths, left=left, height=0.7, color=_COLORS[b], edgecolor="white", linewidth=0.5)
        for y, (x0, w, r) in enumerate(zip(left, widths, ranks, strict=True)):
            if w / max(r.step_ms, 1e-9) >= 0.07:
                ax.text(x0 + w / 2, y, f"{100 * w / r.step_ms:.0f}%", ha="center", va="center", fontsize=8,
                        color="white" if b != "bubble" else "black")
        left = [a + w for a, w in zip(left, widths, strict=True)]
    # hidden comm: a thin band along the bottom of the compute segment (it overlaps compute in time)
    ax.barh([y + 0.27 for y in ys], [min(r.hidden_comm_ms, r.buckets["compute"]) for r in ranks], height=0.16,
            color=_HIDDEN, edgecolor="none")
    for y, r in enumerate(ranks):
        ax.text(r.step_ms + 0.005 * max(x.step_ms for x in ranks), y, f"{r.step_ms:,.0f} ms", va="center", fontsize=8)
        if y and r.coordinates.get("pp") != ranks[y - 1].coordinates.get("pp"):
            ax.axhline(y - 0.5, color="black", linewidth=0.6, alpha=0.5)  # between pipeline stages
    ax.set_yticks(list(ys), [r.label for r in ranks], fontsize=9, family="monospace")
    ax.invert_yaxis()
    ax.set_xlabel("ms per step (mean over traced steps)")
    ax.set_xlim(0, max(r.step_ms for r in ranks) * 1.09)
    ax.spines[["top", "right"]].set_visible(False)
    ax.grid(axis="x", alpha=0.3)
    ax.set_axisbelow(True)
    first, last = report.steps
    fig.suptitle(f"meshpar profile | {_layout_text(report)} | steps {first}-{last}", fontsize=11, x=0.01, ha="left")
    handles = [Patch(color=_COLORS[b], label=_NAMES[b]) for b in order]
    handles.append(Patch(color=_HIDDEN, label="comm hidden under compute"))
    fig.legend(handles=handles, ncol=len(handles), loc="upper left", bbox_to_anchor=(0.01, 1 - 0.3 / height),
               fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.45 / height))
    fig.savefig(path)
    return path


def summarize_cli(path: str | Path, *, top: int = 10) -> int:
    """``meshpar profile summary``: print the table, write ``summary.json`` and ``summary.png``
    next to the traces and print their paths; 2 with a one-line error (on stderr) when the
    traces cannot be read."""
    try:
        report = summarize(path, top=top)
    except ProfileReportError as e:
        print(f"meshpar: error: {e}", file=sys.stderr)
        return 2
    print(format_table(report))
    folder = Path(report.folder)
    print(f"\nwrote {write_json(report, folder / 'summary.json')}")
    try:
        print(f"wrote {write_chart(report, folder / 'summary.png')}")
    except ProfileReportError as e:
        print(f"meshpar: no chart: {e}")
    return 0


# --- one timeline for all ranks ---------------------------------------------------------------------
def merge(path: str | Path, out: str | Path | None = None, *, max_mb: float = 200) -> Path:
    """One gzipped Chrome trace with every rank as its own process (pid = rank), all on one clock
    ([Note: one clock for all ranks]); past ``max_mb`` of JSON the shortest non-``meshpar::``
    events go first, as in [Note: the size cap] (meshpar/profiling.py), recorded under
    ``meshpar.dropped``. Opens in ui.perfetto.dev or chrome://tracing."""
    files = find_traces(path)
    traces = [(f, load_trace(f)) for f in files]
    for f, t in traces:
        if not isinstance(t.get("baseTimeNanoseconds"), int):
            raise ProfileReportError(f"{f}: no baseTimeNanoseconds, so its clock cannot be aligned with the others")
    base = min(t["baseTimeNanoseconds"] for _, t in traces)
    shifted = []  # (rank, header, events, shift in us): [Note: one clock for all ranks]
    for f, t in traces:
        xs = [e for e in t["traceEvents"] if isinstance(e.get("pid"), int) and "ts" in e]  # not the profiler's own
        if not any(e.get("ph") != "M" for e in xs):
            raise ProfileReportError(f"{f}: no events")
        shifted.append((int(t["meshpar"]["rank"]), t["meshpar"], xs, (t["baseTimeNanoseconds"] - base) / 1e3))
    t0 = min(min(e["ts"] for e in xs if e.get("ph") != "M") + s for _, _, xs, s in shifted)
    events: list[dict[str, Any]] = []
    ranks_meta = []
    for i, (rank, header, xs, shift) in enumerate(shifted):
        main = next((e["tid"] for e in xs if e.get("name") == "meshpar::step"), None)
        label = rank_label(rank, header["coordinates"], header["layout"])
        events += [{"ph": "M", "name": "process_name", "pid": rank, "tid": 0,
                    "args": {"name": f"rank {rank} ({label.split(' ', 1)[1] if ' ' in label else 'single'})"}},
                   {"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}}]
        if main is not None:
            events += [{"ph": "M", "name": "thread_name", "pid": rank, "tid": main, "args": {"name": "main"}},
                       {"ph": "M", "name": "thread_sort_index", "pid": rank, "tid": main, "args": {"sort_index": -1}}]
        for e in xs:
            if e.get("ph") == "M" and (e.get("name", "").startswith("process_") or e.get("tid") == main):
                continue
            e = {**e, "pid": rank, "ts": e["ts"] + shift - t0}
            if "id" in e and e.get("ph") in ("s", "f", "t"):
                e["id"] = int(e["id"]) * len(shifted) + i  # flow ids are per trace: keep them apart
            events.append(e)
        ranks_meta.append({"rank": rank, "label": label, "steps": header["steps"], "dropped": header.get("dropped")})
    merged = {"traceEvents": events, "displayTimeUnit": "ms",
              "meshpar": {"merged": True, "world_size": traces[0][1]["meshpar"]["world_size"],
                          "layout": traces[0][1]["meshpar"]["layout"], "ranks": ranks_meta,
                          "origin_epoch_us": base / 1e3 + t0,
                          "clock": "ts = microseconds since origin_epoch_us on the hosts' wall clock "
                                   "(each trace's baseTimeNanoseconds / 1000 + ts)"}}
    cap = int(max_mb * 2**20)
    if len(json.dumps(merged)) > cap:  # flow arrows go first: they would point at dropped events
        flows = sum(e.get("ph") in ("s", "f", "t") for e in merged["traceEvents"])
        merged["traceEvents"] = [e for e in merged["traceEvents"] if e.get("ph") not in ("s", "f", "t")]
        cap_trace(merged, cap)
        merged["meshpar"].setdefault("dropped", {})["flow_events"] = flows
        if len(json.dumps(merged)) > cap:
            merged["meshpar"]["dropped"]["over_cap"] = "the meshpar:: labels alone are larger than the cap"
    out = Path(out) if out is not None else files[0].parent / "merged.json.gz"
    with gzip.open(out, "wt", compresslevel=6) as f:
        json.dump(merged, f)
    return out


# --- intervals: sorted, disjoint (start, end) lists ---------------------------------------------------
def _union(ivs: Intervals) -> Intervals:
    out: Intervals = []
    for a, b in sorted(ivs):
        if out and a <= out[-1][1]:
            if b > out[-1][1]:
                out[-1] = (out[-1][0], b)
        elif b > a:
            out.append((a, b))
    return out


def _length(ivs: Intervals) -> float:
    return sum(b - a for a, b in ivs)


def _intersect(x: Intervals, y: Intervals) -> Intervals:
    out, i, j = [], 0, 0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if a < b:
            out.append((a, b))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return out


def _subtract(x: Intervals, y: Intervals) -> Intervals:
    out, j = [], 0
    for a, b in x:
        while j < len(y) and y[j][1] <= a:
            j += 1
        k = j
        while k < len(y) and y[k][0] < b:
            if y[k][0] > a:
                out.append((a, y[k][0]))
            a = max(a, y[k][1])
            k += 1
        if a < b:
            out.append((a, b))
    return out
