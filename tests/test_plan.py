"""``meshpar plan``: the shipped recipes fit and match their headers, the totals are exact, an
unfitting recipe names its fix, and the planned peak is a real training step's."""

from __future__ import annotations

import contextlib
import functools
import io
import math
import re
import time
from pathlib import Path
from unittest import mock

import pytest
import torch

from meshpar.config import recipe as recipelib
from meshpar.models import get_family
from meshpar.models.llama import LLAMA_SIZES
from meshpar.planner import cli as planlib
from meshpar.planner.candidates import candidates
from meshpar.planner.simulate import schedule_actions
from meshpar.training.optim import build_optimizer
from tests.benchmarks import calibrate_plan
from tests.distributed import CaseSet

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
GIB = 2**30


def _run(*argv: str, compare_cp: bool = False):
    """``meshpar plan ARGV``: (exit code, stdout, stderr, the recipe's Plan, seconds), once per argv.
    Without the dry runs of the other cp attentions unless ``compare_cp`` (one test checks them)."""
    return _plan_cli(*argv, *([] if compare_cp else ["--no-compare-cp"]))


@functools.cache
def _plan_cli(*argv: str):
    captured = {}
    real = planlib.plan

    def capture(*args, **kwargs):
        plan = real(*args, **kwargs)
        captured.setdefault("plan", plan)  # the recipe's own: the first planned
        return plan

    out, err = io.StringIO(), io.StringIO()
    start = time.perf_counter()
    with mock.patch.object(planlib, "plan", capture), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = planlib.main(list(argv))
    return code, out.getvalue(), err.getvalue(), captured.get("plan"), time.perf_counter() - start


def _header_figures(path: Path) -> tuple[list[str], str]:
    """(peak per stage as printed, tokens/s as printed) from a recipe's comment header."""
    head = "".join(line for line in path.read_text().splitlines(keepends=True) if line.startswith("#"))
    per_stage = re.search(r"peak per stage: (.*) of", head)
    peaks = per_stage.group(1).split(" | ") if per_stage else [re.search(r"peak ([\d,.]+) of", head).group(1)]
    return peaks, re.search(r"([\d,]+) tokens/s", head).group(1)


def _check_recipe(name: str) -> None:
    path = RECIPES / f"{name}.toml"
    code, out, err, plan, _ = _run(str(path))  # how long it takes: --durations, not an assertion
    assert code == 0, err
    assert "fits: peak" in out and "tokens/s" in out and "MFU" in out
    peaks, tokens = _header_figures(path)
    assert peaks == [f"{r.peak_bytes / GIB:,.2f}" for r in plan.ranks], "re-run meshpar plan; update the header"
    assert tokens == f"{plan.time.tokens_per_s:,.0f}", "re-run meshpar plan; update the header"


# the cluster recipes: their header quotes the plan (the 405B one has its own test below)
CLUSTER = sorted(p.stem for p in RECIPES.glob("*.toml") if "`meshpar plan" in p.read_text())


def test_every_cluster_recipe_is_planned_here():
    assert set(CLUSTER) == {"llama3_8b", "llama3_70b", "llama3_70b_3d", "llama3_405b", "qwen3_8b", "qwen2_7b",
                            "gpt2_xl", "llama3_8b_float8", "llama3_70b_float8", "llama3_8b_sft", "deepseek_v3_16b",
                            "deepseek_v3_671b", "gpt_oss_20b", "gpt_oss_120b"}


@pytest.mark.slow  # a cluster recipe planned at its target size
@pytest.mark.parametrize("name", [n for n in CLUSTER if n != "llama3_405b"])
def test_shipped_recipe_fits_and_its_header_is_the_plan(name):
    _check_recipe(name)


