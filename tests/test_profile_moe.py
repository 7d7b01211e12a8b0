"""The profile summary's all-to-all time per MoE layer (meshpar/profiling/report/moe.py,
[Note: all-to-all per MoE layer]) on real traces.

Three short runs on 2 ranks, step 3 traced: the debug Qwen3-MoE with expert parallelism
(dp_shard 2, ep 2; 4 blocks, of which 0, 2 and 3 have experts), the same with full activation
checkpointing (the forward's exchanges run again in backward), and a dense Llama.
What is checked: every sparse layer and no dense one gets a line, with exactly the calls the run
implies per pass and exchange; the times are positive and add up to no more than the collective's
own time, the rest being the token-count exchanges; the table and the JSON carry the lines; a dense
run has none.
"""

import json

import pytest

from meshpar.models.moe.args import QWEN3_MOE_SIZES
from meshpar.profiling import report as pr
from meshpar.train import train
from tests.distributed import run_distributed
from tests.helpers import SMALL, load_recipe

EP = ["--model.n_layers=4", "--parallel.dp_shard=2", "--parallel.ep=2"]
TRACE = ["--train.steps=3", "--profile.enable=true", "--profile.active=1"]  # wait 1, warmup 1: step 3
SPARSE = [i for i in range(4) if QWEN3_MOE_SIZES["debug"].is_sparse(i)]  # [0, 2, 3]; block 1 is dense
# SMALL: 8 sequences per step over dp 2 in microbatches of 2 -> 2 forward / backward passes per rank and step
MICROBATCHES = 8 // 2 // 2
assert "--train.global_batch=8" in SMALL and "--train.micro_batch=2" in SMALL


def _train(recipe) -> None:
    train(recipe)


@pytest.fixture(scope="module")
def reports(tmp_path_factory, data_cache) -> dict[str, pr.Report]:
    folder = tmp_path_factory.mktemp("profile-moe")
    recipes = {"ep": load_recipe("qwen3_moe_debug_ep.toml", folder / "ep", *EP, *TRACE),
               "ep_recompute": load_recipe("qwen3_moe_debug_ep.toml", folder / "ep_recompute", *EP, *TRACE,
                                           '--parallel.activation_checkpoint="full"'),
               "dense": load_recipe("llama_debug.toml", folder / "dense", "--parallel.dp_shard=2", *TRACE)}
    for recipe in recipes.values():  # a job each (three train() calls in one job hung once in their third)
        run_distributed(_train, 2, recipe, timeout=120, init_process_group=False)
    return {name: pr.summarize(folder / name) for name in recipes}


@pytest.mark.parametrize("name", ["ep", "ep_recompute"])
def test_every_sparse_layer_has_its_exchanges(name, reports):
    passes = ("forward", "recompute", "backward") if name == "ep_recompute" else ("forward", "backward")
    for r in reports[name].ranks:
        assert r.steps == [3]
        assert [x.layer for x in r.moe_layers] == SPARSE
        for x in r.moe_layers:
            # per microbatch and pass, one dispatch and one combine
            assert x.part_calls == {f"{p} {e}": MICROBATCHES for p in passes for e in ("dispatch", "combine")}, x
            assert (x.op, x.dim, x.calls) == ("all_to_all", "ep", 2 * len(passes) * MICROBATCHES)
            assert x.part_ms.keys() == x.part_calls.keys() and all(v > 0 for v in x.part_ms.values()), x
            assert sum(x.part_ms.values()) == pytest.approx(x.time_ms, rel=1e-6)
            assert 0 <= x.exposed_ms <= x.time_ms
        line = next(c for c in r.comm if (c.op, c.dim) == ("all_to_all", "ep"))
        # the rest of the collective: one exchange of the token counts per sparse layer and forward
        counts = len(SPARSE) * MICROBATCHES * (2 if name == "ep_recompute" else 1)
        assert line.calls == line.accounted_calls == sum(x.calls for x in r.moe_layers) + counts
        assert 0 < sum(x.time_ms for x in r.moe_layers) <= line.time_ms


def test_table_and_json(reports, tmp_path):
    table = pr.format_table(reports["ep"])
    assert "all-to-all per MoE layer" in table
    rows = [line.split() for line in table.splitlines() if line.split()[1:2] == ["all_to_all[ep]"]]
    assert [row[0] for row in rows] == [*map(str, SPARSE), "rest"]
    assert [float(row[2]) for row in rows] == [4.0 * MICROBATCHES] * len(SPARSE) + [len(SPARSE) * MICROBATCHES]
    summary = json.loads(pr.write_json(reports["ep"], tmp_path / "summary.json").read_text())
    for rank in summary["ranks"]:
        assert [x["layer"] for x in rank["moe_layers"]] == SPARSE and all(x["time_ms"] > 0 for x in rank["moe_layers"])


def test_a_dense_run_has_no_layer_table(reports, tmp_path):
    report = reports["dense"]
    assert all(r.moe_layers == [] for r in report.ranks) and report.ranks
    assert "MoE layer" not in pr.format_table(report)
    assert "all_gather[dp_shard]" in pr.format_table(report)
    summary = json.loads(pr.write_json(report, tmp_path / "summary.json").read_text())
    assert all(rank["moe_layers"] == [] for rank in summary["ranks"])


def test_dims_sharing_the_default_group_keep_their_collectives(reports):
    """On 2 ranks dp_shard, ep and dp all span the world, so DeviceMesh gives them the default
    process group and its gloo threads ([Note: the mesh dim of a collective]): FSDP's all-gathers
    and reduce-scatters stay on dp_shard, the expert exchanges on ep."""
    for r in reports["ep"].ranks:
        lines = {(c.op, c.dim): c for c in r.comm}
        assert lines[("all_gather", "dp_shard")].time_ms > 0 and lines[("reduce_scatter", "dp_shard")].time_ms > 0
        assert {dim for op, dim in lines if op in ("all_gather", "reduce_scatter")} == {"dp_shard"}, r.comm
