"""The checks of a tensor-parallel layout that need no process group: the tp degree divides
every dimension a plan shards, the sequence length divides for sequence parallelism, and a plan
that cannot yet be FSDP-sharded over its tp shard is not asked to be. Run by meshpar.training.preflight
and the families' plan checks (meshpar/models/<family>/parallelize.py) before launch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

from meshpar.config.errors import RecipeError

if TYPE_CHECKING:
    from meshpar.parallel.tensor_parallel.plan import TPPlan


def check_tp_degree(tp: int, sizes: Mapping[str, int], fixes: Mapping[str, str] | None = None) -> None:
    """Raise RecipeError (key ``parallel.tp``) unless ``tp`` divides every size in ``sizes``
    (name -> length of a dimension the plan shards), listing the degrees that would work.
    ``fixes`` adds a remedy for a dimension by name (e.g. padding the vocabulary)."""
    if tp < 1:
        raise RecipeError(f"parallel.tp = {tp}: the degree must be >= 1", key="parallel.tp")
    bad = [name for name, size in sizes.items() if size % tp]
    if not bad:
        return
    common = math.gcd(*sizes.values())
    working = [d for d in range(1, common + 1) if common % d == 0]
    name = bad[0]
    fix = f"; {fixes[name]}" if fixes and name in fixes else ""
    raise RecipeError(f"parallel.tp = {tp}: {name} ({sizes[name]}) is not divisible by {tp}; tp degrees that "
                      f"divide every sharded dimension: {', '.join(map(str, working))}{fix}", key="parallel.tp")


def check_fsdp_over_tp(plan: TPPlan, tp: int, dp_shard: int) -> None:
    """Raise RecipeError (key ``parallel.dp_shard``) when ``plan`` cannot be FSDP-sharded over its
    tp shard yet (``plan.no_fsdp``) and the layout asks for both."""
    if plan.no_fsdp and tp > 1 and dp_shard > 1:
        raise RecipeError(f"parallel.tp = {tp} with parallel.dp_shard = {dp_shard}: {plan.no_fsdp}; use "
                          f"dp_replicate instead of dp_shard (and set dp_shard = 1), or tp = 1",
                          key="parallel.dp_shard")


def check_seq_len(seq_len: int, tp: int) -> None:
    """Sequence parallelism splits every sequence across the tp ranks: ``seq_len`` must divide."""
    if tp > 1 and seq_len % tp:
        fits = seq_len - seq_len % tp
        raise RecipeError(f"parallel.tp = {tp}: train.seq_len ({seq_len}) is not divisible by {tp} (sequence "
                          f"parallelism splits each sequence over the tp ranks); use a multiple of {tp}, "
                          f"e.g. {fits or tp}", key="parallel.tp")
