"""Trace capture (meshpar/profiling/capture.py): which ranks trace, which steps, the header, the size cap."""

import gzip
import json
from pathlib import Path

import pytest

from meshpar.config.recipe import RecipeError
from meshpar.profiling.capture import traced_ranks
from meshpar.profiling.report.traces import cap_trace
from tests.distributed import run_distributed
from tests.helpers import ROOT, SMALL, load_recipe, train_on_rank


def test_traced_ranks():
    stages = [0, 0, 0, 0, 1, 1, 1, 1]  # pp 2 over 8 ranks
    assert traced_ranks("all", 8, stages) == set(range(8))
    assert traced_ranks("rank0", 8, stages) == {0}
    assert traced_ranks("stages", 8, stages) == {0, 4}
    assert traced_ranks("0, 3", 8, stages) == {0, 3}
    for bad in ("8", "x", "", "-1"):
        with pytest.raises(RecipeError, match=rf"profile\.ranks = {bad!r}: expected all, rank0, stages"):
            traced_ranks(bad, 8, stages)


def test_cap_drops_shortest_events_first_and_keeps_labels():
    events = [{"ph": "X", "name": f"aten::op{i}", "ts": i, "dur": float(i), "pid": 1, "tid": 1} for i in range(2000)]
    events += [{"ph": "X", "name": "meshpar::step", "ts": 0, "dur": 0.5, "pid": 1, "tid": 1}]
    trace = {"traceEvents": events, "meshpar": {"rank": 0}}
    cap = 40_000
    cap_trace(trace, cap)
    assert len(json.dumps(trace)) <= cap
    kept = trace["traceEvents"]
    assert any(e["name"] == "meshpar::step" for e in kept)  # labels survive however short
    durations = sorted(e["dur"] for e in kept if e["name"] != "meshpar::step")
    dropped = trace["meshpar"]["dropped"]
    assert dropped["events"] == 2000 - len(durations) > 0
    assert durations[0] >= dropped["shorter_than_us"]  # everything kept is at least as long as the cut


def test_pipeline_stages_trace_one_rank_each(tmp_path, data_cache):
    """pp 2 x dp_shard 2 with profile.ranks = stages: ranks 0 and 2 write one trace each over the
    active steps, with their coordinates and meshpar's communication accounting in the header."""
    recipe = load_recipe("llama_debug.toml", tmp_path, "--parallel.pp=2", "--parallel.dp_shard=2", "--train.steps=4",
                         "--train.micro_batch=1", "--profile.enable=true", "--profile.ranks=stages")
    run_distributed(train_on_rank, 4, recipe, timeout=240, init_process_group=False)
    files = sorted(p.name for p in (tmp_path / "traces").iterdir())
    assert files == ["rank0.steps3-4.json.gz", "rank2.steps3-4.json.gz"]
    with gzip.open(tmp_path / "traces" / "rank2.steps3-4.json.gz", "rt") as f:
        trace = json.load(f)
    head = trace["meshpar"]
    assert (head["rank"], head["world_size"], head["pp_stage"], head["steps"]) == (2, 4, 1, [3, 4])
    assert head["coordinates"] == {"pp": 1, "dp_replicate": 0, "dp_shard": 0, "cp": 0, "tp": 0}
    assert trace["distributedInfo"]["rank"] == 2
    # every all-gather meshpar issued in the traced steps appears as a labelled event
    names = [e["name"] for e in trace["traceEvents"] if e.get("ph") == "X"]
    issued = sum(n == "meshpar::comm.all_gather[dp_shard]" for n in names)
    assert head["comm"]["all_gather[dp_shard]"]["calls"] == issued > 0
    assert sum(n == "meshpar::step" for n in names) == 2
    assert any(n.startswith("meshpar::pp.forward[1,") for n in names)


def test_allocation_tracker_categories_and_timeline():
    import torch

    from meshpar.distributed.comm_record import comm_buffers
    from meshpar.profiling.memory import AllocationTracker

    model = torch.nn.Linear(64, 64)
    with AllocationTracker(model, timeline=True) as tracker:
        with comm_buffers():
            buffer = torch.empty(1024)  # 4096 bytes, a communication buffer
        model(torch.randn(8, 64)).sum().backward()
        del buffer
    peak = tracker.peak()
    assert peak["Parameter"] == (64 * 64 + 64) * 4
    assert peak["Communication"] == 4096
    assert tracker.current()["Communication"] == 0  # freed
    assert max(point["Total"] for _, point in tracker.timeline) == peak["Total"] == tracker.peak_bytes
    assert [t for t, _ in tracker.timeline] == sorted(t for t, _ in tracker.timeline)


