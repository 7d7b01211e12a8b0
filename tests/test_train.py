"""End-to-end training: the loss falls on real text, and the layout does not change the numbers.

The single-process run is the reference: data-parallel replicas and gradient accumulation
must reproduce its loss at every step and every parameter at the end. Those parity runs are
float64 (the default dtype inside ``default_dtype()`` and on ranks started through
``in_float64``), held to 1e-9: tests/parity.py [Note: parity in float64].
"""

import gzip
import json
import os
import subprocess
import sys

import pytest
import torch

from meshpar.config import recipe as recipelib
from meshpar.train import train
from meshpar.training.preflight import preflight
from tests.distributed import run_distributed
from tests.helpers import ROOT, SMALL, load_recipe, merged_state, train_losses, train_on_rank
from tests.parity import TOL, default_dtype, in_float64


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """``one_process(recipe, *overrides)``: the single-process float64 run, made once per recipe and
    overrides (several layouts compare with the same one)."""
    cache = {}

    def get(name: str, *overrides: str):
        if (name, overrides) not in cache:
            with default_dtype():
                cache[name, overrides] = train(load_recipe(name, tmp_path_factory.mktemp("ref"), *overrides),
                                               return_state=True)
        return cache[name, overrides]

    return get


def _assert_parity(records: list, state: dict[str, torch.Tensor], reference) -> None:
    """Losses, gradient norms (when logged) and every parameter equal the float64 reference's to 1e-9."""
    torch.testing.assert_close(train_losses(records), train_losses(reference.records), rtol=TOL, atol=TOL)
    grad_norms = [[r["grad_norm"] for r in rs if "grad_norm" in r] for rs in (records, reference.records)]
    torch.testing.assert_close(grad_norms[0], grad_norms[1], rtol=TOL, atol=TOL)
    assert grad_norms[1] and len(grad_norms[1]) == len(train_losses(reference.records)), "steps logged no loss or norm"
    assert state.keys() == reference.state_dict.keys()
    for name, ref in reference.state_dict.items():
        assert ref.dtype == torch.float64, f"{name} is {ref.dtype}: parity runs in float64"
        torch.testing.assert_close(state[name], ref, rtol=TOL, atol=TOL, msg=name)


@pytest.mark.slow  # 40 training steps in one process per family; the inner loop overfits one batch instead
@pytest.mark.parametrize("name", ["llama_debug.toml", "gpt2_debug.toml"])
def test_loss_falls_on_shakespeare(name, tmp_path, data_cache):
    recipe = load_recipe(name, tmp_path, "--train.steps=40", "--train.eval_every=20", "--train.eval_batches=2")
    records = train(recipe).records
    losses = train_losses(records)
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


def test_one_rank_computes_in_bf16_through_fsdp_units(tmp_path, data_cache):
    """On one rank ``param_dtype = "bfloat16"`` makes FSDP units anyway (parallelize.one_device_fsdp:
    fp32 masters, bf16 compute, no collective), where several ranks with dp_shard = 1 refuse it.
    The bf16 losses are not the fp32 ones (the cast took effect) yet stay within bf16's rounding:
    inputs and weights rounded to 8 mantissa bits (relative 2**-9) through 4 blocks give ~1e-2 on a
    loss of ~5.5 after 3 steps; 3e-2 leaves room, and a model left in fp32 would match to 1e-6."""
    fp32 = train_losses(train(load_recipe("llama_debug.toml", tmp_path / "fp32", "--train.steps=3")).records)
    bf16 = train_losses(train(load_recipe("llama_debug.toml", tmp_path / "bf16", "--train.steps=3",
                                          '--parallel.param_dtype="bfloat16"')).records)
    torch.testing.assert_close(bf16, fp32, rtol=3e-2, atol=0)
    assert max(abs(a - b) for a, b in zip(bf16, fp32, strict=True)) > 1e-5, (bf16, fp32)


def test_tensorboard_sink(tmp_path, data_cache):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    records = train(load_recipe("llama_debug.toml", tmp_path, "--train.steps=3", "--metrics.tensorboard=true")).records
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    losses = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert [s for s, _ in losses] == [1, 2, 3]
    torch.testing.assert_close([v for _, v in losses], train_losses(records), rtol=1e-6, atol=0)  # stored as float32
    assert {"train/grad_norm", "train/lr", "train/tokens_per_s", "train/mfu"} <= set(events.Tags()["scalars"])


@pytest.mark.parity
@default_dtype()
def test_gradient_accumulation_matches_one_big_microbatch(tmp_path, data_cache):
    whole = train(load_recipe("llama_debug.toml", tmp_path / "a", "--train.steps=4", "--train.micro_batch=8"),
                  return_state=True)
    accumulated = train(load_recipe("llama_debug.toml", tmp_path / "b", "--train.steps=4", "--train.micro_batch=2"),
                        return_state=True)
    _assert_parity(accumulated.records, accumulated.state_dict, whole)


