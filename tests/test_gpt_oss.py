"""The gpt-oss family (meshpar/models/gpt_oss): logits equal to transformers' GptOssForCausalLM in fp32
and float64, the key map and config both ways, MXFP4 dequantisation against a reference quantiser and
transformers' own, folders with MXFP4 experts converted and loaded (on 2 ep ranks too), a backward
pass, construction on meta, the published sizes, document-causal attention, the layout check and
context parallelism refused with its reason, and the attention's tensor-parallel plan and expert
parallelism on 2 ranks in float64."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import parallelize_module

from meshpar.config.errors import RecipeError
from meshpar.distributed.mesh import Layout
from meshpar.models.gpt_oss import GPT_OSS_SIZES, GptOssTransformer
from meshpar.models.gpt_oss import convert as adapter
from meshpar.models.gpt_oss.family import FAMILIES
from meshpar.models.gpt_oss.model import rope_tables, sink_mask, yarn_frequencies
from meshpar.models.gpt_oss.mxfp4 import dequantize_mxfp4, e2m1_values
from meshpar.models.gpt_oss.parallelize import GPT_OSS_TP_PLAN
from meshpar.parallel.expert_parallel import apply_expert_parallel
from tests.distributed import CaseSet
from tests.parity import TOL, default_dtype, in_float64

DEBUG = GPT_OSS_SIZES["debug"]
FAMILY = FAMILIES[0]
T = 24  # tokens per row: three times the debug window (8), so sliding and full layers differ


def _transformers():
    return pytest.importorskip("transformers", reason="transformers is a test-only extra")


def _random_hf(args=DEBUG, dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Module:
    """A transformers GptOssForCausalLM of ``args``' shape (its config from the adapter's ``hf_config``,
    eager attention and experts) with every tensor random: norms near 1, sinks and the router's bias of
    order 1, gate_up_proj wide enough (|gate_up| ~ 8) that the SwiGLU's clamps at 7 bite."""
    transformers = _transformers()
    config = {k: v for k, v in adapter.hf_config("gpt_oss", args, dtype).items()
              if k not in ("architectures", "model_type", "torch_dtype")}
    config = transformers.GptOssConfig(**config, attn_implementation="eager", experts_implementation="eager")
    torch.manual_seed(seed)
    hf = transformers.GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
            elif name.endswith(("sinks", "router.bias", "experts.gate_up_proj")):
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, 0.1)
    return hf.to(dtype)


def _tokens(rows: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, DEBUG.vocab_size, (rows, T), generator=torch.Generator().manual_seed(seed))


def _meshpar_from(hf: nn.Module, args=DEBUG) -> GptOssTransformer:
    model = GptOssTransformer(args).eval()
    model.load_state_dict(adapter.from_hf(hf.state_dict(), args))
    return model


def test_logits_equal_transformers_fp32():
    """Loaded through the adapter's key map, meshpar's model gives transformers' logits to 2e-5 absolute
    (fp32; logits of magnitude ~4, observed ~6e-6): the RoPE tables differ in their last bits
    (transformers computes YaRN's frequencies and angles in float32, meshpar in float64), and the sums
    run in other orders (the sink as one more key, [Note: attention sinks as one more key]; grouped
    expert matmuls). A window ignored, the sinks dropped or the clamps removed move them by 1e-2 or more."""
    hf = _random_hf()
    args = adapter.args_from_hf_config("gpt_oss", hf.config.to_dict())
    assert args == DEBUG
    model = _meshpar_from(hf)
    tokens = _tokens()
    with torch.no_grad():
        want, got = hf(tokens).logits, model(tokens)
        gap = (got - want).abs().max().item()
        assert gap <= 2e-5, gap
        for wrong in (dict(sliding_window=T), dict(swiglu_limit=100.0)):
            bent = _meshpar_from(hf, dataclasses.replace(args, **wrong))
            assert (bent(tokens) - want).abs().max() > 1e-2, wrong
        for layer in model.layers.values():
            layer.attention.sinks.weight.zero_()
        assert (model(tokens) - want).abs().max() > 1e-2


