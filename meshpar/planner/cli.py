"""``meshpar plan``: will a recipe fit on its target cluster, and how fast will it run? Checked here.

    meshpar plan RECIPE [--world N] [--hardware h100_sxm | profiles/X.toml] [--gpus-per-node 8]
                 [--efficiency E] [--all-params] [--no-compare-cp] [--section.key=value ...]
    meshpar plan --model llama/70b --gpus 64 [--hardware ...] [--seq 8192] [--global-batch 16]
                 [--top 5] [--budget-s 600] [--out FILE]

A dry run at the target world size with no GPU and no real memory (meshpar/planner/): one
representative rank per pipeline stage builds its part of the model through meshpar's own
parallelize path in a fake process group, runs a training step on fake tensors, and reports
parameter placements and local shapes, memory by category and the peak, and the step time,
tokens/s and MFU against the hardware profile; a context-parallel recipe is planned with each cp
attention too (``--no-compare-cp`` skips those dry runs). Exit codes: 0 when every rank fits in device
memory, 1 when one does not (the message names what to change), 2 for a recipe error.

With ``--model`` instead of a recipe it searches the layouts of that model on ``--gpus`` GPUs
(meshpar/planner/candidates.py, search.py), dry-runs them best first, prints the fastest that
fit and writes the best as a recipe.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

from meshpar.config import recipe as recipelib
from meshpar.config.hardware import PROFILES_DIR, HardwareProfile, load_profile
from meshpar.config.keys import local_world_size
from meshpar.config.recipe import RecipeError
from meshpar.parallel.context_parallel.apply import ATTENTIONS
from meshpar.planner import LinkDefaults, Plan, plan, report, verdict
from meshpar.planner.search import HEAD, best_recipe, search
from meshpar.training.preflight import check_model

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def load_hardware(spec: str, defaults: LinkDefaults | None = None) -> tuple[HardwareProfile, str]:
    """A profile by name or path, and a note: links and GPUs per node it lacks come from
    ``defaults`` (meshpar's, named in the note), so a profile with only peaks and memory plans."""
    defaults = defaults or LinkDefaults()
    try:
        return load_profile(spec, "cuda"), ""
    except RecipeError as e:
        if "lacks" not in str(e):
            raise
    path = Path(spec) if spec.endswith(".toml") else PROFILES_DIR / f"{spec}.toml"
    raw = tomllib.loads(path.read_text())
    links = raw.get("links", {})
    try:
        profile = HardwareProfile(
            name=raw["name"], device=raw.get("device", "cuda"),
            devices_per_node=raw.get("devices_per_node", defaults.gpus_per_node), memory_gb=raw["memory_gb"],
            memory_bandwidth_gbps=raw.get("memory_bandwidth_gbps", 0.0), peak_tflops=dict(raw["peak_tflops"]),
            intra_node_gbps=links.get("intra_node_gbps", defaults.intra_node_gbps),
            inter_node_gbps=links.get("inter_node_gbps", defaults.inter_node_gbps),
            latency_s=links.get("latency_us", 0.0) / 1e6)
    except KeyError as e:
        raise RecipeError(f"{path}: hardware profile lacks {e}; see profiles/h100_sxm.toml for the format") from None
    missing = [k for k in ("devices_per_node",) if k not in raw] + [
        f"links.{k}" for k in ("intra_node_gbps", "inter_node_gbps") if k not in links]
    return profile, f"{path.name} lacks {', '.join(missing)}: used meshpar's defaults ({defaults})"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="meshpar plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("recipe", type=Path, nargs="?", help="a TOML recipe (or --model to search)")
    ap.add_argument("--world", type=int, default=None, help="ranks (GPUs) to plan for; default: the product of the "
                    "recipe's degrees (needed when parallel.dp_shard = -1)")
    ap.add_argument("--hardware", default=None, help="hardware profile: a name in profiles/ or a path; default: the "
                    "recipe's metrics.hardware, h100_sxm when it is auto")
    ap.add_argument("--gpus-per-node", type=int, default=None, help="GPUs per node (default: the profile's)")
    ap.add_argument("--efficiency", type=float, default=None,
                    help="share of the dense peak a step's compute reaches (default: measured on a GPU, eager or "
                    "compiled, scaled down beside collectives on more than one device: [Note: the efficiency "
                    "constants] in meshpar/planner/cost.py)")
    ap.add_argument("--all-params", action="store_true", help="print the parameter table of every stage's rank")
    ap.add_argument("--compare-cp", action=argparse.BooleanOptionalAction, default=True,
                    help="with cp > 1: plan the recipe with each cp attention (allgather, ring, ulysses: one more "
                    "dry run each) and print their step times and peaks (default; --no-compare-cp plans the "
                    "recipe's own only)")
    search = ap.add_argument_group("search (instead of a recipe)")
    search.add_argument("--model", help="FAMILY/SIZE to search layouts for, e.g. llama/70b")
    search.add_argument("--gpus", type=int, help="GPUs to search layouts on")
    search.add_argument("--seq", type=int, default=8192, help="sequence length (default 8192)")
    search.add_argument("--global-batch", type=int, default=None,
                        help="sequences per step (default: about 1M tokens, 2**20 / seq)")
    search.add_argument("--top", type=int, default=5, help="layouts to list (default 5)")
    search.add_argument("--budget-s", type=float, default=600, help="stop dry-running after this (default 600)")
    search.add_argument("--out", type=Path, default=None,
                        help="where to write the best as a recipe (default ./<family>_<size>_<gpus>gpu.toml)")
    return ap


def main(argv: list[str]) -> int:
    """Run ``meshpar plan``; returns the exit code (0 fits, 1 does not fit, 2 recipe error)."""
    ap = parser()
    args, overrides = ap.parse_known_args(argv)
    bad = [a for a in overrides if not (a.startswith("--") and "=" in a and "." in a.split("=", 1)[0])]
    if bad:
        ap.error(f"unrecognized arguments: {' '.join(bad)} (recipe overrides are --section.key=value)")
    if args.model:
        return run_search(args, overrides)
    if args.recipe is None:
        ap.error("give a RECIPE, or --model FAMILY/SIZE --gpus N to search")
    try:
        recipe = recipelib.load(args.recipe, overrides)
        world = args.world
        if world is None:
            if recipe.parallel.dp_shard == -1:
                raise RecipeError("parallel.dp_shard = -1 takes the ranks left over: give the target size with "
                                  "--world N")
            world = local_world_size(recipe.parallel)
        spec = args.hardware if args.hardware not in (None, "auto") else recipe.metrics.hardware
        spec = "h100_sxm" if spec == "auto" else spec  # the planner targets a cluster, not this machine
        profile, note = load_hardware(spec)
        start = time.perf_counter()
        # the dry run's progress on stderr, the plan alone on stdout
        result = plan(recipe, world, profile, gpus_per_node=args.gpus_per_node, efficiency=args.efficiency,
                      progress=lambda line: print(f"meshpar plan: {line}", file=sys.stderr, flush=True))
    except RecipeError as e:
        print(f"meshpar: error: {e}", file=sys.stderr)
        return 2
    print(report(result, all_params=args.all_params))
    if note:
        print(f"note: {note}")
    if args.compare_cp and result.layout.cp > 1:
        print("\ncontext-parallel attentions (parallel.cp_attention; the recipe's marked *; a dry run each, "
              "--no-compare-cp skips them):", flush=True)
        compare_cp(result, world, profile, args)
    fits, line = verdict(result)
    print(f"\n{line}\n(dry run in {time.perf_counter() - start:.0f} s)")
    if not fits:
        print(f"meshpar: error: {line}", file=sys.stderr)
    return 0 if fits else 1


def compare_cp(result: Plan, world: int, profile: HardwareProfile, args: argparse.Namespace) -> None:
    """Print the recipe planned with each context-parallel attention, a row as each dry run ends: step
    time, tokens/s, cp bytes, peak; or why the recipe's layout cannot take that attention."""
    for attention in ATTENTIONS:
        mark = "*" if attention == result.recipe.parallel.cp_attention else " "
        if mark == "*":
            other = result
        else:
            recipe = dataclasses.replace(result.recipe, parallel=dataclasses.replace(result.recipe.parallel,
                                                                                   cp_attention=attention))
            try:
                other = plan(recipe, world, profile, gpus_per_node=args.gpus_per_node, efficiency=args.efficiency)
            except RecipeError as e:
                print(f" {mark}{attention:<10} not at this layout: {e}", flush=True)
                continue
        cp = next((c for c in other.time.comm if c.dim == "cp"), None)
        peak = max(r.peak_bytes for r in other.ranks) / 2**30
        t, gb = other.time, 0 if cp is None else cp.bytes_per_step / 1e9
        print(f" {mark}{attention:<10} step {t.step_s:8.3f} s | {t.tokens_per_s:>12,.0f} tokens/s"
              f" | cp {gb:7.2f} GB per step | peak {peak:6.2f} GiB", flush=True)
    flex = result.recipe.parallel.cp_flex and result.profile.device == "cuda"
    ring = ("on flex at 9/7 of the gather's, predicted: [Note: the ring on flex]" if flex
            else "[Note: the ring on a GPU]; parallel.cp_flex puts it on flex_attention")
    print(f"  (every attention's FLOPs at the same rate but the ring's ({ring}); the rate of\n"
          f"  Ulysses' whole-sequence kernel call is not priced apart yet)")


def run_search(args: argparse.Namespace, overrides: list[str]) -> int:
    """``meshpar plan --model F/S --gpus N``: the table of the fastest layouts that fit; the best as a recipe."""
    if "/" not in args.model or not args.gpus:
        print("meshpar: error: --model takes FAMILY/SIZE (e.g. llama/70b) and needs --gpus N", file=sys.stderr)
        return 2
    family, size = args.model.split("/", 1)
    global_batch = args.global_batch or max(1, 2**20 // args.seq)
    spec = args.hardware if args.hardware not in (None, "auto") else "h100_sxm"
    base = [f"--model.family={family}", f"--model.size={size}", f"--train.seq_len={args.seq}",
            f"--train.global_batch={global_batch}", "--train.micro_batch=1",  # each candidate sets its own
            '--parallel.param_dtype="bfloat16"', *overrides]
    try:
        profile, note = load_hardware(spec)
        gpn = args.gpus_per_node or profile.devices_per_node
        check_model(recipelib.load(None, base))  # a bad model or override: say so before any dry run
        print(f"meshpar plan: searching {family} {size} on {args.gpus} x {profile.name} ({gpn} per node), "
              f"{global_batch} x {args.seq} tokens per step", flush=True)
        start = time.perf_counter()
        results, n, skipped, complete = search(base, args.gpus, profile, gpus_per_node=gpn, efficiency=args.efficiency,
                                      top=args.top, budget_s=args.budget_s,
                                      progress=lambda r: print(f"  dry run: {r.row()}", flush=True))
    except RecipeError as e:
        print(f"meshpar: error: {e}", file=sys.stderr)
        return 2
    fitting = [r for r in results if r.fits]
    how = ("complete: no remaining candidate can beat the ones listed" if complete else
           f"stopped by --budget-s {args.budget_s:g}: candidates not dry-run may be faster")
    print(f"\n{n} candidate layouts, {len(results)} dry-run in {time.perf_counter() - start:.0f} s, {skipped} skipped "
          f"(a lighter variant did not fit); {how}; {len(fitting)} fit{'s' if len(fitting) == 1 else ''}:")
    print(f"  {'#':>2}  {HEAD}")
    for i, r in enumerate(fitting[:args.top], 1):
        print(f"  {i:>2}  {r.row()}")
    if note:
        print(f"note: {note}")
    if not fitting:
        print(f"meshpar: error: no layout of {family} {size} fits {args.gpus} x {profile.name} with "
              f"{global_batch} x {args.seq} tokens per step; lower --global-batch or --seq, or add GPUs",
              file=sys.stderr)
        return 1
    out = args.out or Path(f"{family}_{size.replace('.', '_')}_{args.gpus}gpu.toml")
    best = fitting[0]
    header = (f"# {family} {size} on {args.gpus} x {profile.name}: the fastest of {len(results)} layouts dry-run by\n"
              f"# `meshpar plan --model {args.model} --gpus {args.gpus}`; predicted: peak "
              f"{best.peak_bytes / 2**30:.2f} GiB per rank, {best.tokens_per_s:,.0f} tokens/s, "
              f"MFU {100 * best.mfu:.1f}%\n")
    out.write_text(header + recipelib.dumps(best_recipe(base, best, spec)))
    print(f"wrote the best as {out} (meshpar plan {out} shows its full plan)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
