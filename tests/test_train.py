"""End-to-end training: the loss falls on real text, and the layout does not change the numbers.

The single-process run is the reference: data-parallel replicas and gradient accumulation
must reproduce its loss at every step and every parameter at the end.
"""

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from meshpar import recipe as recipelib
from meshpar.preflight import preflight
from meshpar.train import train
from tests.distributed import run_distributed

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--model.n_layers=2", "--train.seq_len=64", "--train.global_batch=8", "--train.micro_batch=2",
         "--train.log_every=1", "--train.eval_every=0", "--data.tokenizer=byte", "--model.vocab_size=256",
         "--metrics.progress=off", "--optim.warmup_steps=2"]


# [Note: parity tolerance] Different layouts sum the same fp32 numbers in a different order
# (~1e-7 relative). Losses and gradient norms show that directly. AdamW divides by sqrt(v), so
# for gradient elements near zero such noise can move an update by up to a fraction of lr
# (3e-3 here); after 4 steps parameters agree to ~6e-6 absolute, so PARAM_ATOL is 1% of lr.
PARAM_ATOL = 3e-5


def _load(name: str, out: Path, *extra: str) -> recipelib.Recipe:
    return recipelib.load(ROOT / "recipes" / name, [*SMALL, f"--train.output_dir={out}", *extra])


def _losses(records) -> list[float]:
    return [r["loss"] for r in records if "loss" in r]


@pytest.mark.parametrize("name", ["llama_debug.toml", "gpt2_debug.toml"])
def test_loss_falls_on_shakespeare(name, tmp_path, data_cache):
    recipe = _load(name, tmp_path, "--train.steps=40", "--train.eval_every=20", "--train.eval_batches=2")
    records = train(recipe).records
    losses = _losses(records)
    assert len(losses) == 40
    assert losses[0] > 5.0  # ~ln(256): an untrained byte-level model
    assert sum(losses[-5:]) / 5 < losses[0] - 2.0, losses

    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train_lines = [r for r in lines if "loss" in r]
    assert [r["step"] for r in train_lines] == list(range(1, 41))
    assert {"step", "loss", "grad_norm", "lr", "tokens_per_s", "mfu", "mem_gb"} <= set(train_lines[0])
    assert [r["step"] for r in lines if "val_loss" in r] == [20, 40]
    assert all(0 < r["mfu"] < 1 and r["tokens_per_s"] > 0 and r["mem_gb"] > 0 for r in train_lines)
    assert recipelib.load(tmp_path / "recipe.toml") == recipe  # the saved recipe is the resolved one


def test_tensorboard_sink(tmp_path, data_cache):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    records = train(_load("llama_debug.toml", tmp_path, "--train.steps=3", "--metrics.tensorboard=true")).records
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    losses = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert [s for s, _ in losses] == [1, 2, 3]
    torch.testing.assert_close([v for _, v in losses], _losses(records), rtol=1e-6, atol=0)  # stored as float32
    assert {"train/grad_norm", "train/lr", "train/tokens_per_s", "train/mfu"} <= set(events.Tags()["scalars"])


def test_gradient_accumulation_matches_one_big_microbatch(tmp_path, data_cache):
    whole = train(_load("llama_debug.toml", tmp_path / "a", "--train.steps=4", "--train.micro_batch=8"),
                  return_state=True)
    accumulated = train(_load("llama_debug.toml", tmp_path / "b", "--train.steps=4", "--train.micro_batch=2"),
                        return_state=True)
    torch.testing.assert_close(_losses(accumulated.records), _losses(whole.records), rtol=1e-5, atol=0)
    for name, ref in whole.state_dict.items():
        torch.testing.assert_close(accumulated.state_dict[name], ref, rtol=1e-4, atol=PARAM_ATOL, msg=name)


def _train_on_rank(recipe: recipelib.Recipe):
    result = train(recipe, return_state=True)
    return result.records, result.state_dict