class _Float64Rotary(nn.Module):
    """transformers' rotary embedding computes cos, sin in float32 whatever the model's dtype: here
    meshpar's float64 tables (checked against transformers' by test_rope_tables_equal_transformers')."""

    def __init__(self, args) -> None:
        super().__init__()
        self.cos, self.sin = rope_tables(args, args.max_seq_len)

    def forward(self, x, position_ids):
        return self.cos[position_ids].to(x.dtype), self.sin[position_ids].to(x.dtype)


class _Float64RMSNorm(nn.Module):
    """transformers' GptOssRMSNorm in the input's dtype (it computes in float32)."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.weight, self.eps = norm.weight, norm.variance_epsilon

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


@pytest.mark.parity
def test_logits_equal_transformers_float64():
    """The same in float64, to 1e-10 (observed ~1e-14): transformers' model in float64 with its two
    float32 computations, the RoPE tables and RMSNorm, replaced by float64 ones, so everything else
    (attention with sinks and windows, routing, the experts' SwiGLU and biases, the key map) is
    compared at float64's precision."""
    hf = _random_hf(dtype=torch.float64)
    hf.model.rotary_emb = _Float64Rotary(DEBUG)
    for module in list(hf.modules()):
        for child_name, child in list(module.named_children()):
            if type(child).__name__ == "GptOssRMSNorm":
                setattr(module, child_name, _Float64RMSNorm(child))
    with default_dtype():
        model = _meshpar_from(hf)
    tokens = _tokens()
    with torch.no_grad():
        gap = (model(tokens) - hf(tokens).logits).abs().max().item()
    assert gap <= 1e-10, gap


def test_rope_tables_equal_transformers():
    """YaRN's frequencies (float64 here) equal transformers' float32 ones to float32's rounding, and
    cos, sin carry its attention factor 0.1 ln(factor) + 1, for the debug and the published YaRN."""
    transformers = _transformers()
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for args in (DEBUG, GPT_OSS_SIZES["20b"]):
        config = transformers.GptOssConfig(**{k: v for k, v in adapter.hf_config("gpt_oss", args, torch.float32)
                                              .items() if k not in ("architectures", "model_type", "torch_dtype")})
        inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](config)
        ours = yarn_frequencies(args.resolved_head_dim, args.rope_theta, args.yarn, truncate=args.yarn.truncate)
        torch.testing.assert_close(ours.float(), inv_freq, rtol=2e-7, atol=0)
        cos, _ = rope_tables(args, 1)
        assert cos[0, 0].item() == pytest.approx(factor, rel=1e-12)


def test_key_map_and_config_round_trip():
    """Hugging Face state dict -> meshpar -> Hugging Face: the same names, the same tensors (renaming
    only); config.json -> args -> config.json -> args, and meshpar.json's model_args, give the args."""
    hf = _random_hf()
    saved = hf.state_dict()
    mine = adapter.from_hf(saved, DEBUG)
    assert set(mine) == set(GptOssTransformer(DEBUG).state_dict())
    back = adapter.to_hf(mine, DEBUG)
    assert set(back) == set(saved)
    assert all(back[k] is saved[k] or torch.equal(back[k], saved[k]) for k in saved)
    for args in GPT_OSS_SIZES.values():
        assert adapter.args_from_hf_config("gpt_oss", adapter.hf_config("gpt_oss", args, torch.bfloat16)) == args
        assert adapter.args_from_dict(dataclasses.asdict(args)) == args
    odd = dataclasses.replace(DEBUG, layer_types=("full_attention",) * 4)
    assert adapter.args_from_hf_config("gpt_oss", adapter.hf_config("gpt_oss", odd, torch.float32)) == odd


