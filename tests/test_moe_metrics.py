"""Mixture-of-experts recipe keys and expert-load metrics.

(a) the [model] keys aux_loss_coef, capacity_factor, aux_free_bias, bias_update_rate reach MoEArgs
    of both families, and bad values stop before launch with the key and the fix; (b) the expert
    loads a step counts (meshpar.models.moe.part.MoEPart.expert_load) against the slots the model keeps on a
    batch built to overflow two experts; (c) meshpar train's metrics.jsonl load figures against a
    direct count (each router's top-k over the same global batch, float64) on one rank and on two
    gloo ranks summed, and the logged aux_loss as coef x the layers' loss; (d) `meshpar train` for
    2 steps writes the fields and the progress line shows the worst layer.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from meshpar.config import recipe as recipelib
from meshpar.data import BatchLoader
from meshpar.models.moe import MoEArgs, MoETransformer
from meshpar.models.moe.family import MOE
from meshpar.train import train
from meshpar.training.metrics import expert_load_fields, format_record
from meshpar.training.preflight import check_model, preflight
from tests.distributed import run_distributed
from tests.helpers import ROOT, SMALL, load_recipe, train_on_rank
from tests.parity import TOL, default_dtype, in_float64

# 3 blocks of the qwen3_moe debug size: layers 0 and 2 sparse, 1 dense (mlp_only_layers)
THREE = "--model.n_layers=3"


def _args(name: str, *overrides: str):
    return check_model(recipelib.load(ROOT / "recipes" / name, ["--data.tokenizer=byte", *overrides]))[1]


# --- (a) keys -----------------------------------------------------------------------------------

@pytest.mark.parametrize(("name", "own_coef"), [("qwen3_moe_debug.toml", 0.01), ("mixtral_debug.toml", 0.02)])
def test_keys_reach_the_model_args_of_both_families(name, own_coef):
    args = _args(name, "--model.aux_loss_coef=0.5", "--model.capacity_factor=1.25", "--model.aux_free_bias=true",
                 "--model.bias_update_rate=0.01")
    assert (args.router_aux_loss_coef, args.capacity_factor, args.aux_free_bias, args.bias_update_rate) == (
        0.5, 1.25, True, 0.01)
    assert _args(name).router_aux_loss_coef == own_coef  # the recipe's own value
    assert _args(name, "--model.aux_loss_coef=-1").router_aux_loss_coef == own_coef  # -1: the size's own
    assert _args(name, "--model.aux_loss_coef=0").router_aux_loss_coef == 0


@default_dtype()
def test_the_coefficient_weights_the_model_aux_loss_exactly():
    """The loss the step backpropagates is cross-entropy + aux_loss; aux_loss = coef x the layers' sum,
    so two coefficients change it by exactly (c2 - c1) x that sum."""
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    totals = {}
    for coef in (0.0, 0.25, 0.75):
        args = _args("qwen3_moe_debug.toml", THREE, "--model.vocab_size=256", f"--model.aux_loss_coef={coef}")
        model = MoETransformer(args)
        torch.manual_seed(0)
        model.init_weights()
        with torch.no_grad():
            ce = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        unweighted = sum(moe.aux_loss for moe in model.moe_layers())
        assert abs(model.aux_loss - coef * unweighted) <= TOL * unweighted
        totals[coef] = (ce + model.aux_loss, unweighted)
    base, unweighted = totals[0.0]
    for coef in (0.25, 0.75):
        assert abs(totals[coef][0] - base - coef * unweighted) <= TOL


@pytest.mark.parametrize(("overrides", "message", "recipe"), [
    (["--model.aux_loss_coef=-0.1"], r"model\.aux_loss_coef = -0\.1: must be -1 \(the size's own\) or >= 0", None),
    (["--model.capacity_factor=0.5"], r"model\.capacity_factor = 0\.5: must be 0 \(no token dropped\) or >= 1", None),
    (["--model.capacity_factor=-1"], r"model\.capacity_factor = -1\.0: must be 0", None),
    (["--model.bias_update_rate=0", "--model.aux_free_bias=true"], r"model\.bias_update_rate = 0\.0: must be > 0",
     None),
    (["--model.bias_update_rate=0.01"], r"model\.bias_update_rate = 0\.01 has no effect without aux-free balancing: "
                                        r"set model\.aux_free_bias = true", None),
    (["--model.capacity_factor=1.25"], r"model\.capacity_factor = 1\.25: model family 'llama' has no experts "
                                       r"\(it applies to qwen3_moe, mixtral, deepseek_v3, gpt_oss\); remove it",
     "llama_debug.toml"),
    (["--model.family=gpt2", "--model.aux_free_bias=true"], r"model\.aux_free_bias = true: model family 'gpt2'",
     "llama_debug.toml"),
    (["--model.family=llama"], r"model\.aux_loss_coef = 0\.01: model family 'llama' has no experts", None),
], ids=["negative-coef", "capacity-below-1", "negative-capacity", "zero-rate", "rate-without-aux-free",
        "dense-llama", "dense-gpt2", "moe-recipe-dense-family"])
def test_bad_values_stop_before_launch(overrides, message, recipe, tmp_path):
    """recipe.load (types, ranges, cross-key rules) then preflight's check_model (the registry): what
    `meshpar train` runs before starting any rank; one line naming the key and the fix."""
    with pytest.raises(recipelib.RecipeError, match=message) as e:
        check_model(recipelib.load(ROOT / "recipes" / (recipe or "qwen3_moe_debug.toml"),
                                   [f"--train.output_dir={tmp_path}", *overrides]))
    assert "\n" not in str(e.value)


# --- (b) counting and dropping ------------------------------------------------------------------

TINY = MoEArgs(dim=16, n_layers=3, n_heads=2, n_kv_heads=1, ffn_dim=24, vocab_size=32, max_seq_len=32,
               n_experts=4, top_k=2, moe_ffn_dim=8, mlp_only_layers=(1,))


def _kept_counts(model: MoETransformer) -> list[torch.Tensor]:
    """The model's own kept slots per expert: the counts its experts run (hooked, model.py untouched)."""
    kept: list[torch.Tensor] = []
    for moe in model.moe_layers():
        moe.experts.register_forward_pre_hook(lambda _, inputs: kept.append(inputs[1].clone()))
    return kept