def test_dp_replicate_matches_single_process(tmp_path, data_cache):
    steps = "--train.steps=4"
    reference = train(_load("llama_debug.toml", tmp_path / "ref", steps), return_state=True)
    recipe = _load("llama_debug.toml", tmp_path / "dp2", steps, "--parallel.dp_replicate=2")
    (records0, state0), (records1, state1) = run_distributed(_train_on_rank, 2, recipe, timeout=180,
                                                             init_process_group=False)
    assert records0 == records1 or _losses(records0) == _losses(records1)  # loss is all-reduced: same on ranks
    torch.testing.assert_close(_losses(records0), _losses(reference.records), rtol=1e-5, atol=0)
    grad_norms = [[r["grad_norm"] for r in rs] for rs in (records0, reference.records)]
    torch.testing.assert_close(grad_norms[0], grad_norms[1], rtol=1e-4, atol=0)
    for name, ref in reference.state_dict.items():
        assert torch.equal(state0[name], state1[name]), f"replicas diverged at {name}"
        torch.testing.assert_close(state0[name], ref, rtol=1e-4, atol=PARAM_ATOL, msg=name)


@pytest.mark.parametrize(("world", "layout"), [
    (2, ["--parallel.dp_shard=2"]),
    (4, ["--parallel.dp_replicate=2", "--parallel.dp_shard=2", "--parallel.reshard_after_forward=false"]),
    (2, ["--parallel.dp_shard=2", '--parallel.grad_reduce="microbatch"']),
], ids=["fsdp-2", "hybrid-2x2", "fsdp-2-reduce-every-microbatch"])
def test_fsdp_matches_single_process(world, layout, tmp_path, data_cache):
    """meshpar train with the FSDP engine: same initial model (layout-independent init), same
    losses and parameters as one process; two microbatches per rank exercise no-sync accumulation."""
    steps = ["--train.steps=5", "--train.micro_batch=1"]
    reference = train(_load("llama_debug.toml", tmp_path / "ref", *steps), return_state=True)
    recipe = _load("llama_debug.toml", tmp_path / "fsdp", *steps, *layout)
    results = run_distributed(_train_on_rank, world, recipe, timeout=240, init_process_group=False)
    records, state = results[0]
    torch.testing.assert_close(_losses(records), _losses(reference.records), rtol=1e-5, atol=0)
    for name, ref in reference.state_dict.items():
        torch.testing.assert_close(state[name], ref, rtol=1e-4, atol=PARAM_ATOL, msg=name)


def test_grad_reduce_sets_how_often_fsdp_reduce_scatters(tmp_path, data_cache):
    """parallel.grad_reduce: once per step (after the last of the 2 microbatches), or after every
    microbatch; counted by meshpar's own accounting in the traced steps (3-4) of each run
    (SMALL: 8 sequences per step, 4 per rank in microbatches of 2)."""
    calls = {}
    for mode in ("step", "microbatch"):
        recipe = _load("llama_debug.toml", tmp_path / mode, "--train.steps=4", "--train.micro_batch=2",
                       "--parallel.dp_shard=2", f'--parallel.grad_reduce="{mode}"', "--profile.enable=true",
                       "--profile.ranks=rank0")
        run_distributed(_train_on_rank, 2, recipe, timeout=180, init_process_group=False)
        with gzip.open(tmp_path / mode / "traces" / "rank0.steps3-4.json.gz", "rt") as f:
            calls[mode] = json.load(f)["meshpar"]["comm"]["reduce_scatter[dp_shard]"]["calls"]
    units = 2 + 1  # a unit per block (SMALL: 2) and the root
    assert calls == {"step": 2 * units, "microbatch": 2 * 2 * units}


def _merged(results) -> dict[str, torch.Tensor]:
    """The whole model's parameters from every rank's gathered stages (identical where they overlap)."""
    merged: dict[str, torch.Tensor] = {}
    for _, state in results:
        for name, value in state.items():
            if name in merged:
                assert torch.equal(merged[name], value), f"ranks disagree on {name}"
            merged[name] = value
    return merged


@pytest.mark.parametrize(("recipe", "world", "layout"), [
    ("llama_debug.toml", 4, ["--parallel.dp_shard=2", "--parallel.tp=2"]),
    ("llama_debug.toml", 4, ["--parallel.dp_replicate=2", "--parallel.dp_shard=1", "--parallel.tp=2",
                             "--parallel.loss_parallel=false", "--parallel.activation_checkpoint=selective"]),
    ("llama_debug.toml", 4, ["--parallel.pp=2", "--parallel.dp_shard=2", "--parallel.activation_checkpoint=full"]),
    ("llama_debug.toml", 2, ["--parallel.pp=2", "--parallel.pp_schedule=interleaved_1f1b", "--model.n_layers=4",
                             "--parallel.pp_virtual_stages=2", "--train.micro_batch=2"]),
    ("gpt2_debug.toml", 4, ["--parallel.dp_replicate=2", "--parallel.dp_shard=1", "--parallel.tp=2"]),
    ("llama_debug.toml", 4, ["--parallel.pp=2", "--parallel.dp_shard=1", "--parallel.tp=2"]),
    ("llama_debug.toml", 8, ["--parallel.pp=2", "--parallel.dp_shard=2", "--parallel.tp=2", "--model.n_layers=4",
                             "--parallel.pp_schedule=interleaved_1f1b", "--parallel.pp_virtual_stages=2"]),
    ("llama_debug.toml", 4, ["--parallel.pp=2", "--parallel.dp_shard=2", '--parallel.grad_reduce="microbatch"']),
], ids=["fsdp2-x-tp2", "replicate2-x-tp2-selective-ac", "pp2-x-fsdp2-full-ac", "pp2-interleaved", "gpt2-rep2-x-tp2",
        "pp2-x-tp2", "3d-interleaved", "pp2-x-fsdp2-reduce-every-microbatch"])
def test_nd_layouts_match_single_process(recipe, world, layout, tmp_path, data_cache):
    """Tensor, pipeline and data parallelism composed by `meshpar train`: the loss at every step, the
    gradient norm (clipped across every mesh dim) and every parameter equal one process's.

    AdamW's eps is 1e-6 here: tensor parallelism reorders more fp32 sums than data parallelism,
    and with eps = 1e-8 AdamW turns that noise on near-zero gradient elements into parameter
    differences of up to 4e-5 (1.3% of lr) after 4 steps, while loss and gradient norm agree to
    1e-6. With eps = 1e-6 every parameter agrees within 1e-5; tests/test_tensor_parallel.py
    proves the composition exact in float64 (1e-12)."""
    steps = ["--train.steps=4", "--train.micro_batch=1", "--optim.eps=1e-6"]
    same_model = [a for a in layout if a.startswith(("--model.", "--train."))]
    reference = train(_load(recipe, tmp_path / "ref", *steps, *same_model), return_state=True)
    parallel = _load(recipe, tmp_path / "nd", *steps, *layout)
    results = run_distributed(_train_on_rank, world, parallel, timeout=300, init_process_group=False)
    records = results[0][0]
    torch.testing.assert_close(_losses(records), _losses(reference.records), rtol=1e-5, atol=0)
    grad_norms = [[r["grad_norm"] for r in rs if "grad_norm" in r] for rs in (records, reference.records)]
    torch.testing.assert_close(grad_norms[0], grad_norms[1], rtol=1e-4, atol=0)
    state = _merged(results)
    assert state.keys() == reference.state_dict.keys()
    for name, ref in reference.state_dict.items():
        torch.testing.assert_close(state[name], ref, rtol=1e-4, atol=PARAM_ATOL, msg=name)


