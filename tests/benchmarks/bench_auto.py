"""``meshpar train --auto``'s choice against measurement: the top predicted layouts, each trained.

    python -m tests.benchmarks.bench_auto [--recipe recipes/llama_debug.toml] [--gpus 4] [--top 3] [--steps 12]

The layout search of ``--auto`` (meshpar/planner/auto.py, priced with the recipe's hardware
profile: on this machine the CPU profile) on ``--gpus`` local ranks; then each of the ``--top``
predicted layouts, and the slowest predicted that fits (an order the prediction is sure of),
trains ``--steps`` steps with ``meshpar train`` (its written recipe), and
``meshpar train RECIPE --auto`` itself once more, searching again and training what it picks.
Printed: each layout's predicted and measured tokens/s (the median over the steps after the
first 3) and both orders. No peer launches a searched layout, so there is no ratio against one.
Results: docs/performance.md#train---auto.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from meshpar.config import recipe as recipelib
from meshpar.config.hardware import load_profile
from meshpar.planner.auto import pinned
from meshpar.planner.search import best_recipe, search

ROOT = Path(__file__).resolve().parents[2]


def measured(out: Path) -> float:
    """Median tokens/s of the logged training steps after the first 3."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    speeds = [r["tokens_per_s"] for r in records if "loss" in r and r.get("step", 0) > 3]
    return statistics.median(speeds)


def train(argv: list[str], out: Path) -> float:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "meshpar.cli", "train", *argv, f"--train.output_dir={out}", "--train.log_every=1",
           "--train.eval_every=0", "--metrics.progress=off", "--checkpoint.every=0"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode:
        sys.exit(f"bench_auto: {' '.join(cmd)} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return measured(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", type=Path, default=ROOT / "recipes" / "llama_debug.toml")
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--top", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    overrides = [f"--train.steps={args.steps}"]
    recipe = recipelib.load(args.recipe, overrides)
    profile = load_profile(recipe.metrics.hardware, "cpu")
    results, n, _, _ = search(overrides, args.gpus, profile, gpus_per_node=args.gpus, efficiency=None,
                              top=args.top, path=args.recipe, pinned=pinned(args.recipe, overrides))
    fits = [r for r in results if r.fits]
    # the top predicted, and the slowest dry-run that fits: an order the prediction is sure of
    picks = [*enumerate(fits[:args.top], 1), (len(fits), fits[-1])]
    print(f"bench_auto: {args.recipe.name} on {args.gpus} ranks, {profile.name}: {n} candidates, "
          f"{len(results)} dry-run", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, r in picks:
            path = Path(tmp) / f"top{i}.toml"
            path.write_text(recipelib.dumps(best_recipe(overrides, r, recipe.metrics.hardware, path=args.recipe)))
            speed = train([str(path)], Path(tmp) / f"top{i}")
            rows.append((f"#{i}", " ".join(x.removeprefix("--") for x in r.overrides), r.tokens_per_s, speed))
            print(f"  #{i} measured {speed:,.0f} tokens/s", flush=True)
        out = Path(tmp) / "auto"
        speed = train([str(args.recipe), "--auto", f"--gpus={args.gpus}", *overrides], out)
        picked = " ".join(f"{k}={v}" for k, v in sorted(vars(recipelib.load(out / "auto.toml").parallel).items())
                          if k in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep", "activation_checkpoint"))
        rows.append(("--auto", picked, fits[0].tokens_per_s, speed))
    print(f"\n{'':7} {'predicted':>10} {'measured':>10}  overrides")
    for name, text, predicted, got in rows:
        print(f"{name:7} {predicted:>10,.0f} {got:>10,.0f}  {text}")
    by_measured = " ".join(r[0] for r in sorted(rows[:-1], key=lambda row: -row[3]))
    print(f"predicted order: {' '.join(r[0] for r in rows[:-1])}; measured order: {by_measured}")


if __name__ == "__main__":
    main()
