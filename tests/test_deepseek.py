"""The DeepSeek-V3 family (meshpar/models/deepseek): the published sizes' parameter counts, logits
equal to transformers' DeepseekV3ForCausalLM, conversion both ways, and training layouts against
one process in float64."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import parallelize_module

from meshpar.config import recipe as recipelib
from meshpar.distributed import comm_record
from meshpar.models.deepseek import DEEPSEEK_V3_SIZES, DeepSeekTransformer
from meshpar.models.deepseek import convert as ds_convert
from meshpar.models.deepseek.parallelize import DEEPSEEK_TP_PLAN, GatherSequenceSharedByHeads
from meshpar.parallel.context_parallel.apply import ContextParallelKeys, apply_context_parallel
from meshpar.parallel.context_parallel.gather import GatherSequence
from meshpar.parallel.context_parallel.layout import sequence_indices, shard_sequence
from meshpar.train import train
from tests.distributed import run_distributed
from tests.helpers import ROOT, SMALL, merged_state, randomize_deepseek, train_losses, train_on_rank
from tests.parity import TOL, default_dtype, in_float64, must_fail


def _params(args) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in DeepSeekTransformer(args).parameters())


def test_published_sizes():
    """Total parameters of the main model (the multi-token-prediction layer is not built) and the
    active ones (matmul weights a token runs through, plus its embedding row's table): DeepSeek-V3
    671B total / 37B activated, Moonlight-16B-A3B 16B / 3B, as their model cards give them."""
    v3, moon = DEEPSEEK_V3_SIZES["671b"], DEEPSEEK_V3_SIZES["16b"]
    assert _params(v3) == 671_026_404_352
    assert v3.matmul_params() + v3.vocab_size * v3.dim == 37_551_276_032  # "37B activated"
    assert _params(moon) == 15_960_108_544
    assert moon.matmul_params() + moon.vocab_size * moon.dim == 2_914_648_064  # "3B activated"
    assert v3.softmax_scale == pytest.approx(192 ** -0.5 * (0.1 * torch.tensor(40.0).log().item() + 1) ** 2)


def _hf_folder(tmp_path, args, seed: int = 0):
    """A transformers DeepseekV3ForCausalLM of ``args``' shape with every tensor random (norms near 1,
    the routing bias too), saved as a Hugging Face folder."""
    transformers = pytest.importorskip("transformers")
    config = ds_convert.hf_config("deepseek_v3", args, torch.float32)
    hf_config = transformers.DeepseekV3Config(**{k: v for k, v in config.items()
                                                 if k not in ("architectures", "model_type")})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    randomize_deepseek(model)
    folder = tmp_path / "hf"
    model.save_pretrained(folder)
    return model, folder


@pytest.mark.parametrize("variant", ["q_lora-yarn", "plain-q"])
def test_logits_equal_transformers(variant, tmp_path):
    """A random DeepseekV3ForCausalLM (group-limited routing over 4 groups, a random routing bias)
    loaded into meshpar gives its logits to 2e-5 absolute (fp32; logits of magnitude ~6, so ~3e-6
    relative): the RoPE tables differ in their last bits (transformers computes YaRN's frequencies
    in float32, meshpar in float64), and the sums run in other orders. A wrong routing group, a
    missing bias or an unscaled softmax moves them by 1e-2 or more."""
    from meshpar.convert import load_hf_weights

    base = DEEPSEEK_V3_SIZES["debug"]
    args = dataclasses.replace(base, n_layers=3, **({} if variant == "q_lora-yarn" else {"q_lora_rank": 0,
                                                                                          "yarn": None}))
    ref, folder = _hf_folder(tmp_path, args)
    model = DeepSeekTransformer(args)
    load_hf_weights(model.state_dict(), folder, "deepseek_v3", args)
    tokens = torch.randint(0, args.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = ref(tokens).logits, model.eval()(tokens)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5)
    assert ds_convert.args_from_hf_config("deepseek_v3", json.loads((folder / "config.json").read_text())) == args


def test_convert_both_ways_gives_the_folder_back(tmp_path):
    """Hugging Face folder -> meshpar DCP checkpoint (experts stacked) -> Hugging Face folder (experts
    unstacked): every tensor of the original, bit for bit, and the same config."""
    from safetensors.torch import load_file

    from meshpar.convert import convert

    args = dataclasses.replace(DEEPSEEK_V3_SIZES["debug"], n_layers=2)
    _, folder = _hf_folder(tmp_path, args)
    convert(folder, tmp_path / "dcp", to="dcp", progress=False)
    convert(tmp_path / "dcp", tmp_path / "back", to="hf", progress=False)

    def tensors(path):
        out = {}
        for file in sorted(path.glob("*.safetensors")):
            out.update(load_file(file))
        return out

    original, back = tensors(folder), tensors(tmp_path / "back")
    assert original.keys() == back.keys() and len(original) > 50
    for name, value in original.items():
        assert torch.equal(value, back[name]), name
    assert ds_convert.args_from_hf_config("deepseek_v3", json.loads((tmp_path / "back" / "config.json").read_text())) \
        == args


STEPS = ["--train.steps=3", "--train.eval_every=3", "--data.val_fraction=0.1"]


def _recipe(out, *extra: str) -> recipelib.Recipe:
    return recipelib.load(ROOT / "recipes" / "deepseek_v3_debug.toml",
                          [*SMALL, *STEPS, f"--train.output_dir={out}", *extra])


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_cache):
    with default_dtype():
        return train(_recipe(tmp_path_factory.mktemp("ref"), "--parallel.dp_shard=1", "--parallel.ep=1"),
                     return_state=True)


def _assert_same(records, state, reference) -> None:
    torch.testing.assert_close(train_losses(records), train_losses(reference.records), rtol=TOL, atol=0)
    for key in ("aux_loss", "val_loss"):
        torch.testing.assert_close([r[key] for r in records if key in r],
                                   [r[key] for r in reference.records if key in r], rtol=TOL, atol=0)
    assert state.keys() == reference.state_dict.keys()
    for name, want in reference.state_dict.items():
        torch.testing.assert_close(state[name], want, rtol=TOL, atol=TOL, msg=name)


LAYOUTS = {  # name: (overrides of recipes/deepseek_v3_debug.toml, world size)
    "dp_shard4-ep2": ([], 4),  # the recipe: routed experts over ep 2, FSDP over 4 (2 for the experts)
    "dp_replicate2-dp_shard2-ep2": (["--parallel.dp_replicate=2", "--parallel.dp_shard=2"], 4),  # HSDP
    "dp_shard2-tp2-ep2": (["--parallel.dp_shard=2", "--parallel.tp=2"], 4),  # MLA's heads over tp
    "dp_shard2-cp2-ep2": (["--parallel.dp_shard=2", "--parallel.cp=2"], 4),  # the latent gathered over cp
    "pp2-dp_shard2-ep2-full-ac": (["--parallel.pp=2", "--parallel.dp_shard=2",
                                   '--parallel.activation_checkpoint="full"'], 4),
}


@pytest.mark.parity
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_match_one_rank(layout, reference, tmp_path):
    """recipes/deepseek_v3_debug.toml on 4 ranks equals one rank in float64 after 3 steps: losses,
    auxiliary losses, validation loss and every parameter (the aux-free routing biases, moved after
    each step by the loads summed over data-parallel ranks, included)."""
    overrides, world = LAYOUTS[layout]
    results = run_distributed(in_float64, world, train_on_rank, _recipe(tmp_path, *overrides), timeout=300,
                              init_process_group=False)
    state = merged_state(results)
    _assert_same(results[0][0], state, reference)
    assert any(name.endswith("moe.expert_bias") for name in state)
    if layout == "dp_shard4-ep2":  # the comparison bites: one routing bias off by 1e-6
        name = next(n for n in state if n.endswith("moe.expert_bias"))
        bent = {**state, name: state[name] + 1e-6}
        must_fail(lambda: _assert_same(results[0][0], bent, reference), "a routing bias off by 1e-6")


class _GatherWithoutSummingGrads(GatherSequenceSharedByHeads):
    """The bug the slot guards against: the gathered RoPE key's gradient kept as this rank's heads' only."""

    def _apply(self, module, device_mesh):
        module.register_forward_pre_hook(lambda _m, inputs: (DTensor.from_local(
            inputs[0].to_local(), device_mesh, (Shard(1),), run_check=False).full_tensor(), *inputs[1:]))
        return module


