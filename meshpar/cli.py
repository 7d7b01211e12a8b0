"""The ``meshpar`` command line.

    meshpar train RECIPE [--nproc N] [--section.key=value ...]
    meshpar recipe RECIPE [--section.key=value ...]     # resolve and check, print the TOML
    meshpar recipe --keys                               # every key, its default and meaning

Recipe problems print one line (``meshpar: error: ...``) and exit with code 2 before any
process starts.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from meshpar import mesh as meshlib
from meshpar import recipe as recipelib
from meshpar.recipe import RecipeError
from meshpar.train import preflight, train

EPILOG = ("Override any recipe key as --section.key=value (e.g. --train.steps=50 --parallel.dp_replicate=2); "
          "see `meshpar recipe --keys`. Precedence: command line > recipe file > defaults.")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshpar", description="Train large transformers with N-D parallelism "
                                     "(FSDP, TP, PP) described in one TOML recipe.", epilog=EPILOG)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    train = sub.add_parser("train", help="train a model from a recipe", epilog=EPILOG, description=(
        "Train from RECIPE. Under torchrun each rank trains with torchrun's environment; otherwise, when the "
        "recipe needs more than one rank, meshpar starts them locally (gloo on CPU, NCCL on CUDA)."))
    train.add_argument("recipe", type=Path, help="a TOML recipe, e.g. recipes/llama_debug.toml")
    train.add_argument("--nproc", type=int, default=None, help="local ranks to start (default: the product of "
                       "the recipe's parallel degrees, with dp_shard = -1 counted as 1)")
    show = sub.add_parser("recipe", help="resolve a recipe, check it and print it as TOML", epilog=EPILOG)
    show.add_argument("recipe", type=Path, nargs="?", help="a TOML recipe (omit for the defaults)")
    show.add_argument("--keys", action="store_true", help="list every recipe key with its default and meaning")
    return parser


def _split_overrides(parser: argparse.ArgumentParser, extra: list[str]) -> list[str]:
    bad = [a for a in extra if not (a.startswith("--") and "." in a.split("=", 1)[0] and "=" in a)]
    if bad:
        parser.error(f"unrecognized arguments: {' '.join(bad)} (recipe overrides are --section.key=value)")
    return extra


def _train(args: argparse.Namespace, overrides: list[str]) -> int:
    recipe = recipelib.load(args.recipe, overrides)
    if "WORLD_SIZE" in os.environ:  # already a rank (torchrun): train here
        train(recipe)
        return 0
    nproc = meshlib.local_world_size(recipe.parallel) if args.nproc is None else args.nproc
    if nproc < 1:
        raise RecipeError(f"--nproc {nproc}: must be >= 1")
    preflight(recipe, nproc)  # every recipe error before a process starts; tokenizes once for all ranks
    if nproc == 1:
        train(recipe)
        return 0
    from meshpar.launch import launch_local
    return launch_local(nproc, [str(args.recipe), *overrides])


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    overrides = _split_overrides(parser, extra)
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