def test_hf_folder_converts_both_ways_and_loads(tmp_path):
    """A saved GptOssForCausalLM folder -> meshpar DCP -> Hugging Face folder: every tensor bit for bit and
    the same config; ``load_hf_weights`` fills meshpar's model from the folder with transformers' logits
    (to the fp32 bound of test_logits_equal_transformers_fp32)."""
    import json

    from safetensors.torch import load_file

    from meshpar.convert import convert, load_hf_weights

    hf = _random_hf()
    hf.save_pretrained(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "dcp", to="dcp", progress=False)
    convert(tmp_path / "dcp", tmp_path / "back", to="hf", progress=False)
    original = load_file(tmp_path / "hf" / "model.safetensors")
    back = {k: v for f in (tmp_path / "back").glob("*.safetensors") for k, v in load_file(f).items()}
    assert original.keys() == back.keys()
    assert all(torch.equal(original[k], back[k]) for k in original)
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert adapter.args_from_hf_config("gpt_oss", config) == DEBUG
    model = GptOssTransformer(DEBUG).eval()
    assert load_hf_weights(model.state_dict(), tmp_path / "hf", "gpt_oss", DEBUG) == ""
    tokens = _tokens()
    with torch.no_grad():
        assert (model(tokens) - hf(tokens).logits).abs().max() <= 2e-5


# --- MXFP4 ---------------------------------------------------------------------------------------

def _quantise_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The published way (OCP MX v1.0), as a reference: w[E, R, K] (a checkpoint's rows, the input along K)
    in blocks of 32 along K; each block's scale 2^(floor(log2(max |x|)) - 2) (2: E2M1's largest exponent),
    stored + 127; each value rounded to the nearest E2M1 point of x / scale (clamped to +-6); codes packed
    two per byte, element 2i in the low nibble. Returns (blocks, scales, the quantised values [E, R, K])."""
    x = w.unflatten(-1, (-1, 32))  # [E, R, G, 32]
    amax = x.abs().amax(-1)
    exponent = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2, torch.full_like(amax, -127)).clamp(-127, 127)
    scaled = x / torch.exp2(exponent).unsqueeze(-1)
    grid = e2m1_values()[:8]  # 0, 0.5, ..., 6
    magnitude = (scaled.abs().clamp(max=6.0).unsqueeze(-1) - grid).abs().argmin(-1)  # [E, R, G, 32] codes 0..7
    codes = magnitude + 8 * (scaled < 0)
    q = (grid[magnitude] * torch.where(scaled < 0, -1.0, 1.0)) * torch.exp2(exponent).unsqueeze(-1)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return blocks, (exponent + 127).to(torch.uint8), q.flatten(-2)


def _published_weight(shape, seed: int) -> torch.Tensor:
    """Random values whose 32-blocks span 2^-40 .. 2^40 in magnitude, a few blocks all zero."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g).unflatten(-1, (-1, 32))
    w = w * torch.exp2(torch.randint(-40, 40, w.shape[:-1], generator=g)).unsqueeze(-1)
    w[0, 0, 0] = 0.0
    return w.flatten(-2)


def test_mxfp4_dequantises_the_published_format():
    """Blocks and scales made by a reference quantiser come back as its quantised values exactly, in
    float32 and bfloat16, transposed to transformers' layout [E, K, R]; equal, bit for bit, to
    transformers' own dequantiser; a scale of 255 (NaN in E8M0) gives NaN."""
    w = _published_weight((3, 40, 64), seed=0)  # E, R (output rows), K (input)
    blocks, scales, q = _quantise_mxfp4(w)
    assert blocks.shape == (3, 40, 2, 16) and scales.shape == (3, 40, 2)
    want = q.transpose(1, 2)
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.float32), want)
    ours = dequantize_mxfp4(blocks, scales, torch.bfloat16)
    assert torch.equal(ours, want.to(torch.bfloat16))
    transformers_mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    for dtype in (torch.bfloat16, torch.float32):
        theirs = transformers_mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=dtype)
        assert torch.equal(dequantize_mxfp4(blocks, scales, dtype), theirs)
    scales[1, 2, 1] = 255
    assert dequantize_mxfp4(blocks, scales, torch.float32)[1, 32:, 2].isnan().all()


