"""The profile report on real traces: a 2D run with some ranks traced and a 3D run with all.

Both runs are made once per session (tiny model, 4 steps, the default schedule records steps
3-4); every test reads them. What is checked: one trace per traced rank, carrying its rank and
coordinates; the step buckets partition the step; call counts read from the trace equal the
engine's own accounting in the header; the merged trace puts every rank on one clock and
respects its size cap; the chart is a real PNG; bad input gets errors that name the file.
"""

import gzip
import json
import re
from pathlib import Path

import pytest

from meshpar.distributed.mesh import DIMS
from meshpar.profiling import report as pr
from meshpar.train import train
from tests.distributed import run_distributed
from tests.helpers import load_recipe

LAYOUTS = {  # name: (world, ranks traced, overrides)
    "2d": (4, [0, 3], ["--parallel.dp_shard=2", "--parallel.tp=2", "--profile.ranks=0,3"]),
    "3d": (8, list(range(8)), ["--parallel.pp=2", "--parallel.dp_shard=2", "--parallel.tp=2",
                               "--train.micro_batch=2"]),  # 2 microbatches: the fewest 1f1b takes
}


def _train(recipe) -> None:
    train(recipe)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache) -> dict[str, Path]:
    out = {}
    for name, (world, _, layout) in LAYOUTS.items():
        folder = tmp_path_factory.mktemp(f"profile-{name}")
        recipe = load_recipe("llama_debug.toml", folder, "--train.steps=4", "--profile.enable=true", *layout)
        run_distributed(_train, world, recipe, timeout=240, init_process_group=False)
        out[name] = folder
    return out


@pytest.fixture(scope="module")
def reports(runs) -> dict[str, pr.Report]:
    return {name: pr.summarize(folder) for name, folder in runs.items()}


@pytest.mark.parametrize("name", LAYOUTS)
def test_one_trace_per_traced_rank_with_its_coordinates(name, runs):
    world, traced, _ = LAYOUTS[name]
    files = pr.find_traces(runs[name])
    assert files == pr.find_traces(runs[name] / "traces")  # the run folder or its traces folder
    assert [f.name for f in files] == [f"rank{r}.steps3-4.json.gz" for r in traced]
    for rank, f in zip(traced, files, strict=True):
        trace = pr.load_trace(f)
        assert trace["distributedInfo"]["rank"] == rank and trace["distributedInfo"]["world_size"] == world
        header = trace["meshpar"]
        sizes = [header["layout"][d] for d in DIMS]  # ranks are laid out row-major over DIMS
        coords, rest = {}, rank
        for d, n in reversed(list(zip(DIMS, sizes, strict=True))):
            coords[d], rest = rest % n, rest // n
        assert header["coordinates"] == coords and header["steps"] == [3, 4]


@pytest.mark.parametrize("name", LAYOUTS)
def test_buckets_partition_every_step(name, reports):
    report = reports[name]
    assert [r.rank for r in report.ranks] == LAYOUTS[name][1] and report.world_size == LAYOUTS[name][0]
    for r in report.ranks:
        assert r.steps == [3, 4] and len(r.per_step) == 2
        for row in r.per_step:
            assert all(row[b] >= 0 for b in pr.BUCKETS)
            assert sum(row[b] for b in pr.BUCKETS) == pytest.approx(row["step_ms"], rel=1e-9)
            assert row["compute"] > 0 and row["exposed_comm"] > 0 and row["data"] > 0 and row["optimizer"] > 0
            assert row["hidden_comm"] <= row["comm"] and row["p2p_wait"] <= row["bubble"] + 1e-9
        assert sum(r.buckets.values()) == pytest.approx(r.step_ms, rel=1e-9)
    p2p = sum(row["p2p_wait"] for r in report.ranks for row in r.per_step)
    assert (p2p > 0) == (name == "3d")  # pipeline receive waits are bubble


@pytest.mark.parametrize("name", LAYOUTS)
def test_call_counts_equal_the_engine_accounting(name, reports):
    for r in reports[name].ranks:
        lines = {(c.op, c.dim): c for c in r.comm}
        engine = {k: c for k, c in lines.items() if c.accounted_calls is not None}
        assert {("all_gather", "dp_shard"), ("reduce_scatter", "dp_shard")} <= engine.keys()
        for c in engine.values():
            assert c.calls == c.accounted_calls > 0, c
            assert c.accounted_bytes >= 0
        # DTensor's collectives are tensor parallel; the pipeline's send / recv are pp
        assert lines[("all_reduce", "tp")].other_calls > 0 and lines[("all_reduce", "tp")].time_ms > 0
        assert (("send", "pp") in lines and ("recv", "pp") in lines) == (name == "3d")
        # every collective inside a step found its dim; "?" is the loss all-reduce after a log step
        assert all(c.dim != "?" or c.time_ms == 0 for c in r.comm), r.comm
        assert all(0 <= c.exposed_ms <= c.time_ms + 1e-9 for c in r.comm)


