"""Search the layouts of a model on N GPUs for the fastest one that fits, each checked by a dry run.

    results, n, skipped, complete = search(base, gpus=64, profile=profile, gpus_per_node=8, efficiency=None)
    results[0]    # the best: a Result whose dry run fits, the highest predicted tokens/s

The candidates, and the bound on each one's tokens/s, come from candidates.py.

[Note: branch and bound over dry runs]
A candidate's predicted step is at least its compute time stretched by the pipeline bubble
(``cost.py``: the other terms only add to it), so ``tokens / (compute x (n + p - 1) / n)``
bounds its tokens/s from above, without a dry run (``candidates.upper_bound``). Candidates are
dry-run best bound first (two at a time, one per core); the search stops when the next bound
falls below the k-th best tokens/s among candidates that fit, since no later candidate can beat
it, or when the time budget is spent (the table then says so). A candidate is skipped without a
dry run when a variant of the same layout that needs no more memory (a micro batch no larger, at
least as much checkpointing, resharding if it reshards, reducing every microbatch if it does)
did not fit.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import multiprocessing
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from meshpar.config import recipe as recipelib
from meshpar.config.hardware import HardwareProfile
from meshpar.config.recipe import Recipe, RecipeError
from meshpar.planner.candidates import AC_MODES, Candidate, candidates, memory_key


@dataclass(frozen=True)
class Result:
    overrides: tuple[str, ...]
    layout: str
    fits: bool
    peak_bytes: int  # the largest over ranks
    usable_bytes: int
    tokens_per_s: float
    mfu: float
    step_s: float
    error: str = ""  # a candidate the planner refused, and why
    report: str = ""  # the dry run's printed plan (meshpar/planner/report.py)

    def row(self) -> str:
        """One line of the table under ``HEAD``."""
        if self.error:
            return f"{' '.join(self.overrides)}: refused: {self.error}"
        o = dict(x.removeprefix("--").split("=", 1) for x in self.overrides)
        ac = o["parallel.activation_checkpoint"].strip('"')
        reduce = o["parallel.grad_reduce"].strip('"')
        reshard = o["parallel.reshard_after_forward"] if o["parallel.pp"] == "1" else "kept"  # pp: units keep them
        return (f"{self.layout:<42} {o['train.micro_batch']:>3} {ac:<13} {reshard:<7} "
                f"{reduce:<10} {self.peak_bytes / 2**30:>9.2f} {self.tokens_per_s:>10,.0f} {100 * self.mfu:>5.1f}%"
                + ("" if self.fits else "  does not fit"))


HEAD = (f"{'layout':<42} {'mb':>3} {'checkpointing':<13} {'reshard':<7} {'grads':<10} {'peak GiB':>9} "
        f"{'tokens/s':>10} {'MFU':>6}")


def _same_layout(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
    keys = ("--parallel.tp", "--parallel.pp", "--parallel.dp_replicate", "--parallel.dp_shard", "--parallel.ep",
            "--parallel.cp", "--parallel.cp_attention")
    return [x for x in a if x.split("=")[0] in keys] == [x for x in b if x.split("=")[0] in keys]


def _needs_more(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
    """Candidate ``a`` needs at least the memory of ``b``: the same layout, a micro batch at least
    as large, no more checkpointing, it keeps parameters gathered if ``b`` does, and it holds
    unsharded gradients across microbatches if ``b`` does."""
    ka, kb = memory_key(a), memory_key(b)
    return _same_layout(a, b) and all(x >= y for x, y in zip(ka, kb, strict=True))


def evaluate(recipe: Recipe, overrides: tuple[str, ...], gpus: int, profile: HardwareProfile,
             gpus_per_node: int, efficiency: float | None) -> Result:
    """One candidate's dry run (in a worker process: it joins a fake process group of its own);
    ``overrides`` made ``recipe`` from the search's base and name it in the result."""
    from meshpar.planner.dry_run import plan

    try:
        p = plan(recipe, gpus, profile, gpus_per_node=gpus_per_node, efficiency=efficiency)
    except RecipeError as e:
        return Result(overrides, "", False, 0, 0, 0.0, 0.0, 0.0, str(e))
    except RuntimeError as e:  # the simulated step itself failed: one candidate, not the search
        return Result(overrides, "", False, 0, 0, 0.0, 0.0, 0.0, f"the dry run failed: {str(e).splitlines()[0]}")
    from meshpar.planner.report import report

    peak = max(r.peak_bytes for r in p.ranks)
    layout = str(p.layout) + (f" ({recipe.parallel.cp_attention})" if p.layout.cp > 1 else "")
    return Result(overrides, layout, peak <= p.usable_bytes, peak, p.usable_bytes, p.time.tokens_per_s,
                  p.time.mfu, p.time.step_s, report=report(p))


def search(base: list[str], gpus: int, profile: HardwareProfile, *, gpus_per_node: int, efficiency: float | None,
           top: int = 5, budget_s: float = 600, workers: int = 2, path: Path | None = None,
           pinned: Mapping[str, object] | None = None,
           progress: Callable[[Result], None] | None = None) -> tuple[list[Result], int, int, bool]:
    """(results best first: those that fit, then the rest; candidates in all; candidates skipped
    because a variant needing less memory did not fit; whether the search was complete, i.e.
    stopped by the bound rather than the budget). ``path`` and ``pinned`` as ``candidates``."""
    cands = candidates(base, gpus, profile, gpus_per_node, efficiency, path=path, pinned=pinned)
    results: list[Result] = []
    start, complete, skipped = time.perf_counter(), True, 0
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        pending: dict[concurrent.futures.Future, Candidate] = {}
        queue = list(cands)

        def kth_best() -> float:
            fit = sorted((r.tokens_per_s for r in results if r.fits), reverse=True)
            return fit[top - 1] if len(fit) >= top else 0.0

        while queue or pending:
            while queue and len(pending) < workers:
                if queue[0].bound < kth_best():
                    queue.clear()  # no remaining candidate can enter the top k
                    break
                if time.perf_counter() - start > budget_s:
                    complete = False
                    queue.clear()
                    break
                c = queue.pop(0)
                if any(not r.fits and not r.error and _needs_more(c.overrides, r.overrides) for r in results):
                    skipped += 1  # a lighter variant of the same layout did not fit
                    continue
                pending[pool.submit(evaluate, c.recipe, c.overrides, gpus, profile, gpus_per_node, efficiency)] = c
            if not pending:
                break
            done, _ = concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
            for future in done:
                pending.pop(future)
                result = future.result()
                results.append(result)
                if progress is not None:
                    progress(result)
    results.sort(key=_rank)
    return results, len(cands), skipped, complete


def _rank(r: Result) -> tuple:
    """Results' order: those that fit, fastest first; among those predicted equally fast (to the
    table's whole tokens/s), the one with less recomputation and fewer microbatches first, costs the
    time model leaves out (host overhead per kernel launched, [Note: the efficiency constants])."""
    if r.error:
        return (True, 0.0, 0, 0, r.overrides)
    o = dict(x.removeprefix("--").split("=", 1) for x in r.overrides)
    ac = AC_MODES.index(o["parallel.activation_checkpoint"].strip('"'))
    return (not r.fits, -round(r.tokens_per_s), ac, -int(o["train.micro_batch"]), r.overrides)


def best_recipe(base: list[str], result: Result, hardware: str, path: Path | None = None) -> Recipe:
    """The winning candidate as a recipe (the hardware profile recorded for MFU)."""
    recipe = recipelib.load(path, [*base, *result.overrides])
    return dataclasses.replace(recipe, metrics=dataclasses.replace(recipe.metrics, hardware=hardware))