@pytest.mark.parametrize(("recipe", "extra", "shown"), [
    ("llama_debug.toml", ["--parallel.dp_replicate=2"], "2 ranks on cpu | layout dp_replicate 2 |"),
    ("llama_debug_hsdp.toml", ["--train.micro_batch=1"], "4 ranks on cpu | layout dp_replicate 2 x dp_shard 2 |"),
    ("llama_debug_3d.toml", [], "8 ranks on cpu | layout pp 2 x dp_shard 2 x tp 2 |"),
], ids=["replicate-2", "hsdp-2x2", "3d-pp2-fsdp2-tp2"])
def test_cli_launches_local_ranks(recipe, extra, shown, tmp_path, data_cache):
    """`meshpar train` with a multi-rank recipe starts the ranks itself and matches one process."""
    args = [*SMALL, "--train.steps=3", *extra, f"--train.output_dir={tmp_path}"]
    proc = subprocess.run([sys.executable, "-m", "meshpar", "train", f"recipes/{recipe}", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=240, env={**os.environ})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert shown in proc.stdout
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    reference = train(_load("llama_debug.toml", tmp_path / "ref", "--train.steps=3")).records
    torch.testing.assert_close([r["loss"] for r in lines], _losses(reference), rtol=1e-5, atol=0)


def test_cli_refuses_a_layout_for_the_wrong_world_size(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "meshpar", "train", "recipes/llama_debug.toml", "--nproc=3",
                           "--parallel.dp_replicate=2", f"--train.output_dir={tmp_path}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "meshpar: error: [parallel] dp_shard = -1 takes the ranks left over, but pp(1) * dp_replicate(2) * cp(1) * "
        "tp(1) = 2 does not divide the world size 3; change the degrees or run on a multiple of 2 ranks"]


@pytest.mark.parametrize(("overrides", "world", "message"), [
    (["--parallel.tp=3"], 3, r"parallel\.tp = 3: n_heads \(8\) is not divisible by 3; tp degrees that divide every "
                              r"sharded dimension: 1, 2, 4"),
    (["--parallel.tp=2", "--train.seq_len=63"], 2, r"train\.seq_len \(63\) is not divisible by 2"),
    (["--parallel.pp=2", "--train.micro_batch=8", "--train.global_batch=8"], 2,
     r"train\.micro_batch = 8: 1 pipeline microbatches per step do not fit schedule '1f1b' on pp = 2: 1f1b needs "
     r"at least pp \(2\) microbatches; micro_batch values that fit the 8 sequences per data-parallel rank: 4, 2, 1$"),
    (["--parallel.pp=4", "--model.n_layers=2"], 4, r"parallel\.pp"),
    (["--model.family=gpt2", "--parallel.tp=2", "--parallel.dp_shard=2"], 4,
     r"GPT-2's fused c_attn cannot be FSDP-sharded over a tensor-parallel shard yet"),
    (["--parallel.tp=2", "--parallel.dp_shard=1", '--parallel.param_dtype="bfloat16"'], 2,
     r"parallel\.param_dtype = 'bfloat16' takes effect through FSDP, and parallel\.dp_shard = 1 makes no FSDP unit"),
    (["--parallel.pp=2", "--parallel.dp_shard=1", "--parallel.pp_schedule=zbv", "--parallel.pp_virtual_stages=2",
      '--parallel.grad_reduce="microbatch"'], 2,
     r"parallel\.grad_reduce = 'microbatch' with parallel\.pp_schedule = 'zbv'.* use grad_reduce = 'step'"),
], ids=["tp-heads", "tp-seq", "pp-microbatches", "pp-layers", "gpt2-tp-fsdp", "bf16-without-fsdp",
        "zero-bubble-reduce-every-microbatch"])
def test_layout_errors_before_launch(overrides, world, message, tmp_path, data_cache):
    """Bad N-D layouts stop in preflight (before any process group) with the key and a remedy."""
    recipe = recipelib.load(ROOT / "recipes" / "llama_debug.toml", [f"--train.output_dir={tmp_path}",
                                                                    "--data.tokenizer=byte", *overrides])
    with pytest.raises(recipelib.RecipeError, match=message):
        preflight(recipe, world)