@default_dtype()
def test_dropped_slots_equal_what_capacity_implies_on_an_overflowing_batch():
    """Every token is routed to experts 0 and 1 (a routing bias of 100 and 50): of 2 x 8 = 16 tokens'
    32 slots, capacity ceil(1.0 x 32 / 4) = 8 per expert, so experts 0 and 1 keep 8 of 16 each and 16
    slots per layer are dropped. Then, on a random batch (router weights x 20), routed - dropped
    equals the slots the model's experts ran."""
    torch.manual_seed(0)
    model = MoETransformer(dataclasses.replace(TINY, capacity_factor=1.0, aux_free_bias=True))
    model.init_weights()
    for moe in model.moe_layers():
        moe.expert_bias.copy_(torch.tensor([100.0, 50.0, 0.0, 0.0]))
    kept = _kept_counts(model)
    tokens = torch.randint(0, 32, (2, 8))
    with torch.no_grad():
        model(tokens)
    assert [i for i, _ in MOE.sparse_layers(model)] == [0, 2]
    load = MOE.expert_load(model, tokens.numel())
    assert load.tolist() == [[[16, 16, 0, 0]] * 2, [[8, 8, 0, 0]] * 2]
    assert all(torch.equal(k, torch.tensor([8, 8, 0, 0])) for k in kept)
    fields = expert_load_fields([0, 2], load, dropped=True)
    assert fields == {"moe_layers": [0, 2], "moe_load_max": [16, 16], "moe_load_mean": 8.0,
                      "moe_imbalance": [2.0, 2.0], "moe_dropped": [16, 16]}

    torch.manual_seed(1)
    model = MoETransformer(dataclasses.replace(TINY, capacity_factor=1.0))
    model.init_weights()
    with torch.no_grad():
        for moe in model.moe_layers():  # a sharper router: random init alone routes too evenly to drop
            moe.router.weight.mul_(20)
    kept = _kept_counts(model)
    tokens = torch.randint(0, 32, (4, 16))
    with torch.no_grad():
        model(tokens)
    routed, dropped = MOE.expert_load(model, tokens.numel())
    assert dropped.sum() > 0, "nothing dropped: the case tests nothing"
    assert torch.equal(routed - dropped, torch.stack(kept))
    assert (routed.sum(1) == tokens.numel() * 2).all()


def test_progress_line_shows_the_worst_layer():
    r = {"step": 7, "loss": 4.5, "aux_loss": 0.0201, "grad_norm": 1.5, "lr": 1e-3, "tokens_per_s": 1000.0,
         "mfu": 0.01, "mem_gb": 0.5, "moe_layers": [0, 2, 3], "moe_load_max": [300, 400, 350],
         "moe_load_mean": 256.0, "moe_imbalance": [1.1719, 1.5625, 1.3672], "moe_dropped": [0, 1200, 34]}
    assert format_record(r) == ("step      7 | loss 4.5000 | aux_loss 0.0201 | grad_norm 1.500 | lr 1.00e-03 | "
                                "1,000 tok/s | mfu 1.00% | mem 0.50 GB | experts max/mean 1.56 (layer 2), "
                                "1,234 slots dropped")
    del r["moe_dropped"]
    assert format_record(r).endswith("| experts max/mean 1.56 (layer 2)")


# --- (c) metrics.jsonl against a direct count ---------------------------------------------------

CAPACITY = ["--train.steps=1", THREE, "--model.capacity_factor=1.0", "--model.aux_loss_coef=0.03"]


def _direct_count(recipe: recipelib.Recipe, world: int) -> dict:
    """Step 1 by hand on one process: the initial model (train's seed; layout-independent init) on
    the whole first global batch; each sparse layer's top-k from its own router, counted and clipped
    at capacity per microbatch; the unweighted aux losses, as the step averages them."""
    checked = preflight(recipe, world)
    t = recipe.train
    model = MoETransformer(checked.args)
    torch.manual_seed(t.seed)
    model.init_weights()
    layers = model.moe_layers()
    routed = [torch.zeros(checked.args.n_experts, dtype=torch.int64) for _ in layers]
    dropped = [0] * len(layers)

    def count(i: int, moe) -> None:
        def hook(_, inputs):
            x = inputs[0].reshape(-1, inputs[0].shape[-1])
            chosen = F.softmax(x @ moe.router.weight.T, dim=-1).topk(moe.top_k, dim=-1).indices
            c = torch.bincount(chosen.flatten(), minlength=moe.n_experts)
            capacity = math.ceil(moe.capacity_factor * x.shape[0] * moe.top_k / moe.n_experts)
            routed[i] += c
            dropped[i] += int((c - capacity).clamp(min=0).sum())
        moe.register_forward_pre_hook(hook)

    for i, moe in enumerate(layers):
        count(i, moe)
    loader = BatchLoader(checked.corpus.train, seq_len=t.seq_len, global_batch=t.global_batch,
                         micro_batch=t.micro_batch, dp_rank=0, dp_size=1, seed=t.seed)
    microbatches = list(loader.next_step())
    aux = 0.0
    with torch.no_grad():
        for inputs, _ in microbatches:
            model(inputs)
            aux += sum(moe.aux_loss.item() for moe in layers) / len(microbatches)
    return {"moe_load_max": [int(r.max()) for r in routed], "moe_load_mean": float(routed[0].sum()) / len(routed[0]),
            "moe_dropped": dropped, "aux": aux}


