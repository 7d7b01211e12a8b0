"""One rank's training run: ``python -m meshpar.train RECIPE [--section.key=value ...]``.

This is what ``torchrun ... -m meshpar.train`` runs on a cluster, and ``run`` what ``meshpar
train`` calls on each local rank it forks (meshpar/runtime/launch.py): the recipe's checks, the
process group and the mesh, then the loop (meshpar/training/loop.py). The data flow (docs/architecture.md):

    recipe -> layout (checked before any process group) -> data (cached tokens)
      -> process group + mesh -> model on meta -> pipeline split -> parallelize (TP, activation
      checkpointing, compile, FSDP) -> to_empty + init_weights -> optimizer + LR schedule
      -> loop: meshpar.training.step.train_step (batch -> forward/backward per microbatch or the
         pipeline schedule -> gradient sync -> clip across every mesh dim -> optimizer step)
      -> metrics -> maybe save
    (a complete checkpoint in checkpoint.dir, or checkpoint.load_from, is loaded before the
    first step, resharded to this layout: meshpar/checkpoint/checkpointer.py)

The step is meshpar/training/step.py, the one the planner also runs, on fake tensors; see
[Note: losses do not depend on the layout] there.
"""

from __future__ import annotations

import argparse
import faulthandler
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from meshpar.checkpoint import CheckpointError, optimizer_state, param_names
from meshpar.config import recipe as recipelib
from meshpar.config.hardware import load_profile
from meshpar.config.keys import replica_jobs
from meshpar.config.recipe import Recipe, RecipeError
from meshpar.convert import load_hf_weights
from meshpar.distributed import comm_record
from meshpar.distributed import mesh as meshlib
from meshpar.runtime import replicas
from meshpar.runtime.fault import (
    EXIT_PREEMPTED,
    StopSignals,
    collective_timeout,
    is_collective_failure,
    report_collective_failure,
)
from meshpar.runtime.process import init_process_group, leave, rank_info, select_device
from meshpar.training.loop import train_loop
from meshpar.training.nonfinite import NonFiniteError
from meshpar.training.preflight import preflight


@dataclass
class RunResult:
    records: list[dict[str, Any]]  # the metrics records, the same on every rank
    state_dict: dict[str, torch.Tensor] | None  # final full parameters on CPU, when asked for
    optim_state: dict[str, torch.Tensor] | None = None  # and AdamW's: "<param name>.<exp_avg|exp_avg_sq|step>"
    stopped_by: str | None = None  # the signal that stopped the run early (a checkpoint was saved), or None


def train(recipe: Recipe, *, return_state: bool = False) -> RunResult:
    """Run ``recipe`` on this rank. ``return_state`` also returns the final parameters and
    optimizer state, gathered to full tensors (for tests)."""
    info = rank_info()
    recipe = replicas.group_recipe(recipe)  # under torchft: this replica group's output folders
    checked = preflight(recipe, info.world_size * replica_jobs(recipe))
    device = select_device(recipe.train.device, info)
    profile = load_profile(recipe.metrics.hardware, device.type)
    timeout = collective_timeout(recipe.fault.timeout, device.type)
    init_process_group(device, info, timeout)
    comms = comm_record.CommRecord(flight_size=recipe.fault.flight_recorder)  # this run's collectives
    signals = StopSignals(recipe.fault.signals)
    try:
        with comms.active():
            mesh = meshlib.build(replicas.group_layout(recipe, checked.layout), device.type)
            model, optimizer, records, stopped_by = train_loop(recipe, checked, mesh, device, profile, info, signals,
                                                             load_hf_weights=load_hf_weights, comms=comms)
            result = RunResult(records, None, stopped_by=stopped_by)
            if return_state:  # gathered: a collective per DTensor, for tests only; this rank's stages
                result.state_dict = {k: _full(v) for k, v in model.state_dict().items()}
                result.optim_state = {f"{name}.{k}": _full(v) for name, state in
                                      optimizer_state(optimizer, param_names(model.stages)).items()
                                      for k, v in state.items()}
            dist.barrier()  # gloo groups torn down while a peer still talks can abort at exit
        return result
    except NonFiniteError:
        dist.barrier()  # every rank raised it at the same step: meet before tearing gloo down
        raise
    except Exception as e:
        if is_collective_failure(e):  # name the op, dim, step and the ranks that did not come, then fail
            report_collective_failure(e, rank=info.rank, world=info.world_size, step=comms.step, timeout=timeout,
                                      record=comms)
        raise
    finally:
        signals.close()
        dist.destroy_process_group()


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()


def run(argv: list[str]) -> int:
    """This rank's run from its command line (``RECIPE [--section.key=value ...]``); the exit code:
    0, ``EXIT_PREEMPTED`` after a stop signal, 2 for a recipe error, 1 for a checkpoint or
    non-finite one (named on stderr). Anything else raises."""
    parser = argparse.ArgumentParser(prog="python -m meshpar.train", description="Train one rank (use under "
                                     "torchrun, or run `meshpar train`, which starts local ranks itself).")
    parser.add_argument("recipe", type=Path)
    args, overrides = parser.parse_known_args(argv)
    # A rank that dies of a signal (SIGSEGV, SIGABRT: a gloo or NCCL abort, SIGBUS, SIGFPE, SIGILL) first
    # prints every thread's Python stack to stderr, and still dies of that signal: the launcher's report
    # ("rank 1 (pid ...) failed: signal SIGSEGV") then comes with where it happened.
    faulthandler.enable(all_threads=True)
    try:
        recipe = recipelib.load(args.recipe, overrides)
        result = train(recipe)
    except RecipeError as e:
        print(f"meshpar: error: {e}", file=sys.stderr)
        return 2
    except CheckpointError as e:  # a folder or file the message names; each failing rank says so
        print(f"meshpar: error: {e}", file=sys.stderr)
        return 1
    except NonFiniteError as e:  # every rank raises it; one says so
        if rank_info().is_rank0:
            print(f"meshpar: error: {e}", file=sys.stderr)
        return 1
    return EXIT_PREEMPTED if result.stopped_by is not None else 0


def main(argv: list[str] | None = None) -> None:
    leave(run(sys.argv[1:] if argv is None else argv))  # [Note: a rank leaves without finalization]


if __name__ == "__main__":
    main()
