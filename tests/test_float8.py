"""Float8 training through torchao under meshpar's FSDP engine, on CPU (torchao's emulated float8).

The FSDP run on 2 ranks, its weights all-gathered in float8 through the extension protocol
(meshpar/fsdp/extensions.py; gloo cannot gather float8 dtypes, so they travel as bytes), equals
one process training the same float8 model on each rank's slice in turn with the gradients
averaged, bit for bit: the weight's float8 scale comes from the amax of the whole weight in both
(torchao reduces the shards' amax over the mesh), activations and output gradients are cast per
slice in both, and the sums are the same two terms. The all-gather's bytes are a quarter of the
float32 all-gather's, which shows the float8 data is what travelled; without float8 the losses
differ (the comparison can fail).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from meshpar.config.recipe import RecipeError, load
from meshpar.distributed import comm_record
from meshpar.distributed._torch import local_tensor
from meshpar.training.preflight import preflight
from tests.distributed import CaseSet
from tests.helpers import ROOT
from tests.processes import finish_run, metrics_records, start_run


def _model(float8: bool, all_gather: bool = True) -> nn.Module:
    import torchao.float8 as torchao_float8  # the dev extra installs it; imported here, not by the inner loop

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 64, bias=False), nn.ReLU(), nn.Linear(64, 32, bias=False))
                            for _ in range(2)])
    if float8:
        config = torchao_float8.Float8LinearConfig(emulate=True, enable_fsdp_float8_all_gather=all_gather)
        torchao_float8.convert_to_float8_training(model, config=config)
    return model


def _batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(2, 8, 32, generator=g)[rank]


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


def _fsdp(float8: bool, all_gather: bool = True, steps: int = 3) -> tuple[list[torch.Tensor], dict, float]:
    """(this rank's losses, its parameter shards after the last step, all-gather bytes of the steps)."""
    import meshpar.fsdp as E

    model = _model(float8, all_gather)
    for block in model:
        E.fully_shard(block)
    E.fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    losses = []
    with comm_record.count() as counted:
        for step in range(steps):
            loss = _loss(model, _batch(step, dist.get_rank()))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach().clone())
    gathered = sum(n for (op, _), n in counted.bytes.items() if op == "all_gather")
    return losses, {k: local_tensor(p).detach().clone() for k, p in model.named_parameters()}, gathered


