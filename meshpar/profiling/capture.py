"""Tracing training steps with the torch profiler: which ranks, which steps, what each trace says.

``StepProfiler`` wraps the training loop (``[profile]`` in the recipe, or ``meshpar train
--profile``). Each traced rank writes, per profiled cycle, one gzipped Chrome trace::

    <train.output_dir>/traces/rank<r>.steps<a>-<b>.json.gz

whose top level carries ``distributedInfo`` (rank, world size, backend: what Holistic Trace
Analysis and Perfetto's tooling read) and ``meshpar`` (the layout, this rank's coordinate on
every mesh dim, its pipeline stage, the steps covered, and the communication meshpar's
engine counted over those steps: calls and bytes per collective and mesh dim). The
``meshpar profile`` commands (meshpar/profiling/report/) read these files.

Every label starts ``meshpar::`` (step, data, forward / backward, optimizer, pipeline stages and
transfers, collectives with their mesh dim, FSDP phases, tensor-parallel redistributions, the
checkpoint save); the list: docs/profiling.md#labels. The tp and pp labels come from
meshpar/profiling/labels.py (the collectives are PyTorch's own).

Notes: [Note: memory in the profiled steps]; the size cap: [Note: the size cap] in report/traces.py.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import ProfilerAction

from meshpar.config.recipe import ProfileConfig, RecipeError
from meshpar.distributed import comm_record
from meshpar.distributed._torch import attach_cuda_oom_observer, dump_cuda_memory_snapshot, record_cuda_memory_history
from meshpar.distributed.mesh import DIMS, Mesh
from meshpar.distributed.tracing import trace_range
from meshpar.profiling.memory import AllocationTracker
from meshpar.profiling.report.traces import cap_trace
from meshpar.runtime.atomic import atomic_path, write_atomic

# [Note: memory in the profiled steps]
# With ``profile.profile_memory``, each traced window also gets a memory record, on any device:
# ``<stem>.memory.json``, live tensor bytes per category (parameters, buffers, gradients,
# activations, temporaries, optimizer state, communication buffers) at the peak and over
# time, from ``meshpar.profiling.memory.AllocationTracker`` (it slows the traced steps: it sees every
# op). On CUDA also the caching allocator's own history, ``<stem>.cuda_memory_snapshot.pickle``
# (open it in https://pytorch.org/memory_viz: blocks, segments, fragmentation, the stack of
# every allocation), recorded from the first step so that an out-of-memory error also leaves
# ``rank<r>.oom_memory_snapshot.pickle``.

def label(name: str):
    """``trace_range("meshpar::<name>")``."""
    return trace_range(f"meshpar::{name}")


def traced_ranks(spec: str, world_size: int, stage_of_rank: list[int]) -> set[int]:
    """The ranks ``profile.ranks`` selects: ``all``, ``rank0``, ``stages`` (the lowest rank of each
    pipeline stage) or a comma-separated list of ranks."""
    spec = spec.strip()
    if spec == "all":
        return set(range(world_size))
    if spec == "rank0":
        return {0}
    if spec == "stages":
        first: dict[int, int] = {}
        for rank, stage in enumerate(stage_of_rank):
            first.setdefault(stage, rank)
        return set(first.values())
    try:
        ranks = {int(x) for x in spec.split(",") if x.strip()}
    except ValueError:
        ranks = None
    if not ranks or any(r < 0 or r >= world_size for r in ranks):
        raise RecipeError(f"profile.ranks = {spec!r}: expected all, rank0, stages or a list of ranks in "
                          f"[0, {world_size}) such as \"0,3\"", "profile.ranks")
    return ranks


def _cuda_in_use() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def check(cfg: ProfileConfig, world_size: int) -> None:
    """Preflight: ``profile.ranks`` names ranks of this world (raises RecipeError)."""
    if cfg.enable:
        traced_ranks(cfg.ranks, world_size, [0] * world_size)


class StepProfiler:
    """The torch profiler over the recipe's schedule on the selected ranks; a no-op elsewhere.

    Use as a context manager around the loop and call ``step()`` after every optimizer step.
    """

    def __init__(self, cfg: ProfileConfig, output_dir: Path, mesh: Mesh, *, record: comm_record.CommRecord,
                 first_step: int = 1, tracked: tuple[Any, ...] = ()):
        self.cfg, self.mesh, self.record = cfg, mesh, record  # record: the run's, counted per step
        rank, world = dist.get_rank(), dist.get_world_size()
        coords = _coordinates(mesh)
        stages = _all_stages(mesh, world)
        self.enabled = cfg.enable and rank in traced_ranks(cfg.ranks, world, stages)
        self.folder = output_dir / "traces"
        self.rank = rank
        self.meta: dict[str, Any] = {"rank": rank, "world_size": world, "layout": {d: getattr(mesh.layout, d)
                                                                                 for d in DIMS},
                                     "coordinates": coords, "pp_stage": coords["pp"]}
        self.step_no = first_step - 1  # the last finished step
        self._recorded: list[int] = []  # steps recorded since the last trace was written
        self._counts: dict[int, comm_record.CommCounter] = {}
        self._counter_cm = None
        self._prof = None
        self._tracked, self._tracker = tracked, None  # [Note: memory in the profiled steps]
        self._cuda_memory = cfg.profile_memory and _cuda_in_use()
        if self.enabled:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if _cuda_in_use():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(
                activities=activities,
                schedule=torch.profiler.schedule(wait=cfg.wait, warmup=cfg.warmup, active=cfg.active,
                                                 repeat=cfg.repeat),
                on_trace_ready=self._write, record_shapes=cfg.record_shapes, profile_memory=cfg.profile_memory,
                with_stack=cfg.with_stack)

    # --- the loop's side ---------------------------------------------------------------------------
    def __enter__(self) -> StepProfiler:
        if self._prof is not None:
            self.folder.mkdir(parents=True, exist_ok=True)
            if self._cuda_memory:  # from the start, so an out-of-memory snapshot has its history
                record_cuda_memory_history(max_entries=200_000)
                attach_cuda_oom_observer(self._on_oom)
            self._prof.__enter__()
            self._begin_step()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._prof is not None:
            self._end_step()
            self._prof.__exit__(*exc)  # writes a window cut short by the end of training

    def step(self) -> None:
        """After each optimizer step."""
        if self._prof is None:
            return
        self._end_step()
        self.step_no += 1
        if self._prof.current_action in (ProfilerAction.RECORD, ProfilerAction.RECORD_AND_SAVE):
            self._recorded.append(self.step_no)
        self._prof.step()  # may call _write, at the end of an active window
        self._begin_step()

    def _begin_step(self) -> None:
        self._counter_cm = self.record.count()
        self._counts[self.step_no + 1] = self._counter_cm.__enter__()
        recording = self._prof.current_action in (ProfilerAction.RECORD, ProfilerAction.RECORD_AND_SAVE)
        if recording and self.cfg.profile_memory and self._tracker is None:
            self._tracker = AllocationTracker(*self._tracked, timeline=True).__enter__()

    def _on_oom(self, device: int, alloc: int, device_alloc: int, device_free: int) -> None:
        path = self.folder / f"rank{self.rank}.oom_memory_snapshot.pickle"
        dump_cuda_memory_snapshot(str(path))
        print(f"meshpar: out of memory on rank {self.rank} (asked for {alloc / 2**30:.2f} GiB, "
              f"{device_free / 2**30:.2f} GiB free); allocator snapshot: {path} (open it in "
              f"https://pytorch.org/memory_viz)", flush=True)

    def _end_step(self) -> None:
        if self._counter_cm is not None:
            self._counter_cm.__exit__(None, None, None)
            self._counter_cm = None

    # --- writing a trace -----------------------------------------------------------------------------
    def _write(self, prof: torch.profiler.profile) -> None:
        if not self._recorded:
            return
        first, last = self._recorded[0], self._recorded[-1]
        self._recorded = []
        self._write_memory(f"rank{self.rank}.steps{first}-{last}")
        raw = self.folder / f".rank{self.rank}.steps{first}-{last}.json"
        prof.export_chrome_trace(str(raw))
        trace = json.loads(raw.read_text())
        raw.unlink()
        steps = range(first, last + 1)
        counts = [self._counts.pop(s, comm_record.CommCounter()) for s in steps]
        self.meta["steps"] = [first, last]
        self.meta["comm"] = {f"{op}[{dim}]": {"calls": sum(c.calls[(op, dim)] for c in counts),
                                              "bytes": sum(c.bytes[(op, dim)] for c in counts)}
                             for op, dim in sorted({k for c in counts for k in c.calls})}
        trace["meshpar"] = dict(self.meta)
        trace.setdefault("distributedInfo", {}).update(rank=self.rank, world_size=self.meta["world_size"])
        cap_trace(trace, int(self.cfg.max_trace_mb * 2**20))
        final = self.folder / f"rank{self.rank}.steps{first}-{last}.json.gz"
        with atomic_path(final) as tmp, gzip.open(tmp, "wt", compresslevel=6) as f:
            json.dump(trace, f)
        for s in list(self._counts):
            if s < first:
                del self._counts[s]


    def _write_memory(self, stem: str) -> None:
        """The memory record of the window that just ended ([Note: memory in the profiled steps])."""
        if self._cuda_memory:
            dump_cuda_memory_snapshot(str(self.folder / f"{stem}.cuda_memory_snapshot.pickle"))
        if self._tracker is None:
            return
        tracker, self._tracker = self._tracker, None
        tracker.__exit__(None, None, None)
        record = {"rank": self.rank, "unit": "bytes", "peak": tracker.peak(),
                  "timeline": [[round(t, 6), point] for t, point in tracker.timeline]}
        write_atomic(self.folder / f"{stem}.memory.json", json.dumps(record))


def _coordinates(mesh: Mesh) -> dict[str, int]:
    return {d: mesh.world.get_local_rank(d) for d in DIMS}


def _all_stages(mesh: Mesh, world: int) -> list[int]:
    """The pipeline stage (pp coordinate) of every global rank."""
    ranks = mesh.world.mesh  # [pp, dp_replicate, dp_shard, cp, tp] -> global rank
    stage = [0] * world
    for pp in range(ranks.shape[0]):
        for r in ranks[pp].flatten().tolist():
            stage[int(r)] = pp
    return stage
