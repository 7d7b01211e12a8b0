"""Finding a run's trace files and checking that each is a meshpar one (written by
meshpar/profiling/capture.py: a Chrome trace with a ``meshpar`` header)."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path
from typing import Any

_TRACE_NAME = re.compile(r"rank(\d+)\.steps(\d+)-(\d+)\.json(\.gz)?")


class ProfileReportError(ValueError):
    """A trace folder or file the report cannot read; the message names the file and the fix."""


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


# [Note: the size cap]
# A trace of a 70B step holds millions of events and viewers fail on files of a few hundred
# MB. ``profile.max_trace_mb`` caps each file (uncompressed JSON): past it, the shortest
# events are dropped first, never ``meshpar::`` labels, until the file fits, and the trace
# records how many were dropped and below which duration.


def cap_trace(trace: dict[str, Any], max_bytes: int) -> None:
    """Drop the shortest non-``meshpar::`` events until the JSON fits in ``max_bytes``
    ([Note: the size cap]); records what was dropped under ``trace["meshpar"]["dropped"]``."""
    events = trace.get("traceEvents", [])
    size = len(json.dumps(trace))
    if size <= max_bytes:
        return
    keep_always = [e for e in events if e.get("ph") != "X" or str(e.get("name", "")).startswith("meshpar::")]
    optional = sorted((e for e in events if e.get("ph") == "X" and not str(e.get("name", "")).startswith("meshpar::")),
                      key=lambda e: -float(e.get("dur", 0)))
    per_event = max(1, size // max(len(events), 1))
    budget = max(0, max_bytes - len(json.dumps({**trace, "traceEvents": keep_always})))
    n = min(len(optional), budget // per_event)
    while True:
        kept = optional[:n]
        trace["traceEvents"] = keep_always + kept
        if len(json.dumps(trace)) <= max_bytes or n == 0:
            break
        n = int(n * 0.9)
    dropped = len(optional) - n
    below = float(optional[n].get("dur", 0)) if n < len(optional) else 0.0
    trace.setdefault("meshpar", {})["dropped"] = {"events": dropped, "shorter_than_us": below,
                                                 "cap_mb": max_bytes / 2**20}
