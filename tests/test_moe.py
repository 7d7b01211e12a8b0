"""Mixture-of-experts families (Qwen3-MoE, Mixtral): routing and dispatch in float64 against naive
references, Hugging Face parity of the adapter, 2-rank FSDP against one process, and a short run.

(a) router / dispatch units, float64: top-k, norm_topk_prob, the grouped matmul and the whole MoE
    layer against a per-token loop, the capacity drop, the load-balancing loss by hand, aux-free
    bias; (b) logits against transformers' Qwen3MoeForCausalLM / MixtralForCausalLM from a tiny
    config, and the reverse key map; (c) fully_shard per block + root on 2 ranks, 3 AdamW steps,
    float64, to tests/parity.TOL; (d) meshpar.train on qwen3_moe_debug (SMALL overrides).
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from meshpar.models import get_family
from meshpar.models.moe import QWEN3_MOE_SIZES, MoEArgs, MoETransformer
from meshpar.models.moe.convert import ADAPTERS
from meshpar.models.moe.grouped import grouped_mm, grouped_mm_supported
from meshpar.models.moe.model import MoE
from tests.distributed import CaseSet
from tests.helpers import load_recipe, train_losses
from tests.parity import TOL, default_dtype, must_fail

TINY = MoEArgs(dim=16, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=24, vocab_size=32, max_seq_len=32,
               n_experts=4, top_k=2, moe_ffn_dim=8)


def _moe(seed: int = 0, **kw) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(dataclasses.replace(TINY, **kw))
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.5)
    return moe


def _naive(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Per token, per chosen expert, the SwiGLU written out: the reference for dispatch."""
    _, idx, gates = moe.route(x)
    e = moe.experts
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            k = idx[t, j]
            out[t] += gates[t, j] * (e.w2[k] @ (F.silu(e.w1[k] @ x[t]) * (e.w3[k] @ x[t])))
    return out


# --- (a) routing and dispatch, float64 ------------------------------------------------------------

@default_dtype()
@pytest.mark.parametrize("norm", [True, False])
def test_router_top_k_and_gate_weights(norm):
    moe = _moe(norm_topk_prob=norm)
    x = torch.randn(10, TINY.dim)
    probs, idx, gates = moe.route(x)
    ref = F.softmax(x @ moe.router.weight.T, dim=-1)
    assert (probs - ref).abs().max() <= TOL
    top = ref.sort(-1, descending=True)
    assert torch.equal(idx, top.indices[:, :2])
    want = top.values[:, :2] / (top.values[:, :2].sum(-1, keepdim=True) if norm else 1)
    assert (gates - want).abs().max() <= TOL
    assert (gates.sum(-1) - 1).abs().max() <= TOL if norm else (gates.sum(-1) < 1).all()


@default_dtype()
def test_moe_layer_equals_a_per_token_loop():
    moe, x = _moe(), torch.randn(13, TINY.dim)
    with torch.no_grad():
        got, ref = moe(x), _naive(moe, x)
    assert (got - ref).abs().max() <= TOL
    assert moe.tokens_per_expert.sum() == 13 * 2
    must_fail(lambda: _check_close(got, _naive(_moe(seed=1), x)), "another expert's weights")


def _check_close(a, b):
    assert (a - b).abs().max() <= TOL


@default_dtype()
def test_grouped_mm_fallback_matches_per_expert_matmuls_and_empty_experts():
    x, w = torch.randn(7, 8), torch.randn(4, 8, 16)
    counts = torch.tensor([3, 0, 4, 0])
    out = grouped_mm(x, w, counts, kernel="loop")
    ref = torch.cat([x[:3] @ w[0], x[3:] @ w[2]])
    assert (out - ref).abs().max() <= TOL


def test_grouped_kernel_agrees_with_the_loop_where_it_runs():
    """torch 2.13 runs F.grouped_mm on CPU in fp32 and bf16 (not float64): both kernels agree, forward
    and backward. fp32 tolerance: the same dot products of length 16 summed maybe in another order,
    |x| |w| ~ 1: 16 * 2^-24 * 4 ~ 4e-6."""
    x, w = torch.randn(9, 16, requires_grad=True), torch.randn(3, 16, 8, requires_grad=True)
    if not grouped_mm_supported(x, w):
        pytest.skip("torch.nn.functional.grouped_mm does not run here for fp32")
    counts, g = torch.tensor([4, 0, 5]), torch.randn(9, 8)
    grads = []
    for kernel in ("grouped", "loop"):
        out = grouped_mm(x, w, counts, kernel=kernel)
        grads.append((out.detach(), *torch.autograd.grad((out * g).sum(), (x, w))))
    for a, b in zip(*grads, strict=True):
        assert (a - b).abs().max() <= 4e-6