@pytest.mark.parity
@default_dtype()
def test_dp_replicate_matches_single_process(tmp_path, data_cache):
    steps = "--train.steps=4"
    reference = train(load_recipe("llama_debug.toml", tmp_path / "ref", steps), return_state=True)
    recipe = load_recipe("llama_debug.toml", tmp_path / "dp2", steps, "--parallel.dp_replicate=2")
    (records0, state0), (records1, state1) = run_distributed(in_float64, 2, train_on_rank, recipe, timeout=180,
                                                             init_process_group=False)
    # the loss is all-reduced: the same on both ranks
    assert records0 == records1 or train_losses(records0) == train_losses(records1)
    for name in reference.state_dict:
        assert torch.equal(state0[name], state1[name]), f"replicas diverged at {name}"
    _assert_parity(records0, state0, reference)


@pytest.mark.parametrize(("world", "layout"), [
    # .ci/run reruns fsdp-2 on other kernel paths; the engine's own layouts are test_fsdp's
    pytest.param(2, ["--parallel.dp_shard=2"], marks=pytest.mark.parity),
    (4, ["--parallel.dp_replicate=2", "--parallel.dp_shard=2", "--parallel.reshard_after_forward=false"]),
    (2, ["--parallel.dp_shard=2", '--parallel.grad_reduce="microbatch"']),
], ids=["fsdp-2", "hybrid-2x2", "fsdp-2-reduce-every-microbatch"])
@default_dtype()
def test_fsdp_matches_single_process(world, layout, one_process, tmp_path, data_cache):
    """meshpar train with the FSDP engine: same initial model (layout-independent init), same
    losses and parameters as one process; two microbatches per rank exercise no-sync accumulation."""
    steps = ["--train.steps=5", "--train.micro_batch=1"]
    reference = one_process("llama_debug.toml", *steps)
    recipe = load_recipe("llama_debug.toml", tmp_path / "fsdp", *steps, *layout)
    results = run_distributed(in_float64, world, train_on_rank, recipe, timeout=240, init_process_group=False)
    _assert_parity(*results[0], reference)


def test_grad_reduce_sets_how_often_fsdp_reduce_scatters(tmp_path, data_cache):
    """parallel.grad_reduce: once per step (after the last of the 2 microbatches), or after every
    microbatch; counted by meshpar's own accounting in the traced steps (3-4) of each run
    (SMALL: 8 sequences per step, 4 per rank in microbatches of 2)."""
    calls = {}
    for mode in ("step", "microbatch"):
        recipe = load_recipe("llama_debug.toml", tmp_path / mode, "--train.steps=4", "--train.micro_batch=2",
                             "--parallel.dp_shard=2", f'--parallel.grad_reduce="{mode}"', "--profile.enable=true",
                             "--profile.ranks=rank0")
        run_distributed(train_on_rank, 2, recipe, timeout=180, init_process_group=False)
        with gzip.open(tmp_path / mode / "traces" / "rank0.steps3-4.json.gz", "rt") as f:
            calls[mode] = json.load(f)["meshpar"]["comm"]["reduce_scatter[dp_shard]"]["calls"]
    units = 2 + 1  # a unit per block (SMALL: 2) and the root
    assert calls == {"step": 2 * units, "microbatch": 2 * 2 * units}


CHUNKED = "--train.loss_chunks=3"  # 64 tokens per microbatch: chunks of 22, 22 and 20


