"""Tensor (and sequence) parallelism against one process: Llama, Qwen2, Qwen3 and GPT-2 plans.

Each case builds the model on meta with a seed, applies the family's plan (and, on 4 ranks,
meshpar.fully_shard per block then the root on dp_shard), materializes it with to_empty +
init_weights, and trains 5 AdamW steps next to a single-process reference built on CPU
with the same seed (meshpar.models.init makes the starting values equal). Compared: the loss at
every step and every gathered parameter at the end, which also checks that the gradients
of replicated parameters (sequence-parallel norms, row-wise biases, per-head norms,
positions) are summed over the tp ranks; gradients are also compared at every step.

Everything runs in float64: TP changes the order of float sums, and AdamW's first steps move
each element by about lr whatever its gradient's size, so in float32 elements whose gradient
is rounding noise differ by ~lr after 5 steps (seen: 7e-5 at lr 1e-3) although the gradients
agree to 1e-6 of their scale. In float64 that noise is ~1e-13, so the tolerance (1e-9) can
be tight and still tell a wrong gradient from rounding (tests/parity.py [Note: parity in
float64]); ``test_parity_catches_planted_bugs`` shows that it does. Sub-cases loop inside
one spawned job per world size (``JOBS``, a tests/distributed.py ``CaseSet``).
"""

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from meshpar.config.recipe import RecipeError
from meshpar.distributed.clip import total_norm
from meshpar.models.gpt2 import GPT2, GPT2_SIZES
from meshpar.models.gpt2.parallelize import check_gpt2_tp, gpt2_tp_plan
from meshpar.models.llama import LLAMA_SIZES, Transformer
from meshpar.models.llama.parallelize import check_llama_tp, llama_tp_plan
from meshpar.parallel.tensor_parallel.checks import check_seq_len
from meshpar.parallel.tensor_parallel.plan import apply_tp, loss_parallel_context, reduce_partial_grads
from tests.distributed import CaseSet
from tests.parity import must_fail

STEPS, BATCH, SEQ_LEN, LR, TOL, GRAD_TOL = 3, 4, 32, 1e-3, 1e-9, 1e-9

LLAMA = dataclasses.replace(LLAMA_SIZES["debug"], n_layers=2)
QWEN3 = dataclasses.replace(LLAMA, head_dim=64, qk_norm=True, norm_eps=1e-6)  # as QWEN3_SIZES["debug"], 2 layers
QWEN2 = dataclasses.replace(LLAMA, n_kv_heads=2, qkv_bias=True, tie_embeddings=True)  # as QWEN2_SIZES["debug"]
GPT2_ARGS = dataclasses.replace(GPT2_SIZES["debug"], n_layers=2)

CASES = {  # name -> (model class, args, plan builder)
    "llama": (Transformer, LLAMA, llama_tp_plan),
    "qwen3": (Transformer, QWEN3, llama_tp_plan),
    "qwen2": (Transformer, QWEN2, llama_tp_plan),
    "gpt2": (GPT2, GPT2_ARGS, gpt2_tp_plan),
}


def _value(loss: torch.Tensor) -> float:
    return (loss.to_local() if isinstance(loss, DTensor) else loss).item()  # loss parallel: a Replicate DTensor


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _loss(model: nn.Module, tokens: torch.Tensor, loss_parallel: bool) -> torch.Tensor:
    """Next-token cross-entropy, forward and backward (under loss parallel when the logits are vocab-sharded)."""
    with loss_parallel_context(loss_parallel):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
    return loss


def _build(case: str, mesh, loss_parallel: bool, fsdp: bool) -> tuple[nn.Module, nn.Module]:
    cls, args, plan = CASES[case]
    ref = cls(args)
    torch.manual_seed(0)  # init_weights draws its base seed here, as the TP model's does below
    ref.init_weights()
    with torch.device("meta"):
        model = cls(args)
    apply_tp(model, mesh["tp"], plan(loss_parallel))
    assert all(p.is_meta and isinstance(p, DTensor) for p in model.parameters()), case  # nothing allocated yet
    if fsdp:
        from meshpar.fsdp import fully_shard

        for block in model.layers.values():
            fully_shard(block, mesh=mesh["dp_shard"])
        fully_shard(model, mesh=mesh["dp_shard"])
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    return model, ref


