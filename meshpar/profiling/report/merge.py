"""One timeline of all ranks: every rank's trace as its own process in one Chrome trace.

[Note: one clock for all ranks]
A trace's ``ts`` are microseconds since its ``baseTimeNanoseconds`` (the profiler's
wall-clock base, nanoseconds since the epoch), so ``base / 1000 + ts`` puts every rank on the
host's wall clock: exact for ranks on one host, as good as the hosts' clock synchronisation
across hosts. The merged trace starts at its earliest event (``ts`` 0) and records that
instant as ``meshpar.origin_epoch_us``.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

from meshpar.profiling.report.analysis import rank_label
from meshpar.profiling.report.traces import ProfileReportError, cap_trace, find_traces, load_trace


def merge(path: str | Path, out: str | Path | None = None, *, max_mb: float = 200) -> Path:
    """One gzipped Chrome trace with every rank as its own process (pid = rank), all on one clock
    ([Note: one clock for all ranks]); past ``max_mb`` of JSON the shortest non-``meshpar::``
    events go first, as in [Note: the size cap] (report/traces.py), recorded under
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