@pytest.mark.slow  # a cluster recipe planned at its target size
def test_405b_recipe_fits_in_budget_with_exact_totals():
    _check_recipe("llama3_405b")
    plan = _run(str(RECIPES / "llama3_405b.toml"))[3]
    assert plan.n_params == 405_853_388_800  # the published count (meshpar/models/llama/args.py)
    assert [r.layers for r in plan.ranks][::6] == [range(0, 16), range(96, 111)]
    _check_exact(plan)


def _expected_local_bytes(args, layers: range, first: bool, last: bool, dp: int, tp: int) -> tuple[int, int]:
    """(bytes, tensors) of rank (dp 0, tp 0)'s sharded float32 parameters, by arithmetic on the
    published shapes and the Llama plan table: q/k/v/w1/w3 and the vocabulary split on dim 0
    over tp, o/w2 on dim 1, norms replicated; then FSDP's torch.chunk of dim 0, rank 0's chunk
    the largest (ceil)."""
    d, h, kv, dh, f, v = args.dim, args.n_heads, args.n_kv_heads, args.resolved_head_dim, args.ffn_dim, args.vocab_size
    block = [((h * dh, d), 0), ((kv * dh, d), 0), ((kv * dh, d), 0), ((d, h * dh), 1),  # wq wk wv wo
             ((f, d), 0), ((d, f), 1), ((f, d), 0), ((d,), None), ((d,), None)]  # w1 w2 w3 norms
    tensors = [t for _ in layers for t in block]
    tensors += [((v, d), 0)] if first else []
    tensors += [((d,), None), ((v, d), 0)] if last else []
    total = 0
    for shape, tp_dim in tensors:
        local = [n // tp if i == tp_dim else n for i, n in enumerate(shape)]
        total += 4 * math.ceil(local[0] / dp) * math.prod(local[1:])
    return total, len(tensors)


def _check_exact(plan) -> None:
    layout = plan.layout
    for r in plan.ranks:
        expected, n = _expected_local_bytes(plan.args, r.layers, r.stage == 0, r.stage == layout.pp - 1,
                                            layout.dp_shard, layout.tp)
        assert r.param_bytes == r.grad_bytes == expected
        assert r.optim_bytes == 2 * expected + 4 * n  # exp_avg, exp_avg_sq, a float32 step per tensor


@pytest.mark.slow  # a cluster recipe planned at its target size
def test_70b_totals_are_the_analytic_ones():
    for name in ("llama3_70b", "llama3_70b_3d"):
        plan = _run(str(RECIPES / f"{name}.toml"))[3]
        assert plan.n_params == 70_553_706_496  # the published count, summed over the pipeline stages
        _check_exact(plan)
    plan = _run(str(RECIPES / "llama3_70b.toml"))[3]
    # 4 bytes x (embedding and output 2 x [2004, 8192] + 80 blocks x (wq [128, 8192], wk and wv 2 x [16, 8192],
    # wo [1024, 1024], w1 and w3 2 x [448, 8192], w2 [1024, 3584], 2 norms [1024]) + final norm [1024])
    assert plan.ranks[0].param_bytes == 4_410_183_680
    rows = {row.name: row for row in plan.ranks[0].rows}
    assert rows["layers.0..79.attention.wq.weight"].placements == "dp_shard:_S(0, 8) tp:S(0)"
    assert rows["layers.0..79.attention.wq.weight"].local_shape == (128, 8192)
    assert rows["layers.0..79.feed_forward.w2.weight"].local_shape == (1024, 3584)
    assert rows["output.weight"].local_shape == (2004, 8192)


def test_optimizer_bytes_are_fused_adamw_state():
    """The planner's AdamW bytes equal the state torch's fused AdamW allocates (one process)."""
    recipe = recipelib.load(None, ["--parallel.dp_shard=1", "--train.global_batch=4", "--train.micro_batch=4"])
    plan = planlib.plan(recipe, 1, planlib.load_hardware("cpu")[0])
    model = get_family("llama").build(recipe.model)
    optimizer = build_optimizer(model, recipe.optim)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    state = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values())
    assert plan.ranks[0].optim_bytes == state
    assert plan.ranks[0].param_bytes == sum(p.numel() * 4 for p in model.parameters())


