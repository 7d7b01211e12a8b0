"""The ``meshpar`` command line.

    meshpar train RECIPE [--nproc N] [--max-restarts N] [--section.key=value ...]
    meshpar train RECIPE --auto [--gpus N]             # search the layout (keeping what is set), then train it
    meshpar lighthouse [--port P] [--min-replicas N]     # coordinates replica groups (fault.replicas = "torchft")
    meshpar recipe RECIPE [--section.key=value ...]     # resolve and check, print the TOML
    meshpar recipe --keys                               # every key, its default and meaning
    meshpar convert SRC DST --to {hf,torch,dcp} [--layout dp_shard=4,tp=2] [--verify] [--shard-size 5GB]
    meshpar data prepare SOURCES --tokenizer T --out DIR   # tokenize a corpus once, train with data.path = DIR
    meshpar checkpoint info DIR                         # step, layout, completeness, every tensor
    meshpar train RECIPE --profile                      # = --profile.enable=true: traces in <output_dir>/traces
    meshpar profile summarize DIR                       # per-rank breakdown: table, summary.json, summary.png
    meshpar profile merge DIR [--max-mb N]              # one trace, a process per rank, for Perfetto
    meshpar plan RECIPE [--world N] [--hardware X]      # dry run at the target size: memory, step time, fit
    meshpar plan --model llama/70b --gpus 64 [...]      # search layouts that fit, best first

Recipe problems print one line (``meshpar: error: ...``) and exit with code 2 before any
process starts; a conversion problem prints one line and exits with code 1.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

from meshpar.config import recipe as recipelib
from meshpar.config.keys import local_world_size, replica_jobs
from meshpar.config.recipe import RecipeError

# What each local rank runs (meshpar/runtime/launch.py): named, so the launcher need not import it
RANK_ENTRYPOINT = "meshpar.train:run"

# Only the recipe and argument parsing load at start; torch and the training stack load in the
# command that needs them, so `--help`, `meshpar recipe` and every recipe error answer at once.

EPILOG = ("Override any recipe key as --section.key=value (e.g. --train.steps=50 --parallel.dp_replicate=2); "
          "see `meshpar recipe --keys`. Precedence: command line > recipe file > defaults.")


def parser() -> argparse.ArgumentParser:
    """``meshpar``'s argument parser (``meshpar plan`` has its own: meshpar/planner/cli.py)."""
    parser = argparse.ArgumentParser(prog="meshpar", description="Train large transformers with N-D parallelism "
                                     "(FSDP, TP, PP) described in one TOML recipe.", epilog=EPILOG)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    train = sub.add_parser("train", help="train a model from a recipe", epilog=EPILOG, description=(
        "Train from RECIPE. Under torchrun each rank trains with torchrun's environment; otherwise, when the "
        "recipe needs more than one rank, meshpar starts them locally (gloo on CPU, NCCL on CUDA)."))
    train.add_argument("recipe", type=Path, help="a TOML recipe, e.g. recipes/llama_debug.toml")
    train.add_argument("--nproc", type=int, default=None, help="local ranks to start (default: the product of "
                       "the recipe's parallel degrees, with dp_shard = -1 counted as 1)")
    train.add_argument("--max-restarts", type=int, default=0, metavar="N", help="restart every rank up to N "
                       "times after a rank fails; each restart resumes from the newest complete checkpoint "
                       "(torchelastic's restarts, as torchrun --max-restarts)")
    train.add_argument("--auto", action="store_true", help="search the layout first (meshpar/planner/auto.py): "
                       "parallel degrees, cp attention, checkpointing, resharding, gradient reduction and micro "
                       "batch, keeping each the recipe's [parallel] table or the command line sets; print the "
                       "winner's plan and what it beat, write it as <train.output_dir>/auto.toml and train that")
    train.add_argument("--gpus", type=int, default=None, help="with --auto: the ranks to search for and start "
                       "(default: --nproc, else this machine's CUDA devices)")
    train.add_argument("--budget-s", type=float, default=600, help="with --auto: stop dry-running layouts after this "
                       "many seconds (default 600)")
    train.add_argument("--profile", action="store_true", help="trace steps with the torch profiler (the same as "
                       "--profile.enable=true; schedule and ranks from [profile]); then `meshpar profile summarize`")
    lighthouse = sub.add_parser("lighthouse", help="coordinate replica groups under fault.replicas = \"torchft\": "
                                "serve each step's quorum until stopped (docs/cluster.md)")
    lighthouse.add_argument("--port", type=int, default=29510, help="port to listen on (0: any free one; default "
                            "29510)")
    lighthouse.add_argument("--min-replicas", type=int, default=1, help="groups a quorum needs (default 1)")
    lighthouse.add_argument("--join-timeout-ms", type=int, default=1000, help="how long a quorum waits for more "
                            "groups to join once it could form (default 1000)")
    lighthouse.add_argument("--heartbeat-timeout-ms", type=int, default=5000, help="a group silent this long is left "
                            "out of the next quorum (default 5000)")
    show = sub.add_parser("recipe", help="resolve a recipe, check it and print it as TOML", epilog=EPILOG)
    show.add_argument("recipe", type=Path, nargs="?", help="a TOML recipe (omit for the defaults)")
    show.add_argument("--keys", action="store_true", help="list every recipe key with its default and meaning")
    sub.add_parser("plan", add_help=False, help="dry-run a recipe at its target size (memory per rank, step time, "
                   "fit), or search layouts that fit: `meshpar plan --help`")
    sub.add_parser("generate", add_help=False, help="continue a prompt from a checkpoint or a Hugging Face folder, "
                   "greedy or sampled, in one process: `meshpar generate --help`")
    add_convert_arguments(sub.add_parser("convert", help="convert a checkpoint (DCP, Hugging Face, torch.save), "
                                         "offline, one tensor at a time", description=CONVERT_HELP))
    from meshpar.data import prepare_cli
    data = sub.add_parser("data", help="prepare training data").add_subparsers(dest="action", required=True)
    prepare_cli.add_arguments(data.add_parser("prepare", help="tokenize a corpus once into memory-mapped shards",
                                              description=prepare_cli.HELP))
    checkpoint = sub.add_parser("checkpoint", help="inspect checkpoints").add_subparsers(dest="action", required=True)
    info = checkpoint.add_parser("info", help="step, layout saved from, completeness, every tensor's shape, dtype, "
                                 "size and chunks; a folder of step_* checkpoints lists them and describes the newest")
    info.add_argument("dir", type=Path, help="a checkpoint folder <dir>/step_<N>, or <dir>")
    profile = sub.add_parser("profile", help="read the traces of a profiled run").add_subparsers(
        dest="action", required=True)
    where = "the run's output folder (train.output_dir) or its traces/ folder"
    summarize = profile.add_parser("summarize", help="per rank and step: compute, communication per collective and "
                                   "mesh dim, exposed communication, bubble, data, optimizer; a table, "
                                   "summary.json and summary.png")
    summarize.add_argument("dir", type=Path, help=where)
    summarize.add_argument("--top", type=int, default=10, help="how many ops to list by self time")
    merge = profile.add_parser("merge", help="one Chrome trace with every rank as its own process, on one clock "
                               "(open it in https://ui.perfetto.dev)")
    merge.add_argument("dir", type=Path, help=where)
    merge.add_argument("--out", type=Path, default=None, help="output file (default: <traces>/merged.json.gz)")
    merge.add_argument("--max-mb", type=float, default=200.0, help="size cap of the merged trace (uncompressed)")
    return parser


