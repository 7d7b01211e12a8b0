"""The planner's step time and peak memory against ``bench_gpu``'s measurements on one GPU.

    python -m tests.benchmarks.calibrate_gpu RESULTS.json [--efficiency 0.34]

``RESULTS.json`` is what ``python -m tests.benchmarks.bench_gpu --json RESULTS.json`` wrote on
the GPU. For every case meshpar ran (its engine, not plain PyTorch's), this plans the same
recipe (the model size, sequence, batch, bf16 compute, activation checkpointing) on one device
of the GPU's hardware profile and prints, per layout:

- step time: predicted (the planner's own efficiency, or ``--efficiency``) against measured, and
  the compute efficiency the measurement implies (the planner's compute at efficiency 1 over the
  measured step less its optimizer term: one device has no communication);
- peak memory: the planner's peak (every tensor it accounts for) against
  ``torch.cuda.max_memory_allocated``.

It runs on CPU (the planner needs no GPU), after the measurement.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from meshpar.config import recipe as recipelib
from meshpar.planner import plan
from meshpar.planner.cli import load_hardware

GiB = 2**30


def overrides(case: dict) -> list[str]:
    """The recipe ``bench_gpu`` ran, as ``meshpar plan`` overrides."""
    ac = _ac(case)
    return [f"--model.size={case['size']}", f"--train.seq_len={case['seq_len']}",
            f"--train.global_batch={case.get('batch', 1)}", f"--train.micro_batch={case.get('batch', 1)}",
            "--parallel.dp_shard=1", '--parallel.param_dtype="bfloat16"', '--parallel.reduce_dtype="float32"',
            f'--parallel.activation_checkpoint="{ac}"', f"--parallel.compile={str(bool(case.get('compile'))).lower()}",
            "--train.eval_every=0"]


def _ac(case: dict) -> str:
    """bench_gpu's ``ac`` (a bool: full checkpointing per block or none) as the recipe key's value."""
    ac = case.get("ac", "none")
    return {True: "full", False: "none"}.get(ac, ac)


def profile_name(gpu: str) -> str:
    gpu = gpu.lower()
    return "h200" if "h200" in gpu else "a100_80gb" if "a100" in gpu else "h100_sxm"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", type=Path)
    ap.add_argument("--efficiency", type=float, default=None,
                    help="the planner's compute efficiency (default: its own, [Note: the efficiency constants])")
    args = ap.parse_args()
    data = json.loads(args.results.read_text())
    cases = [c for c in data["rows"] if c.get("engine") == "meshpar" and c.get("status") == "ok"]
    gpu = str(data.get("gpu") or data.get("device", ""))
    profile, _ = load_hardware(profile_name(gpu))
    print(f"GPU {gpu}, profile {profile.name}, planner efficiency "
          f"{args.efficiency or 'default (meshpar/planner/cost.py: [Note: the efficiency constants])'}")
    print(f"{'layout':<34} {'measured ms':>11} {'planned ms':>10} {'error':>7} {'implied eff':>11} "
          f"{'measured GiB':>12} {'planned GiB':>11} {'error':>7}")
    implied = []
    for case in cases:
        recipe = recipelib.load(None, overrides(case))
        planned = plan(recipe, 1, profile, efficiency=args.efficiency)
        t = planned.time
        predicted_s = t.step_s
        measured_s = case["step_ms"] / 1e3
        # the compute efficiency the measurement implies: compute at efficiency 1 over what the step
        # took besides the optimizer (one device: no collectives)
        eff = t.compute_s * t.efficiency / (measured_s - t.optimizer_s)
        implied.append(eff)
        planned_gib = max(r.peak_bytes for r in planned.ranks) / GiB
        name = (f"{case['size']} seq {case['seq_len']}{' compile' if case.get('compile') else ''}"
                f"{' AC ' + _ac(case) if _ac(case) != 'none' else ''}")
        mem = case.get("peak_gib")
        mem_err = f"{100 * (planned_gib / mem - 1):>+6.1f}%" if mem else "      -"
        error = 100 * (predicted_s / measured_s - 1)
        print(f"{name:<34} {case['step_ms']:>11.1f} {predicted_s * 1e3:>10.1f} {error:>+6.1f}% "
              f"{eff:>11.3f} {mem or 0:>12.2f} {planned_gib:>11.2f} {mem_err}")
    if implied:
        print(f"implied compute efficiency: {min(implied):.3f} to {max(implied):.3f}")


if __name__ == "__main__":
    main()