def _mla_grads(variant: str, mesh=None, gather=None) -> dict[str, torch.Tensor]:
    """One MLA layer's output and every gradient (weights and input) on a fixed input, in float64;
    with ``mesh``, under the family's tensor-parallel plan (the slot's style replaced by ``gather``)."""
    args = dataclasses.replace(DEEPSEEK_V3_SIZES["debug"], q_lora_rank=0 if variant == "plain-q" else 64)
    torch.manual_seed(0)
    model = DeepSeekTransformer(dataclasses.replace(args, n_layers=1))
    model.init_weights()
    mla = model.layers["0"].attention
    t = 32
    cos, sin = model.rope_cos[:t], model.rope_sin[:t]
    x = torch.randn(2, t, args.dim, generator=torch.Generator().manual_seed(1), requires_grad=True)
    weight = torch.randn(2, t, args.dim, generator=torch.Generator().manual_seed(2))
    if mesh is not None:
        plan = {k.removeprefix("attention."): v for k, v in DEEPSEEK_TP_PLAN.block.items() if k.startswith("attention.")
                and hasattr(mla, k.removeprefix("attention."))}
        if gather is not None:
            plan["shared_rope_key"] = gather
        parallelize_module(mla, mesh, plan)
        assert mla.wkv_b.weight.placements == (Shard(0),) and mla.wkv_a.weight.placements == (Replicate(),)
        x = distribute_tensor(x.detach(), mesh, [Shard(1)]).requires_grad_()  # [B, T/tp, D] on each rank
        out = mla(x, cos, sin).full_tensor()
    else:
        out = mla(x, cos, sin)
    (out * weight).sum().backward()
    grads = {name: p.grad for name, p in mla.named_parameters()}
    return {name: g.full_tensor() if isinstance(g, DTensor) else g  # Partial and Shard gradients: the sum, whole
            for name, g in {"out": out.detach(), "x": x.grad, **grads}.items()}


