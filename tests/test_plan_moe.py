"""``meshpar plan`` for the mixture-of-experts families: the MoE recipes dry-run at their world size
and match their headers; active versus total parameters; the expert-parallel
all-to-all's bytes are the balanced-routing arithmetic ([Note: the planner routes tokens evenly],
meshpar/planner/moe.py); the layout search tries ep, with tp and pp."""

from __future__ import annotations

import pytest

from meshpar.models.moe import MIXTRAL_SIZES, QWEN3_MOE_SIZES
from meshpar.planner.candidates import candidates
from tests.test_plan import RECIPES, _check_recipe, _run, planlib

MOE_RECIPES = ("qwen3_30b_a3b", "qwen3_235b_a22b", "mixtral_8x7b")


@pytest.mark.slow  # a cluster recipe planned at its target size
@pytest.mark.parametrize("name", MOE_RECIPES)
def test_moe_recipe_fits_at_its_world_size_and_its_header_is_the_plan(name):
    _check_recipe(name)  # how long: docs/performance.md#test-suite-and-set-up


@pytest.mark.slow  # a cluster recipe planned at its target size
def test_active_parameters_are_total_less_the_skipped_experts():
    plan = _run(str(RECIPES / "qwen3_30b_a3b.toml"))[3]
    assert plan.n_params == 30_532_122_624  # the published count (meshpar/models/moe/args.py)
    assert plan.n_params - plan.args.inactive_params() == 3_353_032_704  # "3.3B activated"
    assert QWEN3_MOE_SIZES["235b_a22b"].n_sparse_layers() == 94
    out = _run(str(RECIPES / "qwen3_30b_a3b.toml"))[1]
    assert "30,532,122,624 parameters, 3,353,032,704 active" in out
    mixtral = MIXTRAL_SIZES["8x7b"]
    assert 46_702_792_704 - mixtral.inactive_params() == 12_879_925_248  # "12.9B active", as published


@pytest.mark.slow  # a cluster recipe planned at its target size
def test_all_to_all_bytes_are_the_balanced_arithmetic():
    """Per sparse layer of a stage and microbatch, forward, backward and (full or selective
    checkpointing: the all-to-all is no matmul, so selective recomputes it too) the recomputed
    forward: 2 x tokens x top_k x (ep-1)/ep x D x itemsize each, a rank's tokens its 1/tp of the
    sequence, plus the counts' exchange in each forward (E/ep int64 to each other rank)."""
    for name in MOE_RECIPES:
        plan = _run(str(RECIPES / f"{name}.toml"))[3]
        a, t, layout = plan.args, plan.recipe.train, plan.layout
        forwards = 1 if plan.recipe.parallel.activation_checkpoint == "none" else 2  # every recipe's ac_every 1
        tokens = t.micro_batch * t.seq_len // layout.tp
        rows = (forwards + 1) * 2 * tokens * a.top_k * (layout.ep - 1) / layout.ep
        counts = forwards * 8 * a.n_experts // layout.ep * (layout.ep - 1)
        sparse = max(sum(map(a.is_sparse, r.layers)) for r in plan.ranks)  # the stages hold as many
        expected = sparse * plan.accum * (rows * a.dim * 2 + counts)  # bf16 rows
        ep = next(c for c in plan.time.comm if c.dim == "ep")
        assert ep.bytes_per_step == pytest.approx(expected, rel=1e-6), name
        assert not ep.overlapped and ep.degree == layout.ep
        # ep innermost of dp_shard, tp inside it: a group spans ep x tp consecutive ranks
        assert ep.link == ("intra-node" if 8 % (layout.ep * layout.tp) == 0 else "inter-node"), name
    assert {name: str(_run(str(RECIPES / f"{name}.toml"))[3].layout) for name in MOE_RECIPES} == {
        "qwen3_30b_a3b": "dp_shard 4 x tp 2 (ep 4 within dp_shard)",
        "qwen3_235b_a22b": "dp_shard 64 (ep 8 within dp_shard)",  # ep's all-to-all inside a node
        "mixtral_8x7b": "pp 2 x dp_shard 8 (ep 8 within dp_shard)"}


def test_debug_moe_plans_with_and_without_ep():
    for argv in (("recipes/qwen3_moe_debug.toml", "--world", "2"), ("recipes/qwen3_moe_debug_ep.toml",)):
        code, out, err, plan, _ = _run(*argv)
        assert code == 0, err
        assert "active" in out
    assert any(c.dim == "ep" for c in plan.time.comm)


def test_search_tries_ep_for_moe_families():
    profile = planlib.load_hardware("h100_sxm")[0]
    base = ["--model.family=\"qwen3_moe\"", "--model.size=\"30b_a3b\"", "--train.seq_len=2048",
            "--train.global_batch=64", '--parallel.param_dtype="bfloat16"']
    eps, tp_pp = set(), set()
    for c in candidates(base, 8, profile, 8, 0.34):
        o = dict(x.removeprefix("--").split("=", 1) for x in c.overrides)
        ep, shard = int(o["parallel.ep"]), int(o["parallel.dp_shard"])
        tp, pp = int(o["parallel.tp"]), int(o["parallel.pp"])
        assert shard % ep == 0 and 128 % ep == 0 and tp * pp * shard == 8
        eps.add(ep)
        tp_pp.add((tp, pp, ep > 1))
    assert eps == {1, 2, 4, 8}
    assert {(2, 1, True), (1, 2, True)} <= tp_pp  # tp and pp compose with ep in the MoE families
    # On two nodes the search also tries FSDP inside a node and replicas across: ep with dp_replicate.
    hybrid = set()
    for c in candidates(base, 16, profile, 8, 0.34):
        o = dict(x.removeprefix("--").split("=", 1) for x in c.overrides)
        replicate, shard, ep = int(o["parallel.dp_replicate"]), int(o["parallel.dp_shard"]), int(o["parallel.ep"])
        assert shard % ep == 0
        if replicate > 1:
            hybrid.add(ep)
    assert {1, 2, 4, 8} <= hybrid
