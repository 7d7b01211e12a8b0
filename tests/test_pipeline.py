"""Pipeline parallelism against a single-process reference, at 2 and 4 gloo ranks.

Parity (STYLE #13): the debug Llama (4 blocks) built on meta, split into stages, each stage
materialized with ``to_empty`` + ``init_weights`` after ``torch.manual_seed(0)``; the
reference is the whole model on CPU initialized the same way. Both take STEPS AdamW steps on
the same global batches in float64; the loss of every step (from the last stage's rank), the
gradient norm and every parameter of every stage (against the reference's parameter of the
same name) match to 1e-9 (tests/parity.py [Note: parity in float64]), and
``test_two_ranks[catches_bugs]`` plants wrong gradients to show that this fails. With
``dp_shard`` 2 each pipeline sees half the batch and meshpar's FSDP engine shards every
stage; there each FSDP unit must reduce-scatter exactly once per step.

Process start-up dominates on two cores, so the cases of a world size run in one spawned
job (``CASES``, a tests/distributed.py ``CaseSet``); each ``test_*`` reads its case's outcome
from it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.testing import assert_close

from meshpar import clip_grad_norm_
from meshpar.config.recipe import RecipeError
from meshpar.distributed import comm_record
from meshpar.fsdp import fully_shard
from meshpar.models.gpt2 import GPT2, GPT2Args
from meshpar.models.llama import LLAMA_SIZES, Transformer
from meshpar.parallel.pipeline import (
    SCHEDULES,
    Stage,
    build_schedule,
    check_microbatches,
    split,
    stage_ids,
    stage_layers,
)
from tests.distributed import CaseSet
from tests.parity import TOL, default_dtype, must_fail, upcast

ARGS = dataclasses.replace(LLAMA_SIZES["debug"], n_layers=4, max_seq_len=16)
BATCH, SEQ, MICRO, STEPS = 8, 16, 4, 3
LR = 1e-3
CLIP = 0.5  # below every step's gradient norm, so clipping is active
EVAL_AFTER = 2  # steps before a forward-only evaluation, after which training goes on


def _batch(step: int) -> tuple[Tensor, Tensor]:
    """Step ``step``'s global batch (inputs, targets), [BATCH, SEQ] each; step -1 is held out."""
    g = torch.Generator().manual_seed(300 + step)
    tokens = torch.randint(0, ARGS.vocab_size, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def cross_entropy(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(upcast(logits.flatten(0, 1)), targets.flatten())


# [Note: the reference accumulates the same microbatches]
# The pipeline's gradient is a sum over microbatches of (microbatch mean / n), and with
# dp_shard each replica's sum is then averaged over replicas by the reduce-scatter.
# Mathematically that is the mean over the batch, but rounding differs from one
# cross_entropy over all the tokens, and AdamW turns rounding noise on a near-zero gradient
# element into an update of ~lr (its step is scale-free): in float32 one embedding element
# drifted 1.5e-4 in five steps (float64 shrinks that to ~1e-12, but exact is simpler). So
# the reference adds the same terms in the same order: each replica's slice in microbatches,
# accumulated, then the replicas' sums averaged; and
# test_microbatch_accumulation_is_the_batch_mean checks, once, that this equals the gradient
# of the mean over the whole batch. A wrong loss scale would not show in AdamW's updates
# (scale-free), so parity also compares the loss and the gradient norm of every step.

_REFERENCE: dict[tuple, tuple[list[float], list[float], dict[str, Tensor]]] = {}


def _reference_model() -> Transformer:
    model = Transformer(ARGS)
    torch.manual_seed(0)
    model.init_weights()
    return model


def _accumulate(model: nn.Module, inputs: Tensor, targets: Tensor, n_micro: int) -> float:
    total = 0.0
    for x, y in zip(inputs.chunk(n_micro), targets.chunk(n_micro), strict=True):
        loss = cross_entropy(model(x), y) / n_micro
        loss.backward()
        total += loss.item()
    return total


def _reference(dp: int, max_norm: float | None) -> tuple[list[float], list[float], dict[str, Tensor]]:
    """Losses (the evaluation's last), gradient norms and final parameters of the whole model in
    this process, each of ``dp`` slices of a step's batch in MICRO microbatches: [Note: the
    reference accumulates the same microbatches]."""
    if (dp, max_norm) not in _REFERENCE:
        model = _reference_model()
        params = list(model.parameters())
        opt = torch.optim.AdamW(params, lr=LR)
        losses, norms = [], []
        for step in range(STEPS):
            total, sums = 0.0, [torch.zeros_like(p) for p in params]
            for inputs, targets in zip(*(t.chunk(dp) for t in _batch(step)), strict=True):
                total += _accumulate(model, inputs, targets, MICRO) / dp
                for acc, p in zip(sums, params, strict=True):
                    acc += p.grad  # the replicas' sums, in rank order, as the reduce-scatter adds them
                opt.zero_grad()
            for acc, p in zip(sums, params, strict=True):
                p.grad = acc / dp
            norms.append(torch.nn.utils.clip_grad_norm_(params, max_norm or float("inf")).item())
            opt.step()
            opt.zero_grad()
            losses.append(total)
            if step + 1 == EVAL_AFTER:
                with torch.no_grad():
                    inputs, targets = _batch(-1)
                    eval_loss = sum(cross_entropy(model(x), y).item() for x, y in
                                    zip(inputs.chunk(dp * MICRO), targets.chunk(dp * MICRO), strict=True))
        losses.append(eval_loss / (dp * MICRO))
        _REFERENCE[dp, max_norm] = losses, norms, {n: p.detach().clone() for n, p in model.named_parameters()}
    return _REFERENCE[dp, max_norm]


def _stages(name: str, pp_rank: int, pp: int, virtual: int, shard: Callable[[nn.Module], None] | None = None):
    """This rank's stages, materialized as the reference is: seed 0, then init_weights, per stage."""
    with torch.device("meta"):
        whole = Transformer(ARGS)
    stages = split(whole, pp_rank, pp, virtual=virtual, style=SCHEDULES[name].style)
    for _, stage in stages:
        if shard is not None:
            shard(stage)
        stage.to_empty(device="cpu")
        torch.manual_seed(0)
        stage.init_weights()
    return stages


def _train(name: str, pp_mesh, virtual: int, *, dp_mesh=None, max_norm: float | None = None,
           shard: Callable[[nn.Module], None] | None = None,
           bug: Callable[[int, list[Tensor]], None] | None = None) -> dict:
    """STEPS steps of ``name``; returns losses and norms per step, collectives per step, parameters.
    ``bug(pp_rank, params)``: a planted error applied to the gradients after each step's backward."""
    pp_group, pp, pp_rank = pp_mesh.get_group(), pp_mesh.size(), pp_mesh.get_local_rank()
    stages = _stages(name, pp_rank, pp, virtual, shard)
    pipe = build_schedule(stages, pp * virtual, pp_mesh, torch.device("cpu"), name, MICRO, cross_entropy)
    params = [p for _, s in stages for p in s.parameters()]
    opt = torch.optim.AdamW(params, lr=LR)
    dp, dp_rank = (1, 0) if dp_mesh is None else (dp_mesh.size(), dp_mesh.get_local_rank())
    out = {"losses": [], "norms": [], "counts": []}

    def loss_everywhere(loss: Tensor | None) -> float:
        """The last stage's loss on every rank, averaged over data-parallel replicas."""
        total = torch.zeros((), dtype=torch.float64) if loss is None else loss.double()
        dist.all_reduce(total, group=pp_group)
        if dp_mesh is not None:
            dist.all_reduce(total, group=dp_mesh.get_group())
        return total.item() / dp

    for step in range(STEPS):
        inputs, targets = (t.chunk(dp)[dp_rank] for t in _batch(step))
        with comm_record.count() as c:
            out["losses"].append(loss_everywhere(pipe.step(inputs, targets)))
        if bug is not None:
            bug(pp_rank, params)
        norm = clip_grad_norm_(params, max_norm or float("inf"), extra_groups=[pp_group])
        out["norms"].append(norm.item())
        opt.step()
        opt.zero_grad()
        out["counts"].append(c)
        if step + 1 == EVAL_AFTER:  # as meshpar.train evaluates: no_grad, between steps
            with torch.no_grad():
                eval_loss = loss_everywhere(pipe.eval(*(t.chunk(dp)[dp_rank] for t in _batch(-1))))
    out["losses"].append(eval_loss)
    out["params"] = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach()
                     for _, s in stages for n, p in s.named_parameters()}
    out["stages"] = stages
    return out


def _assert_parity(out: dict, max_norm: float | None = None, dp: int = 1) -> None:
    losses, norms, params = _reference(dp, max_norm)
    assert_close(torch.tensor(out["losses"]), torch.tensor(losses), rtol=TOL, atol=TOL,
                 msg=lambda m: f"losses {out['losses']} vs reference {losses}: {m}")
    assert_close(torch.tensor(out["norms"]), torch.tensor(norms), rtol=TOL, atol=TOL,
                 msg=lambda m: f"grad norms {out['norms']} vs reference {norms}: {m}")
    assert out["params"], "this rank holds no parameters"
    for name, p in out["params"].items():
        assert p.dtype == torch.float64, f"{name} is {p.dtype}: parity runs in float64"
        assert_close(p, params[name], rtol=TOL, atol=TOL, msg=lambda m, name=name: f"{name}: {m}")


# --- 2 ranks: one process per pipeline rank -----------------------------------------------------

def _case_schedule(name: str, virtual: int) -> Callable[[], None]:
    @default_dtype()  # every case runs in float64: tests/parity.py
    def case() -> None:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
        _assert_parity(_train(name, mesh, virtual))
    return case


@default_dtype()
def _case_clip() -> None:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    out = _train("1f1b", mesh, 1, max_norm=CLIP)
    assert min(out["norms"]) > CLIP, f"clipping inactive: norms {out['norms']}"
    _assert_parity(out, CLIP)


@default_dtype()
def _case_catches_bugs() -> None:
    """The parity comparison fails on planted bugs: the last stage's gradients doubled (its
    microbatches accumulated twice), and every gradient n_microbatches times too large (the
    schedule's loss not divided by the microbatch count; AdamW is nearly scale-free, so this
    shows in the gradient norm and, through eps, in the parameters)."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))

    def last_stage_doubled(pp_rank: int, params: list[Tensor]) -> None:
        for p in params if pp_rank == 1 else ():
            p.grad.mul_(2)

    def not_divided_by_microbatches(pp_rank: int, params: list[Tensor]) -> None:
        for p in params:
            p.grad.mul_(MICRO)

    for bug in (last_stage_doubled, not_divided_by_microbatches):
        out = _train("1f1b", mesh, 1, bug=bug)
        must_fail(lambda out=out: _assert_parity(out), bug.__name__)


@default_dtype()
def _case_microbatch_counts() -> None:
    """check_microbatches accepts exactly the counts each schedule runs (at pp 2, 1..6), here on a
    2-block model so that a rejected count costs a constructor and an accepted one a step."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    tiny = dataclasses.replace(ARGS, dim=32, n_heads=2, n_kv_heads=2, ffn_dim=32, vocab_size=64, n_layers=4)
    rank = mesh.get_local_rank()
    for name, virtual in (("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 2), ("zbv", 2)):
        for n in range(1, 7):
            try:
                check_microbatches(name, n, 2, virtual, local_batch=n)
                accepted = True
            except RecipeError:
                accepted = False
            with torch.device("meta"):
                whole = Transformer(tiny)
            stages = split(whole, rank, 2, virtual=virtual, style=SCHEDULES[name].style)
            for _, s in stages:
                s.to_empty(device="cpu")
                s.init_weights()
            try:
                spec = SCHEDULES[name]
                built = [Stage(m, i, 2 * virtual, torch.device("cpu"), mesh.get_group()) for i, m in stages]
                sched = spec.cls(built if spec.multi else built[0], n_microbatches=n, loss_fn=cross_entropy)
                x = torch.randint(0, 64, (n, 4))
                sched.step(*((x,) if rank == 0 else ()), target=x if any(s.is_last for s in built) else None)
                ran = True
            except ValueError:
                ran = False
            assert accepted == ran, f"{name} with {n} microbatches: check_microbatches says {accepted}, runs {ran}"


# --- 4 ranks: pp 2 x dp_shard 2, meshpar FSDP inside every stage ---------------------------------

def _case_fsdp(name: str, virtual: int, reshard_after_forward: bool) -> Callable[[], None]:
    @default_dtype()
    def case() -> None:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp_shard"))
        dp = mesh["dp_shard"]
        units: list[int] = []

        def shard(stage: nn.Module) -> None:
            for block in stage.layers.values():
                fully_shard(block, mesh=dp, reshard_after_forward=reshard_after_forward)
            fully_shard(stage, mesh=dp, reshard_after_forward=reshard_after_forward)
            has_end = stage.tok_embeddings is not None or stage.output is not None
            units.append(len(stage.layers) + has_end)  # the units with parameters

        out = _train(name, mesh["pp"], virtual, dp_mesh=dp, max_norm=CLIP, shard=shard)
        _assert_parity(out, CLIP, dp=dp.size())
        assert len(out["counts"]) == STEPS, out["counts"]
        for step, c in enumerate(out["counts"]):
            got = c.calls[("reduce_scatter", "dp_shard")]
            assert got == sum(units), f"step {step}: {got} reduce-scatters for {sum(units)} FSDP units"
            assert c.total_calls("all_reduce") == 0, f"step {step}: unexpected all-reduces {c.calls}"
            gathers = c.calls[("all_gather", "dp_shard")]
            # step 0 also gathers for the schedule's shape inference, which runs a forward
            if step > 0 and not reshard_after_forward:
                assert gathers == sum(units), f"step {step}: {gathers} all-gathers for {sum(units)} FSDP units"
    return case


CASES = CaseSet({
    "gpipe": (_case_schedule("gpipe", 1), 2),
    "1f1b": (_case_schedule("1f1b", 1), 2),
    "interleaved_1f1b": (_case_schedule("interleaved_1f1b", 2), 2),
    "zero_bubble": (_case_schedule("zero_bubble", 2), 2),
    "zbv": (_case_schedule("zbv", 2), 2),
    "clip": (_case_clip, 2),
    "catches_bugs": (_case_catches_bugs, 2),
    "microbatch_counts": (_case_microbatch_counts, 2),
    "fsdp_1f1b": (_case_fsdp("1f1b", 1, False), 4),
    "fsdp_interleaved_1f1b": (_case_fsdp("interleaved_1f1b", 2, False), 4),
    "fsdp_zero_bubble_reshard": (_case_fsdp("zero_bubble", 2, True), 4),
    "fsdp_zbv": (_case_fsdp("zbv", 2, False), 4),
}, timeout=240)


@pytest.mark.parity
@pytest.mark.parametrize("case", CASES.names(world=2))
def test_two_ranks(case):
    CASES.check(case, 2)


@pytest.mark.parity
@pytest.mark.parametrize("case", CASES.names(world=4))
def test_pp2_x_dp_shard2(case):
    CASES.check(case, 4)


# --- one process ------------------------------------------------------------------------------------

def test_stage_layers_and_ids():
    assert stage_layers(4, 2) == [range(0, 2), range(2, 4)]
    assert stage_layers(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]  # earlier stages take the extra
    assert stage_layers(7, 3, [2, 5]) == [range(0, 2), range(2, 5), range(5, 7)]
    assert stage_ids(1, 4, 2, "loop") == [1, 5]
    assert stage_ids(1, 4, 2, "v") == [1, 6]
    for bad in ([2], [3, 3], [0, 4], [2, 7]):
        with pytest.raises(RecipeError, match="parallel.pp_boundaries") as e:
            stage_layers(7, 3, bad)
        assert e.value.key == "parallel.pp_boundaries"
    with pytest.raises(RecipeError, match="parallel.pp"):
        stage_layers(2, 4)
    with pytest.raises(RecipeError, match="parallel.pp_virtual_stages"):
        stage_ids(0, 2, 3, "v")


def test_split_keeps_the_whole_models_names():
    with torch.device("meta"):
        whole = Transformer(ARGS)
    names: list[str] = []
    for pp, virtual, style in ((2, 1, "loop"), (2, 2, "loop"), (2, 2, "v")):
        names = [n for r in range(pp) for _, s in split(whole, r, pp, virtual=virtual, style=style)
                 for n, _ in s.named_parameters()]
        assert sorted(names) == sorted(n for n, _ in whole.named_parameters()), (pp, virtual, style)
    first, *_, last = [s for r in range(2) for _, s in split(whole, r, 2)]
    assert first.norm is None and first.output is None and first.tok_embeddings is not None
    assert last.tok_embeddings is None and last.norm is not None
    assert len(whole.layers) == 4 and whole.norm is not None  # the whole model is left as it was


def test_tied_embeddings_are_refused():
    with torch.device("meta"):
        gpt2 = GPT2(GPT2Args(dim=16, n_layers=2, n_heads=2, vocab_size=37, max_seq_len=8))
    with pytest.raises(RecipeError, match="ties its input and output embeddings") as e:
        split(gpt2, 0, 2)
    assert e.value.key == "parallel.pp"


def test_microbatch_count_errors():
    check_microbatches("1f1b", 4, pp=4, local_batch=8)
    check_microbatches("interleaved_1f1b", 3, pp=2, virtual=2)  # n < 2 pp: one round
    for args, key in ((("1f1b", 2, 4), "parallel.pp_microbatches"),
                      (("interleaved_1f1b", 5, 2, 2), "parallel.pp_microbatches"),
                      (("zero_bubble", 9, 4, 2), "parallel.pp_microbatches"),
                      (("gpipe", 2, 2, 2), "parallel.pp_virtual_stages"),
                      (("zbv", 4, 2, 1), "parallel.pp_virtual_stages"),
                      (("pipedream", 4, 2), "parallel.pp_schedule")):
        with pytest.raises(RecipeError, match=key) as e:
            check_microbatches(*args)
        assert e.value.key == key
    with pytest.raises(RecipeError, match="must divide the 6 sequences") as e:
        check_microbatches("gpipe", 4, 2, local_batch=6)


@pytest.mark.parity
@default_dtype()
def test_microbatch_accumulation_is_the_batch_mean():
    """The reference's (and the pipeline's) sum of microbatch means / n is the whole batch's mean
    (in float64: equal up to summation order, 1e-16 relative)."""
    inputs, targets = _batch(0)
    whole, micro = _reference_model(), _reference_model()
    cross_entropy(whole(inputs), targets).backward()
    _accumulate(micro, inputs, targets, MICRO)
    for (name, p), q in zip(whole.named_parameters(), micro.parameters(), strict=True):
        assert_close(q.grad, p.grad, rtol=TOL, atol=TOL, msg=lambda m, name=name: f"{name}: {m}")