def _mla_tp_on_rank(variant: str, broken: bool):
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    return _mla_grads(variant, mesh, _GatherWithoutSummingGrads() if broken else None)


@pytest.mark.parity
@pytest.mark.parametrize("variant", ["q_lora", "plain-q"])
def test_mla_tensor_parallel_equals_one_process(variant):
    """MLA's heads over 2 tp ranks ([Note: MLA under tensor parallelism]): the output, the input's
    gradient and every weight's gradient equal one process's in float64. The replicated
    down-projections' and norms' gradients are sums over ranks; without the reduce-scatter of the
    shared RoPE key's gradient, wkv_a's gradient misses the other rank's heads and the check fails."""
    want = in_float64(_mla_grads, variant)
    for broken in (False, True):
        got = run_distributed(in_float64, 2, _mla_tp_on_rank, variant, broken, timeout=120)[0]

        def same(got=got):
            assert got.keys() == want.keys()
            for name in want:
                torch.testing.assert_close(got[name], want[name], rtol=TOL, atol=TOL, msg=name)
        same() if not broken else must_fail(same, "the shared RoPE key's gradient not summed over tp")


def test_balance_loss_is_sequence_wise():
    """A sparse layer's auxiliary loss is DeepSeek-V3's sequence-wise balance loss (eq. 17-20):
    per row, E / (k T) x (slots of e) times the mean over its tokens of the scores normalised per
    token, summed over experts, then the mean over rows; the batch-wide statistic differs."""
    args = dataclasses.replace(DEEPSEEK_V3_SIZES["debug"], n_layers=2)
    with default_dtype():
        torch.manual_seed(0)
        model = DeepSeekTransformer(args)
        model.init_weights()
        moe = model.layers["1"].moe
        seen = []
        moe.register_forward_hook(lambda _m, inputs, _out: seen.append(inputs[0].detach()))
        b, t, e, k = 3, 16, args.n_experts, args.top_k
        model(torch.randint(0, args.vocab_size, (b, t), generator=torch.Generator().manual_seed(1)))
        x = seen[0].flatten(0, 1)
        scores = torch.sigmoid(moe.router(x)).unflatten(0, (b, t))  # [B, T, E]
        chosen = torch.nn.functional.one_hot(moe.route(x)[1], e).sum(1).unflatten(0, (b, t))  # [B, T, E]
        f = e / (k * t) * chosen.sum(1)  # [B, E]
        p = (scores / scores.sum(-1, keepdim=True)).mean(1)  # [B, E]
        want = (f * p).sum(-1).mean()
        torch.testing.assert_close(moe.aux_loss, want, rtol=TOL, atol=0)
        batch_wide = e / (k * b * t) * chosen.sum((0, 1)) @ (scores / scores.sum(-1, keepdim=True)).mean((0, 1))
        assert abs(batch_wide - want) > 1e-4


class _KeysOutOfOrder(ContextParallelKeys):
    """The bug the gather's reordering guards against: keys left in rank order, not sequence order."""

    def forward(self, latent, k_rope):
        both = torch.cat([latent.unsqueeze(1), k_rope], dim=-1)
        both = GatherSequence.apply(both, self.layout.mesh.get_group())
        return both[..., :latent.shape[-1]].squeeze(1), both[..., latent.shape[-1]:]


