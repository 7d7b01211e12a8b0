"""A Hugging Face folder shaped like the published DeepSeek-V3 ones (deepseek-ai/DeepSeek-V3) imports into
meshpar's deepseek_v3: config.json says ``num_nextn_predict_layers: 1`` and the weights, sharded with
model.safetensors.index.json, carry the multi-token-prediction layer ``model.layers.{num_hidden_layers}.*``
in a shard of its own. ``meshpar convert`` (HFSource) and ``checkpoint.hf_weights`` (load_hf_weights) skip
exactly that layer ([Note: the multi-token-prediction layer on import] in meshpar/models/deepseek/convert.py)
and give transformers' logits; any other extra layer is still an error."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from meshpar.convert import ConvertError, HFSource, convert, load_hf_weights
from meshpar.models.deepseek import DeepSeekTransformer
from meshpar.models.deepseek import convert as ds_convert
from tests.helpers import randomize_deepseek

# deepseek-ai/DeepSeek-V3's config.json with its sizes made tiny (2 layers, the second sparse) and without
# quantization_config (fp8 weights are another matter) or auto_map (remote code this folder does not hold)
PUBLISHED = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "attention_bias": False,
    "attention_dropout": 0.0, "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1,
    "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02,
    "intermediate_size": 128, "kv_lora_rank": 16, "max_position_embeddings": 256, "moe_intermediate_size": 32,
    "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 4, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 4, "num_experts_per_tok": 2, "num_hidden_layers": 2, "num_key_value_heads": 4,
    "num_nextn_predict_layers": 1, "pretraining_tp": 1, "q_lora_rank": 32, "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8, "rms_norm_eps": 1e-6, "rope_scaling": None, "rope_theta": 10000,
    "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True, "tie_word_embeddings": False,
    "topk_group": 1, "topk_method": "noaux_tc", "torch_dtype": "float32", "transformers_version": "4.33.1",
    "use_cache": True, "v_head_dim": 16, "vocab_size": 256,
}
# the multi-token-prediction layer's own tensors, besides a whole decoder layer's: name -> shape
D, V = PUBLISHED["hidden_size"], PUBLISHED["vocab_size"]
MTP_OWN = {"embed_tokens.weight": [V, D], "enorm.weight": [D], "hnorm.weight": [D], "eh_proj.weight": [D, 2 * D],
           "shared_head.norm.weight": [D], "shared_head.head.weight": [V, D]}


def _save_shards(folder, shards: dict[str, dict[str, torch.Tensor]]) -> None:
    """Write ``shards`` ({file: {name: tensor}}) and model.safetensors.index.json into ``folder``, adding to
    the index an existing one's entries."""
    from safetensors.torch import save_file

    index_file = folder / "model.safetensors.index.json"
    weight_map = json.loads(index_file.read_text())["weight_map"] if index_file.exists() else {}
    for file, tensors in shards.items():
        save_file(tensors, folder / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
    total = sum(t.numel() * t.element_size() for ts in shards.values() for t in ts.values())
    index_file.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """(transformers' model, its folder shaped as published): random weights (norms near 1, the routing bias
    too), the main model in two shards, the multi-token-prediction layer model.layers.2.* (a sparse decoder
    layer plus MTP_OWN, random too, so that reading any of it into the main model moves the logits) in a
    third, and the published config.json."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    config = transformers.DeepseekV3Config(**{k: v for k, v in PUBLISHED.items()
                                              if k not in ("architectures", "model_type", "torch_dtype")})
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(config).to(torch.float32).eval()
    randomize_deepseek(model)
    root = tmp_path_factory.mktemp("deepseek")
    model.save_pretrained(root / "saved")
    weights = {}
    for file in sorted((root / "saved").glob("*.safetensors")):
        weights.update(load_file(file))
    n = PUBLISHED["num_hidden_layers"]
    generator = torch.Generator().manual_seed(1)
    mtp = {name.replace(f"model.layers.{n - 1}.", f"model.layers.{n}."): torch.randn(t.shape, generator=generator)
           for name, t in weights.items() if name.startswith(f"model.layers.{n - 1}.")}  # layer n - 1 is sparse
    mtp.update({f"model.layers.{n}.{name}": torch.randn(shape, generator=generator) for name, shape in MTP_OWN.items()})
    folder = root / "published"
    folder.mkdir()
    first = {k: v for k, v in weights.items() if k.startswith("model.embed_tokens") or k.startswith("model.layers.0.")}
    _save_shards(folder, {"model-00001-of-00003.safetensors": first,
                          "model-00002-of-00003.safetensors": {k: v for k, v in weights.items() if k not in first},
                          "model-00003-of-00003.safetensors": mtp})
    (folder / "config.json").write_text(json.dumps(PUBLISHED, indent=2))
    return model, folder


def test_published_folder_imports_skipping_the_mtp_layer(published, tmp_path):
    """Both import paths read the folder, skip the MTP layer and say so, and agree tensor for tensor; the
    model then gives transformers' logits to 2e-5 absolute (fp32, logits of magnitude ~2.5, so ~1e-5
    relative: the sums run in other orders, 1e-6 here). Reading any MTP tensor (random) in place of the
    main model's moves them by 1 or more."""
    ref, folder = published
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    n_mtp = sum(name.startswith("model.layers.2.") for name in weight_map)  # 26 of a sparse layer + 6 own
    source = HFSource(folder)
    assert f"skipped {n_mtp} tensors, model.layers.2.*: the multi-token-prediction layer" in source.note
    assert not any(name.startswith("model.layers.2.") for name in source.where_hf)
    args = source.spec.args
    assert args == ds_convert.args_from_hf_config("deepseek_v3", PUBLISHED) and args.n_layers == 2
    convert(folder, tmp_path / "weights.pt", "torch", verify=True, progress=False)  # `meshpar convert --to torch`
    converted = torch.load(tmp_path / "weights.pt", weights_only=True)
    model = DeepSeekTransformer(args)
    note = load_hf_weights(model.state_dict(), folder, "deepseek_v3", args)  # checkpoint.hf_weights
    assert "skipped 32 tensors, model.layers.2.*: the multi-token-prediction layer" in note  # printed by the run
    assert converted.keys() == model.state_dict().keys()
    for fqn, value in model.state_dict().items():
        assert torch.equal(converted[fqn], value), fqn
    tokens = torch.randint(0, args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want, got = ref(tokens).logits, model.eval()(tokens)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5)


def test_only_the_mtp_layers_config_json_lists_are_skipped(published, tmp_path):
    """A layer beyond the num_nextn_predict_layers MTP layers, or the MTP layer of a config.json that lists
    none, has no place in the model: both import paths raise ConvertError naming it."""
    _, folder = published
    stray = tmp_path / "stray"
    shutil.copytree(folder, stray)
    _save_shards(stray, {"model-extra.safetensors": {"model.layers.3.eh_proj.weight": torch.zeros(D, 2 * D)}})
    none = tmp_path / "none"
    shutil.copytree(folder, none)
    (none / "config.json").write_text(json.dumps({**PUBLISHED, "num_nextn_predict_layers": 0}))
    args = HFSource(folder).spec.args
    for path, name in ((stray, "model.layers.3.eh_proj.weight"), (none, "model.layers.2.eh_proj.weight")):
        with pytest.raises(ConvertError, match=f"tensors .*{name.replace('.', '[.]')}.* have no place"):
            HFSource(path)
        with pytest.raises(ConvertError, match=name.replace(".", "[.]")):
            load_hf_weights(DeepSeekTransformer(args).state_dict(), path, "deepseek_v3", args)
