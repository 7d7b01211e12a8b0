"""The report as a table, JSON and a PNG chart, and ``meshpar profile summary``."""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path

from meshpar.profiling.report.analysis import Report, summarize
from meshpar.profiling.report.attribution import _is_comm
from meshpar.profiling.report.traces import ProfileReportError


def _layout_text(report: Report) -> str:
    dims = " x ".join(f"{d} {n}" for d, n in report.layout.items() if n > 1) or "single rank"
    return f"layout {dims} ({report.world_size} ranks)"


def format_table(report: Report) -> str:
    """A row per rank (ms per step, mean over its traced steps, with % of the step), then
    communication per collective and mesh dim, the all-to-all per MoE layer (expert parallelism
    only), then the top ops by self time."""
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
    out += _moe_table(report)
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


def _moe_table(report: Report) -> list[str]:
    """The expert all-to-all per MoE layer, mean per traced rank and step ([Note: all-to-all per
    MoE layer]), then what the layers leave of each collective; nothing for a run without experts."""
    if not any(r.moe_layers for r in report.ranks):
        return []
    out = ["", "all-to-all per MoE layer (expert parallelism: meshpar::moe.dispatch / combine[<layer>], forward and "
               "backward), mean per traced", "rank and step; 'rest' is the collective outside the layers' ranges "
               "(the token-count exchange before each layer's dispatch)",
           f"{'layer':<7}{'collective':<17}{'calls':>7}{'forward ms':>12}{'recompute ms':>14}{'backward ms':>13}"
           f"{'dispatch ms':>13}{'combine ms':>12}{'time ms':>9}{'exposed ms':>12}"]
    n = len(report.ranks)
    rows: dict[tuple[int, str], list[float]] = defaultdict(lambda: [0.0] * 8)
    for r in report.ranks:
        for x in r.moe_layers:
            by = [sum(v for k, v in x.part_ms.items() if k.startswith(p)) for p in ("forward", "recompute", "backward")]
            by += [sum(v for k, v in x.part_ms.items() if k.endswith(p)) for p in ("dispatch", "combine")]
            for i, v in enumerate([x.calls / len(r.steps), *by, x.time_ms, x.exposed_ms]):
                rows[(x.layer, f"{x.op}[{x.dim}]")][i] += v / n
    for (layer, collective), (calls, *ms) in sorted(rows.items()):
        out.append(f"{layer:<7}{collective:<17}{calls:>7.1f}" + "".join(
            f"{v:>{w}.1f}" for v, w in zip(ms, (12, 14, 13, 13, 12, 9, 12), strict=True)))
    for collective in sorted({c for _, c in rows}):
        calls, ms = 0.0, 0.0
        for r in report.ranks:
            line = next((c for c in r.comm if f"{c.op}[{c.dim}]" == collective), None)
            layers = [x for x in r.moe_layers if f"{x.op}[{x.dim}]" == collective]
            if line is not None:
                calls += (line.calls - sum(x.calls for x in layers)) / len(r.steps) / n
                ms += (line.time_ms - sum(x.time_ms for x in layers)) / n
        out.append(f"{'rest':<7}{collective:<17}{calls:>7.1f}{'':>76}{ms:>9.1f}")
    return out


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