def _train_case(case: str, mesh, loss_parallel: bool, fsdp: bool, bug=None) -> dict:
    """STEPS steps next to the reference; ``bug(model)``, a planted error, replaces reduce_partial_grads."""
    model, ref = _build(case, mesh, loss_parallel, fsdp)
    init_diff = max((_full(p) - ref.get_parameter(n)).abs().max().item() for n, p in model.named_parameters())
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=LR) for m in (model, ref))
    dp_rank, dp_size = (mesh["dp_shard"].get_local_rank(), mesh["dp_shard"].size()) if fsdp else (0, 1)
    data = torch.Generator().manual_seed(1)
    per_rank = BATCH // dp_size
    losses, grad_norms, grad_errs = [], [], {}
    for _ in range(STEPS):
        tokens = torch.randint(0, ref.args.vocab_size, (BATCH, SEQ_LEN + 1), generator=data)
        loss = _loss(model, tokens[dp_rank * per_rank:(dp_rank + 1) * per_rank], loss_parallel)
        (bug or reduce_partial_grads)(model)  # pure TP: replicated parameters' grads are partial sums
        ref_loss = _loss(ref, tokens, False)
        grad_norms.append((total_norm([p.grad for p in model.parameters()]).item(),
                           total_norm([p.grad for p in ref.parameters()]).item()))
        for name, p in model.named_parameters():  # relative to the gradient's scale
            assert p.grad.placements == p.placements, name  # no Partial gradient is left
            ref_grad = ref.get_parameter(name).grad
            err = (_full(p.grad) - ref_grad).abs().max().item() / ref_grad.abs().max().item()
            grad_errs[name] = max(grad_errs.get(name, 0.0), err)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        total = torch.tensor(_value(loss))
        dist.all_reduce(total)  # every tp rank of a dp rank saw the same batch: the mean is the dp mean
        losses.append((total.item() / dist.get_world_size(), ref_loss.item()))
    ref_params = dict(ref.named_parameters())
    params = {n: _full(p.detach()) for n, p in model.named_parameters()}
    return {"losses": losses, "grad_norms": grad_norms, "grad_errs": grad_errs, "init_diff": init_diff,
            "tied": _is_tied(model), "ref_tied": _is_tied(ref),
            "diffs": {n: (p - ref_params[n]).abs().max().item() for n, p in params.items()},
            "names": (sorted(params), sorted(ref_params))}


def _partial_grads_not_summed(model: nn.Module) -> None:
    """Bug: replicated parameters (sequence-parallel norms) keep this rank's partial gradient."""
    for p in model.parameters():
        if p.grad.placements != p.placements:
            p.grad = DTensor.from_local(p.grad.to_local(), p.grad.device_mesh, p.placements, run_check=False)


def _doubled_on_rank_1(model: nn.Module) -> None:
    """Bug: tp rank 1's gradients (its shards of the sharded parameters) are twice what they should be."""
    reduce_partial_grads(model)
    if dist.get_rank() == 1:
        with torch.no_grad():
            for p in model.parameters():
                p.grad.to_local().mul_(2)


def _catches_bugs(mesh) -> None:
    """The parity comparison below fails on each planted bug (2 ranks, pure TP, Llama)."""
    for bug in (_partial_grads_not_summed, _doubled_on_rank_1):
        result = _train_case("llama", mesh, False, fsdp=False, bug=bug)
        must_fail(lambda result=result, bug=bug: _assert_parity({bug.__name__: result}), bug.__name__)


def _is_tied(model: nn.Module) -> bool:
    if isinstance(model, GPT2):
        return model.lm_head.weight is model.wte.weight
    return model.output.weight is model.tok_embeddings.weight


def _stage_case(mesh) -> float:
    """Two pipeline-stage slices of one Llama under TP: hidden states cross the boundary as
    local sequence shards, and the composition matches the whole single-process model."""
    ref = Transformer(LLAMA)
    torch.manual_seed(0)
    ref.init_weights()
    stages = []
    for keep in ("0", "1"):
        with torch.device("meta"):
            stage = Transformer(LLAMA)
        stage.layers = nn.ModuleDict({keep: stage.layers[keep]})
        if keep == "0":
            stage.norm = stage.output = None
        else:
            stage.tok_embeddings = None
        apply_tp(stage, mesh["tp"], llama_tp_plan(loss_parallel=False))
        stage.to_empty(device="cpu")
        torch.manual_seed(0)
        stage.init_weights()
        stages.append(stage)
    tokens = torch.randint(0, LLAMA.vocab_size, (2, SEQ_LEN), generator=torch.Generator().manual_seed(2))
    hidden = stages[0](tokens)
    assert type(hidden) is torch.Tensor and hidden.shape == (2, SEQ_LEN // mesh["tp"].size(), LLAMA.dim)
    with torch.no_grad():
        return (stages[1](hidden) - ref(tokens)).abs().max().item()


def _setup(tmp: Path):
    """TP over both ranks at 2; at 4, dp_shard 2 x tp 2 (FSDP over TP)."""
    torch.set_default_dtype(torch.float64)  # see the module docstring
    if dist.get_world_size() == 2:
        return init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))


def _trained(case: str, loss_parallel: bool):
    def run(mesh) -> dict:
        return _train_case(case, mesh, loss_parallel, fsdp="dp_shard" in mesh.mesh_dim_names)
    return run


TRAIN = {  # job case -> (model case, loss parallel, world sizes)
    "llama-loss_parallel": ("llama", True, (2, 4)), "llama": ("llama", False, 2),
    "qwen3-loss_parallel": ("qwen3", True, 2), "qwen2": ("qwen2", False, (2, 4)),
    "gpt2-loss_parallel": ("gpt2", True, 2), "gpt2": ("gpt2", False, 2),
}
JOBS = CaseSet({**{name: (_trained(case, lp), worlds) for name, (case, lp, worlds) in TRAIN.items()},
                "stages": (_stage_case, 2), "catches_bugs": (_catches_bugs, 2)}, setup=_setup, timeout=240)


