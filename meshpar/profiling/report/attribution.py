"""Which collective and mesh dim each piece of communication in a trace is.

[Note: the mesh dim of a collective]
An issue op on the main thread (the outermost ``c10d::*`` / ``_c10d_functional::*`` op) takes
its dim from the enclosing ``meshpar::comm.<op>[<dim>]`` label, or is ``tp`` inside a
``meshpar::tp.*`` label and ``pp`` inside a ``meshpar::pp.send_* / recv_*`` one
(meshpar/profiling/labels.py); an unlabelled op is ``?``. The work runs on a gloo worker thread,
which serves one process group: each of its events votes for the dim of the latest compatible
issue op before it, the thread takes the majority, and its events then match that dim's issue
ops first in, first out (a busy machine may start an item a few places late: ``_match``). Dims
that span all ranks share DeviceMesh's default group, so its threads and one queue; which dims
have a group of their own comes from the trace's ``distributedInfo.pg_config`` (a trace without
it gets a group per dim). Calls per (op, dim) are counted from the labels; bytes come from the
header's accounting (a trace records no sizes). Per-collective exposed times may overlap; the
rank's exposed total counts each instant once.
"""

from __future__ import annotations

import bisect
import re
from collections import Counter, defaultdict
from collections.abc import Iterator

from meshpar.profiling.report.intervals import Intervals

_COMM_LABEL = re.compile(r"meshpar::comm\.(\w+)\[(.+)\]")
_DIM_LABEL = re.compile(r"meshpar::(tp)\..*|meshpar::(pp)\.(?:send|recv)_.*")  # trace_labels.py
_NOT_ISSUES = ("_c10d_functional::wait_tensor", "_c10d_functional::_wrap_tensor_autograd")
_KINDS = ("alltoall", "allgather", "reducescatter", "allreduce", "broadcast", "barrier", "send", "recv",
          "gather", "scatter", "reduce")
_OP_NAMES = {"alltoall": "all_to_all", "allgather": "all_gather", "reducescatter": "reduce_scatter",
             "allreduce": "all_reduce"}


def _is_comm(name: str) -> bool:
    return name.startswith(("c10d::", "_c10d_functional::", "gloo:", "nccl:", "record_param_comms"))


def _kind(name: str) -> str:
    """``c10d::_allgather_base_``, ``gloo:all_gather`` -> ``allgather``."""
    n = name.rsplit(":", 1)[-1].replace("_", "").lower()
    return next((k for k in _KINDS if k in n), n)


def _runs_as(issue_kind: str, gloo_kind: str) -> bool:
    # gloo has no reduce-scatter: torch runs one as an all-reduce, meshpar as an all-to-all
    return issue_kind == gloo_kind or (issue_kind == "reducescatter" and gloo_kind in ("allreduce", "alltoall"))


def _labelled_dims(on_main: list[dict]) -> dict[int, str]:
    """{id(event): dim} for the communication events of the main thread (sorted by start, longest
    first) that lie inside a ``meshpar::tp.*`` or ``meshpar::pp.send_* / recv_*`` label (a gloo
    send / recv span on the main thread, which lasts until the transfer completes: that starts
    inside one); the innermost label wins. One sweep: events on one thread nest."""
    out, stack = {}, []  # stack: (end, dim) of the labels open at the current event
    for e in on_main:
        end = e["ts"] if e["name"].startswith("gloo:") else e["ts"] + e["dur"]
        while stack and stack[-1][0] < end - 1e-3:
            stack.pop()
        if m := _DIM_LABEL.fullmatch(e["name"]):
            stack.append((e["ts"] + e["dur"], m[1] or m[2]))
        elif stack and _is_comm(e["name"]):
            out[id(e)] = stack[-1][1]
    return out


def own_groups(trace: dict) -> set[str] | None:
    """The dims with a process group of their own (``mesh_<dim>`` in the profiler's
    ``distributedInfo.pg_config``); the others run on the default group. None when the trace
    does not say: [Note: the mesh dim of a collective]."""
    config = trace.get("distributedInfo", {}).get("pg_config")
    if not isinstance(config, list):
        return None
    return {c["pg_desc"].removeprefix("mesh_") for c in config
            if isinstance(c, dict) and str(c.get("pg_desc", "")).startswith("mesh_")}