@default_dtype()
def test_capacity_factor_drops_the_latest_tokens_of_an_overloaded_expert():
    moe = _moe(capacity_factor=0.5)  # capacity ceil(0.5 * 8 * 2 / 4) = 2 slots per expert
    x = torch.randn(8, TINY.dim)
    _, idx, gates = moe.route(x)
    kept = torch.zeros_like(gates)
    seen = [0] * TINY.n_experts
    for t in range(8):  # token order; an expert keeps its first 2 slots
        for j in range(2):
            e = idx[t, j].item()
            kept[t, j] = seen[e] < 2
            seen[e] += 1
    assert kept.sum() < 16, "nothing dropped: the case tests nothing"
    ref_moe = _moe()
    ref_moe.route = lambda x: (None, idx, gates * kept)  # the same routing, dropped slots weighted 0
    with torch.no_grad():
        assert (moe(x) - _naive(ref_moe, x)).abs().max() <= TOL


@default_dtype()
def test_load_balancing_loss_by_hand():
    moe = _moe(n_experts=2, top_k=1)
    with torch.no_grad():
        moe.router.weight.copy_(torch.tensor([[1.0] + [0.0] * 15, [0.0] * 16]))
    x = torch.zeros(3, TINY.dim)
    x[:, 0] = torch.tensor([1.0, 2.0, -1.0])  # logits (x0, 0): experts 0, 0, 1
    moe(x)
    p0 = torch.sigmoid(torch.tensor([1.0, 2.0, -1.0]))  # softmax of (x0, 0) for expert 0
    f, p = torch.tensor([2 / 3, 1 / 3]), torch.stack([p0.mean(), 1 - p0.mean()])
    assert abs(moe.aux_loss.item() - 2 * (f * p).sum().item()) <= TOL


@default_dtype()
def test_model_aux_loss_is_the_weighted_sum_over_sparse_layers():
    torch.manual_seed(0)
    model = MoETransformer(dataclasses.replace(TINY, n_layers=3, mlp_only_layers=(1,), router_aux_loss_coef=0.1))
    model.init_weights()
    model(torch.randint(0, 32, (2, 8)))
    assert len(model.moe_layers()) == 2
    assert abs(model.aux_loss.item() - 0.1 * sum(m.aux_loss.item() for m in model.moe_layers())) <= TOL


@default_dtype()
def test_aux_free_bias_changes_the_choice_not_the_gate_weights():
    moe, x = _moe(aux_free_bias=True), torch.randn(6, TINY.dim)
    probs, idx, gates = moe.route(x)
    moe.expert_bias[idx[0, 0]] = -10.0  # token 0's first choice is pushed out of its top-k
    probs2, idx2, gates2 = moe.route(x)
    assert idx[0, 0] not in idx2[0]
    assert (probs2 - probs).abs().max() == 0
    want = probs.gather(-1, idx2)
    assert (gates2 - want / want.sum(-1, keepdim=True)).abs().max() <= TOL
    # the update: overloaded experts go down, underloaded up, by the rate
    moe.expert_bias.zero_()
    moe.update_expert_bias(torch.tensor([5.0, 1.0, 3.0, 3.0]), rate=0.5)
    assert torch.equal(moe.expert_bias, torch.tensor([-0.5, 0.5, 0.0, 0.0]))
    assert moe.expert_load.sum() == 0


# --- sizes ----------------------------------------------------------------------------------------

@pytest.mark.parametrize(("family", "size", "total", "active"), [
    ("qwen3_moe", "30b_a3b", 30_532_122_624, 3_041_656_832),
    ("qwen3_moe", "235b_a22b", 235_093_634_560, 21_567_635_456),
    ("mixtral", "8x7b", 46_702_792_704, 12_748_587_008),
    ("mixtral", "8x22b", 140_630_071_296, 38_959_448_064),
])
def test_published_sizes_have_their_parameter_counts(family, size, total, active):
    args = get_family(family).sizes[size]
    with torch.device("meta"):
        model = MoETransformer(args)
    assert sum(p.numel() for p in model.parameters()) == total
    assert args.matmul_params() == active  # flops_per_token counts the top_k experts only


# --- (b) Hugging Face parity ---------------------------------------------------------------------

