"""The pure-PyTorch model families: shapes, initialization, pipeline passthrough, numerics.

Big sizes are built on the meta device only; everything that runs numbers uses the
debug sizes, so the file takes a few seconds on two CPU cores.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from meshpar.config.recipe import ModelConfig
from meshpar.models import get_family
from meshpar.models.gpt2 import GPT2, GPT2_SIZES
from meshpar.models.llama import LLAMA_SIZES, QWEN2_SIZES, QWEN3_SIZES, RopeScaling, Transformer
from meshpar.models.llama.model import apply_rope, rope_frequencies
from tests.helpers import FAMILIES, build_model
from tests.parity import TOL, default_dtype

# (embedding attributes, final norm, output) per family, for pipeline splits
PARTS = {Transformer: (("tok_embeddings",), "norm", "output"), GPT2: (("wte", "wpe"), "ln_f", "lm_head")}


def tokens(model: nn.Module, batch: int = 2, seq_len: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, model.args.vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(seed))


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() counts a tied weight once


# --- shapes --------------------------------------------------------------------------------

PARAM_COUNTS = [
    ("llama", "1b", 1_235_814_400), ("llama", "3b", 3_212_749_824), ("llama", "8b", 8_030_261_248),
    ("llama", "70b", 70_553_706_496), ("llama", "405b", 405_853_388_800), ("qwen2", "0.5b", 494_032_768),
    ("qwen2", "7b", 7_615_616_512),
    ("qwen3", "0.6b", 596_049_920), ("qwen3", "8b", 8_190_735_360), ("gpt2", "124m", 124_439_808),
    ("gpt2", "350m", 354_823_168), ("gpt2", "774m", 774_030_080), ("gpt2", "1.5b", 1_557_611_200),
]


@pytest.mark.parametrize(("family", "size", "expected"), PARAM_COUNTS)
def test_parameter_count_matches_published_shapes(family, size, expected):
    cls, sizes = FAMILIES[family]
    with torch.device("meta"):
        model = cls(sizes[size])
    assert n_params(model) == expected
    # flops_per_token's N is every nn.Linear weight, a tied output included
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    assert sizes[size].matmul_params() == linear


def test_rounded_published_figures():
    with torch.device("meta"):
        counts = {s: n_params(Transformer(LLAMA_SIZES[s])) for s in ("8b", "70b", "405b")}
        gpt2 = n_params(GPT2(GPT2_SIZES["124m"]))
    assert round(counts["8b"] / 1e9, 2) == 8.03
    assert round(counts["70b"] / 1e9, 1) == 70.6
    assert round(counts["405b"] / 1e9, 1) == 405.9
    assert round(gpt2 / 1e6) == 124


def test_flops_per_token_by_hand():
    # Llama 3.1 8B, per layer: wq + wo 2 * 4096^2, wk + wv 2 * 4096 * 1024, w1 w2 w3 3 * 4096 * 14336
    #   = 33,554,432 + 8,388,608 + 176,160,768 = 218,103,808; x 32 = 6,979,321,856
    #   + output 128256 * 4096 = 525,336,576 -> N = 7,504,658,432; 6N = 45,027,950,592
    #   attention 12 * 32 layers * 32 heads * 128 * 8192 = 12,884,901,888
    assert LLAMA_SIZES["8b"].flops_per_token(8192) == 57_912_852_480
    # GPT-2 124M: N = 12 * 12 * 768^2 + 50257 * 768 = 123,532,032; 6N = 741,192,192
    #   attention 12 * 12 * 768 * 1024 = 113,246,208
    assert GPT2_SIZES["124m"].flops_per_token(1024) == 854_438_400


def test_qwen2_has_qkv_biases_and_llama_has_none():
    with torch.device("meta"):
        qwen2, llama = Transformer(QWEN2_SIZES["7b"]), Transformer(LLAMA_SIZES["8b"])
    attn = qwen2.layers["0"].attention
    assert attn.wq.bias.shape == (3584,) and attn.wk.bias.shape == (512,) and attn.wv.bias.shape == (512,)
    assert attn.wo.bias is None
    assert not [n for n, _ in llama.named_parameters() if n.endswith("bias")]
    small = build_model("qwen2")
    assert all((m.attention.wk.bias == 0).all() for m in small.layers.values())


def test_qwen3_head_dim_and_qk_norm_shapes():
    with torch.device("meta"):
        model = Transformer(QWEN3_SIZES["0.6b"])
    attn = model.layers["0"].attention
    assert attn.wq.weight.shape == (16 * 128, 1024)  # H * Dh = 2048 != dim 1024
    assert attn.wk.weight.shape == (8 * 128, 1024)
    assert attn.wo.weight.shape == (1024, 16 * 128)
    assert attn.q_norm.weight.shape == (128,) and attn.k_norm.weight.shape == (128,)
    assert model.rope_cos.shape == (40960, 64)
    assert model.output.weight is model.tok_embeddings.weight
    small = build_model("qwen3")
    assert small(tokens(small)).shape == (2, 16, small.args.vocab_size)


def test_registry_builds_with_overrides():
    with torch.device("meta"):
        model = get_family("qwen3").build(ModelConfig(family="qwen3", size="8b", n_layers=2, vocab_size=512))
    assert list(model.layers) == ["0", "1"] and model.output.weight.shape == (512, 4096)


# --- initialization ------------------------------------------------------------------------

@pytest.mark.parametrize("family", list(FAMILIES))
def test_meta_init_equals_cpu_init(family):
    cls, sizes = FAMILIES[family]
    with torch.device("meta"):
        meta = cls(sizes["debug"])
    meta.to_empty(device="cpu")
    torch.manual_seed(3)
    meta.init_weights()
    cpu = build_model(family, seed=3)
    a = dict(meta.named_parameters(remove_duplicate=False)) | dict(meta.named_buffers())
    b = dict(cpu.named_parameters(remove_duplicate=False)) | dict(cpu.named_buffers())
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    x = tokens(cpu)
    assert torch.equal(meta(x), cpu(x))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_pipeline_stage_initialized_alone_equals_the_whole_model(family):
    """Values are keyed by parameter name (meshpar.models.init), so each stage, built on meta and
    initialized on its own, starts as the same parameters of the whole model; the last stage's
    copy of a tied embedding starts equal to the embedding."""
    whole = dict(build_model(family, seed=5).named_parameters(remove_duplicate=False))
    cls, sizes = FAMILIES[family]
    with torch.device("meta"):
        model = cls(sizes["debug"])
    for stage in split_in_two(model):
        stage.to_empty(device="cpu")
        torch.manual_seed(5)
        stage.init_weights()
        for name, param in stage.named_parameters(remove_duplicate=False):
            assert torch.equal(param, whole[name]), name


def test_llama_init_statistics():
    model = build_model("llama")
    layer = model.layers["1"]
    assert model.tok_embeddings.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert layer.attention.wq.weight.std().item() == pytest.approx(0.02, rel=0.05)
    out_std = 0.02 / math.sqrt(2 * 4)
    for w in (layer.attention.wo.weight, layer.feed_forward.w2.weight):
        assert w.std().item() == pytest.approx(out_std, rel=0.05)
        assert w.abs().max().item() <= 3 * out_std  # truncated at 3 std
    assert (layer.attention_norm.weight == 1).all() and (model.norm.weight == 1).all()


@pytest.mark.parametrize(("family", "head", "embedding"), [("gpt2", "lm_head", "wte"),
                                                           ("qwen2", "output", "tok_embeddings")])
def test_tie_survives_meta_init_and_training(family, head, embedding):
    cls, sizes = FAMILIES[family]
    with torch.device("meta"):
        model = cls(sizes["debug"])
    model.to_empty(device="cpu")  # gives each module a new Parameter: the tie is lost here ...
    torch.manual_seed(0)
    model.init_weights()  # ... and restored here
    assert getattr(model, head).weight is getattr(model, embedding).weight
    assert n_params(model) == n_params(build_model(family))
    before = getattr(model, embedding).weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    x = tokens(model)
    F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
    opt.step()
    state = model.state_dict()
    assert not torch.equal(state[f"{embedding}.weight"], before)
    assert torch.equal(state[f"{embedding}.weight"], state[f"{head}.weight"])


# --- forward -------------------------------------------------------------------------------

def split_in_two(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """Two pipeline stages cut at the middle block, as meshpar's pipeline splitter would."""
    embeddings, norm, output = PARTS[type(model)]
    keys = list(model.layers)
    first, second = copy.deepcopy(model), copy.deepcopy(model)
    setattr(first, norm, None)
    setattr(first, output, None)
    for name in embeddings:
        setattr(second, name, None)
    for key in keys[len(keys) // 2:]:
        del first.layers[key]
    for key in keys[:len(keys) // 2]:
        del second.layers[key]
    return first, second


@pytest.mark.parametrize("family", list(FAMILIES))
def test_pipeline_split_passthrough(family):
    model = build_model(family)
    first, second = split_in_two(model)
    assert list(second.layers) == ["2", "3"]  # keys keep their index in the whole model
    names = dict(model.named_parameters(remove_duplicate=False))
    stage_names = [dict(s.named_parameters(remove_duplicate=False)) for s in (first, second)]
    assert stage_names[0].keys() | stage_names[1].keys() == names.keys()
    x = tokens(model)
    hidden = first(x)
    assert hidden.shape == (2, 16, model.args.dim)
    torch.testing.assert_close(second(hidden), model(x), rtol=0, atol=0)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parity
@default_dtype()  # float64: the prefix's logits agree to summation order, ~1e-15
def test_causality(family):
    model = build_model(family)
    x = tokens(model, batch=1)
    t = 9
    y = x.clone()
    y[0, t] = (x[0, t] + 1) % model.args.vocab_size
    with torch.no_grad():
        a, b = model(x), model(y)
    torch.testing.assert_close(a[:, :t], b[:, :t], rtol=0, atol=TOL)
    assert (a[:, t:] - b[:, t:]).abs().amax(dim=-1).min() > 1e-4  # every later position sees the change


def test_too_long_sequence_is_refused():
    model = build_model("gpt2", max_seq_len=8)
    with pytest.raises(ValueError, match="max_seq_len"):
        model(tokens(model, seq_len=9))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parity
@default_dtype()
def test_grouped_query_attention_equals_repeated_kv_heads(family):
    gqa = build_model(family)
    args = gqa.args
    group = args.n_heads // args.n_kv_heads
    assert group > 1
    x = tokens(gqa)

    def with_kv(expand) -> torch.Tensor:
        mha = build_model(family, n_kv_heads=args.n_heads)
        state = gqa.state_dict()
        for name, w in state.items():
            if ".attention.wk." in name or ".attention.wv." in name:
                w = rearrange(w, "(h d) ... -> h d ...", d=args.resolved_head_dim)
                state[name] = rearrange(expand(w), "h d ... -> (h d) ...")
        mha.load_state_dict(state)
        return mha(x)

    # query head i reads kv head i // group: each kv head repeated `group` times in a row
    torch.testing.assert_close(with_kv(lambda w: w.repeat_interleave(group, dim=0)), gqa(x), rtol=TOL, atol=TOL)
    tiled = with_kv(lambda w: w.repeat(group, *[1] * (w.ndim - 1)))  # the wrong grouping
    assert not torch.allclose(tiled, gqa(x), atol=1e-4)


# --- RoPE ----------------------------------------------------------------------------------

def test_llama31_rope_scaling_bands():
    # Llama 3.1: theta 5e5, Dh 128, factor 8, low 1, high 4, original 8192. Wavelength 2*pi / freq
    # is below 8192 / 4 = 2048 up to index 28 (1955), above 8192 from index 35 (8216).
    scaling = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=8192)
    plain = rope_frequencies(128, 500000.0)
    scaled = rope_frequencies(128, 500000.0, scaling)
    assert plain[1].item() == pytest.approx(500000.0 ** (-2 / 128))
    torch.testing.assert_close(scaled[:29], plain[:29], rtol=1e-12, atol=0)  # high frequencies kept
    torch.testing.assert_close(scaled[35:], plain[35:] / 8, rtol=1e-12, atol=0)  # low divided by factor
    band = slice(29, 35)
    assert ((scaled[band] > plain[band] / 8) & (scaled[band] < plain[band])).all()
    assert (scaled[band][1:] / plain[band][1:] < scaled[band][:-1] / plain[band][:-1]).all()  # smooth descent
    # index 32: freq = 5e5^-0.5 = 1.41421e-3, wavelength 4442.88, 8192 / 4442.88 = 1.84385,
    # smooth = (1.84385 - 1) / (4 - 1) = 0.281283, (1 - smooth) * freq / 8 + smooth * freq = 5.24846e-4
    assert scaled[32].item() == pytest.approx(5.24846e-4, rel=1e-5)


@default_dtype()  # RoPE tables in float64, so exact trigonometry to ~1e-15
def test_rope_is_half_split_and_relative():
    model = build_model("llama")
    dh = model.args.resolved_head_dim
    freqs = rope_frequencies(dh, model.args.rope_theta)
    cos, sin = model.rope_cos, model.rope_sin
    # the HF "rotate_half" layout: element j is paired with j + Dh/2 (see [Note: RoPE layout])
    j, pos = 3, 7
    unit = torch.zeros(1, 1, pos + 1, dh)
    unit[..., j] = 1.0
    rotated = apply_rope(unit, cos[:pos + 1], sin[:pos + 1])[0, 0, pos]
    angle = pos * freqs[j].item()
    assert rotated[j].item() == pytest.approx(math.cos(angle), abs=TOL)
    assert rotated[j + dh // 2].item() == pytest.approx(math.sin(angle), abs=TOL)
    assert rotated.abs().sum().item() == pytest.approx(abs(math.cos(angle)) + abs(math.sin(angle)), abs=TOL)
    # scores depend only on the distance between positions: <q@m, k@n> == <q@m+s, k@n+s>
    q, k = torch.randn(2, 1, 1, 1, dh).unbind(0)

    def at(v, p):
        return apply_rope(v.expand(1, 1, 64, dh), cos[:64], sin[:64])[0, 0, p]
    assert (at(q, 10) @ at(k, 4)).item() == pytest.approx((at(q, 50) @ at(k, 44)).item(), abs=TOL)


# --- training ------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_debug_model_overfits_one_batch(family):
    torch.manual_seed(0)
    model = build_model(family)
    batch = tokens(model, batch=4, seq_len=33)
    inputs, targets = batch[:, :-1], batch[:, 1:]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    losses = []
    for _ in range(30):
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses
