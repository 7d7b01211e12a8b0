"""A mixture-of-experts checkpoint resumed at another expert-parallel degree continues the same run.

recipes/qwen3_moe_debug_ep.toml (SMALL: one dense and one sparse block, 8 experts top 2) through
``meshpar train`` in float64, one sequence per microbatch so that every layout runs the same
forwards (the auxiliary loss is per forward). One chain of runs, each saving for the next:

    ep2         2 ranks, ep 2 = dp_shard 2, 4 experts a rank      steps 1-6, the straight run
    ep4         4 ranks, ep 4 = dp_shard 4, 2 experts a rank      loads ep2's step 2, steps 3-6
    ep2 in dp4  4 ranks, ep 2 within dp_shard 4: 4 experts an ep  loads ep4's step 4, steps 5-6
                rank, FSDP-sharded over the 2 ranks ep leaves
    1 rank      every expert                                      loads ep4's step 4, steps 5-6

Each resumed run's losses, auxiliary losses and gradient norms equal the straight run's at the
same steps, and its final parameters and AdamW state (gathered to full tensors) equal the straight
run's final ones, to TOL (tests/parity.py [Note: parity in float64]). The checkpoints' chunk owners
show the experts (weights and moments) really moved between ranks. ep4's last checkpoint loads
on one rank bit for bit, expert moments included. A resume that starts AdamW afresh
(``checkpoint.exclude = ["optimizer"]``) keeps the first resumed loss and fails the comparison at
the next step: the moments are what carries the run across the change of degree.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from meshpar.checkpoint.format import SafeReader
from meshpar.config import recipe as recipelib
from meshpar.train import train
from tests.distributed import run_distributed
from tests.helpers import load_recipe, merged_state
from tests.parity import TOL, default_dtype, in_float64, must_fail

STEPS = 6
LAYOUTS = {  # name -> (ranks, overrides)
    "ep2": (2, ["--parallel.dp_shard=2", "--parallel.ep=2"]),
    "ep4": (4, ["--parallel.dp_shard=4", "--parallel.ep=4"]),
    "ep2 in dp4": (4, ["--parallel.dp_shard=4", "--parallel.ep=2"]),
    "1 rank": (1, ["--parallel.dp_shard=1", "--parallel.ep=1"]),
}
# every run has the straight run's length, so the learning-rate schedule is the same one
COMMON = [f"--train.steps={STEPS}", "--train.micro_batch=1"]
EXPERTS = [f"layers.0.moe.experts.{w}" for w in ("w1", "w2", "w3")]  # block 1 is dense (mlp_only_layers)
Run = tuple[list[dict], dict[str, torch.Tensor]]  # (rank 0's metric records, the whole gathered state)


def _on_rank(recipe: recipelib.Recipe) -> Run:
    result = train(recipe, return_state=True)
    return result.records, {**result.state_dict, **{f"optim.{k}": v for k, v in result.optim_state.items()}}


def _run(layout: str, out: Path, *extra: str) -> Run:
    """``layout`` in float64 for the COMMON steps, writing to ``out``, with ``extra`` overrides."""
    world, args = LAYOUTS[layout]
    recipe = load_recipe("qwen3_moe_debug_ep.toml", out, *args, *COMMON, *extra)
    if world == 1:
        with default_dtype():
            return _on_rank(recipe)
    results = run_distributed(in_float64, world, _on_rank, recipe, timeout=240, init_process_group=False)
    return results[0][0], merged_state(results)


def _resume(layout: str, out: Path, source: Path, step: int, *extra: str) -> Run:
    return _run(layout, out, f"--checkpoint.load_from={source / 'checkpoints' / f'step_{step}'}", *extra)


def _expert_owners(checkpoint: Path) -> dict[int, int]:
    """{first expert of a chunk: the rank that wrote it} for the sparse block's w1 in ``checkpoint``,
    the same for its weights and for its AdamW second moments (files are ``__<rank>_<i>.distcp``)."""
    storage = SafeReader(checkpoint).read_metadata().storage_data
    owners = {}
    for fqn in (f"model.{EXPERTS[0]}", f"optim.{EXPERTS[0]}.exp_avg_sq"):
        owners[fqn] = {index.offset[0]: int(re.match(r"__(\d+)_", info.relative_path).group(1))
                       for index, info in storage.items() if index.fqn == fqn}
    assert len(set(map(str, owners.values()))) == 1, owners
    return owners[f"model.{EXPERTS[0]}"]


def _by_step(records: list[dict], key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in records if key in r and "loss" in r}


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference over the tensor's largest magnitude: rounding noise scales with the
    tensor, and AdamW's second moments (~1e-8 here) would pass any absolute TOL."""
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-300)).item()


