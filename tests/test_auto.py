"""``meshpar train RECIPE --auto``: the layout search around what the user pinned (pinned keys kept,
the rest searched, the three cp attentions tried where cp > 1), the winner printed with its plan,
written as a recipe and trained; bad uses refused before any process starts."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from meshpar.config import recipe as recipelib
from meshpar.config.hardware import load_profile
from meshpar.parallel.context_parallel.apply import ATTENTIONS
from meshpar.planner.auto import pinned
from meshpar.planner.candidates import candidates
from tests.helpers import ROOT, SMALL

DEBUG = ROOT / "recipes" / "llama_debug.toml"
CP = ROOT / "recipes" / "llama_debug_cp.toml"
CPU = load_profile("cpu", "cpu")


def test_pinned_keys_are_the_searched_ones_the_user_set():
    """A [parallel] key of the file or any searched key of the command line is pinned, with the value the
    recipe resolves it to; dp_shard = -1 (the ranks left over) pins nothing, nor does the file's micro batch."""
    assert pinned(DEBUG, []) == {}
    assert pinned(DEBUG, ["--parallel.tp=2", "--train.micro_batch=2", "--train.steps=3"]) == {
        "parallel.tp": 2, "train.micro_batch": 2}
    cp = pinned(CP, [])
    assert cp["parallel.cp"] == 2 and "train.micro_batch" not in cp
    assert pinned(CP, ['--parallel.cp_attention="ulysses"'])["parallel.cp_attention"] == "ulysses"


def test_candidates_keep_the_pinned_keys_and_search_the_rest():
    keep = {"parallel.tp": 2, "parallel.activation_checkpoint": "selective"}
    cands = candidates(SMALL, 4, CPU, 4, None, path=DEBUG, pinned=keep)
    assert cands and all(c.recipe.parallel.tp == 2 and c.recipe.parallel.activation_checkpoint == "selective"
                         for c in cands)
    assert {c.recipe.parallel.dp_shard * c.recipe.parallel.pp for c in cands} == {2}
    assert len({c.recipe.train.micro_batch for c in cands}) > 1  # searched
    free = candidates(SMALL, 4, CPU, 4, None, path=DEBUG)
    assert {c.recipe.parallel.tp for c in free} == {1, 2, 4}


def test_a_pinned_cp_is_searched_with_each_attention():
    """cp at a length the free search never splits (64 tokens) is kept when pinned, and tried with
    each attention; a pinned attention is kept."""
    cands = candidates(SMALL, 4, CPU, 4, None, path=CP, pinned=pinned(CP, SMALL))
    assert cands and {c.recipe.parallel.cp for c in cands} == {2}
    assert {c.recipe.parallel.cp_attention for c in cands} == set(ATTENTIONS)
    assert all(f'--parallel.cp_attention="{c.recipe.parallel.cp_attention}"' in c.overrides for c in cands)
    ring = candidates(SMALL, 4, CPU, 4, None, path=CP, pinned=pinned(CP, [*SMALL, '--parallel.cp_attention="ring"']))
    assert ring and {c.recipe.parallel.cp_attention for c in ring} == {"ring"}


def _meshpar(*argv: str, timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    return subprocess.run([sys.executable, "-m", "meshpar.cli", *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_bad_uses_are_refused_before_any_process():
    unpinnable = _meshpar("train", str(DEBUG), "--auto", "--gpus=3", "--parallel.tp=2", timeout=60)
    assert unpinnable.returncode == 2 and "no layout of 3 ranks keeps parallel.tp = 2" in unpinnable.stderr
    assert "--gpus" in _meshpar("train", str(DEBUG), "--gpus=2", timeout=60).stderr  # --gpus only with --auto


@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_auto_searches_prints_writes_and_trains(tmp_path):
    """On 2 ranks with a global batch of 2 (a few candidates): the search's dry runs, the winner's plan
    (memory by category, step time), the table it beat, the written recipe, which is what trains."""
    out = tmp_path / "run"
    done = _meshpar("train", str(DEBUG), "--auto", "--gpus=2", *SMALL, "--train.global_batch=2",
                    "--train.micro_batch=1", "--train.steps=2", f"--train.output_dir={out}", timeout=280)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    text = done.stdout
    assert "dry run:" in text and "memory" in text.lower() and "The fastest that fit:" in text
    written = out / "auto.toml"
    assert f"wrote {written}" in text
    chosen = recipelib.load(written)
    assert chosen.train.micro_batch == 1 and chosen.parallel.dp_shard * chosen.parallel.tp == 2
    assert (out / "metrics.jsonl").exists()


def test_cpu_ranks_on_one_host_share_its_peak():
    """The CPU profile's peaks are the host's: 4 local ranks compute at a quarter of them each (``host_share``),
    4 ranks on 4 hosts at all of it; MFU stays against the hosts' peak either way. A GPU rank has its own."""
    import dataclasses

    from meshpar.planner import cost, plan

    recipe = recipelib.load(DEBUG, [*SMALL, "--parallel.dp_shard=4"])
    planned = plan(recipe, 4, CPU, gpus_per_node=1)

    def priced(gpn: int, profile=CPU):
        return cost.step_time(recipe, planned.layout, planned.args, profile, planned.ranks, planned.accum,
                              gpus_per_node=gpn, efficiency=0.3, links=cost.LinkDefaults())

    apart, together = priced(1), priced(4)
    assert together.compute_s == pytest.approx(4 * apart.compute_s, rel=1e-12)
    assert together.optimizer_s == pytest.approx(4 * apart.optimizer_s, rel=1e-12)
    host_peak = CPU.peak_flops(getattr(torch, recipe.parallel.param_dtype))
    assert together.mfu == pytest.approx(together.model_flops_per_token * together.tokens_per_s / host_peak, rel=1e-9)
    gpu = dataclasses.replace(CPU, device="cuda")
    assert priced(4, gpu).compute_s == pytest.approx(priced(1, gpu).compute_s, rel=1e-12)


def test_each_collective_costs_the_profiles_latency():
    """``[links] latency_us``: a dim's time is its bytes over the link plus its collectives (those the
    simulated step issued, over every microbatch) times the latency; the CPU profile has one (gloo's, about
    a millisecond)."""
    import dataclasses

    from meshpar.planner import cost, plan

    recipe = recipelib.load(DEBUG, [*SMALL, "--parallel.tp=2", "--parallel.dp_shard=1", "--train.micro_batch=1"])
    planned = plan(recipe, 2, CPU, gpus_per_node=2)

    def tp(profile) -> cost.DimComm:
        step = cost.step_time(recipe, planned.layout, planned.args, profile, planned.ranks, planned.accum,
                              gpus_per_node=2, efficiency=0.3, links=cost.LinkDefaults())
        return next(c for c in step.comm if c.dim == "tp")

    with_latency, without = tp(CPU), tp(dataclasses.replace(CPU, latency_s=0.0))
    assert CPU.latency_s > 0 and with_latency.calls == without.calls > 0
    assert with_latency.calls == sum(n for (_, dim), n in planned.ranks[0].measured.comm_calls.items() if dim == "tp")
    assert with_latency.seconds == pytest.approx(without.seconds + with_latency.calls * CPU.latency_s, rel=1e-12)
