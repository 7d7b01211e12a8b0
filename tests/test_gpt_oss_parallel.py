"""recipes/gpt_oss_debug.toml trained on 4 ranks equals one rank in float64: the recipe's layout (FSDP 4,
experts over ep 2 within it), HSDP, pipeline parallelism 2 and tensor parallelism 2, each with ep 2. Losses,
auxiliary and validation losses, gradient norms and every parameter (sinks, biases, router and experts
included) after 3 steps, as tests/test_deepseek.py checks the DeepSeek-V3 recipe. The attention's tp
plan and the experts under ep are checked piece by piece in tests/test_gpt_oss.py."""

from __future__ import annotations

import pytest
import torch

from meshpar.train import train
from tests.distributed import run_distributed
from tests.helpers import load_recipe, merged_state, train_losses, train_on_rank
from tests.parity import TOL, default_dtype, in_float64, must_fail

RECIPE = "gpt_oss_debug.toml"
# SMALL (tests/helpers.py) makes the model 2 blocks, one sliding and one full, on 64-token rows (8 windows)
STEPS = ["--train.steps=3", "--train.eval_every=3", "--data.val_fraction=0.1"]
WORLD = 4
LAYOUTS = {  # name: overrides of the recipe, each on WORLD ranks with its ep 2
    "dp_shard4-ep2": [],  # the recipe: FSDP over 4, the experts over ep 2 and FSDP over the 2 ranks left
    "dp_replicate2-dp_shard2-ep2": ["--parallel.dp_replicate=2", "--parallel.dp_shard=2"],  # HSDP
    "pp2-dp_shard2-ep2": ["--parallel.pp=2", "--parallel.dp_shard=2"],  # a sliding block per stage, then a full one
    "dp_shard2-tp2-ep2": ["--parallel.dp_shard=2", "--parallel.tp=2"],  # heads and sinks split, sequence sharded
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_cache):
    with default_dtype():
        return train(load_recipe(RECIPE, tmp_path_factory.mktemp("ref"), *STEPS, "--parallel.dp_shard=1",
                                 "--parallel.ep=1"), return_state=True)


@pytest.fixture(scope="module")
def layouts(tmp_path_factory, data_cache):
    """Layout name -> (rank 0's records, the merged state of every rank), each layout run once (the
    planted-bug test reuses the recipe's). One job per layout, not one looping them: a rank's second
    ``train``, pp 2 after dp_shard 4 x ep 2, fails in clipping to resolve a process group of the first."""
    runs = {}

    def get(name: str):
        if name not in runs:
            recipe = load_recipe(RECIPE, tmp_path_factory.mktemp(name), *STEPS, *LAYOUTS[name])
            results = run_distributed(in_float64, WORLD, train_on_rank, recipe, timeout=240, init_process_group=False)
            runs[name] = results[0][0], merged_state(results)
        return runs[name]

    return get


def _assert_same(records: list[dict], state: dict[str, torch.Tensor], reference) -> None:
    want = reference.records
    torch.testing.assert_close(train_losses(records), train_losses(want), rtol=TOL, atol=0)
    for key in ("aux_loss", "grad_norm", "val_loss"):
        got = [r[key] for r in records if key in r]
        assert got, key
        torch.testing.assert_close(got, [r[key] for r in want if key in r], rtol=TOL, atol=0, msg=key)
    assert state.keys() == reference.state_dict.keys()
    for name, value in reference.state_dict.items():
        assert value.dtype == torch.float64, name
        torch.testing.assert_close(state[name], value, rtol=TOL, atol=TOL, msg=name)


@pytest.mark.parity
@pytest.mark.timeout(420)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_one_rank(layout, layouts, reference):
    records, state = layouts(layout)
    _assert_same(records, state, reference)
    # what init leaves at zero has moved, so the comparison covers gpt-oss's own parameters too
    moved = [n for n in state if n.endswith(("sinks.weight", "bias")) and state[n].abs().max() > 0]
    assert {".".join(n.split(".")[-2:]) for n in moved} >= {
        "sinks.weight", "wq.bias", "wo.bias", "router.bias", "experts.gate_up_proj_bias", "experts.down_proj_bias"}


@pytest.mark.parity
@pytest.mark.timeout(420)
def test_comparison_catches_a_sink_off_by_1e_6(layouts, reference):
    """The comparison bites: one head's sink logit moved by 1e-6 in the recipe's layout fails it."""
    records, state = layouts("dp_shard4-ep2")
    name = next(n for n in state if n.endswith("attention.sinks.weight"))
    bent = {**state, name: state[name] + torch.nn.functional.one_hot(torch.tensor(0), state[name].numel()) * 1e-6}
    must_fail(lambda: _assert_same(records, bent, reference), "a sink logit off by 1e-6")