def _one_process(steps: int = 3) -> tuple[list[torch.Tensor], dict]:
    """The float8 model in one process: each rank's slice in turn, gradients averaged."""
    model = _model(True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(steps):
        for r in range(world):
            loss = _loss(model, _batch(step, r))
            loss.backward()
            if r == rank:
                losses.append(loss.detach().clone())
        for p in model.parameters():
            p.grad.div_(world)
        opt.step()
        opt.zero_grad()
    return losses, {k: p.detach().chunk(world)[rank].clone() for k, p in model.named_parameters()}


def _case_float8_all_gather() -> dict:
    torch.set_default_dtype(torch.float32)
    want_losses, want_params = _one_process()
    losses, params, gathered = _fsdp(True)
    for step, (got, want) in enumerate(zip(losses, want_losses, strict=True)):
        assert torch.equal(got, want), f"step {step}: loss {got.item()!r} vs one process {want.item()!r}"
    for name, want in want_params.items():
        got = params[name]
        assert torch.equal(got.float(), want.float()), f"{name}: max diff {(got.float() - want.float()).abs().max()}"
    plain_losses, _, plain_gathered = _fsdp(True, all_gather=False)
    assert gathered * 4 == plain_gathered, (gathered, plain_gathered)  # float8 bytes, not float32's
    unconverted, _, _ = _fsdp(False)
    assert not torch.equal(unconverted[0], want_losses[0]), "float8 changed nothing: the comparison cannot fail"
    return {"losses": [x.item() for x in losses], "all-gather bytes": (gathered, plain_gathered)}


# --- tensor parallel -----------------------------------------------------------------------------------------
# [Note: float8 tensor-parallel parity bound]
# torchao's emulated float8 matmul multiplies in float32 (``a._data.float() / a._scale``), whatever
# the model's dtype; tp gives BLAS other shapes (and its row-parallel layers sum two halves), so its
# sums round differently, by ~1e-7 relative. Where such a value sits that close to a float8 rounding
# boundary it rounds to the neighbouring float8 value (a step of 2^-3), and from there on every later
# position of that sequence differs by as much as float8 itself moves it. Such a flip is rare, and
# which values sit that close depends on the machine's BLAS, so tp and one process are compared
# sequence by sequence, over many short sequences: a sequence agrees when its logits differ by at
# most SEQUENCE_TOL of the logits' largest magnitude, which lies orders of magnitude above float32's
# rounding carried through two blocks and below what one flip or float8 itself moves a sequence
# (measured: docs/performance.md#float8-tensor-parallel-parity); at least half the sequences must
# agree. A wrong float8 path under tp (a layer left in high precision, another scale) moves every
# sequence, so it fails; the unconverted model is checked to agree in none (the comparison can fail).
SEQUENCE_TOL = 1e-4
SEQUENCES, POSITIONS = 32, 4


def _tp_logits(family: str, mode: str, mesh=None) -> tuple[torch.Tensor, int]:
    """The first step's logits ``[SEQUENCES, POSITIONS, vocab]`` of the family's 2-layer debug model
    (after a backward, so the float8 gradients' all-gathers ran), float8 ``mode`` ("none":
    unconverted), one process (``mesh`` None) or tensor parallel on ``mesh``, and the float8
    all-gathers tp ran."""
    import dataclasses

    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor

    from meshpar.models.gpt2 import GPT2, GPT2_SIZES
    from meshpar.models.gpt2.parallelize import gpt2_tp_plan
    from meshpar.models.llama import LLAMA_SIZES, Transformer
    from meshpar.models.llama.parallelize import llama_tp_plan
    from meshpar.parallel import float8 as float8lib
    from meshpar.parallel.tensor_parallel.plan import apply_tp, loss_parallel_context

    cls, args, plan = {"llama": (Transformer, LLAMA_SIZES["debug"], llama_tp_plan),
                       "gpt2": (GPT2, GPT2_SIZES["debug"], gpt2_tp_plan)}[family]
    args = dataclasses.replace(args, n_layers=2)
    with torch.device("meta" if mesh is not None else "cpu"):
        model = cls(args)
    if mode != "none":
        float8lib.apply_float8(model, mode, emulate=True, fsdp_all_gather=False)
    if mesh is not None:
        apply_tp(model, mesh, plan(True), restyle=float8lib.float8_tp_style if mode == "tensorwise" else None)
        model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    tokens = torch.randint(0, args.vocab_size, (SEQUENCES, POSITIONS + 1), generator=torch.Generator().manual_seed(1))
    around = float8lib.around_step(mode, mesh)
    with loss_parallel_context(mesh is not None), around:
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    logits = logits.full_tensor() if isinstance(logits, DTensor) else logits
    return logits.detach(), getattr(around, "gathers", 0)


def _sequence_differences(got: torch.Tensor, want: torch.Tensor) -> list[float]:
    """Each sequence's largest logit difference, relative to the largest logit magnitude."""
    return ((got - want).abs().amax(dim=(1, 2)) / want.abs().amax()).tolist()


def _case_float8_tp() -> dict:
    """tp 2 with float8 against one process with float8, sequence by sequence ([Note: float8
    tensor-parallel parity bound]): Llama in tensorwise (torchao's float8 styles, activations
    all-gathered in float8, as bytes over gloo) and rowwise (PyTorch's styles), GPT-2 in tensorwise
    (its layers have biases: PyTorch's styles, [Note: float8 TP styles and biases])."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_default_dtype(torch.float64)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))["tp"]
    out = {}
    for family, mode in (("llama", "tensorwise"), ("llama", "rowwise"), ("gpt2", "tensorwise")):
        tp, gathers = _tp_logits(family, mode, mesh)
        one, _ = _tp_logits(family, mode)
        unconverted, _ = _tp_logits(family, "none")
        differences = _sequence_differences(tp, one)
        agree = sum(d <= SEQUENCE_TOL for d in differences)
        assert 2 * agree >= SEQUENCES, (family, mode, differences)
        moved = _sequence_differences(unconverted, one)
        assert all(d > 10 * SEQUENCE_TOL for d in moved), (family, mode, "float8 changed nothing", moved)
        if (family, mode) == ("llama", "tensorwise"):  # per block: attention and feed-forward inputs, wo and w2's
            assert gathers >= 4 * 2, gathers            # output gradients
        elif mode == "rowwise":
            assert gathers == 0, gathers  # rowwise gathers in high precision
        out[f"{family} {mode}"] = {"sequences agreeing": agree, "differences": differences,
                                   "float8 against none, smallest": min(moved), "float8 all-gathers": gathers}
    return out


CASES = CaseSet({"float8_all_gather": (lambda: _case_float8_all_gather(), 2),
                 "float8_tp": (lambda: _case_float8_tp(), 2)}, timeout=300)


@pytest.mark.parametrize(("case", "world"), CASES.params())
def test_float8_fsdp_and_tp_equal_one_process(case, world):
    CASES.check(case, world)


# --- meshpar train with model.float8 ----------------------------------------------------------------------------
@pytest.mark.parametrize(("overrides", "message"), [
    (["--model.float8_emulate=true"], r"model.float8_emulate = true has no effect with model.float8 = \"none\""),
    (["--model.float8=rowwise", "--train.device=cpu"], r"model.float8 = 'rowwise' on CPU runs only emulated"),
])
def test_float8_recipe_errors_name_the_key(overrides, message):
    with pytest.raises(RecipeError, match=message):
        preflight(load(ROOT / "recipes" / "llama_debug_fsdp.toml", overrides), 2)


def _tensor_entries(checkpoint: Path) -> dict[str, tuple]:
    """(dtype, global size) of each model and optimizer tensor a checkpoint holds."""
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(str(checkpoint)).read_metadata()
    return {k: (str(v.properties.dtype), tuple(v.size)) for k, v in metadata.state_dict_metadata.items()
            if k.startswith(("model.", "optim.")) and hasattr(v, "properties")}


def test_meshpar_train_with_float8_and_its_checkpoints(tmp_path):
    """``meshpar train`` of the debug Llama at dp_shard 2 x tp 2, tensorwise, emulated: its log names float8,
    the float8 all-gathers of FSDP and of tensor parallelism and the one layer left in high precision
    (the output projection), and its losses are finite. Its checkpoint holds the plain float32 tensors a
    run without float8 saves ([Note: checkpoints hold plain tensors] in meshpar/checkpoint/format.py):
    resuming it under float8 gives the uninterrupted run's steps bit for bit, and a run without float8
    on another layout (dp_shard 2) loads it."""
    float8 = ("--model.float8=tensorwise", "--model.float8_emulate=true", "--parallel.tp=2")
    straight, resumed, plain = tmp_path / "straight", tmp_path / "resumed", tmp_path / "plain"
    code, output = finish_run(start_run(straight, *float8, "--train.steps=4", "--checkpoint.every=2",
                                        "--train.eval_every=4"), timeout=300)
    assert code == 0, output[-4000:]
    assert [r["step"] for r in metrics_records(straight) if "val_loss" in r] == [4]  # float8's gathers in eval too
    assert ("meshpar: float8 tensorwise (emulated), all-gather in float8, tensor-parallel activations gathered in "
            "float8 (layers without a bias) | left in high precision: output\n") in output
    losses = [r["loss"] for r in metrics_records(straight) if "loss" in r]
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses))), losses
    step_2 = straight / "checkpoints" / "step_2"
    code, output = finish_run(start_run(resumed, *float8, "--train.steps=4", f"--checkpoint.load_from={step_2}",
                                        "--train.eval_every=4"),
                              timeout=300)
    assert code == 0 and "resumed from" in output, output[-4000:]
    want = [r for r in metrics_records(straight) if r.get("step", 0) > 2]
    assert want and [r for r in metrics_records(resumed) if r.get("step", 0) > 2] == want
    code, output = finish_run(start_run(plain, "--train.steps=3", f"--checkpoint.load_from={step_2}",
                                        "--checkpoint.every=3"), timeout=240)
    assert code == 0 and "resumed from" in output, output[-4000:]
    entries = _tensor_entries(step_2)
    assert entries and entries == _tensor_entries(plain / "checkpoints" / "step_3")
    assert {dtype for dtype, _ in entries.values()} == {"torch.float32"}
    # `meshpar convert --to hf` of the float8 checkpoint: the tensors a run without float8 exports
    from safetensors import safe_open

    from tools.convert import main as convert

    def exported(checkpoint: Path, out: Path) -> dict[str, tuple]:
        assert convert([str(checkpoint), str(out), "--to", "hf"]) == 0
        found = {}
        for f in sorted(out.glob("*.safetensors")):
            with safe_open(str(f), "pt") as st:
                names = list(st.keys())  # a safetensors file is no mapping
                found.update({k: (st.get_slice(k).get_dtype(), tuple(st.get_slice(k).get_shape())) for k in names})
        return found

    hf = exported(step_2, tmp_path / "hf_float8")
    assert hf and hf == exported(plain / "checkpoints" / "step_3", tmp_path / "hf_plain")
    # pipeline stages, context parallelism and selective checkpointing with float8: pp 2 x cp 2 trains
    # the same model; each cp rank scales its own tokens, so its losses are the straight run's to 1e-3
    composed = tmp_path / "composed"
    code, output = finish_run(start_run(composed, "--model.float8=tensorwise", "--model.float8_emulate=true",
                                        "--parallel.pp=2", "--parallel.cp=2", "--parallel.dp_shard=1",
                                        "--parallel.activation_checkpoint=selective", "--train.steps=2"), timeout=300)
    assert code == 0 and "meshpar: float8 tensorwise (emulated), all-gather in float8" in output, output[-4000:]
    got = [r["loss"] for r in metrics_records(composed) if "loss" in r]
    close = all(abs(a - b) <= 1e-3 * abs(b) for a, b in zip(got, losses[:2], strict=True))
    assert len(got) == 2 and close, (got, losses)


def test_plan_prices_float8():
    """meshpar plan prices float8 ([Note: float8 in the time model]): the blocks' linears at the float8
    rate, FSDP's gathered weights at 1 byte under tensorwise. The dry run does not depend on float8, so
    one plan's ranks price every mode; the none-mode step is the plan's own, and the printed plan says
    what was priced."""
    import dataclasses

    from meshpar.config.hardware import load_profile
    from meshpar.planner import cost, plan, report

    profile = load_profile("h100_sxm", "cuda")
    recipe = load(ROOT / "recipes" / "llama_debug_fsdp.toml", ["--parallel.param_dtype=bfloat16"])
    planned = plan(recipe, 2, profile, gpus_per_node=8)

    def priced(mode: str):
        r = dataclasses.replace(recipe, model=dataclasses.replace(recipe.model, float8=mode))
        return cost.step_time(r, planned.layout, planned.args, profile, planned.ranks, planned.accum,
                              gpus_per_node=8, efficiency=None, links=cost.LinkDefaults())

    none, tensorwise, rowwise = priced("none"), priced("tensorwise"), priced("rowwise")
    assert none == planned.time
    assert none.tokens_per_s < rowwise.tokens_per_s < tensorwise.tokens_per_s
    # the converted FLOPs move from the bf16 rate to the float8 one; the rest stays
    args = planned.args
    converted = cost.float8_params_per_block(args) * 6 * args.n_layers
    rate = profile.peak_flops(torch.bfloat16)
    tokens = recipe.train.global_batch * recipe.train.seq_len / planned.layout.dp
    for t, mode in ((tensorwise, "tensorwise"), (rowwise, "rowwise")):
        saved = converted * tokens * (1 / rate - 1 / cost.float8_rate(profile, mode)) / none.efficiency
        assert math.isclose(none.compute_s - t.compute_s, saved, rel_tol=1e-9), mode
    gathered = {name: sum(c.bytes_per_step for c in t.comm if c.dim == "dp_shard")
                for name, t in (("none", none), ("tensorwise", tensorwise), ("rowwise", rowwise))}
    assert gathered["rowwise"] == gathered["none"] > gathered["tensorwise"], gathered
    planned.recipe = dataclasses.replace(recipe, model=dataclasses.replace(recipe.model, float8="tensorwise"))
    planned.time = tensorwise
    assert "FSDP gathers the converted weights and tp the activations in float8" in report(planned)
    with pytest.raises(RecipeError, match="has no peak for float8"):
        cost.float8_rate(load_profile("a100_80gb", "cuda"), "tensorwise")
