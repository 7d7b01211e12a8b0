"""meshpar's FSDP engine next to PyTorch's ``fully_shard``, DDP and plain PyTorch, on gloo.

    python -m tests.benchmarks.bench_fsdp [--model debug|100m|all] [--ranks 1,2,4] [--steps N]
                                          [--warmup N] [--engines a,b] [--json runs/bench_fsdp.json]

For each model and rank count, one spawned job (1 thread per rank) trains every engine in
turn from the same initial values on the same global batch (each rank its slice): fused AdamW
(meshpar's optimizer), loss = cross-entropy on random tokens. Per engine it reports

- step time: median over the timed steps of the slowest rank's forward + backward + step,
  after warmup steps (ranks start each step together at a barrier);
- peak memory: live tensor bytes over one more step, the largest rank (probes.PeakMemory);
- persistent memory: parameter + gradient + AdamW-state storage bytes held by a rank;
- communication per step and rank: meshpar from ``meshpar.distributed.comm_record.count()``, PyTorch's engine
  from its calls of torch.distributed's functions, DDP from the dispatcher (its reducer
  calls C++ directly); all as ring bytes (see probes.py [Note: what each engine calls on gloo]).

Both FSDP engines wrap each block of ``model.layers`` and then the root (meshpar/parallel/parallelize.py),
passing every unit, the root included, the same explicit ``reshard_after_forward``: True
("reshard", the root too is freed after forward and gathered again for backward) or False
("keep").
Models are built on CPU and sharded from there (meshpar's meta-device path is not used).
Goals are checked against the printed ratios; see ``_goal_lines``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from meshpar.distributed import comm_record
from meshpar.models.llama import LLAMA_SIZES, Transformer
from meshpar.models.llama.args import ModelArgs
from tests.benchmarks.probes import DispatchedCollectives, PeakMemory, PythonCollectives, persistent_bytes
from tests.distributed import run_distributed

F32 = 4
MiB = 2**20


@dataclass(frozen=True)
class Workload:
    args: ModelArgs
    seq_len: int
    global_batch: int  # sequences per step over all ranks; divisible by every rank count
    warmup: int
    steps: int  # timed steps


WORKLOADS = {
    # ~4.2M parameters: the engines' per-step overheads dominate
    "debug": Workload(LLAMA_SIZES["debug"], seq_len=128, global_batch=8, warmup=3, steps=8),
    # 100,685,568 parameters: dim 768, 14 blocks of 6.29M, vocab 8192 (embedding and output 6.29M each)
    "100m": Workload(dataclasses.replace(LLAMA_SIZES["debug"], dim=768, n_layers=14, n_heads=12, n_kv_heads=4,
                                         ffn_dim=2048, vocab_size=8192),
                     seq_len=64, global_batch=4, warmup=2, steps=3),
}


def _fsdp(shard: Callable, reshard: bool) -> Callable[[nn.Module, Any], nn.Module]:
    def wrap(model: nn.Module, mesh: Any) -> nn.Module:
        for block in model.layers.values():
            shard(block, mesh=mesh, reshard_after_forward=reshard)
        shard(model, mesh=mesh, reshard_after_forward=reshard)
        return model

    return wrap


def _wrap(engine: str, model: nn.Module, mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.nn.parallel import DistributedDataParallel

    from meshpar.fsdp import fully_shard

    if engine == "plain":
        return model
    if engine == "ddp":  # RoPE tables are constant buffers: no per-forward broadcast
        return DistributedDataParallel(model, broadcast_buffers=False)
    shard = fully_shard if engine.startswith("meshpar") else torch_fully_shard
    return _fsdp(shard, reshard=not engine.endswith("keep"))(model, mesh)


ENGINES = ("plain", "meshpar", "meshpar keep", "torch", "torch keep", "ddp")  # plain: 1 rank only


def _batch(w: Workload, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of the fixed global batch: inputs, targets[B / world, seq_len]."""
    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, w.args.vocab_size, (w.global_batch, w.seq_len + 1), generator=g)
    mine = tokens.chunk(world)[rank]
    return mine[:, :-1].contiguous(), mine[:, 1:].contiguous()