def run_profile(args: argparse.Namespace) -> int:
    from meshpar.profiling import report as profile_report

    if args.action == "summarize":
        return profile_report.summarize_cli(args.dir, top=args.top)
    try:
        out = profile_report.merge(args.dir, args.out, max_mb=args.max_mb)
    except profile_report.ProfileReportError as e:
        print(f"meshpar: error: {e}", file=sys.stderr)
        return 2
    print(f"meshpar: merged trace: {out} (open it in https://ui.perfetto.dev)")
    return 0


CONVERT_HELP = ("Convert SRC (a meshpar checkpoint folder <dir>/step_<N>, a Hugging Face folder, or a torch file) to "
                "--to: hf (safetensors + config.json), torch (one torch.save file of the model's weights), or dcp (a "
                "meshpar checkpoint, re-chunked for --layout, optimizer state included). No GPU and no process "
                "group; memory stays near the largest tensor.")


def add_convert_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``meshpar convert`` (also ``tools/convert.py``)."""
    parser.add_argument("src", type=Path, help="checkpoint folder, Hugging Face folder or torch file")
    parser.add_argument("dst", type=Path, help="output folder (hf, dcp) or file (torch); must not exist yet")
    parser.add_argument("--to", required=True, choices=("hf", "torch", "dcp"), help="output format")
    parser.add_argument("--layout", type=_layout, default=None, metavar="DIM=N,...",
                        help="dcp: the layout to chunk for, e.g. dp_shard=4,tp=2 (dims: pp, dp_replicate, dp_shard, "
                        "cp, tp; default: the source's)")
    parser.add_argument("--verify", action="store_true", help="reload the output and compare every tensor by checksum")
    parser.add_argument("--shard-size", type=_size, default="5GB", metavar="SIZE",
                        help="hf: the largest safetensors file, e.g. 5GB, 500MB (default 5GB)")
    parser.add_argument("--all", action="store_true", help="torch: every checkpoint entry (optimizer state, "
                        "schedule, data position), not only the model's weights")


def _layout(text: str) -> dict[str, int]:
    try:
        return {k.strip(): int(v) for k, v in (item.split("=") for item in text.split(","))}
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}': write the degrees as dim=N,... e.g. dp_shard=4,tp=2") from None


def _size(text: str) -> int:
    m = re.fullmatch(r"(\d+(?:\.\d*)?)\s*([KMG]?)B?", text.strip().upper())
    if m is None:
        raise argparse.ArgumentTypeError(f"'{text}': give a size such as 5GB or 500MB")
    return int(float(m.group(1)) * {"": 1, "K": 10**3, "M": 10**6, "G": 10**9}[m.group(2)])


def run_convert(args: argparse.Namespace) -> int:
    from meshpar import convert as convertlib

    try:
        if getattr(args, "command", "convert") == "checkpoint":
            print(convertlib.describe(args.dir))
        else:
            convertlib.convert(args.src, args.dst, args.to, layout=args.layout, verify=args.verify,
                               shard_size=args.shard_size, model_only=not args.all)
    except convertlib.ConvertError as e:
        print(f"meshpar: error: {e}", file=sys.stderr)
        return 1
    return 0


def _split_overrides(parser: argparse.ArgumentParser, extra: list[str]) -> list[str]:
    bad = [a for a in extra if not (a.startswith("--") and "." in a.split("=", 1)[0] and "=" in a)]
    if bad:
        parser.error(f"unrecognized arguments: {' '.join(bad)} (recipe overrides are --section.key=value)")
    return extra


def _train(args: argparse.Namespace, overrides: list[str]) -> int:
    if args.profile:
        overrides = [*overrides, "--profile.enable=true"]
    recipe = recipelib.load(args.recipe, overrides)
    if args.max_restarts < 0:
        raise RecipeError(f"--max-restarts {args.max_restarts}: must be >= 0")
    if args.auto:
        args.recipe, overrides, args.nproc = _auto(args, overrides)
        recipe = recipelib.load(args.recipe)
    elif args.gpus is not None:
        raise RecipeError(f"--gpus {args.gpus} goes with --auto (the ranks to search layouts for); without it, "
                          "--nproc N starts N ranks")
    if "WORLD_SIZE" in os.environ:  # already a rank (torchrun, which does the restarting): train here
        return _train_here(recipe)
    jobs = replica_jobs(recipe)  # under fault.replicas = "torchft" this command starts one replica group
    nproc = local_world_size(recipe.parallel) // jobs if args.nproc is None else args.nproc
    if nproc < 1:
        raise RecipeError(f"--nproc {nproc}: must be >= 1")
    local = nproc > 1 or args.max_restarts
    if local:  # first: the ranks' forkserver imports torch and meshpar while this process checks the recipe
        from meshpar.runtime.forkserver import start_forkserver
        start_forkserver(RANK_ENTRYPOINT)
    from meshpar.training.preflight import preflight
    preflight(recipe, nproc * jobs)  # every recipe error before a process starts; tokenizes once for all ranks
    if not local:
        return _train_here(recipe)
    from meshpar.runtime.launch import launch_local
    return launch_local(nproc, RANK_ENTRYPOINT, [str(args.recipe), *overrides], max_restarts=args.max_restarts,
                        signals=recipe.fault.signals)


def _auto(args: argparse.Namespace, overrides: list[str]) -> tuple[Path, list[str], int]:
    """``--auto``: the searched recipe's path, its (baked-in) overrides, its ranks."""
    if "WORLD_SIZE" in os.environ:
        raise RecipeError("--auto searches in the launching process, not in each rank: under torchrun, launch "
                          "the recipe `meshpar train RECIPE --auto --gpus N` writes (<train.output_dir>/auto.toml)")
    import torch

    from meshpar.planner.auto import auto_recipe

    device = "cuda" if torch.cuda.is_available() else "cpu"
    gpus = args.gpus or args.nproc or (torch.cuda.device_count() if device == "cuda" else 0)
    if gpus < 1:
        raise RecipeError("--auto on a machine without CUDA devices needs --gpus N: the local ranks to search "
                          "layouts for and start")
    return auto_recipe(args.recipe, overrides, gpus, device=device, budget_s=args.budget_s), [], gpus


