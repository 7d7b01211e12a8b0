"""Expert parallelism composed with the other mesh dims, through ``meshpar train``, against one rank.

recipes/qwen3_moe_debug_ep.toml (Qwen3-MoE debug: 4 blocks, block 1 dense, 8 experts, top 2) runs 2
steps in float64 on 4 ranks in each layout below, and once on one rank with the same data, batch
and values. Losses, auxiliary losses, gradient norms, the per-layer expert loads (max and mean token
slots per expert, summed over the data-parallel ranks) and every parameter equal the one-rank run's
to TOL (tests/parity.py [Note: parity in float64]): any token sent to a wrong expert, an auxiliary
loss left out of a stage's backward or counted twice, or an expert gradient summed over the wrong
ranks moves them by far more. The pp and tp layouts' checkpoints also resume on one rank.
"""

from __future__ import annotations

import pytest
import torch

from meshpar.train import train
from tests.distributed import run_distributed
from tests.helpers import load_recipe, merged_state, train_losses, train_on_rank
from tests.parity import TOL, default_dtype, in_float64

# two steps: the second routes and runs on the first update (and, aux-free, its bias); its own update
# is checked in every parameter
STEPS = ["--train.steps=2", "--train.micro_batch=1", "--model.n_layers=4"]  # sparse blocks 0, 2, 3
# aux-free balancing: each step's loads move the routing bias, so a forward counted twice or on
# wrong tokens (torch's metadata inference under pp: [Note: forwards outside the schedule]) changes
# the next step's routing
AUX_FREE = ("--model.aux_free_bias=true", "--model.bias_update_rate=0.05")
LAYOUTS = {  # name: (overrides, world size[, model overrides shared with the reference])
    "pp2-ep2": (["--parallel.pp=2", "--parallel.dp_shard=2", "--parallel.ep=2"], 4),
    # the loss in 3 chunks (meshpar/training/loss.py) on the last stage, the auxiliary loss joined to h
    "pp2-ep2-aux-free-chunked-loss": (["--parallel.pp=2", "--parallel.dp_shard=2", "--parallel.ep=2",
                                       "--train.loss_chunks=3"], 4, AUX_FREE),
    "replicate2-ep2": (["--parallel.dp_replicate=2", "--parallel.dp_shard=2", "--parallel.ep=2"], 4),
    "tp2-dp_shard2": (["--parallel.tp=2", "--parallel.dp_shard=2", "--parallel.ep=1"], 4),
    "tp2-ep2-chunked-loss": (["--parallel.tp=2", "--parallel.dp_shard=2", "--parallel.ep=2",
                              "--train.loss_chunks=3"], 4),
    "cp2-ep2": (["--parallel.cp=2", "--parallel.dp_shard=2", "--parallel.ep=2"], 4),
    "cp2-tp2-ep2": (["--parallel.cp=2", "--parallel.tp=2", "--parallel.dp_shard=2", "--parallel.ep=2"], 8),
    "cp2-ep2-ulysses": (["--parallel.cp=2", "--parallel.dp_shard=2", "--parallel.ep=2",
                         '--parallel.cp_attention="ulysses"'], 4),
    # the experts a unit inside each block, gathered over the 2 ranks ep leaves: [Note: units inside a unit]
    "ep2-in-dp_shard4-selective-ac": (["--parallel.dp_shard=4", "--parallel.ep=2",
                                       '--parallel.activation_checkpoint="selective"'], 4),
}


RESUMED = {"pp2-ep2", "tp2-ep2-chunked-loss"}  # layouts whose step-1 checkpoint is also resumed on one rank


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """The one-rank run per set of model overrides, made once."""
    cache = {}

    def get(model: tuple[str, ...]):
        if model not in cache:
            with default_dtype():
                cache[model] = train(load_recipe("qwen3_moe_debug_ep.toml", tmp_path_factory.mktemp("ref"), *STEPS,
                                                 *model, "--parallel.dp_shard=1", "--parallel.ep=1"), return_state=True)
        return cache[model]

    return get


def _close(got: list, want: list, what: str) -> None:
    assert len(got) == len(want) and got, (what, got, want)
    for g, w in zip(got, want, strict=True):
        assert abs(g - w) <= TOL * abs(w), (what, got, want)


# the parity reruns on other kernel paths (.ci/run) take one layout: the same float64 arithmetic as
# the others, and each rerun of all of them would add minutes
@pytest.mark.parametrize("layout", [pytest.param(name, marks=pytest.mark.parity) if name == "pp2-ep2" else name
                                    for name in LAYOUTS])
def test_composed_layout_matches_one_rank(layout, references, tmp_path, data_cache):
    overrides, world, *model = LAYOUTS[layout]
    model = tuple(model[0]) if model else ()
    reference = references(model)
    resume = layout in RESUMED
    recipe = load_recipe("qwen3_moe_debug_ep.toml", tmp_path / "run", *STEPS, *model, *overrides,
                         *(["--checkpoint.every=1"] if resume else []))
    results = run_distributed(in_float64, world, train_on_rank, recipe, timeout=300, init_process_group=False)
    records, want = results[0][0], reference.records
    _close(train_losses(records), train_losses(want), "loss")
    for key in ("aux_loss", "grad_norm", "moe_load_mean"):
        _close([r[key] for r in records if key in r], [r[key] for r in want if key in r], key)
    logged = [r for r in records if "moe_load_max" in r]
    assert logged and [r["moe_load_max"] for r in logged] == [r["moe_load_max"] for r in want if "moe_load_max" in r]
    assert logged[0]["moe_layers"] == [0, 2, 3]
    state = merged_state(results)
    assert state.keys() == reference.state_dict.keys()
    for name, value in reference.state_dict.items():
        assert value.dtype == torch.float64, name
        torch.testing.assert_close(state[name], value, rtol=TOL, atol=TOL, msg=name)
    if resume:  # its step-2 checkpoint (DCP, this layout's shards) continues on one rank
        with default_dtype():
            resumed = train(load_recipe("qwen3_moe_debug_ep.toml", tmp_path / "resumed", *STEPS, *model,
                                        "--parallel.dp_shard=1", "--parallel.ep=1",
                                        f"--checkpoint.load_from={tmp_path / 'run' / 'checkpoints' / 'step_1'}"))
        _close(train_losses(resumed.records), train_losses(want)[1:], "resumed loss")