class _Trainer:
    """One engine's model, AdamW and this rank's batch; ``step()`` is one training step."""

    def __init__(self, w: Workload, engine: str, mesh: Any) -> None:
        rank, world = dist.get_rank(), dist.get_world_size()
        self.engine = engine
        torch.manual_seed(0)
        model = Transformer(w.args)
        model.init_weights()  # the same values on every rank and for every engine
        self.model = _wrap(engine, model, mesh)
        # fused, as meshpar's training uses it (meshpar/training/optim.py), for every engine alike
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
        self.inputs, self.targets = _batch(w, rank, world)
        self.losses: list[float] = []
        self.times: list[float] = []

    def step(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(self.model(self.inputs).flatten(0, 1).float(), self.targets.flatten())
        loss.backward()
        self.opt.step()
        self.losses.append(loss.item())

    def timed_step(self) -> None:
        dist.barrier()  # every rank starts together; the step's time is the slowest rank's
        start = time.perf_counter()
        self.step()
        self.times.append(time.perf_counter() - start)

    def probe(self, name: str) -> dict[str, Any]:
        """One more step, counting collectives and live tensor memory; then the record."""
        dist.barrier()
        with comm_record.count() as meshpar_comm, PythonCollectives() as python_comm, \
                DispatchedCollectives() as dispatched, \
                PeakMemory(self.model, self.opt, self.inputs, self.targets) as memory:
            self.step()
        return dict(model=name, engine=self.engine, ranks=dist.get_world_size(), rank=dist.get_rank(),
                    times=self.times, losses=[self.losses[0], self.losses[-1]],
                    peak=memory.peak_bytes, peak_breakdown=memory.peak_breakdown(),
                    persistent=persistent_bytes(self.model, self.opt),
                    comm={"meshpar": _counts(meshpar_comm), "python": _counts(python_comm),
                          "dispatched": _counts(dispatched.counter)})


def _counts(counter: comm_record.CommCounter) -> dict[str, dict[str, float]]:
    ops = sorted({op for op, _ in counter.calls})
    return {op: {"calls": counter.total_calls(op), "bytes": counter.total_bytes(op)} for op in ops}


def _run_interleaved(name: str, w: Workload, engines: list[str], mesh: Any) -> list[dict]:
    """Train ``engines`` side by side, one step of each in turn, so that load from other
    processes on the machine falls on all of them alike; then probe each in turn."""
    trainers = [_Trainer(w, e, mesh) for e in engines]
    for _ in range(w.warmup):
        for t in trainers:
            t.step()
    for _ in range(w.steps):
        for t in trainers:
            t.timed_step()
    records = []
    while trainers:
        records.append(trainers.pop(0).probe(name))
        gc.collect()
    return records


# Engines trained side by side, one step of each in turn; each group holds the engines one goal
# compares (at 1 rank, plain too). Groups run one after another to bound memory: a rank
# holds two or three models' state at a time, and DDP's whole replica on its own.
GROUPS = (("plain", "meshpar", "torch"), ("meshpar keep", "torch keep"), ("ddp",))


def _rank_job(models: list[str], engines: list[str], steps: int | None, warmup: int | None) -> list[dict]:
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    records = []
    for name in models:
        w = _workload(name, steps, warmup)
        for group in GROUPS:
            chosen = [e for e in group if e in engines and (e != "plain" or world == 1)]
            if chosen:
                records += _run_interleaved(name, w, chosen, mesh)
    return records


def _workload(name: str, steps: int | None, warmup: int | None) -> Workload:
    return dataclasses.replace(WORKLOADS[name], **{k: v for k, v in (("steps", steps), ("warmup", warmup))
                                                   if v is not None})


# --- aggregation --------------------------------------------------------------------------------

def _summarize(per_rank: list[list[dict]], params: dict[str, int], units: dict[str, int]) -> list[dict]:
    """One row per (model, engine, ranks): the slowest rank per step, the largest rank's memory."""
    rows = []
    for records in zip(*per_rank, strict=True):
        r0, n = records[0], records[0]["ranks"]
        psi, engine = params[r0["model"]], r0["engine"]
        step_s = statistics.median(max(ts) for ts in zip(*(r["times"] for r in records), strict=True))
        source = {"meshpar": "meshpar", "meshpar keep": "meshpar", "torch": "python", "torch keep": "python"}
        counts = r0["comm"][source.get(engine, "dispatched")]
        total = sum(c["bytes"] for c in counts.values())
        reshard = engine in ("meshpar", "torch")
        ideal = (3 if reshard else 2) * psi * (n - 1) / n * F32
        persistent = max(sum(r["persistent"].values()) for r in records)
        rows.append(dict(
            model=r0["model"], engine=engine, ranks=n, params=psi, units=units[r0["model"]],
            step_ms=step_s * 1e3,
            step_ms_all=[1e3 * max(ts) for ts in zip(*(r["times"] for r in records), strict=True)],
            loss_first=r0["losses"][0], loss_last=r0["losses"][1],
            peak_bytes=max(r["peak"] for r in records), peak_breakdown=r0["peak_breakdown"],
            persistent_bytes=persistent, persistent_parts=r0["persistent"],
            persistent_vs_ideal=persistent / (16 * psi / n),
            comm=counts, comm_cross_check=r0["comm"]["dispatched"], comm_bytes=total,
            bytes_vs_ideal=total / ideal if ideal else None,
            all_gather_per_unit=counts.get("all_gather", {}).get("calls", 0) / units[r0["model"]],
            reduce_scatter_per_unit=counts.get("reduce_scatter", {}).get("calls", 0) / units[r0["model"]],
        ))
    return rows


def _find(rows: list[dict], model: str, engine: str, ranks: int) -> dict | None:
    return next((r for r in rows if (r["model"], r["engine"], r["ranks"]) == (model, engine, ranks)), None)


def _ratios(rows: list[dict], model: str, ranks: list[int]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for n in ranks:
        entry: dict[str, Any] = {}
        pairs = {"reshard": ("meshpar", "torch"), "keep": ("meshpar keep", "torch keep")}
        for setting, (mine, theirs) in pairs.items():
            a, b = _find(rows, model, mine, n), _find(rows, model, theirs, n)
            if a and b:
                entry[f"step_time_{setting}"] = a["step_ms"] / b["step_ms"]
                entry[f"peak_memory_{setting}"] = a["peak_bytes"] / b["peak_bytes"]
            if a:
                entry[f"bytes_vs_ideal_{setting}"] = a["bytes_vs_ideal"]
                entry[f"all_gather_per_unit_{setting}"] = a["all_gather_per_unit"]
                entry[f"reduce_scatter_per_unit_{setting}"] = a["reduce_scatter_per_unit"]
                entry[f"persistent_vs_ideal_{setting}"] = a["persistent_vs_ideal"]
        plain, mine = _find(rows, model, "plain", n), _find(rows, model, "meshpar", n)
        if plain and mine:
            entry["step_time_vs_plain"] = mine["step_ms"] / plain["step_ms"]
            keep = _find(rows, model, "meshpar keep", n)
            if keep:
                entry["step_time_keep_vs_plain"] = keep["step_ms"] / plain["step_ms"]
        out[str(n)] = entry
    return out


# --- output -------------------------------------------------------------------------------------

def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def _print_table(model: str, w: Workload, rows: list[dict]) -> None:
    r0 = rows[0]
    print(f"\n== llama {model}: psi = {r0['params']:,} params, {r0['units']} FSDP units "
          f"(dim {w.args.dim}, {w.args.n_layers} blocks, vocab {w.args.vocab_size}); seq {w.seq_len}, "
          f"global batch {w.global_batch}; {w.warmup} warmup + {w.steps} timed steps")
    head = (f"{'N':>2} {'engine':<13}{'step ms':>9} {'peak MiB':>9} {'persist MiB':>11} {'/16psi/N':>8} "
            f"{'AG/unit':>7} {'RS/unit':>7} {'other calls':<22}{'comm MiB':>9} {'/ideal':>7} {'loss0':>7}")
    print(head)
    print("-" * len(head))
    for r in rows:
        other = ", ".join(f"{op} {c['calls']}" for op, c in r["comm"].items()
                          if op not in ("all_gather", "reduce_scatter"))
        print(f"{r['ranks']:>2} {r['engine']:<13}{r['step_ms']:>9.1f} {r['peak_bytes'] / MiB:>9.1f} "
              f"{r['persistent_bytes'] / MiB:>11.1f} {r['persistent_vs_ideal']:>8.3f} "
              f"{r['all_gather_per_unit']:>7.2f} {r['reduce_scatter_per_unit']:>7.2f} {other:<22}"
              f"{r['comm_bytes'] / MiB:>9.1f} {_fmt(r['bytes_vs_ideal']):>7} {r['loss_first']:>7.4f}")


def _goal_lines(model: str, ratios: dict[str, dict], units: int) -> list[str]:
    lines = []
    for n, e in ratios.items():
        def check(label: str, key: str, limit: float, *, at_least: int = 1, n: str = n, e: dict = e) -> None:
            if key in e and int(n) >= at_least:
                ok = e[key] <= limit
                lines.append(f"  N={n} {label:<44} {e[key]:7.3f}  (goal <= {limit})  {'met' if ok else 'NOT MET'}")

        check("step time meshpar/torch (reshard)", "step_time_reshard", 1.0, at_least=2)
        check("step time meshpar/torch (keep)", "step_time_keep", 1.0, at_least=2)
        check("peak memory meshpar/torch (reshard)", "peak_memory_reshard", 1.0)
        check("peak memory meshpar/torch (keep)", "peak_memory_keep", 1.0)
        check("bytes / ideal (reshard: 3 psi (N-1)/N x 4)", "bytes_vs_ideal_reshard", 1.01, at_least=2)
        check("bytes / ideal (keep: 2 psi (N-1)/N x 4)", "bytes_vs_ideal_keep", 1.01, at_least=2)
        check("persistent / (16 psi / N) (reshard)", "persistent_vs_ideal_reshard", 1.02)
        check("persistent / (16 psi / N) (keep)", "persistent_vs_ideal_keep", 1.02)
        check("step time meshpar/plain (1 rank)", "step_time_vs_plain", 1.05)
        check("step time meshpar keep/plain (1 rank)", "step_time_keep_vs_plain", 1.05)
        if int(n) >= 2:
            for setting, ag in (("reshard", 2), ("keep", 1)):
                if f"all_gather_per_unit_{setting}" in e:
                    got = (e[f"all_gather_per_unit_{setting}"], e[f"reduce_scatter_per_unit_{setting}"])
                    # every unit, the root included, is given reshard_after_forward explicitly
                    ok = got == (ag, 1.0)
                    lines.append(f"  N={n} all-gathers, reduce-scatters per unit ({setting})".ljust(50)
                                 + f" {got[0]:.2f}, {got[1]:.2f}  (goal {ag}, 1)  {'met' if ok else 'NOT MET'}")
    return [f"goals, {model}:"] + lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="all", choices=[*WORKLOADS, "all"])
    parser.add_argument("--ranks", default="1,2,4", help="comma-separated rank counts")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default: per model)")
    parser.add_argument("--warmup", type=int, default=None, help="warmup steps (default: per model)")
    parser.add_argument("--engines", default=",".join(ENGINES), help=f"subset of {', '.join(ENGINES)}")
    parser.add_argument("--json", default="runs/bench_fsdp.json", help="where to write the results")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per rank count")
    args = parser.parse_args(argv)
    models = list(WORKLOADS) if args.model == "all" else [args.model]
    ranks = [int(x) for x in args.ranks.split(",")]
    engines = [e.strip() for e in args.engines.split(",")]
    if unknown := set(engines) - set(ENGINES):
        parser.error(f"unknown engines {sorted(unknown)}; choose from {', '.join(ENGINES)}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    workloads = {m: _workload(m, args.steps, args.warmup) for m in models}
    for m, w in workloads.items():
        bad = [n for n in ranks if w.global_batch % n]
        if bad:
            parser.error(f"model {m}: global batch {w.global_batch} does not split over {bad} ranks")
    params = {m: sum(p.numel() for p in Transformer(w.args).parameters()) for m, w in workloads.items()}
    units = {m: w.args.n_layers + 1 for m, w in workloads.items()}

    rows: list[dict] = []
    started = time.perf_counter()
    for n in ranks:
        t0 = time.perf_counter()
        per_rank = run_distributed(_rank_job, n, models, engines, args.steps, args.warmup, timeout=args.timeout)
        rows += _summarize(per_rank, params, units)
        print(f"[{n} rank(s): {time.perf_counter() - t0:.0f} s]", flush=True)

    report: dict[str, Any] = {"torch": torch.__version__, "ranks": ranks, "models": {}, "rows": rows,
                              "wall_s": time.perf_counter() - started}
    for m in models:
        mine = sorted((r for r in rows if r["model"] == m), key=lambda r: (r["ranks"], ENGINES.index(r["engine"])))
        _print_table(m, workloads[m], mine)
        ratios = _ratios(rows, m, ranks)
        print("\n".join(_goal_lines(m, ratios, units[m])))
        report["models"][m] = dict(params=params[m], units=units[m], ratios=ratios,
                                   workload=dataclasses.asdict(workloads[m]))
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, default=str))
    print(f"\nwrote {path} ({report['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