def _train_here(recipe: recipelib.Recipe) -> int:
    """Train in this process (one rank, or a rank torchrun started)."""
    from meshpar.checkpoint import CheckpointError
    from meshpar.runtime.fault import EXIT_PREEMPTED
    from meshpar.train import train
    from meshpar.training.nonfinite import NonFiniteError

    try:
        return EXIT_PREEMPTED if train(recipe).stopped_by else 0
    except (CheckpointError, NonFiniteError) as e:  # one process (no launcher): the same one line as a rank's
        print(f"meshpar: error: {e}", file=sys.stderr)
        return 1


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["plan"]:  # its own argument parser (meshpar/planner/cli.py)
        from meshpar.planner.cli import main as plan_main

        sys.exit(plan_main(argv[1:]))
    if argv[:1] == ["generate"]:  # its own argument parser (meshpar/inference/generate.py)
        from meshpar.inference.generate import main as generate_main

        sys.exit(generate_main(argv[1:]))
    cli = parser()
    args, extra = cli.parse_known_args(argv)
    if args.command == "lighthouse":
        if extra:
            cli.error(f"unrecognized arguments: {' '.join(extra)}")
        from meshpar.runtime.replicas import serve_lighthouse
        sys.exit(serve_lighthouse(args.port, args.min_replicas, args.join_timeout_ms, args.heartbeat_timeout_ms))
    if args.command in ("convert", "checkpoint", "profile", "data"):
        if extra:
            cli.error(f"unrecognized arguments: {' '.join(extra)}")
        if args.command == "data":
            from meshpar.data import prepare_cli
            sys.exit(prepare_cli.run(args))
        sys.exit(run_profile(args) if args.command == "profile" else run_convert(args))
    overrides = _split_overrides(cli, extra)
    try:
        if args.command == "train":
            sys.exit(_train(args, overrides))
        if args.keys:
            print(recipelib.describe_keys())
        else:
            print(recipelib.dumps(recipelib.load(args.recipe, overrides)), end="")
    except RecipeError as e:
        print(f"meshpar: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