def _assert_parity(results: dict) -> None:
    for key, r in results.items():
        names, ref_names = r["names"]
        assert names == ref_names, key  # parameter names unchanged by TP / FSDP
        assert r["tied"] == r["ref_tied"], key  # a tied embedding stays one Parameter
        assert r["init_diff"] == 0.0, key  # layout-independent init: bit-identical start
        assert len(r["losses"]) == STEPS, (key, r["losses"])
        for step, (loss, ref_loss) in enumerate(r["losses"]):
            assert abs(loss - ref_loss) <= TOL * abs(ref_loss), (key, step, loss, ref_loss)
        worst = max(r["grad_errs"].items(), key=lambda kv: kv[1])
        assert worst[1] <= GRAD_TOL, (key, "gradient", worst)
        worst = max(r["diffs"].items(), key=lambda kv: kv[1])
        assert worst[1] <= TOL, (key, "parameter", worst)


def _results(case: str, world_size: int) -> dict:
    """Rank 0's result of ``case`` in the ``world_size``-rank job (one spawn per world size)."""
    return JOBS.check(case, world_size)[0]


@pytest.mark.parity
@pytest.mark.parametrize("case", [name for name in JOBS.names(world=2) if name in TRAIN])
def test_tensor_parallel_matches_one_process(case):
    _assert_parity({case: _results(case, 2)})


@pytest.mark.parity
def test_pipeline_stage_slices_under_tensor_parallel():
    stage_diff = _results("stages", 2)
    assert stage_diff <= TOL


@pytest.mark.parity
@pytest.mark.parametrize("case", [name for name in JOBS.names(world=4) if name in TRAIN])
def test_tensor_parallel_with_fsdp_matches_one_process(case):
    _assert_parity({case: _results(case, 4)})


@pytest.mark.parity
@pytest.mark.parametrize(("case", "world_size"), [p for p in JOBS.params() if p.values[0] in TRAIN])
def test_gradient_norm_over_tensor_parallel_gradients(case, world_size):
    r = _results(case, world_size)
    assert len(r["grad_norms"]) == STEPS, case
    for step, (norm, ref_norm) in enumerate(r["grad_norms"]):
        assert abs(norm - ref_norm) <= TOL * ref_norm, (case, step, norm, ref_norm)  # fp64 gradients: summed in fp64


@pytest.mark.parity
def test_parity_catches_planted_bugs():
    JOBS.check("catches_bugs", 2)


# --- divisibility checks: no processes -------------------------------------------------------

def test_check_tp_degree_names_the_dimension_and_the_degrees_that_work():
    args = dataclasses.replace(LLAMA, n_heads=8, n_kv_heads=2)
    check_llama_tp(args, 2)
    with pytest.raises(RecipeError) as err:
        check_llama_tp(args, 4)
    assert str(err.value) == ("parallel.tp = 4: n_kv_heads (2) is not divisible by 4; tp degrees that divide "
                              "every sharded dimension: 1, 2")
    assert err.value.key == "parallel.tp"
    with pytest.raises(RecipeError, match=r"ffn_dim \(102\) is not divisible by 4; .*: 1, 2$"):
        check_llama_tp(dataclasses.replace(LLAMA, ffn_dim=102), 4)


def test_check_gpt2_tp_points_at_padding_the_vocabulary():
    with pytest.raises(RecipeError, match=r"vocab_size \(50257\) is not divisible by 2; .*: 1; model.vocab_size"):
        check_gpt2_tp(GPT2_SIZES["124m"], 2)
    check_gpt2_tp(dataclasses.replace(GPT2_SIZES["124m"], vocab_size=50304), 4)
    with pytest.raises(RecipeError, match=r"n_heads \(25\) is not divisible by 2"):
        check_gpt2_tp(dataclasses.replace(GPT2_SIZES["1.5b"], vocab_size=50304), 2)


def test_check_seq_len():
    check_seq_len(256, 4)
    check_seq_len(7, 1)
    with pytest.raises(RecipeError, match=r"train.seq_len \(10\) is not divisible by 4 .*e.g. 8"):
        check_seq_len(10, 4)


def test_gpt2_refuses_tensor_parallel_with_fsdp():
    from meshpar.config.recipe import ParallelConfig
    from meshpar.distributed.mesh import Layout, Mesh
    from meshpar.models import get_family
    from meshpar.parallel.parallelize import parallelize_transformer

    mesh = Mesh(Layout(pp=1, dp_replicate=1, dp_shard=2, cp=1, tp=2), world=None, dp=None)
    with pytest.raises(RecipeError, match="fused c_attn cannot be FSDP-sharded") as err:
        parallelize_transformer(nn.Module(), mesh, ParallelConfig(tp=2, dp_shard=2), get_family("gpt2").tp_plan)
    assert err.value.key == "parallel.dp_shard"