def _cp_forward_backward(mesh=None, attention: str = "allgather", broken: bool = False, latent: bool = True):
    """The 2-layer debug model's logits and every gradient on fixed tokens, in float64; with ``mesh``,
    each rank holding its balanced half of every sequence (logits gathered back in sequence order),
    plus the cp bytes the forward and backward sent per rank."""
    args = dataclasses.replace(DEEPSEEK_V3_SIZES["debug"], n_layers=2)
    torch.manual_seed(0)
    model = DeepSeekTransformer(args)
    model.init_weights()
    tokens = torch.randint(0, args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    if mesh is None:
        out = model(tokens)
        out.square().sum().backward()
        return out.detach(), {n: p.grad for n, p in model.named_parameters()}, 0
    apply_context_parallel(model, mesh, attention=attention, tp=1 if latent else 2)  # tp 2: K and V gathered
    if broken:
        for block in model.layers.values():
            block.attention.sequence_keys = _KeysOutOfOrder(block.attention.sequence_keys.layout)
    with comm_record.count() as counter:
        out = model(shard_sequence(tokens, mesh))
        out.square().sum().backward()  # each rank its tokens' share of the one loss
    grads = {}
    for name, p in model.named_parameters():
        torch.distributed.all_reduce(p.grad, group=mesh.get_group())
        grads[name] = p.grad
    pieces = [torch.empty_like(out) for _ in range(2)]
    torch.distributed.all_gather(pieces, out.detach().contiguous(), group=mesh.get_group())
    order = torch.cat([sequence_indices(32, 2, r) for r in range(2)]).argsort()
    return torch.cat(pieces, dim=1)[:, order], grads, counter.total_bytes()


def _cp_on_rank(attention: str, broken: bool, latent: bool):
    return _cp_forward_backward(init_device_mesh("cpu", (2,), mesh_dim_names=("cp",)), attention, broken, latent)


@pytest.mark.parity
def test_mla_context_parallel_gathers_the_latent():
    """[Note: MLA's latent gathered over cp]: the debug model on 2 cp ranks (the gather) equals one
    process in float64, logits and every gradient, as do K and V gathered (the path under tp x cp)
    and the ring (one K | V tensor: [Note: MLA's values padded to the keys' width]); the latent's
    gather sends (kv_lora_rank + qk_rope_head_dim) / (H x 2 qk_head_dim) of K and V's bytes (V
    padded); keys left in rank order fail the comparison."""
    want_out, want_grads, _ = in_float64(_cp_forward_backward)
    results = {}
    for attention, broken, latent in (("allgather", False, True), ("allgather", False, False),
                                      ("ring", False, True), ("allgather", True, True)):
        out, grads, nbytes = run_distributed(in_float64, 2, _cp_on_rank, attention, broken, latent, timeout=120)[0]
        results[attention, latent] = nbytes

        def same(out=out, grads=grads):
            torch.testing.assert_close(out, want_out, rtol=TOL, atol=TOL)
            for name, want in want_grads.items():
                torch.testing.assert_close(grads[name], want, rtol=TOL, atol=TOL, msg=name)
        same() if not broken else must_fail(same, "MLA's gathered keys not put back in sequence order")
    args = DEEPSEEK_V3_SIZES["debug"]
    latent, kv = args.kv_lora_rank + args.qk_rope_head_dim, args.n_heads * 2 * args.qk_head_dim
    torch.testing.assert_close(results["allgather", True] / results["allgather", False], latent / kv, rtol=0,
                               atol=0)  # per layer one all-gather and reduce-scatter of [B, 1, T, 80], not K and V's



def test_hf_folder_trains_and_converts_back_to_transformers_logits(tmp_path, data_cache):
    """A random DeepseekV3ForCausalLM folder trains in meshpar from ``checkpoint.hf_weights``
    (one rank, fp32); its checkpoint converts back to a folder transformers loads, whose logits are
    the trained meshpar model's to 2e-5 (the bound of test_logits_equal_transformers), and the
    weights did move away from the folder's."""
    transformers = pytest.importorskip("transformers")
    from meshpar.convert import convert

    args = dataclasses.replace(DEEPSEEK_V3_SIZES["debug"], n_layers=2, vocab_size=256)  # SMALL's shape
    start, folder = _hf_folder(tmp_path, args)
    out = tmp_path / "run"
    result = train(_recipe(out, "--parallel.dp_shard=1", "--parallel.ep=1", f"--checkpoint.hf_weights={folder}",
                           "--checkpoint.every=3"), return_state=True)
    convert(out / "checkpoints" / "step_3", tmp_path / "back", to="hf", progress=False)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float32).eval()
    model = DeepSeekTransformer(args)
    model.load_state_dict(result.state_dict)
    tokens = torch.randint(0, args.vocab_size, (2, 64), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want, got, before = back(tokens).logits, model.eval()(tokens), start(tokens).logits
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5)
    assert (got - before).abs().max() > 1e-3  # three steps of training changed the model