def test_from_hf_reads_mxfp4_experts():
    """A state dict as the published folders hold it (experts as *_blocks and *_scales of the
    checkpoint's [E, rows, input] orientation) loads into meshpar's experts as the quantised values."""
    hf = _random_hf()
    saved, quantised = dict(hf.state_dict()), {}
    for name in [n for n in saved if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales, q = _quantise_mxfp4(saved.pop(name).transpose(1, 2))
        saved[f"{name}_blocks"], saved[f"{name}_scales"] = blocks, scales
        quantised[name] = q.transpose(1, 2)
    mine = adapter.from_hf(saved, DEBUG)
    for name, q in quantised.items():
        assert torch.equal(mine[name.replace("model.layers.", "layers.").replace("mlp.", "moe.")], q), name
    GptOssTransformer(DEBUG).load_state_dict(mine)


_MXFP4 = ("gate_up_proj", "down_proj")  # the experts' matrices a published folder stores as MXFP4


def _mxfp4_folder(folder) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A saved random GptOssForCausalLM folder as the published ones hold it: every layer's experts'
    matrices replaced by MXFP4 ``_blocks`` and ``_scales`` quantised the published way (of the
    checkpoint's [E, rows, input] orientation), biases plain, config.json with its quantization_config.
    Returns transformers' model holding the quantised values (the dequantised model) and, by meshpar
    name, ``dequantize_mxfp4`` of each blocks and scales in float32."""
    import json

    from safetensors.torch import save_file

    hf = _random_hf()
    tensors = {k: v.clone() for k, v in hf.state_dict().items()}  # as save_pretrained writes them (on rank 0 only)
    want = {}
    params = dict(hf.named_parameters())
    for i in range(DEBUG.n_layers):
        for p in _MXFP4:
            name = f"model.layers.{i}.mlp.experts.{p}"
            blocks, scales, q = _quantise_mxfp4(tensors.pop(name).transpose(1, 2))
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
            with torch.no_grad():
                params[name].copy_(q.transpose(1, 2))
            want[f"layers.{i}.moe.experts.{p}"] = dequantize_mxfp4(blocks, scales, torch.float32)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = hf.config.to_dict()
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                     "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(config))
    return hf, want


def test_mxfp4_folder_converts_and_loads(tmp_path):
    """A folder with MXFP4 experts, as published: ``meshpar convert`` to DCP gives each expert tensor as
    ``dequantize_mxfp4`` of its blocks and scales bit for bit (in config.json's dtype) and every other
    tensor as stored; back to Hugging Face the experts are written plain; ``load_hf_weights`` fills
    meshpar's model with the same values and transformers' logits of the dequantised model (to the fp32
    bound of test_logits_equal_transformers_fp32)."""
    from safetensors.torch import load_file

    from meshpar.convert import convert, load_hf_weights, open_checkpoint

    hf, want = _mxfp4_folder(tmp_path / "hf")
    want.update((k, v) for k, v in adapter.from_hf(hf.state_dict(), DEBUG).items() if k not in want)
    convert(tmp_path / "hf", tmp_path / "dcp", to="dcp", progress=False)
    dcp = open_checkpoint(tmp_path / "dcp")
    assert set(dcp.tensors) == {f"model.{k}" for k in want}
    for name, value in want.items():
        got = dcp.read(f"model.{name}")
        assert got.dtype == torch.float32 and torch.equal(got, value), name
    convert(tmp_path / "dcp", tmp_path / "back", to="hf", progress=False)
    back = {k: v for f in (tmp_path / "back").glob("*.safetensors") for k, v in load_file(f).items()}
    assert back.keys() == adapter.to_hf(want, DEBUG).keys()  # plain gate_up_proj and down_proj, no blocks
    assert all(torch.equal(back[k], v) for k, v in adapter.to_hf(want, DEBUG).items())
    model = GptOssTransformer(DEBUG).eval()
    assert load_hf_weights(model.state_dict(), tmp_path / "hf", "gpt_oss", DEBUG) == ""
    for name, value in model.state_dict().items():
        assert torch.equal(value, want[name]), name
    tokens = _tokens()
    with torch.no_grad():
        assert (model(tokens) - hf(tokens).logits).abs().max() <= 2e-5


def test_mxfp4_folder_missing_scales_names_them(tmp_path):
    """An MXFP4 folder lacking one ``_scales`` tensor: converting and loading it fail naming that tensor."""
    from safetensors.torch import load_file, save_file

    from meshpar.convert import ConvertError, convert, load_hf_weights

    _mxfp4_folder(tmp_path / "hf")
    tensors = {k: v.clone() for k, v in load_file(tmp_path / "hf" / "model.safetensors").items()}
    missing = "model.layers.1.mlp.experts.down_proj_scales"
    del tensors[missing]
    save_file(tensors, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConvertError, match=f"tensor '{missing}' is missing"):
        convert(tmp_path / "hf", tmp_path / "dcp", to="dcp", progress=False)
    with pytest.raises(ConvertError, match=f"tensor '{missing}' is missing"):
        load_hf_weights(GptOssTransformer(DEBUG).state_dict(), tmp_path / "hf", "gpt_oss", DEBUG)


# --- the model on its own ------------------------------------------------------------------------

def test_meta_init_and_a_backward_pass():
    """Built on meta, materialised and initialised, the debug model equals one built on the CPU under the
    same seed ([Note: layout-independent init]); cross-entropy plus the auxiliary loss backpropagates a
    finite gradient into every parameter (sinks, every bias and the router's included)."""
    with torch.device("meta"):
        meta = GptOssTransformer(DEBUG)
    meta.to_empty(device="cpu")
    torch.manual_seed(3)
    meta.init_weights()
    cpu = GptOssTransformer(DEBUG)
    torch.manual_seed(3)
    cpu.init_weights()
    for (name, a), b in zip(meta.state_dict().items(), cpu.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    torch.testing.assert_close(meta.rope_cos, cpu.rope_cos)
    model = cpu.train()
    tokens = _tokens()
    logits = model(tokens)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()) + model.aux_loss
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    assert model.layers["0"].attention.sinks.weight.grad.abs().sum() > 0
    assert model.layers["1"].moe.router.bias.grad.abs().sum() > 0


def test_published_sizes():
    """Parameter counts of openai/gpt-oss-20b and -120b: 20.91B and 116.83B in total, 3.61B and 5.13B
    active (the matmul weights a token runs through: attention, router, 4 experts, unembedding), as
    OpenAI's model card gives them; layers alternate sliding (first) and full."""
    for size, total, active in (("20b", 20_914_757_184, 3_607_142_400), ("120b", 116_829_156_672, 5_131_100_160)):
        args = GPT_OSS_SIZES[size]
        with torch.device("meta"):
            assert sum(p.numel() for p in GptOssTransformer(args).parameters()) == total
        assert args.matmul_params() == active
        assert [args.layer_type(i) for i in range(3)] == ["sliding_attention", "full_attention", "sliding_attention"]
    assert round(20_914_757_184 / 1e9, 2) == 20.91 and round(5_131_100_160 / 1e9, 2) == 5.13


@pytest.mark.parity
@default_dtype()
def test_packed_documents_equal_documents_alone():
    """With ``document_eos``, a row packing two documents gives the second one's logits as the document
    alone does (positions restart, the window and the sinks per document), in float64 to 1e-9."""
    eos = 7
    args = dataclasses.replace(DEBUG, document_eos=eos)
    torch.manual_seed(0)
    model = GptOssTransformer(args).eval()
    model.init_weights()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("sinks.weight", "bias")):
                p.normal_(0.0, 0.5)
    tokens = _tokens(rows=1).clamp(min=eos + 1)
    tokens[0, 9] = eos  # document A: tokens 0..9; document B: 10..23
    with torch.no_grad():
        packed, alone = model(tokens), model(tokens[:, 10:])
    torch.testing.assert_close(packed[:, 10:], alone, rtol=0, atol=1e-9)


def test_layout_check():
    """tp must divide the heads; tp needs dp_shard > 1 for the experts; ep divides the experts; the model
    offers context parallelism no attention slot."""
    args = GPT_OSS_SIZES["20b"]
    FAMILY.check_layout(args, Layout(pp=2, dp_replicate=1, dp_shard=4, cp=1, tp=8, ep=4))
    with pytest.raises(NotImplementedError, match="sliding window"):
        GptOssTransformer(DEBUG).attention_slots()
    for layout, key in ((Layout(pp=1, dp_replicate=1, dp_shard=2, cp=1, tp=16), "n_kv_heads"),
                        (Layout(pp=1, dp_replicate=1, dp_shard=1, cp=1, tp=2), "dp_shard"),
                        (Layout(pp=1, dp_replicate=1, dp_shard=6, cp=1, tp=1, ep=3), "32 experts")):
        with pytest.raises(RecipeError, match=key):
            FAMILY.check_layout(args, layout)


def test_context_parallelism_refused_saying_why():
    """A recipe with parallel.cp = 2 fails preflight's ``check_model`` with the family's reason (cp's attention
    has no sliding window and no sinks), the key and the fix; ep and tp pass it."""
    from meshpar.config import recipe as recipelib
    from meshpar.training.preflight import check_model

    family = ["--model.family=gpt_oss", "--model.size=debug"]
    why = r"parallel\.cp = 2: context parallelism is not built yet for model family 'gpt_oss': .*neither a sliding "
    with pytest.raises(RecipeError, match=why + r"window nor sink logits.*set parallel\.cp = 1"):
        check_model(recipelib.load(None, [*family, "--parallel.cp=2"]))
    assert check_model(recipelib.load(None, [*family, "--parallel.tp=2", "--parallel.ep=2"]))[1] == DEBUG


# --- tensor and expert parallelism on 2 ranks, float64 --------------------------------------------

def _randomize_biases_and_sinks(module: nn.Module) -> None:
    """init_weights leaves biases and sinks at zero, which would hide one placed or summed wrong."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith(("bias", "sinks.weight")):
                p.normal_(0.0, 0.5)


def _attention_grads(mesh=None) -> dict[str, torch.Tensor]:
    """One sliding and one full layer's attention (debug size): output and every gradient on a fixed
    input; with ``mesh``, under the family's plan (its ``attention*`` entries: the sequence gathered in,
    heads split, reduce-scattered out)."""
    torch.manual_seed(0)
    model = GptOssTransformer(dataclasses.replace(DEBUG, n_layers=2))
    model.init_weights()
    _randomize_biases_and_sinks(model)
    out = {}
    for i in ("0", "1"):
        attention = model.layers[i].attention
        cos, sin = model.rope_cos[:T], model.rope_sin[:T]
        mask = sink_mask(T, DEBUG.sliding_window if i == "0" else None, None, torch.float64, torch.device("cpu"))
        x = torch.randn(2, T, DEBUG.dim, generator=torch.Generator().manual_seed(1), requires_grad=True)
        weight = torch.randn(2, T, DEBUG.dim, generator=torch.Generator().manual_seed(2))
        if mesh is not None:
            plan = GPT_OSS_TP_PLAN.block
            parallelize_module(attention, mesh, plan["attention"])
            parallelize_module(attention, mesh, {k.removeprefix("attention."): v for k, v in plan.items()
                                                 if k.startswith("attention.")})
            assert attention.sinks.weight.placements == (Shard(0),)
            x = distribute_tensor(x.detach(), mesh, [Shard(1)]).requires_grad_()  # [B, T/tp, D] on each rank
            y = attention(x, cos, sin, mask).full_tensor()
        else:
            y = attention(x, cos, sin, mask)
        (y * weight).sum().backward()
        grads = {name: p.grad for name, p in attention.named_parameters()}
        out.update({f"{i}.{name}": g.full_tensor() if isinstance(g, DTensor) else g  # Shard or Partial: whole
                    for name, g in {"out": y.detach(), "x": x.grad, **grads}.items()})
    return out


def _expert_grads(mesh=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A 2-layer model's logits on two rows and its experts' gradients; with ``mesh`` (ep), the experts
    split over it (``Experts.stacked``: the four tensors, biases included) and each rank running its row."""
    torch.manual_seed(0)
    model = GptOssTransformer(dataclasses.replace(DEBUG, n_layers=2))
    model.init_weights()
    _randomize_biases_and_sinks(model)
    tokens = _tokens()
    weight = torch.randn(2, T, DEBUG.vocab_size, generator=torch.Generator().manual_seed(2))
    if mesh is not None:
        apply_expert_parallel(FAMILY.moe.sparse_layers(model), mesh)
        r = mesh.get_local_rank()
        tokens, weight = tokens[r:r + 1], weight[r:r + 1]
    logits = model(tokens)
    (logits * weight).sum().backward()
    return logits.detach(), {name: p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                             for name, p in model.named_parameters() if ".experts." in name}


def _case_tp_attention():
    return in_float64(_attention_grads, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)))


