"""Expert parallelism (meshpar/parallel/expert_parallel.py) against one process, at ep 2 and ep 4.

Each rank trains a MoE transformer (Qwen3-MoE shape: a dense layer and sparse ones, 8 experts,
top 2) on its slice of the global batch with its share of the experts; the non-expert
parameters are replicated and their gradients averaged over the ranks, the expert gradients
(summed over every rank's token slots by the all-to-all's backward) divided by the ranks. The
reference is one process with every expert, its loss the mean over the same slices of each
slice's cross-entropy plus weighted auxiliary loss (the auxiliary loss is per forward, so a
data-parallel step averages the ranks' own). After 3 AdamW steps in float64 the losses, the
auxiliary losses, the per-expert token counts (summed over ranks) and every parameter (the
experts gathered) equal the reference's to TOL (tests/parity.py [Note: parity in float64]); the
all-to-all calls and bytes meshpar.distributed.comm counted on the ``ep`` dim equal the figure the routing
implies ([Note: expert-parallel dispatch]).
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from meshpar.distributed import comm_record
from meshpar.models.moe import MoEArgs, MoETransformer
from meshpar.models.moe.family import MOE
from meshpar.parallel.expert_parallel import apply_expert_parallel
from meshpar.train import train
from tests.distributed import CaseSet, run_distributed
from tests.helpers import load_recipe, train_losses, train_on_rank
from tests.parity import TOL, default_dtype, in_float64

ARGS = MoEArgs(dim=16, n_layers=3, n_heads=2, n_kv_heads=1, ffn_dim=24, vocab_size=64, max_seq_len=32,
               n_experts=8, top_k=2, moe_ffn_dim=8, mlp_only_layers=(0,), router_aux_loss_coef=0.01)
STEPS, PER_RANK, T = 3, 2, 12  # optimizer steps, sequences per rank, tokens per sequence


def _build() -> MoETransformer:
    torch.manual_seed(0)
    model = MoETransformer(ARGS)
    for p in model.parameters():  # larger than init_weights' so the router spreads tokens unevenly
        torch.nn.init.normal_(p, std=0.3)
    return model


def _loss(model: MoETransformer, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cross-entropy + the model's weighted aux loss, the aux loss) of one forward."""
    logits = model(tokens[:, :-1])
    ce = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    return ce + model.aux_loss, model.aux_loss.detach()


def _counts(model: MoETransformer) -> list[torch.Tensor]:
    return [moe.tokens_per_expert.clone() for moe in model.moe_layers()]


