"""Expert parallelism's step time and all-to-all traffic, per layout.

    python -m tests.benchmarks.bench_moe [--layouts all | 1,3,6] [--warmup 2] [--steps 5]
                                         [--json runs/bench_moe.json] [--smoke]
                                         [--recipe recipes/deepseek_v3_debug.toml]

Each layout trains the debug Qwen3-MoE (or ``--recipe``'s model: the debug DeepSeek-V3, with its
shared experts, grouped routing and moving routing bias) (recipes/qwen3_moe_debug.toml: 4 blocks, dim 256, 8
experts top 2 in 3 sparse blocks; here seq_len 128, global batch 8, one microbatch per rank) on
gloo ranks (``tests/distributed.py``, 1 thread per rank) through meshpar's own code, as
calibrate_plan.py does: ``meshpar.parallel.parallelize.build`` from recipe overrides, fused AdamW,
``meshpar.training.step.train_step`` on random tokens. Layouts: 1 rank; dp_shard 2 FSDP only (experts
sharded like every other parameter); dp_shard 2 with ep 2; dp_shard 4 FSDP only; dp_shard 4 with
ep 2; dp_shard 4 with ep 4. Per layout it prints

- step time: median over the timed steps (after warmup) of the slowest rank's step, ranks
  starting each step together at a barrier; its ratio to 1 rank and to the FSDP-only layout
  of the same rank count;
- all-to-all calls and bytes per step and rank on the ``ep`` dim, as ``meshpar.distributed.comm_record.count()``
  recorded them, next to the analytic figure from that step's routing (every ep rank's
  ``tokens_per_expert`` per sparse layer, gathered): per sparse layer a rank sends, forward and
  backward, 2 x (rows for other ranks' experts + rows it computed for other ranks) x dim x
  itemsize, plus (ep - 1) x (n_experts / ep) int64 counts forward ([Note: expert-parallel
  dispatch]; tests/test_expert_parallel.py derives the same). "equal" means every rank, every
  timed step, byte for byte.

``--smoke`` (tests/test_bench_moe.py): 2 ranks, 2 layouts, 1 warmup and 1 timed step, seq 32.

The bytes check by hand: at ep 2 with 4 sequences of 128 tokens per rank, a sparse layer routes
1024 token slots, about half to the other rank's experts, so about 512 rows out and 512 computed
for the other rank, x 256 (dim) x 4 bytes x 2 (forward, backward) x 3 sparse layers = 6 MiB; at
ep 4 (2 sequences per rank) 3/4 of 512 slots leave: 384 + 384 rows, 4.5 MiB. 15 calls per step =
5 per sparse layer (counts, rows and results forward; the two gradients backward). On a loaded
2-core machine the load, not the layout, dominates the step times: the benchmark prints the
ratios and checks only the bytes (it exits non-zero when they differ). Results:
docs/performance.md#expert-parallel-communication.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from meshpar.config import recipe as recipelib
from meshpar.distributed import comm_record
from tests.benchmarks.calibrate_plan import build_training
from tests.distributed import run_distributed

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "qwen3_moe_debug.toml"  # the default --recipe
BASE = ["--train.seq_len=128", "--train.global_batch=8", "--train.eval_every=0"]
EP = ("all_to_all", "ep")

# name -> (ranks, dp_shard, ep); FSDP-only layouts have ep 1
LAYOUTS: dict[str, tuple[int, int, int]] = {
    "1 rank": (1, 1, 1),
    "dp_shard 2 (FSDP only)": (2, 2, 1),
    "dp_shard 2, ep 2": (2, 2, 2),
    "dp_shard 4 (FSDP only)": (4, 4, 1),
    "dp_shard 4, ep 2": (4, 4, 2),
    "dp_shard 4, ep 4": (4, 4, 4),
}


def _overrides(ranks: int, dp_shard: int, ep: int, base: list[str]) -> list[str]:
    global_batch = int(next(o for o in base if o.startswith("--train.global_batch=")).split("=")[1])
    return [*base, f"--parallel.dp_shard={dp_shard}", f"--parallel.ep={ep}",
            f"--train.micro_batch={global_batch // ranks}"]  # one microbatch: tokens_per_expert is the step's


def _expected_bytes(counts: torch.Tensor, every: list[torch.Tensor], rank: int, n: int, dim: int,
                    itemsize: int) -> int:
    """What ep rank ``rank`` sends in one step by [Note: expert-parallel dispatch], from every ep rank's
    ``counts[layers, E]``: its rows for other ranks' experts and the rows it computed for other ranks,
    both forward and backward, plus ``n - 1`` runs of ``E / n`` int64 counts per layer forward."""
    layers, n_experts = counts.shape
    local = n_experts // n
    mine = slice(rank * local, (rank + 1) * local)
    sent_rows = int(counts.sum() - counts[:, mine].sum())
    computed_for_others = sum(int(every[i][:, mine].sum()) for i in range(n) if i != rank)
    return 2 * (sent_rows + computed_for_others) * dim * itemsize + layers * (n - 1) * local * 8


def measure_rank(path: Path, overrides: list[str], warmup: int, steps: int) -> dict:
    """On one gloo rank: per timed step its seconds, the ep all-to-all calls and bytes counted, the
    analytic bytes, and the token slots each expert of each sparse layer received (this rank)."""
    recipe = recipelib.load(path, overrides)
    run = build_training(recipe)
    layout, args, mesh, p = run.layout, run.args, run.mesh, recipe.parallel
    run.loader.generator.manual_seed(dist.get_rank())  # each rank its own tokens, so routing differs by rank
    moes = [moe for stage in run.model.stages for moe in stage.moe_layers()]
    itemsize = getattr(torch, p.param_dtype).itemsize  # the rows travel in the compute dtype
    ep_mesh = mesh.ep if layout.ep > 1 else None
    out: dict = {"times": [], "calls": [], "bytes": [], "expected": [], "load": []}
    for i in range(warmup + steps):
        dist.barrier()  # every rank starts together; the step's time is the slowest rank's
        start = time.perf_counter()
        with comm_record.count() as counted:
            run.step()
        elapsed = time.perf_counter() - start
        expected = 0
        if ep_mesh is not None:
            counts = torch.stack([moe.tokens_per_expert for moe in moes]).to(torch.int64)
            every = [torch.empty_like(counts) for _ in range(layout.ep)]
            dist.all_gather(every, counts, group=ep_mesh.get_group())
            expected = _expected_bytes(counts, every, ep_mesh.get_local_rank(), layout.ep, args.dim, itemsize)
        if i >= warmup:
            out["times"].append(elapsed)
            out["calls"].append(counted.calls[EP])
            out["bytes"].append(int(counted.bytes[EP]))
            out["expected"].append(expected)
            out["load"].append(torch.stack([moe.tokens_per_expert for moe in moes]).tolist())
    return out


def summarize(name: str, ranks: int, ep: int, records: list[dict]) -> dict:
    """One layout's figures from every rank's records."""
    step_s = statistics.median(max(ts) for ts in zip(*(r["times"] for r in records), strict=True))
    sent = [b for r in records for b in r["bytes"]]
    expected = [b for r in records for b in r["expected"]]
    load = torch.tensor([r["load"] for r in records], dtype=torch.float64).sum((0, 1))  # [layers, E], every step
    return {"layout": name, "ranks": ranks, "ep": ep, "step_s": step_s,
            "load_max_over_mean": (load.max(-1).values / load.mean(-1)).max().item(),
            "a2a_calls_per_step": statistics.mean(c for r in records for c in r["calls"]),
            "a2a_bytes_per_step": statistics.mean(sent), "analytic_bytes_per_step": statistics.mean(expected),
            "bytes_equal": sent == expected}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layouts", default="all", help="'all' or 1-based indices, e.g. 1,3,6")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5, help="timed steps")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--smoke", action="store_true", help="2 ranks, 2 layouts, 2 steps, seq 32 (for a test)")
    ap.add_argument("--recipe", type=Path, default=RECIPE, help="a mixture-of-experts debug recipe")
    args = ap.parse_args()
    names = list(LAYOUTS)
    chosen = names if args.layouts == "all" else [names[int(i) - 1] for i in args.layouts.split(",")]
    base = BASE
    if args.smoke:
        chosen, base, args.warmup, args.steps = names[1:3], [*BASE, "--train.seq_len=32"], 1, 1
    print(f"{'layout':<24} {'ranks':>5} {'step ms':>8} {'vs 1 rank':>9} {'vs FSDP':>8} {'a2a calls':>9} "
          f"{'a2a KiB/rank':>12} {'analytic KiB':>12}  bytes      load max/mean", flush=True)
    results: dict[str, dict] = {}
    for name in chosen:
        ranks, dp_shard, ep = LAYOUTS[name]
        records = run_distributed(measure_rank, ranks, args.recipe, _overrides(ranks, dp_shard, ep, base),
                                  args.warmup, args.steps, timeout=900)
        r = results[name] = summarize(name, ranks, ep, records)
        one = results.get("1 rank")
        fsdp = next((s for s in results.values() if s["ranks"] == ranks > 1 and s["ep"] == 1), None)
        r["vs_1_rank"] = r["step_s"] / one["step_s"] if one else None
        r["vs_fsdp"] = r["step_s"] / fsdp["step_s"] if fsdp else None
        ratio = lambda x: f"{x:.2f}x" if x is not None else "-"  # noqa: E731
        print(f"{name:<24} {ranks:>5} {1e3 * r['step_s']:>8.0f} {ratio(r['vs_1_rank']):>9} {ratio(r['vs_fsdp']):>8} "
              f"{r['a2a_calls_per_step']:>9.0f} {r['a2a_bytes_per_step'] / 1024:>12.1f} "
              f"{r['analytic_bytes_per_step'] / 1024:>12.1f}  {'equal' if r['bytes_equal'] else 'NOT EQUAL':<9}  "
              f"{r['load_max_over_mean']:.2f}",
              flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(list(results.values()), indent=2))
    if not all(r["bytes_equal"] for r in results.values()):
        raise SystemExit("all-to-all bytes differ from the analytic figure")


if __name__ == "__main__":
    main()