def _case_ep():
    return in_float64(_expert_grads, init_device_mesh("cpu", (2,), mesh_dim_names=("ep",)))


def _case_ep_mxfp4():
    """Each rank loads an MXFP4 folder (built alike on every rank) into a model whose experts are split
    over 2 ep ranks: its local experts, and the dequantised values it should hold, by meshpar name."""
    import tempfile
    from pathlib import Path

    from meshpar.convert import load_hf_weights

    with tempfile.TemporaryDirectory() as folder:
        _, want = _mxfp4_folder(Path(folder))
        with torch.device("meta"):
            model = GptOssTransformer(DEBUG)
        apply_expert_parallel(FAMILY.moe.sparse_layers(model), init_device_mesh("cpu", (2,), mesh_dim_names=("ep",)))
        model.to_empty(device="cpu")
        load_hf_weights(model.state_dict(), folder, "gpt_oss", DEBUG)
    return {name: model.get_parameter(name).to_local() for name in want}, want


JOBS = CaseSet({"tp_attention": (_case_tp_attention, 2), "ep": (_case_ep, 2), "ep_mxfp4": (_case_ep_mxfp4, 2)},
               timeout=180)


@pytest.mark.parity
def test_attention_tensor_parallel_equals_one_process():
    """gpt-oss attention over 2 tp ranks (q/k/v column-wise with biases, sinks split by head, wo row-wise
    with its bias): the output, the input's gradient and every weight's, sink's and bias's gradient
    equal one process's in float64, for a sliding and a full layer."""
    want = in_float64(_attention_grads)
    got = JOBS.check("tp_attention", 2)[0]
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=TOL, atol=TOL, msg=name)