_ISSUE = re.compile(r"(c10d::|_c10d_functional::)(?!wait_tensor|_wrap_tensor_autograd).*")
_LABELLED = re.compile(r"meshpar::(comm\.|tp\.|pp\.(send|recv)_).*")


def test_every_collective_in_a_step_is_labelled(runs):
    """Every collective issued in a step runs under a meshpar label that names its dim or kind
    (meshpar::comm / tp / pp); the pipeline's transfers name their stage and microbatch."""
    for name in LAYOUTS:
        assert pr.find_traces(runs[name]), name
        for f in pr.find_traces(runs[name]):
            trace = pr.load_trace(f)
            events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
            steps = [e for e in events if e["name"] == "meshpar::step"]
            on_main = [e for e in events if e["tid"] == steps[0]["tid"]]

            def within(e, spans):
                return any(s["ts"] <= e["ts"] and e["ts"] + e["dur"] <= s["ts"] + s["dur"] + 1e-3 for s in spans)

            labels = [e for e in on_main if _LABELLED.fullmatch(e["name"])]
            issued = [e for e in on_main if _ISSUE.fullmatch(e["name"]) and within(e, steps)]
            assert len(issued) > 10 and [e["name"] for e in issued if not within(e, labels)] == [], f
            if name == "3d":  # 1f1b, 2 microbatches: stage 0 sends activations and receives gradients
                stage = trace["meshpar"]["coordinates"]["pp"]
                ops = ("send_forward", "recv_backward") if stage == 0 else ("recv_forward", "send_backward")
                def parts(names):  # a mixed batch is labelled pp.send_forward[0,1]+pp.recv_backward[0,0]
                    return {p for n in names for p in n.removeprefix("meshpar::").split("+")}

                issue = parts(e["name"] for e in labels if not e["name"].endswith(".wait"))
                assert {f"pp.{op}[{stage},{m}]" for op in ops for m in (0, 1)} <= issue, f
                waited = parts(e["name"].removesuffix(".wait") for e in on_main if e["name"].endswith(".wait"))
                assert {f"pp.{ops[1 - stage]}[{stage},{m}]" for m in (0, 1)} <= waited, f