@pytest.mark.slow  # two cluster recipes planned at their target size (cached: the header tests plan them too)
def test_time_model_figures():
    plan = _run(str(RECIPES / "llama3_70b_3d.toml"))[3]
    t, r = plan.time, plan.recipe.train
    assert t.bubble == pytest.approx(3 / 35)  # (p - 1) / (m + p - 1), p = 4, m = 32
    assert t.tokens_per_s * t.step_s == pytest.approx(r.global_batch * r.seq_len)
    peak = 989.4e12
    assert t.mfu == pytest.approx(plan.args.flops_per_token(r.seq_len) * t.tokens_per_s / (64 * peak))
    plan = _run(str(RECIPES / "llama3_70b.toml"))[3]  # selective: no recomputed matmuls, one stage
    tokens_per_rank = 16 * 8192 / 8
    # eager beside collectives: [Note: the efficiency constants] in meshpar/planner/cost.py (0.43 x 0.80)
    assert plan.time.efficiency == pytest.approx(0.43 * 0.80)
    assert plan.time.compute_s == pytest.approx(plan.args.flops_per_token(8192) * tokens_per_rank / 8 / (peak * 0.344))
    # the optimizer step: 40 bytes per local fp32 parameter at the profile's bandwidth
    assert plan.time.optimizer_s == pytest.approx(plan.ranks[0].param_bytes / 4 * 40 / 3350e9)
    links = {c.dim: c.link for c in plan.time.comm}
    assert links == {"dp_shard": "inter-node", "tp": "intra-node"}


@pytest.mark.slow  # a cluster recipe planned at its target size
def test_unfitting_recipe_exits_1_naming_what_to_change():
    code, out, err, plan, _ = _run(str(RECIPES / "llama3_8b.toml"), "--parallel.dp_shard=1",
                                   "--parallel.dp_replicate=8", '--parallel.param_dtype="float32"')
    assert code == 1
    assert "does not fit: peak" in err and "parallel.dp_shard" in err
    assert plan.ranks[0].optim_bytes == 2 * plan.ranks[0].param_bytes + 4 * 291  # replicated: all of 8B
    assert plan.ranks[0].param_bytes == 8_030_261_248 * 4


def test_the_dry_run_tells_its_progress_on_stderr():
    """A line as the dry run starts and one per pipeline stage, each stage once, on stderr: stdout is
    the plan alone. Of the four stages the two middle ones are alike: one simulated, the other reuses it."""
    code, out, err, _, _ = _run(str(RECIPES / "llama_debug.toml"), "--world", "4", "--parallel.pp=4",
                                "--parallel.dp_shard=1", "--train.micro_batch=2", "--hardware", "cpu")
    assert code == 0, err
    lines = err.splitlines()
    assert lines[0] == ("meshpar plan: a dry run of llama debug at 4 ranks: each pipeline stage's step simulated "
                        "on fake tensors")
    stage = re.compile(r"meshpar plan: pipeline stage (\d) of 4 \(1 block\) simulated (in [\d.]+ s|as stage (\d)'s)")
    stages = [stage.fullmatch(line) for line in lines[1:]]
    assert len(stages) == 4 and all(stages), lines
    assert sorted(int(m.group(1)) for m in stages) == [0, 1, 2, 3]
    assert [(m.group(1), m.group(3)) for m in stages if m.group(3)] == [("2", "1")]
    assert not any(line in out for line in lines) and "fits: peak" in out


def test_recipe_errors_exit_2(capsys):
    assert planlib.main([str(RECIPES / "llama_debug.toml")]) == 2  # dp_shard = -1: the world size is needed
    assert "--world" in capsys.readouterr().err
    assert planlib.main([str(RECIPES / "llama3_70b.toml"), "--parallel.tp=3", "--world", "24"]) == 2
    assert "parallel.tp = 3" in capsys.readouterr().err
    assert planlib.main([str(RECIPES / "llama3_70b.toml"), "--world", "48"]) == 2
    assert "!= world size 48" in capsys.readouterr().err


