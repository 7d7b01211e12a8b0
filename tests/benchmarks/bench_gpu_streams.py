"""The FSDP engine's collective path on one GPU: CUDA streams on and off, against no collectives.

    python -m tests.benchmarks.bench_gpu_streams [--size 1b] [--seq 2048] [--steps 5] [--json PATH]
    python -m tests.benchmarks.bench_gpu_streams --smoke      # CPU and gloo, the debug model

One rank, one process group (NCCL on CUDA), meshpar's own training path (``parallelize.build``
with an FSDP unit per block and the root, bf16 compute, fp32 reduction, fused AdamW,
``step.train_step``) on random tokens, in three modes one after the other:

- ``alias``: the one-rank shortcut, no collective ([Note: one data-parallel rank]; in bf16 each
  unit casts its shards into the unsharded parameters, in fp32 they are the shards);
- ``streams``: ``comm_record.force_collectives()`` ([Note: forcing the collectives of one rank]): every
  unit all-gathers and reduce-scatters through NCCL, on the copy-in / all-gather /
  reduce-scatter streams of [Note: CUDA streams in FSDP];
- ``no streams``: the same collectives with MESHPAR_FSDP_STREAMS=0: copy-in on the compute
  stream, collectives as async work (the engine before the streams).

Each mode reports the median step time, the peak allocated memory, the reserved memory after
every step (it must not grow once the first steps are done) and the losses, which must be equal
across modes to bf16 rounding (same arithmetic; the collective copies are exact). With
``--trace`` the ``streams`` mode also exports one step's profiler trace and reports how much of
the NCCL kernels' time ran while another stream computed (the overlap the streams exist for).
One rank's NCCL collectives are device copies, far faster than a real link, so the step-time
differences bound the engine's overheads rather than show what overlap saves across nodes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from meshpar.config import recipe as recipelib
from meshpar.distributed import comm_record
from meshpar.distributed import mesh as meshlib
from meshpar.models import get_family
from meshpar.parallel.parallelize import build
from meshpar.runtime.process import init_process_group, rank_info
from meshpar.training.optim import build_optimizer
from meshpar.training.step import GradSync, Model, train_step

GiB = 2**30
MODES = ("alias", "streams", "no streams")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_mode(mode: str, overrides: list[str], device: torch.device, steps: int, warmup: int,
             trace: Path | None) -> dict:
    os.environ["MESHPAR_FSDP_STREAMS"] = "0" if mode == "no streams" else "1"
    recipe = recipelib.load(None, overrides)
    layout = meshlib.resolve(recipe.parallel, 1)
    family = get_family(recipe.model.family)
    args = family.model_args(recipe.model)
    mesh = meshlib.build(layout, device.type)
    forced = contextlib.nullcontext() if mode == "alias" else comm_record.force_collectives()
    cuda = device.type == "cuda"
    with forced:
        stages = build(family, args, mesh, recipe.parallel, device, recipe.train.seed)
        model = Model(torch.nn.ModuleList(m for _, m in stages), None, False, moe=family.moe)
        optimizer = build_optimizer(model.stages, recipe.optim)
        sync = GradSync.of(mesh, recipe.parallel, recipe.optim)
        gen = torch.Generator().manual_seed(0)
        shape = (recipe.train.micro_batch, recipe.train.seq_len)
        batches = [[(torch.randint(0, args.vocab_size, shape, generator=gen),
                     torch.randint(0, args.vocab_size, shape, generator=gen))] for _ in range(warmup + steps)]
        losses, times, reserved = [], [], []
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        for batch in batches:
            _sync(device)
            start = time.perf_counter()
            result = train_step(model, lambda batch=batch: batch, 1, sync, device, optimizer)
            _sync(device)
            times.append(time.perf_counter() - start)
            losses.append(float(result.loss))
            reserved.append(torch.cuda.memory_reserved(device) / GiB if cuda else 0.0)
        overlap = None
        if trace is not None and mode == "streams":
            overlap = _traced_step(model, batches[-1], sync, device, optimizer, trace)
    out = {"mode": mode, "step_ms": 1e3 * statistics.median(times[warmup:]), "losses": losses,
           "reserved_gib": reserved, "peak_gib": torch.cuda.max_memory_allocated(device) / GiB if cuda else None,
           "nccl_overlap": overlap}
    del model, optimizer, stages
    if cuda:
        torch.cuda.empty_cache()
    return out


def _traced_step(model, batch, sync, device, optimizer, path: Path) -> dict | None:
    """One more step under the profiler; of the NCCL kernels' time, the share during which a kernel
    on another stream ran."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        train_step(model, lambda: batch, 1, sync, device, optimizer)
        _sync(device)
    prof.export_chrome_trace(str(path))
    kernels = [e for e in json.loads(path.read_text()).get("traceEvents", [])
               if e.get("cat") == "kernel" and "dur" in e]
    if not kernels:
        return None
    nccl = [k for k in kernels if "nccl" in k["name"].lower()]
    other = [k for k in kernels if "nccl" not in k["name"].lower()]
    total = sum(k["dur"] for k in nccl)
    covered = 0.0
    for k in nccl:
        start, end = k["ts"], k["ts"] + k["dur"]
        spans = sorted((max(start, o["ts"]), min(end, o["ts"] + o["dur"])) for o in other
                       if o["args"].get("stream") != k["args"].get("stream") and o["ts"] < end
                       and o["ts"] + o["dur"] > start)
        reach = start
        for a, b in spans:  # union of the overlapping intervals
            a = max(a, reach)
            if b > a:
                covered += b - a
                reach = b
    streams = sorted({k["args"].get("stream") for k in nccl})
    return {"nccl_kernels": len(nccl), "nccl_ms": total / 1e3, "overlapped": covered / total if total else 0.0,
            "nccl_streams": streams, "compute_kernels": len(other)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="1b")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--trace", type=Path, help="export one traced step of the streams mode here")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                    help="compute dtype; float32 makes 'alias' the true one-rank shortcut and the three modes "
                         "the same arithmetic, so their losses differ only by the GPU's run-to-run order of "
                         "atomic additions: the test for a race between streams at full size")
    ap.add_argument("--smoke", action="store_true", help="CPU, gloo, the debug model, 2 steps")
    a = ap.parse_args()
    device = torch.device("cpu") if a.smoke else torch.device("cuda", 0)
    if a.smoke:
        a.size, a.seq, a.steps, a.warmup = "debug", 64, 2, 1
    else:
        torch.cuda.set_device(device)
    dtype = "float32" if a.smoke else a.dtype
    overrides = [f"--model.size={a.size}", f"--train.seq_len={a.seq}", f"--train.global_batch={a.batch}",
                 f"--train.micro_batch={a.batch}", "--parallel.dp_shard=1", f'--parallel.param_dtype="{dtype}"',
                 '--parallel.reduce_dtype="float32"', "--train.eval_every=0"]
    init_process_group(device, rank_info())
    print(f"torch {torch.__version__}, "
          f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}, llama {a.size}, seq {a.seq}, "
          f"batch {a.batch}, {dtype} compute")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in MODES:
            trace = (a.trace or Path(tmp) / "trace.json") if mode == "streams" else None
            r = run_mode(mode, overrides, device, a.steps, a.warmup, trace)
            results.append(r)
            grow = r["reserved_gib"][-1] - r["reserved_gib"][a.warmup - 1] if device.type == "cuda" else 0.0
            print(f"{mode:<11} step {r['step_ms']:8.1f} ms  peak {r['peak_gib'] or 0:6.2f} GiB  reserved "
                  f"{', '.join(f'{x:.2f}' for x in r['reserved_gib'])} GiB (growth after warmup {grow:+.3f})  "
                  f"losses {', '.join(f'{x:.4f}' for x in r['losses'])}", flush=True)
            if r["nccl_overlap"]:
                o = r["nccl_overlap"]
                print(f"            {o['nccl_kernels']} NCCL kernels, {o['nccl_ms']:.2f} ms, "
                      f"{100 * o['overlapped']:.0f}% of it beside compute kernels on other streams "
                      f"(NCCL streams {o['nccl_streams']})")
            if a.json:
                a.json.write_text(json.dumps(results, indent=1))
    base = results[0]
    for r in results[1:]:
        diff = max(abs(x - y) / abs(y) for x, y in zip(r["losses"], base["losses"], strict=True))
        print(f"{r['mode']} / alias: step time {r['step_ms'] / base['step_ms']:.3f}, largest relative loss "
              f"difference {diff:.2e}")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
