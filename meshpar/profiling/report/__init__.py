"""Reading meshpar's profiler traces: where each rank's step time goes, and one timeline of all ranks.

    report = summarize("runs/llama_debug_3d")      # the run folder or its traces/ folder
    print(format_table(report)); write_json(report, "summary.json"); write_chart(report, "summary.png")
    merge("runs/llama_debug_3d")                   # -> traces/merged.json.gz, open in ui.perfetto.dev

The input is what meshpar/profiling/capture.py writes: one gzipped Chrome trace per traced rank and
profiled window, ``traces/rank<r>.steps<a>-<b>.json.gz``, with a ``meshpar`` header (layout,
coordinates, steps, the engine's own communication accounting). Any subset of ranks may be
traced (``profile.ranks``); the report covers the ranks it finds.

The package, in reading order: ``analysis.py`` (summarize: the buckets of a step, per rank;
[Note: where step time goes]), ``attribution.py`` (which collective and mesh dim each piece of
communication is; [Note: the mesh dim of a collective]), ``moe.py`` (expert parallelism's
all-to-all per MoE layer; [Note: all-to-all per MoE layer]), ``intervals.py``, ``traces.py``
(finding and checking trace files), ``output.py`` (table, JSON, chart, ``meshpar profile summary``) and
``merge.py`` (one timeline; [Note: one clock for all ranks]).
"""

from meshpar.profiling.report.analysis import BUCKETS, CommLine, RankSummary, Report, rank_label, summarize
from meshpar.profiling.report.intervals import _intersect, _length, _subtract, _union  # noqa: F401 - tests
from meshpar.profiling.report.merge import merge
from meshpar.profiling.report.moe import LayerAllToAll
from meshpar.profiling.report.output import format_table, summarize_cli, write_chart, write_json
from meshpar.profiling.report.traces import ProfileReportError, find_traces, load_trace

__all__ = [
    "BUCKETS", "CommLine", "LayerAllToAll", "ProfileReportError", "RankSummary", "Report", "find_traces",
    "format_table", "load_trace", "merge", "rank_label", "summarize", "summarize_cli", "write_chart", "write_json",
]