@pytest.mark.parametrize(("recipe", "world", "layout"), [
    # three layouts compute the loss in 3 chunks (meshpar/training/loss.py) against the unchunked
    # process: vocabulary-sharded chunks, gathered-logits chunks, the pipeline's last stage
    ("llama_debug.toml", 4, ["--parallel.dp_shard=2", "--parallel.tp=2", CHUNKED]),
    ("llama_debug.toml", 4, ["--parallel.dp_replicate=2", "--parallel.dp_shard=1", "--parallel.tp=2",
                             "--parallel.loss_parallel=false", "--parallel.activation_checkpoint=selective", CHUNKED]),
    ("llama_debug.toml", 4, ["--parallel.pp=2", "--parallel.dp_shard=2", "--parallel.activation_checkpoint=full",
                             CHUNKED]),
    ("llama_debug.toml", 2, ["--parallel.pp=2", "--parallel.pp_schedule=interleaved_1f1b", "--model.n_layers=4",
                             "--parallel.pp_virtual_stages=2", "--train.micro_batch=2"]),
    ("gpt2_debug.toml", 4, ["--parallel.dp_replicate=2", "--parallel.dp_shard=1", "--parallel.tp=2"]),
    ("llama_debug.toml", 4, ["--parallel.pp=2", "--parallel.dp_shard=1", "--parallel.tp=2"]),
    # the one layout that composes all three, rerun on other kernel paths by .ci/run (marker
    # parity); the other seven are float64 at 1e-9 too, but each engine's own parity tests
    # (test_fsdp, test_tensor_parallel, test_pipeline) already cover their pieces there
    pytest.param("llama_debug.toml", 8, ["--parallel.pp=2", "--parallel.dp_shard=2", "--parallel.tp=2",
                                         "--model.n_layers=4", "--parallel.pp_schedule=interleaved_1f1b",
                                         "--parallel.pp_virtual_stages=2"], marks=pytest.mark.parity),
    ("llama_debug.toml", 4, ["--parallel.pp=2", "--parallel.dp_shard=2", '--parallel.grad_reduce="microbatch"']),
], ids=["fsdp2-x-tp2-chunked-loss", "replicate2-x-tp2-selective-ac-chunked-loss",
        "pp2-x-fsdp2-full-ac-chunked-loss", "pp2-interleaved", "gpt2-rep2-x-tp2",
        "pp2-x-tp2", "3d-interleaved", "pp2-x-fsdp2-reduce-every-microbatch"])
@default_dtype()
def test_nd_layouts_match_single_process(recipe, world, layout, one_process, tmp_path, data_cache):
    """Tensor, pipeline and data parallelism composed by `meshpar train`: the loss at every step, the
    gradient norm (clipped across every mesh dim) and every parameter equal one process's, in
    float64 to 1e-9. (In float32, with AdamW's eps at 1e-8, tensor parallelism's reordered sums
    moved parameters by up to 4e-5 after 4 steps: tests/parity.py [Note: parity in float64].)"""
    steps = ["--train.steps=2", "--train.micro_batch=1"]  # the second on the first update; both updates checked
    same_model = [a for a in layout if a.startswith(("--model.", "--train.")) and a != CHUNKED]
    reference = one_process(recipe, *steps, *same_model)
    parallel = load_recipe(recipe, tmp_path / "nd", *steps, *layout)
    results = run_distributed(in_float64, world, train_on_rank, parallel, timeout=300, init_process_group=False)
    _assert_parity(results[0][0], merged_state(results), reference)


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
    reference = train(load_recipe("llama_debug.toml", tmp_path / "ref", "--train.steps=3")).records
    # float32 (a launched command takes no dtype), so derived, not 1e-9: the layouts add the same
    # fp32 terms in other orders, ~1e-7 relative on the loss, and AdamW turns noise on near-zero
    # gradient elements into parameter moves of at most ~lr (3e-3) on a few elements, which shifts
    # a mean over 512 tokens by well under 1e-6; rtol 1e-5 is ten times that. This test is about
    # the launch; the layouts' numbers are held to 1e-9 in float64 by the tests above.
    torch.testing.assert_close([r["loss"] for r in lines], train_losses(reference), rtol=1e-5, atol=0)


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
    (["--parallel.cp=4", "--parallel.tp=4", "--parallel.dp_shard=1", '--parallel.cp_attention="ulysses"'], 16,
     r"parallel\.cp_attention = 'ulysses' splits each tp rank's 2 query heads over cp = 4, which does not divide "
     r"them; use cp in \[2\] or cp_attention = 'allgather'"),
], ids=["tp-heads", "tp-seq", "pp-microbatches", "pp-layers", "gpt2-tp-fsdp", "bf16-without-fsdp",
        "zero-bubble-reduce-every-microbatch", "ulysses-heads"])
def test_layout_errors_before_launch(overrides, world, message, tmp_path, data_cache):
    """Bad N-D layouts stop in preflight (before any process group) with the key and a remedy."""
    recipe = recipelib.load(ROOT / "recipes" / "llama_debug.toml", [f"--train.output_dir={tmp_path}",
                                                                    "--data.tokenizer=byte", *overrides])
    with pytest.raises(recipelib.RecipeError, match=message):
        preflight(recipe, world)


@pytest.mark.timeout(60)
def test_a_rank_leaves_with_its_code_and_its_output_flushed():
    """[Note: a rank leaves without finalization]: buffered output (stdout is a pipe here) and
    logging's handlers are flushed before ``os._exit``; the exit code is the one asked for."""
    script = ("import logging, sys; from meshpar.runtime.process import leave; logging.basicConfig(stream=sys.stdout); "
              "print('out', end=''); print('err', end='', file=sys.stderr); logging.warning('logged'); leave(75)")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=50)
    assert done.returncode == 75, done.stderr
    assert done.stdout.startswith("out") and "logged" in done.stdout, done.stdout
    assert done.stderr == "err", done.stderr