def test_schedule_actions_hold_the_microbatches_a_schedule_holds():
    def held(schedule, n, pp, stage):
        return 1 + max(others for _, others in schedule_actions(schedule, n, pp, stage, min(n, 3)))

    assert [held("1f1b", 8, 4, s) for s in range(4)] == [4, 3, 2, 1]
    assert [held("gpipe", 8, 4, s) for s in range(4)] == [8, 8, 8, 8]
    assert held(None, 8, 1, 0) == 1
    actions = schedule_actions("1f1b", 4, 2, 0, 3)  # F F B F B F B B
    assert [a for a, _ in actions] == ["F0", "F0", "B0", "F1", "B1", "F1", "B1", "B2"]


def test_profile_without_links_uses_named_defaults(tmp_path):
    path = tmp_path / "gpu.toml"
    path.write_text('name = "a GPU"\nmemory_gb = 96\n[peak_tflops]\nbfloat16 = 800\n')
    profile, note = planlib.load_hardware(str(path))
    assert (profile.devices_per_node, profile.intra_node_gbps, profile.inter_node_gbps) == (8, 450.0, 50.0)
    assert "links.intra_node_gbps" in note and "defaults" in note


# The layouts are 4-rank: one spawned job measures them in turn.
CALIBRATED = ["dp_shard 2 x tp 2, full AC, bf16", "pp 2 x dp_shard 2, 1f1b",
              "pp 2 x dp_shard 2, 1f1b, loss in 4 chunks"]
MEASURED = CaseSet({layout: (functools.partial(calibrate_plan.measure_rank,
                                               calibrate_plan.BASE + calibrate_plan.LAYOUTS[layout][1], 2),
                             calibrate_plan.LAYOUTS[layout][0]) for layout in CALIBRATED}, timeout=300)


@pytest.mark.parametrize("layout", CALIBRATED)
def test_planned_peak_is_a_real_steps(layout):
    """The planned peak per stage against AllocationTracker's in a real training step on gloo
    (tests/benchmarks/calibrate_plan.py runs all of them)."""
    world, extra = calibrate_plan.LAYOUTS[layout]
    overrides = calibrate_plan.BASE + extra
    measured: dict[int, int] = {}
    for stage, peak in MEASURED.check(layout, world):
        measured[stage] = max(measured.get(stage, 0), peak)
    planned = calibrate_plan.predict(overrides, world)
    assert measured.keys() == planned.keys(), (measured, planned)
    for stage, peak in measured.items():
        assert planned[stage] == pytest.approx(peak, rel=0.01), (stage, planned[stage], peak)


def test_search_candidates_multiply_to_the_world_and_divide_the_model():
    profile = planlib.load_hardware("h100_sxm")[0]
    base = ["--model.size=70b", "--train.seq_len=8192", "--train.global_batch=16", '--parallel.param_dtype="bfloat16"']
    cands = candidates(base, 64, profile, 8, 0.34)
    assert len(cands) > 50
    args = LLAMA_SIZES["70b"]
    for c in cands:
        o = {k: int(v) for k, v in (x.removeprefix("--").split("=") for x in c.overrides[:5])}
        tp, pp, rep, shard = (o["parallel.tp"], o["parallel.pp"], o["parallel.dp_replicate"], o["parallel.dp_shard"])
        assert tp * pp * rep * shard == 64
        assert all(n % tp == 0 for n in (args.n_heads, args.n_kv_heads, args.ffn_dim, args.vocab_size, 8192))
        assert 16 % (rep * shard * o["train.micro_batch"]) == 0 and args.n_layers >= 2 * pp
    assert [c.bound for c in cands] == sorted((c.bound for c in cands), reverse=True)