def _attribute(on_main: list[dict], workers: list[dict], own_groups: set[str] | None = None) -> tuple[dict, dict]:
    """Intervals of communication per (op, dim), and calls per (op, dim, "meshpar" or "other"):
    [Note: the mesh dim of a collective]. ``own_groups``: as ``own_groups(trace)`` says, None
    for a group per dim."""
    labels = [e for e in on_main if _COMM_LABEL.fullmatch(e["name"])]
    label_starts = [e["ts"] for e in labels]
    labelled_dim = _labelled_dims(on_main)

    def dim_label(e: dict) -> str:
        return labelled_dim.get(id(e), "?")
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
            dim = dim_label(e)
            calls[(op, dim, "other")] += 1
        issues.append((e["ts"], kind, op, dim))
    starts = [i[0] for i in issues]

    def latest(e: dict) -> tuple | None:  # the latest issue op before e that it can be the work of
        k, j = _kind(e["name"]), bisect.bisect_right(starts, e["ts"]) - 1
        while j >= 0 and not _runs_as(issues[j][1], k):
            j -= 1
        return issues[j] if j >= 0 else None

    def group(dim: str) -> str:  # the process group a dim's collectives run on, when known
        return dim if own_groups is None or dim in own_groups or dim == "?" else "default"
    votes: dict[int, Counter] = defaultdict(Counter)
    for e in workers:
        if (hit := latest(e)) is not None:
            votes[e["tid"]][hit[3]] += 1
    thread_dim = {tid: next((d for d, _ in c.most_common() if d != "?"), "?") for tid, c in votes.items()}
    per_kind: dict[tuple[str, str], Intervals] = defaultdict(list)
    for g in {group(d) for d in thread_dim.values()} | {"?"}:
        queue = [i for i in issues if group(i[3]) == g]  # this group's issue ops, first in first out
        for e, k in _match(queue, sorted((e for e in workers if group(thread_dim.get(e["tid"], "?")) == g),
                                         key=lambda e: e["ts"])):
            kind = _kind(e["name"])
            op, dim = queue[k][2:] if k is not None else (_OP_NAMES.get(kind, kind), thread_dim.get(e["tid"], "?"))
            per_kind[(op, dim)].append((e["ts"], e["ts"] + e["dur"]))
    for e in on_main:  # gloo work run by the main thread itself: p2p send / recv
        if e["name"].startswith("gloo:"):
            kind = _kind(e["name"])
            hit = latest(e) if kind not in ("send", "recv") else None
            op, dim = hit[2:] if hit else (_OP_NAMES.get(kind, kind), dim_label(e))
            per_kind[(op, dim)].append((e["ts"], e["ts"] + e["dur"]))
    return per_kind, calls


REORDER = 4  # how many later issue ops a work event may have started behind ([Note: the mesh dim of a collective])


def _match(queue: list[tuple], events: list[dict]) -> Iterator[tuple[dict, int | None]]:
    """(event, index of its issue op in ``queue`` or None) for a group's worker ``events`` in start
    order: the earliest issue op not yet taken that was issued before the event and runs as it.
    The group's threads take work in issue order, but one of them may start its item after another
    thread started a later one; an issue op passed over stays eligible until ``REORDER`` later ones
    have been taken (one whose work the trace lacks must not hold every later match back)."""
    j, passed = 0, []  # next issue op not yet looked at; those looked at, passed over, and still eligible
    for e in events:
        kind = _kind(e["name"])
        k = next((n for n in passed if _runs_as(queue[n][1], kind)), None)
        if k is not None:
            passed.remove(k)
        else:
            k = next((n for n in range(j, len(queue)) if queue[n][0] <= e["ts"] and _runs_as(queue[n][1], kind)),
                     None)
            if k is not None:
                passed += range(j, k)
                j = k + 1
        passed = [n for n in passed if n >= j - 1 - REORDER]
        yield e, k