@pytest.mark.parity
def test_expert_parallel_equals_one_process():
    """The experts over 2 ep ranks through ``GptOssExperts.compute`` on each rank's share (weights and
    biases [E/2, ...]): each rank's logits are its row's, and the ranks' expert gradients, stacked,
    are one process's, in float64."""
    want_logits, want = in_float64(_expert_grads)
    ranks = JOBS.check("ep", 2)
    torch.testing.assert_close(torch.cat([logits for logits, _ in ranks]), want_logits, rtol=TOL, atol=TOL)
    for name, grad in want.items():
        torch.testing.assert_close(torch.cat([grads[name] for _, grads in ranks]), grad, rtol=TOL, atol=TOL,
                                   msg=name)


@pytest.mark.parity
def test_mxfp4_folder_loads_into_expert_parallel_shards():
    """``load_hf_weights`` from an MXFP4 folder into experts split over 2 ep ranks: rank r holds experts
    r * E/2 .. (r + 1) * E/2 of each dequantised tensor, bit for bit (it reads and decodes only those)."""
    ranks = JOBS.check("ep_mxfp4", 2)
    for name, whole in ranks[0][1].items():
        for r, (local, _) in enumerate(ranks):
            assert torch.equal(local[name], whole.chunk(2)[r]), (name, r)


def test_generate_refused_saying_why(tmp_path):
    """``meshpar generate`` fills the attention slots with a KV cache that has no window and no sinks:
    a gpt-oss folder is refused by name before any weight is read."""
    from meshpar.convert.spec import ConvertError
    from meshpar.inference.generate import load_model

    _random_hf().save_pretrained(tmp_path / "hf")
    with pytest.raises(ConvertError, match="`meshpar generate` is not built for model family 'gpt_oss' "
                                           r"\(meshpar's KV-cache attention has no sliding window and no sinks"):
        load_model(tmp_path / "hf")