def test_table_and_summary_files(runs, reports, capsys):
    table = pr.format_table(reports["2d"])
    assert "2 of 4 ranks traced" in table and "layout dp_shard 2 x tp 2" in table
    assert "r0 dp0 tp0" in table and "r3 dp1 tp1" in table and "all_gather[dp_shard]" in table
    assert pr.summarize_cli(runs["3d"]) == 0
    printed = capsys.readouterr().out
    traces = runs["3d"] / "traces"
    assert "r5 pp1 dp0 tp1" in printed and str(traces / "summary.png") in printed
    summary = json.loads((traces / "summary.json").read_text())
    assert [r["rank"] for r in summary["ranks"]] == list(range(8)) and summary["layout"]["pp"] == 2
    png = (traces / "summary.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert width == 1200 and 300 < height < 900
    assert pr.find_traces(runs["3d"]) == pr.find_traces(traces)  # summary files are not traces


def merged_state(path: Path) -> dict:
    with gzip.open(path, "rt") as f:
        return json.load(f)


def test_merge_puts_every_rank_on_one_clock(runs):
    out = pr.merge(runs["3d"])
    assert out == runs["3d"] / "traces" / "merged.json.gz"
    trace = merged_state(out)
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert names[5] == "rank 5 (pp1 dp0 tp1)" and sorted(names) == list(range(8))
    assert {e["pid"] for e in events} == set(range(8))
    timed = [e for e in events if e.get("ph") == "X"]
    assert min(e["ts"] for e in timed) == pytest.approx(0, abs=1e-6)
    steps = sorted((e["ts"], e["ts"] + e["dur"], e["pid"]) for e in timed if e["name"] == "meshpar::step")
    assert len(steps) == 16
    for k in range(2):  # a step ends with collectives over every rank: the k-th steps of all ranks overlap
        spans = [s for s in steps if sorted(x for x in steps if x[2] == s[2]).index(s) == k]
        assert max(a for a, _, _ in spans) < min(b for _, b, _ in spans)
    assert trace["meshpar"]["origin_epoch_us"] > 1.6e15  # microseconds since the epoch: 2020 or later


def test_merge_respects_the_size_cap_and_keeps_meshpar_labels(runs, tmp_path):
    labels = sum(e.get("name", "").startswith("meshpar::") for f in pr.find_traces(runs["2d"])
                 for e in pr.load_trace(f)["traceEvents"])
    full = pr.merge(runs["2d"], tmp_path / "full.json.gz")
    assert "dropped" not in merged_state(full)["meshpar"]
    # a cap below the labels alone keeps every label and says it is over; the run's own sizes set the
    # cap between that and the whole trace (the labels' JSON varies with the timings' digits)
    tiny = merged_state(pr.merge(runs["2d"], tmp_path / "tiny.json.gz", max_mb=0.01))
    assert sum(e.get("name", "").startswith("meshpar::") for e in tiny["traceEvents"]) == labels
    assert "over_cap" in tiny["meshpar"]["dropped"]
    floor, whole = len(json.dumps(tiny)), len(json.dumps(merged_state(full)))
    assert floor < 0.8 * whole, (floor, whole)
    cap_mb = (floor + whole) // 2 / 2**20  # a whole number of bytes, as the merge keeps its cap
    capped = merged_state(pr.merge(runs["2d"], tmp_path / "capped.json.gz", max_mb=cap_mb))
    assert len(json.dumps(capped)) <= cap_mb * 2**20 < whole
    assert sum(e.get("name", "").startswith("meshpar::") for e in capped["traceEvents"]) == labels
    dropped = capped["meshpar"]["dropped"]
    assert dropped["events"] > 0 and dropped["cap_mb"] == cap_mb and "over_cap" not in dropped


def test_errors_name_the_file_and_the_fix(tmp_path):
    with pytest.raises(pr.ProfileReportError, match="no such file"):
        pr.find_traces(tmp_path / "missing")
    with pytest.raises(pr.ProfileReportError, match=r"no meshpar traces .* --profile\.enable=true"):
        pr.summarize(tmp_path)
    foreign = tmp_path / "rank0.steps1-2.json.gz"
    with gzip.open(foreign, "wt") as f:
        json.dump({"traceEvents": []}, f)
    with pytest.raises(pr.ProfileReportError, match=r"rank0\.steps1-2\.json\.gz: no `meshpar` header.*not written"):
        pr.summarize(tmp_path)
    foreign.write_bytes(b"not gzip")
    with pytest.raises(pr.ProfileReportError, match=r"rank0\.steps1-2\.json\.gz: not a readable Chrome trace"):
        pr.merge(tmp_path)
    assert pr.summarize_cli(tmp_path) == 2


def test_interval_arithmetic():
    a = pr._union([(5, 7), (0, 2), (1, 3), (6, 9)])
    assert a == [(0, 3), (5, 9)]
    assert pr._intersect(a, [(2, 6), (8, 10)]) == [(2, 3), (5, 6), (8, 9)]
    assert pr._subtract(a, [(1, 2), (4, 6), (8, 10)]) == [(0, 1), (2, 3), (6, 8)]
    assert pr._length(a) == 7


def test_work_started_behind_a_later_issue_keeps_its_dim():
    """Two dims on one group (the default one): a gloo thread that mostly runs ep's all-to-alls
    starts the dp_shard all-gather after the other thread started the two all-to-alls issued after
    it (a busy machine, seen in a real trace). It still counts as the all-gather on dp_shard, not as
    an unmatched item of its thread's dim, and every other item as its own issue op's."""
    from meshpar.profiling.report.attribution import _attribute

    def x(name, ts, dur, tid=1):
        return {"name": name, "ts": float(ts), "dur": float(dur), "tid": tid}

    def issued(op, dim, ts):
        name = {"all_gather": "c10d::_allgather_base_", "all_to_all": "c10d::alltoall_base_"}[op]
        return [x(f"meshpar::comm.{op}[{dim}]", ts, 5), x(name, ts + 1, 3)]

    on_main = [*issued("all_gather", "dp_shard", 0), *issued("all_to_all", "ep", 10),
               *issued("all_to_all", "ep", 20), *issued("all_to_all", "ep", 40), *issued("all_to_all", "ep", 50),
               *issued("all_gather", "dp_shard", 60)]
    workers = [x("gloo:all_to_all", 12, 10, tid=3), x("gloo:all_to_all", 23, 10, tid=3),
               x("gloo:all_gather", 25, 10, tid=2), x("gloo:all_to_all", 42, 5, tid=2),
               x("gloo:all_to_all", 52, 5, tid=2), x("gloo:all_gather", 62, 10, tid=3)]
    per_kind, calls = _attribute(on_main, workers, own_groups=set())
    assert per_kind == {("all_to_all", "ep"): [(12.0, 22.0), (23.0, 33.0), (42.0, 47.0), (52.0, 57.0)],
                        ("all_gather", "dp_shard"): [(25.0, 35.0), (62.0, 72.0)]}
    assert calls == {("all_gather", "dp_shard", "meshpar"): 2, ("all_to_all", "ep", "meshpar"): 4}