@pytest.mark.slow  # dry runs of every candidate layout, then of the written recipe
def test_search_writes_the_fastest_layout_that_fits(tmp_path):
    # a global batch of 2 (one sequence a rank, a few candidates) that the defaults' micro_batch (4) does not divide
    out = tmp_path / "found.toml"
    code, printed, err, _, _ = _run("--model", "llama/debug", "--gpus", "2", "--hardware", "cpu", "--gpus-per-node",
                                    "2", "--seq", "256", "--global-batch", "2", "--top", "3", "--out", str(out))
    assert code == 0, err
    table = printed[printed.index("   #  layout"):].splitlines()[1:4]
    speeds = [float(line.split()[-2].replace(",", "")) for line in table]
    assert speeds == sorted(speeds, reverse=True) and len(speeds) == 3
    assert _run(str(out), "--hardware", "cpu")[0] == 0  # the written recipe plans, and fits


@pytest.mark.slow  # a cluster recipe planned at its target size
def test_reducing_every_microbatch_keeps_gradients_sharded():
    """parallel.grad_reduce = "microbatch" on the 8B recipe (2 microbatches per step): at the step's
    peak only the sharded gradients are live, the whole difference in peak is those gradients
    (11.2 GiB a rank: each unit's unsharded bf16 gradient held across microbatches, 2 bytes x 8.0e9,
    against the fp32 shard), and FSDP reduce-scatters twice the bytes."""
    path = str(RECIPES / "llama3_8b.toml")  # its step-reduced plan is the header's (cached by _run)
    step, micro = _run(path)[3], _run(path, '--parallel.grad_reduce="microbatch"')[3]
    assert step.accum == micro.accum == 2

    def grads_at_peak(plan) -> int:
        r = plan.ranks[0]
        return r.measured.phases[r.peak_phase].at_peak["Gradient"]

    r = micro.ranks[0]
    assert grads_at_peak(step) > 3 * r.grad_bytes
    assert grads_at_peak(micro) == pytest.approx(r.grad_bytes, rel=0.01)
    saved = step.ranks[0].peak_bytes - r.peak_bytes
    assert saved > 10 * GIB and saved == pytest.approx(grads_at_peak(step) - grads_at_peak(micro), rel=1e-3)

    def scattered(plan) -> int:
        return plan.ranks[0].measured.comm_bytes[("reduce_scatter", "dp_shard")]

    assert scattered(micro) == 2 * scattered(step)


def test_stages_checkpointing_different_blocks_are_simulated_apart():
    """ac_every counts global block indices: with 10 blocks on 5 stages and every 3rd block
    checkpointed, stages 1 and 3 checkpoint 1 of their 2 blocks (3; 6) and stage 2 none (4, 5), so
    stage 2 keeps more activations per microbatch."""
    code, _, err, plan, _ = _run(str(RECIPES / "llama_debug.toml"), "--world", "5", "--hardware", "cpu",
                                 "--model.n_layers=10", "--parallel.pp=5", "--parallel.dp_shard=1",
                                 '--parallel.activation_checkpoint="full"', "--parallel.ac_every=3",
                                 "--train.global_batch=10", "--train.micro_batch=2")
    assert code == 0, err
    act = [r.measured.activation_bytes for r in plan.ranks]
    assert act[1] == act[3] < act[2]


def test_a_group_spanning_two_nodes_is_inter_node():
    from meshpar.distributed.mesh import Layout
    from meshpar.planner.cost import _link

    profile = planlib.load_hardware("h100_sxm")[0]
    assert _link("tp", Layout(1, 1, 8, 1, 8), 8, profile)[0] == "intra-node"
    assert _link("tp", Layout(1, 1, 8, 1, 3), 8, profile)[0] == "inter-node"  # ranks 6, 7, 8 share a group
    assert _link("dp_shard", Layout(1, 1, 2, 1, 4), 8, profile)[0] == "intra-node"
    assert _link("dp_shard", Layout(1, 1, 8, 1, 4), 8, profile)[0] == "inter-node"