def test_memory_record_of_the_profiled_steps(tmp_path, data_cache):
    """FSDP on 2 ranks with profile.profile_memory: each traced window gets a memory record whose
    peak names parameters, optimizer state and meshpar's communication buffers, and whose
    timeline reaches that peak."""
    recipe = load_recipe("llama_debug.toml", tmp_path, "--parallel.dp_shard=2", "--train.steps=4",
                         "--profile.enable=true", "--profile.profile_memory=true")
    run_distributed(train_on_rank, 2, recipe, timeout=240, init_process_group=False)
    record = json.loads((tmp_path / "traces" / "rank1.steps3-4.memory.json").read_text())
    peak = record["peak"]
    assert peak["Parameter"] > 0 and peak["Optstate"] > 0 and peak["Communication"] > 0, peak
    assert sum(v for k, v in peak.items() if k != "Total") == peak["Total"]
    assert max(point["Total"] for _, point in record["timeline"]) == peak["Total"]


def _train_with_a_stand_in_for_cuda(recipe):
    """A rank whose profiler believes CUDA is in use: the allocator calls are recorded (and the
    snapshot files written as placeholders) instead of made; after training, the out-of-memory
    observer the profiler attached is fired as the allocator would."""
    import torch

    from meshpar.profiling import capture as profiling
    from meshpar.train import train

    calls, observers = [], []

    def dump(path):
        calls.append(("dump", Path(path).name))
        Path(path).write_bytes(b"placeholder")

    profiling._cuda_in_use = lambda: True
    torch.cuda.memory._record_memory_history = lambda **kw: calls.append(("history", kw))
    torch.cuda.memory._dump_snapshot = dump
    torch._C._cuda_attach_out_of_memory_observer = observers.append
    train(recipe)
    calls.append(("training done",))
    assert len(observers) == 1
    observers[0](0, 3 * 2**30, 70 * 2**30, 2**30)  # device, asked, device allocated, device free
    return calls


def test_cuda_memory_snapshots_are_taken_around_the_window_and_on_oom(tmp_path, data_cache, capfd):
    """On CUDA (stood in for: no GPU here) profile_memory records the allocator's history from the
    first step, dumps a snapshot at the end of each traced window beside the per-category record,
    and an out-of-memory error leaves its own snapshot and a message naming it."""
    recipe = load_recipe("llama_debug.toml", tmp_path, "--train.steps=4", "--profile.enable=true",
                         "--profile.profile_memory=true")
    calls = run_distributed(_train_with_a_stand_in_for_cuda, 1, recipe, timeout=240, init_process_group=False)[0]
    assert calls == [("history", {"max_entries": 200_000}),
                     ("dump", "rank0.steps3-4.cuda_memory_snapshot.pickle"),
                     ("training done",),
                     ("dump", "rank0.oom_memory_snapshot.pickle")]
    traces = tmp_path / "traces"
    assert (traces / "rank0.oom_memory_snapshot.pickle").read_bytes() == b"placeholder"
    record = json.loads((traces / "rank0.steps3-4.memory.json").read_text())  # categories on CUDA too
    assert record["peak"]["Parameter"] > 0 and record["peak"]["Optstate"] > 0
    out = capfd.readouterr().out
    assert (f"out of memory on rank 0 (asked for 3.00 GiB, 1.00 GiB free); allocator snapshot: "
            f"{traces / 'rank0.oom_memory_snapshot.pickle'}") in out


def test_cli_profile_then_summarize_and_merge(tmp_path, data_cache):
    """The acceptance path: `meshpar train ... --profile`, then `meshpar profile summarize` and
    `meshpar profile merge` on the run's output folder."""
    import subprocess
    import sys


    run = [sys.executable, "-m", "meshpar"]
    train = subprocess.run([*run, "train", "recipes/llama_debug_2d.toml", *SMALL, "--train.steps=4", "--profile",
                            f"--train.output_dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert train.returncode == 0, train.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "traces").glob("*.json.gz")) == [
        f"rank{r}.steps3-4.json.gz" for r in range(4)]
    summary = subprocess.run([*run, "profile", "summarize", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                             timeout=120)
    assert summary.returncode == 0, summary.stderr
    assert "4 of 4 ranks traced | layout dp_shard 2 x tp 2" in summary.stdout
    assert "all_gather[dp_shard]" in summary.stdout
    png = (tmp_path / "traces" / "summary.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    merged = subprocess.run([*run, "profile", "merge", str(tmp_path / "traces")], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert merged.returncode == 0, merged.stderr
    with gzip.open(tmp_path / "traces" / "merged.json.gz", "rt") as f:
        trace = json.load(f)
    assert {e["pid"] for e in trace["traceEvents"] if e.get("ph") == "X"} == {0, 1, 2, 3}
    (tmp_path / "unprofiled").mkdir()
    missing = subprocess.run([*run, "profile", "summarize", str(tmp_path / "unprofiled")], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "--profile" in missing.stderr, missing.stderr
