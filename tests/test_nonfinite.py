"""``train.on_nonfinite``: a NaN planted in one rank's gradient, under FSDP (2 ranks) and under
pp x tp (4 ranks), stops every rank naming the step and the parameter, with no checkpoint of
the bad step, or is skipped: the optimizer and LR schedule do not step, so a run whose last
step is skipped ends with exactly the parameters and optimizer state of the run one step
shorter (constant LR after warmup, so the schedule does not depend on train.steps), and too
many skips in a row stop the run. See meshpar/training/nonfinite.py [Note: non-finite steps].
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from meshpar.train import train
from meshpar.training import step as steplib
from meshpar.training.nonfinite import NonFiniteError
from tests.distributed import run_distributed
from tests.helpers import load_recipe


def _poisoning(rank: int, steps: set[int]):
    """A ``clip_grad_norm_`` that first fills rank ``rank``'s first gradient with NaN on ``steps``
    (counted from 1, one clip per step)."""
    real = steplib.clip_grad_norm_
    calls = [0]

    def clip(params, *args, **kwargs):
        calls[0] += 1
        if dist.get_rank() == rank and calls[0] in steps:
            grad = next(p.grad for p in params if p.grad is not None)
            (grad.to_local() if hasattr(grad, "to_local") else grad).fill_(float("nan"))
        return real(params, *args, **kwargs)
    return clip


def _run(recipe_name: str, out: Path, poison: tuple[int, set[int]] | None, *extra: str):
    """``train`` with the poison in place: ("ok", records, params, optim) or ("error", message)."""
    recipe = load_recipe(recipe_name, out, "--optim.schedule=constant", *extra)
    real = steplib.clip_grad_norm_
    if poison is not None:
        steplib.clip_grad_norm_ = _poisoning(*poison)
    try:
        result = train(recipe, return_state=True)
        return "ok", result.records, result.state_dict, result.optim_state
    except NonFiniteError as e:
        return ("error", str(e))
    finally:
        steplib.clip_grad_norm_ = real


FSDP_RUNS = {  # name -> (poison (rank, steps) or None, overrides)
    "stop": ((1, {3}), ("--train.steps=4", "--checkpoint.every=1")),
    "skip": ((1, {3}), ("--train.steps=3", "--train.on_nonfinite=skip")),
    "shorter": (None, ("--train.steps=2",)),
    "skips": ((0, {2, 3}), ("--train.steps=4", "--train.on_nonfinite=skip", "--train.max_skips=2")),
}


def _fsdp_run(tmp: str, name: str):
    poison, extra = FSDP_RUNS[name]
    return _run("llama_debug_fsdp.toml", Path(tmp) / name, poison, *extra)


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory) -> tuple[list[dict], Path]:
    """Each run in its own 2-rank job (a second ``train`` in one process would reuse the first's
    rendezvous port while its store may still be closing)."""
    tmp = tmp_path_factory.mktemp("nonfinite")
    by_name = {name: run_distributed(_fsdp_run, 2, str(tmp), name, timeout=120, init_process_group=False)
               for name in FSDP_RUNS}
    return [{name: runs[r] for name, runs in by_name.items()} for r in range(2)], tmp


@pytest.mark.timeout(300)
def test_stop_names_step_and_parameter_and_saves_nothing_bad(fsdp):
    ranks, tmp = fsdp
    for r, runs in enumerate(ranks):
        kind, *rest = runs["stop"]
        assert kind == "error", f"rank {r} did not stop: {rest[0] if rest else ''}"
        message = rest[0]
        assert message.startswith("step 3: non-finite gradients (first: "), message
        assert " on rank 1; gradient norm on this rank nan)" in message and "on rank 0" not in message, message
        assert "no checkpoint of this state was written" in message, message
    saved = sorted(p.name for p in (tmp / "stop" / "checkpoints").iterdir())
    assert saved == ["step_1", "step_2"], saved


@pytest.mark.timeout(300)
def test_skip_leaves_the_model_as_one_step_shorter(fsdp):
    ranks, _ = fsdp
    for runs in ranks:
        kind, records, params, optim = runs["skip"]
        assert kind == "ok"
        assert {"step": 3, "skipped": "non-finite gradient"} in records, records
        _, _, short_params, short_optim = runs["shorter"]
        assert params.keys() == short_params.keys() and optim.keys() == short_optim.keys()
        for name in params:  # no update at step 3: bit for bit the 2-step run's
            assert torch.equal(params[name], short_params[name]), name
        for name in optim:
            assert torch.equal(optim[name], short_optim[name]), name


@pytest.mark.timeout(300)
def test_too_many_skips_in_a_row_stop(fsdp):
    ranks, _ = fsdp
    for runs in ranks:
        kind, message = runs["skips"]
        assert kind == "error"
        assert message.startswith("step 3: ") and "on rank 0" in message, message
        assert "2 steps in a row skipped (train.max_skips = 2)" in message, message


def _pp_tp_run(tmp: str):
    return _run("llama_debug.toml", Path(tmp) / "pptp", (3, {2}), "--train.steps=3", "--parallel.pp=2",
                "--parallel.dp_shard=1", "--parallel.tp=2")


@pytest.mark.timeout(300)
def test_stop_under_pipeline_and_tensor_parallel(tmp_path):
    ranks = run_distributed(_pp_tp_run, 4, str(tmp_path), timeout=240, init_process_group=False)
    for r, (kind, *rest) in enumerate(ranks):
        assert kind == "error", f"rank {r} did not stop"
        assert rest[0].startswith("step 2: non-finite gradients (first: ") and " on rank 3; " in rest[0], rest[0]