def _check_record(record: dict, want: dict, coef: float) -> None:
    assert record["moe_layers"] == [0, 2]
    for key in ("moe_load_max", "moe_load_mean", "moe_dropped"):
        assert record[key] == want[key], key
    assert sum(record["moe_dropped"]) > 0, "nothing dropped: the case tests nothing"
    # logged apart from the loss, and exactly coef x the layers' loss (averaged over dp: one rank's
    # microbatches hold half the batch, and the mean of per-microbatch means is the same figure)
    assert abs(record["aux_loss"] - coef * want["aux"]) <= TOL * record["aux_loss"]


@default_dtype()
def test_one_rank_loads_equal_a_direct_count(tmp_path, data_cache):
    recipe = load_recipe("qwen3_moe_debug.toml", tmp_path, *CAPACITY)
    record = train(recipe).records[0]
    _check_record(record, _direct_count(recipe, 1), 0.03)


@default_dtype()
def test_two_ranks_sum_their_loads(tmp_path, data_cache):
    """dp_shard 2: each rank counts its half of the global batch; the record sums them over dp."""
    recipe = load_recipe("qwen3_moe_debug.toml", tmp_path, *CAPACITY, "--parallel.dp_shard=2")
    want = _direct_count(recipe, 2)
    results = run_distributed(in_float64, 2, train_on_rank, recipe, timeout=180, init_process_group=False)
    record = results[0][0][0]
    _check_record(record, want, 0.03)
    other = results[1][0][0]  # every rank records the same sums (timings are each rank's own)
    assert all(other[k] == v for k, v in record.items() if k.startswith("moe_") or k in ("loss", "aux_loss"))


# --- (d) meshpar train ----------------------------------------------------------------------------

def test_meshpar_train_writes_expert_loads_to_metrics_jsonl(tmp_path, data_cache):
    proc = subprocess.run([sys.executable, "-m", "meshpar", "train", "recipes/qwen3_moe_debug.toml", *SMALL, THREE,
                           "--train.steps=2", "--model.capacity_factor=1.25", f"--train.output_dir={tmp_path}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=240, env={**os.environ})
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["moe_layers"] == [0, 2]
        assert r["moe_load_mean"] == 8 * 64 * 2 / 8  # tokens x top_k / n_experts
        assert all(m >= r["moe_load_mean"] for m in r["moe_load_max"])
        assert r["moe_imbalance"] == [round(m / r["moe_load_mean"], 4) for m in r["moe_load_max"]]
        assert len(r["moe_dropped"]) == 2
        worst = max(range(2), key=lambda i: r["moe_imbalance"][i])
        assert (f"| experts max/mean {r['moe_imbalance'][worst]:.2f} (layer {r['moe_layers'][worst]}), "
                f"{sum(r['moe_dropped']):,} slots dropped") in proc.stdout


def _aux_losses_after_a_checkpointed_step(recipe_path: str, overrides: list[str]) -> list[bool]:
    from tests.benchmarks.calibrate_plan import build_training

    run = build_training(recipelib.load(recipe_path, overrides))
    run.step()
    return [moe.aux_loss is None for stage in run.model.stages for moe in stage.moe_layers()]


def test_a_checkpointed_step_lets_go_of_the_recomputed_aux_losses(tmp_path):
    """[Note: auxiliary losses] in meshpar/training/step.py: under full activation checkpointing the recompute
    in backward sets each layer's aux_loss again, a graph of that recompute's activations; the step
    drops them, where they would otherwise live until the next forward."""
    from tests.distributed import run_distributed

    overrides = ["--model.n_layers=2", "--model.vocab_size=256", "--train.seq_len=32", "--train.global_batch=2",
                 "--train.micro_batch=1", '--parallel.activation_checkpoint="full"', "--parallel.dp_shard=1"]
    released = run_distributed(_aux_losses_after_a_checkpointed_step, 1, str(ROOT / "recipes" / "qwen3_moe_debug.toml"),
                               overrides, timeout=120)[0]
    assert released and all(released), released
