"""``meshpar train RECIPE --auto [--gpus N]``: the layout search around what the user pinned, its
winner printed with its plan and written as a recipe, which is what the launch then trains.

    path = auto_recipe(Path("recipes/llama_debug.toml"), ["--train.steps=50"], 4, device="cpu")

The search is ``meshpar plan --model``'s (meshpar/planner/search.py: every layout dry-run best
bound first, the three cp attentions where cp > 1), on the recipe instead of a model name, over the
``SEARCHED`` keys. A key the user set keeps its value and the rest is searched around it: a key in
the recipe file's [parallel] table or on the command line (``parallel.dp_shard = -1``, "the ranks
left over", sets nothing). ``train.micro_batch`` is kept only when the command line sets it: a
recipe's micro batch was chosen for the recipe's own layout. Prices come from the recipe's
``metrics.hardware`` profile (``auto``: this machine's), so on a CPU the planner's CPU profile
orders the layouts; all ``N`` ranks are taken to be on one node, as ``meshpar train`` starts them
(on a CPU sharing its cores: ``host_share`` in cost.py).
"""

from __future__ import annotations

from pathlib import Path

from meshpar.config import recipe as recipelib
from meshpar.config.hardware import load_profile
from meshpar.config.recipe import RecipeError
from meshpar.planner.search import HEAD, Result, best_recipe, search

# Keys the search sets: the mesh degrees, the cp attention, checkpointing, resharding, when
# gradients reduce, and the micro batch (Choice.overrides in candidates.py)
SEARCHED = ("parallel.tp", "parallel.pp", "parallel.dp_replicate", "parallel.dp_shard", "parallel.ep", "parallel.cp",
            "parallel.cp_attention", "parallel.activation_checkpoint", "parallel.reshard_after_forward",
            "parallel.grad_reduce", "train.micro_batch")


def pinned(path: Path | None, overrides: list[str]) -> dict[str, object]:
    """The searched keys the user set, with the values the recipe resolves them to."""
    recipe = recipelib.load(path, overrides)
    file_keys, line_keys = recipelib.set_keys(path, overrides)
    keep = {k for k in SEARCHED if k in line_keys or (k in file_keys and k.startswith("parallel."))}
    values = {k: getattr(getattr(recipe, k.split(".")[0]), k.split(".")[1]) for k in keep}
    if values.get("parallel.dp_shard") == -1:
        del values["parallel.dp_shard"]
    return values


def auto_recipe(path: Path, overrides: list[str], gpus: int, *, device: str, budget_s: float = 600, top: int = 5,
                out: Path | None = None) -> Path:
    """Search, print, write the winner as a recipe (default ``<train.output_dir>/auto.toml``); its path.
    Raises RecipeError when no layout of ``gpus`` ranks keeps the pinned keys, or none fits."""
    recipe = recipelib.load(path, overrides)
    keep = pinned(path, overrides)
    spec = recipe.metrics.hardware
    profile = load_profile(spec, device)
    gpn = gpus if device == "cpu" else min(gpus, profile.devices_per_node)
    shown = ", ".join(f"{k} = {v!r}" for k, v in keep.items()) or "nothing"
    print(f"meshpar: --auto: searching layouts of {path} on {gpus} ranks of {profile.name} ({gpn} per node), "
          f"keeping {shown}", flush=True)
    results, n, skipped, complete = search(overrides, gpus, profile, gpus_per_node=gpn, efficiency=None, top=top,
                                           budget_s=budget_s, path=path, pinned=keep,
                                           progress=lambda r: print(f"  dry run: {r.row()}", flush=True))
    fitting = [r for r in results if r.fits]
    if not n:
        raise RecipeError(f"--auto: no layout of {gpus} ranks keeps {shown} (each must divide the ranks and the "
                          "model's dimensions); unpin one or change --gpus")
    if not fitting:
        raise RecipeError(f"--auto: none of the {len(results)} layouts dry-run fits {profile.name}'s memory; "
                          "lower train.micro_batch or train.seq_len, or add ranks")
    best = fitting[0]
    print(best.report)
    print(_beaten(fitting[:top], n, len(results), skipped, complete, budget_s))
    out = out or Path(recipe.train.output_dir) / "auto.toml"
    out.parent.mkdir(parents=True, exist_ok=True)
    chosen = best_recipe(overrides, best, spec, path=path)
    header = (f"# {path} with --auto on {gpus} ranks of {profile.name}: the fastest of {len(results)} layouts "
              f"dry-run; predicted peak {best.peak_bytes / 2**30:.2f} GiB per rank, {best.tokens_per_s:,.0f} "
              f"tokens/s\n")
    out.write_text(header + recipelib.dumps(chosen))
    print(f"meshpar: --auto: wrote {out}; training it", flush=True)
    return out


def _beaten(fitting: list[Result], n: int, ran: int, skipped: int, complete: bool, budget_s: float) -> str:
    """The table of the fastest that fit, each against the winner."""
    how = ("complete" if complete else f"stopped by the budget ({budget_s:g} s): layouts not dry-run may be faster")
    lines = [f"--auto: {n} candidate layouts, {ran} dry-run, {skipped} skipped (a lighter variant did not fit); "
             f"{how}. The fastest that fit:", f"   #  {HEAD}  vs best"]
    for i, r in enumerate(fitting, 1):
        lines.append(f"  {i:>2}  {r.row()}  {fitting[0].tokens_per_s / r.tokens_per_s:.2f}x")
    if len(fitting) > 1:
        lines.append(f"the winner beats the next by {fitting[0].tokens_per_s / fitting[1].tokens_per_s:.2f}x "
                     "predicted tokens/s")
    return "\n".join(lines)