def _case_parity(mesh) -> dict:
    rank, n = mesh.get_local_rank(), mesh.size()
    batches = [torch.randint(0, ARGS.vocab_size, (n * PER_RANK, T + 1), generator=torch.Generator().manual_seed(s))
               for s in range(STEPS)]
    ref = _build()
    model = copy.deepcopy(ref)
    apply_expert_parallel(MOE.sparse_layers(model), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    out = {"loss": [], "ref_loss": [], "aux": [], "ref_aux": [], "counts": [], "ref_counts": [], "sent": [],
           "expected_sent": []}
    for tokens in batches:
        # --- expert parallel: this rank's slice, its share of the experts -------------------------
        with comm_record.count() as counted:
            loss, aux = _loss(model, tokens[rank * PER_RANK:(rank + 1) * PER_RANK])
            loss.backward()
        counts = _counts(model)
        for p in model.parameters():
            if isinstance(p, DTensor):  # an expert weight: every rank's slots already summed into it
                p.grad.to_local().div_(n)
            else:  # replicated: average over the ranks
                dist.all_reduce(p.grad)
                p.grad.div_(n)
        opt.step()
        opt.zero_grad()
        stats = torch.stack([loss.detach(), aux])
        dist.all_reduce(stats)
        summed = [c.clone() for c in counts]
        for c in summed:
            dist.all_reduce(c)
        out["loss"].append(stats[0].item() / n)
        out["aux"].append(stats[1].item() / n)
        out["counts"].append([c.tolist() for c in summed])
        # what this rank sent, from every rank's routing: its rows for other ranks' experts (dispatch,
        # and their gradients back in backward) and the rows it computed for other ranks (combine, and
        # the gradients of its own rows in backward), dim * 8 bytes each (float64), plus n - 1 runs of
        # L int64 counts per layer in forward
        local, layers = ARGS.n_experts // n, len(counts)
        every = [torch.zeros(layers, ARGS.n_experts, dtype=torch.int64) for _ in range(n)]
        dist.all_gather(every, torch.stack(counts))
        mine = slice(rank * local, (rank + 1) * local)
        sent_rows = int(every[rank].sum() - every[rank][:, mine].sum())
        computed_for_others = sum(int(every[i][:, mine].sum()) for i in range(n) if i != rank)
        out["sent"].append((counted.calls[("all_to_all", "ep")], counted.bytes[("all_to_all", "ep")]))
        out["expected_sent"].append(2 * (sent_rows + computed_for_others) * ARGS.dim * 8
                                    + layers * (n - 1) * local * 8)
        # --- the reference: every slice in one process ----------------------------------------------
        total, aux_total, ref_counts = 0.0, 0.0, None
        for i in range(n):
            slice_loss, slice_aux = _loss(ref, tokens[i * PER_RANK:(i + 1) * PER_RANK])
            (slice_loss / n).backward()
            total, aux_total = total + slice_loss.item() / n, aux_total + slice_aux.item() / n
            c = _counts(ref)
            ref_counts = c if ref_counts is None else [a + b for a, b in zip(ref_counts, c, strict=True)]
        ref_opt.step()
        ref_opt.zero_grad()
        out["ref_loss"].append(total)
        out["ref_aux"].append(aux_total)
        out["ref_counts"].append([c.tolist() for c in ref_counts])
    out["diff"] = {name: (p.full_tensor() if isinstance(p, DTensor) else p).sub(q).abs().max().item()
                   for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True)}
    out["sharded"] = sorted(name for name, p in model.named_parameters() if isinstance(p, DTensor))
    return out


def _case_bad_degree(mesh):
    """6 experts over 4 ranks."""
    try:
        apply_expert_parallel(MOE.sparse_layers(MoETransformer(dataclasses.replace(ARGS, n_experts=6))), mesh)
    except ValueError as e:
        return str(e)
    return None


def _setup(tmp: Path):
    torch.set_default_dtype(torch.float64)
    return init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("ep",))


JOBS = CaseSet({"parity": (_case_parity, (2, 4)), "bad_degree": (_case_bad_degree, 4)}, setup=_setup, timeout=240)


@pytest.mark.parity
@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_matches_one_process(world):
    r = JOBS.check("parity", world)[0]
    for key in ("loss", "aux"):
        for got, want in zip(r[key], r[f"ref_{key}"], strict=True):
            assert abs(got - want) <= TOL * abs(want), (key, r[key], r[f"ref_{key}"])
    assert r["counts"] == r["ref_counts"]  # token slots per expert, summed over ranks
    assert any(max(layer) > min(layer) for step in r["counts"] for layer in step), "routing was uniform: no test"
    worst = max(r["diff"].values())
    assert worst <= TOL, {k: v for k, v in r["diff"].items() if v > TOL}
    assert r["sharded"] == [f"layers.{i}.moe.experts.{w}" for i in (1, 2) for w in ("w1", "w2", "w3")]


@pytest.mark.parametrize("world", [2, 4])
def test_all_to_all_traffic_is_what_the_routing_implies(world):
    """Per step and sparse layer: forward exchanges the counts, the rows and the results (3 calls),
    backward the two gradients (2 calls, the autograd function's); bytes as the case derives them
    from every rank's routing."""
    r = JOBS.check("parity", world)[0]
    for (calls, sent), expected in zip(r["sent"], r["expected_sent"], strict=True):
        assert sent == expected, (sent, expected)
        assert calls == 5 * 2  # 2 sparse layers