def _assert_continues(resumed: Run, straight: Run, first: int) -> dict[str, float]:
    """``resumed`` (which started at step ``first``) logged the straight run's steps from there on
    and ended in its state, to TOL; returns the worst relative difference per kind of number."""
    (records, state), (want_records, want_state) = resumed, straight
    worst = {}
    for key in ("loss", "aux_loss", "grad_norm"):
        got, want = _by_step(records, key), _by_step(want_records, key)
        assert sorted(got) == list(range(first, STEPS + 1)), (key, sorted(got))
        worst[key] = max(abs(got[s] - want[s]) / abs(want[s]) for s in got)
        assert worst[key] <= TOL, (key, got, {s: want[s] for s in got})
    assert state.keys() == want_state.keys(), sorted(set(state) ^ set(want_state))
    assert {f"optim.{e}.{k}" for e in EXPERTS for k in ("exp_avg", "exp_avg_sq", "step")} <= state.keys()
    for name, value in want_state.items():
        assert value.dtype == (torch.float32 if name.endswith(".step") else torch.float64), (name, value.dtype)
        if name.endswith(".step"):
            assert torch.equal(state[name], value), (name, state[name], value)
            continue
        kind = "param" if not name.startswith("optim.") else name.rsplit(".", 1)[1]
        worst[kind] = max(worst.get(kind, 0.0), _relative(state[name], value))
        assert worst[kind] <= TOL, (name, worst[kind])
    return worst


@pytest.fixture(scope="module")
def straight(tmp_path_factory, data_cache) -> tuple[Run, Path]:
    """ep2 for every step, saving at 2, 4 and 6."""
    out = tmp_path_factory.mktemp("ep2")
    return _run("ep2", out, "--checkpoint.every=2"), out


@pytest.fixture(scope="module")
def ep4(straight, tmp_path_factory) -> tuple[Run, Path]:
    """ep4 from ep2's step 2, saving at 4 and 6."""
    out = tmp_path_factory.mktemp("ep4")
    return _resume("ep4", out, straight[1], 2, "--checkpoint.every=2"), out


@pytest.mark.parity
def test_ep2_checkpoint_continues_at_ep4(straight, ep4):
    # 4 experts on each of 2 ranks, then 2 on each of 4
    assert _expert_owners(straight[1] / "checkpoints" / "step_2") == {0: 0, 4: 1}
    assert _expert_owners(ep4[1] / "checkpoints" / "step_4") == {0: 0, 2: 1, 4: 2, 6: 3}
    worst = _assert_continues(ep4[0], straight[0], first=3)
    print("ep2 -> ep4, worst relative differences:", worst)


@pytest.mark.parity
def test_ep4_checkpoint_continues_at_ep2_within_dp_shard4(straight, ep4, tmp_path):
    worst = _assert_continues(_resume("ep2 in dp4", tmp_path, ep4[1], 4, "--checkpoint.every=2"), straight[0],
                              first=5)
    # ep ranks are the inner, neighbouring ones (meshpar/distributed/mesh.py Mesh.ep): rank r holds ep
    # rank r % 2's experts 4(r % 2) .. +4, FSDP-sharded by r // 2, so ranks 1 and 2 swapped theirs
    assert _expert_owners(tmp_path / "checkpoints" / "step_6") == {0: 0, 4: 1, 2: 2, 6: 3}
    print("ep4 -> ep2 in dp4, worst relative differences:", worst)


@pytest.mark.parity
def test_ep4_checkpoint_continues_on_one_rank(straight, ep4, tmp_path):
    worst = _assert_continues(_resume("1 rank", tmp_path, ep4[1], 4), straight[0], first=5)
    print("ep4 -> 1 rank, worst relative differences:", worst)


def test_ep4_checkpoint_loads_on_one_rank_bit_for_bit(ep4, tmp_path):
    """ep4's step-6 checkpoint (the state its run ended in) on one rank, no step left to train:
    every parameter and AdamW tensor, the experts' 2-per-rank shards joined, is what ep4 held."""
    records, state = _resume("1 rank", tmp_path, ep4[1], 6)
    assert not _by_step(records, "loss")
    saved = ep4[0][1]
    assert state.keys() == saved.keys(), sorted(set(state) ^ set(saved))
    assert {f"optim.{e}.exp_avg_sq" for e in EXPERTS} <= state.keys()
    for name, value in saved.items():
        assert torch.equal(state[name], value), name


@pytest.mark.parity
def test_a_fresh_optimizer_fails_the_comparison(straight, ep4, tmp_path):
    """Without the AdamW state the weights alone give step 5 (computed before any update) but not
    step 6: the comparison above tells a restored optimizer from a re-initialized one."""
    fresh = _resume("1 rank", tmp_path, ep4[1], 4, '--checkpoint.exclude=["optimizer"]')
    got, want = _by_step(fresh[0], "loss"), _by_step(straight[0][0], "loss")
    assert abs(got[5] - want[5]) <= TOL * abs(want[5]), (got, want)
    assert abs(got[6] - want[6]) > 1e3 * TOL * abs(want[6]), (got, want)
    message = must_fail(lambda: _assert_continues(fresh, straight[0], first=5), "AdamW state not loaded")
    print("fresh optimizer:", message[:200], "| losses", got, "straight", want)