def _hf_configs():
    transformers = pytest.importorskip("transformers", reason="transformers is a test-only extra")
    common = dict(vocab_size=96, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                  num_experts_per_tok=2, max_position_embeddings=64)
    return transformers, {
        "qwen3_moe": transformers.Qwen3MoeConfig(**common, intermediate_size=48, moe_intermediate_size=16,
                                                 num_hidden_layers=3, head_dim=16, num_experts=4,
                                                 mlp_only_layers=[1], norm_topk_prob=True),
        "mixtral": transformers.MixtralConfig(**common, intermediate_size=16, num_hidden_layers=2,
                                              num_local_experts=4),
    }


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_hf_logits_and_the_reverse_map(family):
    """Logits of meshpar's model from the converted checkpoint against transformers' (fp32):
    max |diff| <= 1e-5. Both compute the same sums in fp32 but not in the same order (fused
    gate_up vs separate projections, SDPA kernels, RoPE tables in float64 here vs fp32 there),
    ~1e-7 relative per op over a few layers of logits of size ~0.5: observed ~1e-7, bound 1e-5.
    Then the reverse map gives back Hugging Face's saved tensors exactly."""
    from safetensors.torch import load_file

    transformers, configs = _hf_configs()
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(configs[family]).eval()
    adapter = ADAPTERS[family]
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        saved = load_file(str(Path(d) / "model.safetensors"))
    args = adapter.args_from_hf_config(family, configs[family].to_dict())
    model = MoETransformer(args)
    model.load_state_dict(adapter.from_hf(saved, args))
    tokens = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        gap = (model(tokens) - hf(tokens).logits).abs().max().item()
    assert gap <= 1e-5, gap
    back = adapter.to_hf(model.state_dict(), args)
    assert set(back) == set(saved)
    assert all(torch.equal(back[k], saved[k]) for k in saved)
    config = adapter.hf_config(family, args, torch.float32)
    assert adapter.args_from_hf_config(family, config) == args


# --- (c) 2-rank FSDP against one process, float64 ------------------------------------------------

def _build(device: str = "cpu", **kw) -> MoETransformer:
    args = dataclasses.replace(QWEN3_MOE_SIZES["debug"], dim=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=96,
                               vocab_size=128, n_layers=3, moe_ffn_dim=32, max_seq_len=64, **kw)
    with torch.device(device):
        model = MoETransformer(args)
    if device == "cpu":
        torch.manual_seed(0)
        model.init_weights()
    return model


def _train3(model, tokens) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(3):
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        (loss + model.aux_loss / 1).backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def _case_fsdp(mesh) -> dict:
    import torch.distributed as dist

    from meshpar.fsdp import fully_shard

    rank = mesh.get_local_rank()
    tokens = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(5))
    ref, model = _build(), _build("meta")
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    # one row per rank: the mean of the ranks' means is the batch mean, but the aux loss is not
    # linear in the tokens (f_e * P_e), so the reference sums each row's aux loss, as the ranks do
    ref_losses = []
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    for _ in range(3):
        total = 0
        for row in range(2):
            ce = F.cross_entropy(ref(tokens[row:row + 1, :-1]).flatten(0, 1), tokens[row, 1:])
            ((ce + ref.aux_loss) / 2).backward()
            total += ce.detach() / 2
        opt.step()
        opt.zero_grad()
        ref_losses.append(total.item())
    losses = _train3(model, tokens[rank:rank + 1])
    mine = torch.stack(losses)
    dist.all_reduce(mine)
    params = {n: (p.full_tensor() - ref.get_parameter(n)).abs().max().item() for n, p in model.named_parameters()}
    return {"loss": ((mine / 2).tolist(), ref_losses), "params": params}


def _setup(tmp: Path):
    torch.set_default_dtype(torch.float64)
    return init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))


JOBS = CaseSet({"fsdp": (_case_fsdp, 2)}, setup=_setup, timeout=180)


@pytest.mark.parity
def test_fsdp_matches_one_process_after_three_adamw_steps():
    r = JOBS.check("fsdp", 2)[0]
    for got, want in zip(*r["loss"], strict=True):
        assert abs(got - want) <= TOL * abs(want), r["loss"]
    assert len(r["params"]) > 10
    worst = max(r["params"].items(), key=lambda kv: kv[1])
    assert worst[1] <= TOL, worst


# --- (d) meshpar train --------------------------------------------------------------------------

def test_train_qwen3_moe_debug_logs_the_aux_loss_separately(tmp_path):
    from meshpar.train import train

    recipe = load_recipe("qwen3_moe_debug.toml", tmp_path, "--train.steps=6", "--optim.lr=3e-3")
    records = train(recipe).records
    losses = train_losses(records)
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0]
    logged = [r for r in records if "loss" in r]
    assert logged and all(r["aux_loss"] > 0 for r in logged)  # apart from the cross-entropy ([Note: auxiliary losses])