def test_an_expert_count_the_degree_does_not_divide_is_refused():
    message = JOBS.check("bad_degree", 4)[0]
    assert message == "6 experts do not split over ep = 4 ranks; choose an ep degree that divides the expert count"


def _close(got: list[float], want: list[float], what: str) -> None:
    assert len(got) == len(want) and got, (what, got, want)
    for g, w in zip(got, want, strict=True):
        assert abs(g - w) <= TOL * abs(w), (what, got, want)


@pytest.mark.parity
@default_dtype()
def test_meshpar_train_with_ep_matches_one_rank_and_resumes_on_one(tmp_path, data_cache):
    """recipes/qwen3_moe_debug_ep.toml through meshpar train: ep 2 within dp_shard 4 on 4 ranks (the
    experts FSDP-sharded over the 2 ranks ep leaves, two microbatches per rank) against the same
    recipe on one rank, float64: losses, auxiliary losses, gradient norms and every parameter to
    TOL. Its step-2 checkpoint (experts Shard(0) over ep and dp_shard) then resumes on one rank, and
    step 3 gives the uninterrupted run's loss."""
    steps = ["--train.steps=3", "--train.micro_batch=1"]
    one = ["--parallel.dp_shard=1", "--parallel.ep=1"]
    reference = train(load_recipe("qwen3_moe_debug_ep.toml", tmp_path / "ref", *steps, *one), return_state=True)
    recipe = load_recipe("qwen3_moe_debug_ep.toml", tmp_path / "ep", *steps, "--checkpoint.every=2")
    records, state = run_distributed(in_float64, 4, train_on_rank, recipe, timeout=300, init_process_group=False)[0]
    _close(train_losses(records), train_losses(reference.records), "loss")
    for key in ("aux_loss", "grad_norm"):
        _close([r[key] for r in records if key in r], [r[key] for r in reference.records if key in r], key)
    assert state.keys() == reference.state_dict.keys()
    for name, want in reference.state_dict.items():
        assert want.dtype == torch.float64, name
        torch.testing.assert_close(state[name], want, rtol=TOL, atol=TOL, msg=name)
    resumed = train(load_recipe("qwen3_moe_debug_ep.toml", tmp_path / "resumed", *steps, *one,
                                f"--checkpoint.load_from={tmp_path / 'ep' / 'checkpoints' / 'step_2'}"))
    _close(train_losses(resumed.records), train_losses(reference.records)[2:], "resumed loss")


@pytest.mark.parametrize(("recipe", "overrides", "world", "message"), [
    ("llama_debug.toml", ["--parallel.dp_shard=2", "--parallel.ep=2"], 2,
     r"parallel\.ep = 2: expert parallelism \(mixture-of-experts families only\) is not built yet for model "
     r"family 'llama'"),
    ("qwen3_moe_debug_ep.toml", ["--parallel.dp_shard=3", "--parallel.ep=2"], 3,
     r"\[parallel\] ep = 2 borrows its ranks from dp_shard = 3, which it must divide"),
    ("qwen3_moe_debug_ep.toml", ["--parallel.dp_shard=3", "--parallel.ep=3", "--train.global_batch=6"], 3,
     r"parallel\.ep = 3: 8 experts do not split over 3 ranks; choose an ep that divides the expert count"),
], ids=["dense-family", "ep-not-dividing-dp_shard", "experts-not-dividing"])
def test_bad_ep_layouts_are_refused_before_launch(recipe, overrides, world, message, tmp_path):
    from meshpar.config.recipe import RecipeError
    from meshpar.training.preflight import check_layout

    with pytest.raises(RecipeError, match=message):
        check_layout(load_recipe(recipe, tmp_path, *overrides), world)
