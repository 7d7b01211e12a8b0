"""Hugging Face <-> meshpar for the gpt-oss family (``GptOssForCausalLM``): the key map, ``config.json``
both ways, and whole in-memory state dicts (MXFP4 experts dequantised on the way in).

A pure adapter with the interface of meshpar/models/moe/convert.py (see meshpar/convert/spec.py).
transformers stores gpt-oss's experts stacked, as meshpar does (``mlp.experts.gate_up_proj``
[E, D, 2F] ...), so every tensor converts by renaming alone: no ``EXPERT_KEYS``, nothing transposed;
the streaming converter and ``load_hf_weights`` read and write such folders as they stand.

Folders of the published checkpoints (openai/gpt-oss-20b, -120b) hold the experts' two matrices as
MXFP4 ``*_blocks`` / ``*_scales`` (meshpar/models/gpt_oss/mxfp4.py); ``QUANTIZED`` says so, and the
streaming converter and ``load_hf_weights`` decode them ([Note: quantised tensors on import] in
meshpar/convert/spec.py), in config.json's dtype and the parameter's respectively; ``from_hf`` in the
dtype of their bias. Export (``--to hf``, ``to_hf``) writes them plain, in the checkpoint's dtype.

Limits: the aux-free routing bias has no Hugging Face equivalent, so such a model is refused for
export (``hf_export_error``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from meshpar.models.gpt_oss.args import FULL, SLIDING, GptOssArgs, Yarn
from meshpar.models.gpt_oss.mxfp4 import dequantize_mxfp4
from meshpar.models.gpt_oss.parallelize import gpt_oss_tp_plan

_ATTENTION = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj"}
_EXPERTS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")  # the same names on both sides

# meshpar name -> Hugging Face name; {i} is a block index.
KEYS: dict[str, str] = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "layers.{i}.attention_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "layers.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    **{f"layers.{{i}}.attention.{m}.{p}": f"model.layers.{{i}}.self_attn.{h}.{p}"
       for m, h in _ATTENTION.items() for p in ("weight", "bias")},
    "layers.{i}.attention.sinks.weight": "model.layers.{i}.self_attn.sinks",
    "layers.{i}.moe.router.weight": "model.layers.{i}.mlp.router.weight",
    "layers.{i}.moe.router.bias": "model.layers.{i}.mlp.router.bias",
    **{f"layers.{{i}}.moe.experts.{p}": f"model.layers.{{i}}.mlp.experts.{p}" for p in _EXPERTS},
}
EXPERT_KEYS: dict[str, str] = {}  # stacked in Hugging Face folders too: renamed like any tensor
# meshpar name -> (the MXFP4 tensors a published folder stores it as, their decoder): blocks [E, R, G, 16]
# and scales [E, R, G], dim 0 the expert as the parameter's ([Note: quantised tensors on import])
QUANTIZED: dict[str, tuple[tuple[str, str], Callable[..., Tensor]]] = {
    f"layers.{{i}}.moe.experts.{p}": ((f"model.layers.{{i}}.mlp.experts.{p}_blocks",
                                       f"model.layers.{{i}}.mlp.experts.{p}_scales"), dequantize_mxfp4)
    for p in ("gate_up_proj", "down_proj")
}
EXPERTS_KEY = "num_local_experts"
TRANSPOSED: frozenset[str] = frozenset()
IGNORED_HF: tuple[str, ...] = (r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",)
# model_args that shape training, not the weights (load_hf_weights lets them differ from config.json's)
TRAINING_ONLY: tuple[str, ...] = ("router_aux_loss_coef", "capacity_factor", "aux_free_bias", "bias_update_rate")
ZERO_INIT: tuple[str, ...] = (r"layers\.\d+\.moe\.expert_bias",)  # the aux-free bias, absent from HF folders
ARCHITECTURES = {"gpt_oss": "GptOssForCausalLM"}

TP_PLAN = gpt_oss_tp_plan


def tied(args: GptOssArgs) -> dict[str, str]:
    return {}  # gpt-oss's output is its own matrix


def hf_export_error(args: GptOssArgs) -> str | None:
    """Why a model with these args cannot become a Hugging Face folder (None: it can)."""
    if args.aux_free_bias:
        return ("model_args.aux_free_bias is true: its per-expert routing bias changes which experts a token picks "
                "and GptOssForCausalLM has no such bias, so the exported model would route differently; convert to "
                "dcp or torch instead, or train with aux_free_bias = false")
    return None


def _default_layer_types(n_layers: int) -> tuple[str, ...]:
    return tuple(SLIDING if i % 2 == 0 else FULL for i in range(n_layers))


def args_from_dict(d: dict[str, Any]) -> GptOssArgs:
    """GptOssArgs from ``dataclasses.asdict`` (meshpar.json's ``model_args``)."""
    yarn = d.get("yarn")
    return GptOssArgs(**{**d, "rope_scaling": None, "mlp_only_layers": tuple(d.get("mlp_only_layers", ())),
                         "layer_types": tuple(d.get("layer_types", ())), "yarn": Yarn(**yarn) if yarn else None})


def hf_config(family: str, args: GptOssArgs, dtype: torch.dtype) -> dict[str, Any]:
    """``config.json`` for GptOssForCausalLM; RoPE with the keys every transformers release reads
    (``rope_theta``, ``rope_scaling``)."""
    yarn = args.yarn
    return {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
        "hidden_size": args.dim, "intermediate_size": args.moe_ffn_dim, "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.resolved_head_dim, "num_local_experts": args.n_experts, "num_experts_per_tok": args.top_k,
        "sliding_window": args.sliding_window, "layer_types": [args.layer_type(i) for i in range(args.n_layers)],
        "max_position_embeddings": args.max_seq_len, "rms_norm_eps": args.norm_eps, "rope_theta": args.rope_theta,
        "rope_scaling": None if yarn is None else {
            "rope_type": "yarn", "factor": yarn.factor, "beta_fast": yarn.beta_fast, "beta_slow": yarn.beta_slow,
            "truncate": yarn.truncate, "original_max_position_embeddings": yarn.original_max_seq_len},
        "swiglu_alpha": args.swiglu_alpha, "swiglu_limit": args.swiglu_limit, "attention_bias": True,
        "attention_dropout": 0.0, "hidden_act": "silu", "vocab_size": args.vocab_size, "tie_word_embeddings": False,
        "router_aux_loss_coef": args.router_aux_loss_coef, "output_router_logits": False, "initializer_range": 0.02,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def _yarn(config: dict[str, Any]) -> tuple[float, Yarn | None]:
    """(rope_theta, YaRN) from the legacy keys or transformers 5's ``rope_parameters``."""
    params = config.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", config.get("rope_theta", 150000.0)))
    scaling = config.get("rope_scaling") or params
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return theta, None
    if kind != "yarn":
        raise ValueError(f"config.json: RoPE scaling type '{kind}' is not built for gpt_oss (meshpar builds 'yarn')")
    for key in ("attention_factor", "mscale", "mscale_all_dim"):
        if scaling.get(key) is not None:
            raise ValueError(f"config.json: YaRN's {key} is not built for gpt_oss (its factor on cos and sin is "
                             "0.1 ln(factor) + 1); remove it or convert a published gpt-oss config")
    return theta, Yarn(factor=float(scaling["factor"]),
                       original_max_seq_len=int(scaling["original_max_position_embeddings"]),
                       beta_fast=float(scaling.get("beta_fast") or 32.0),
                       beta_slow=float(scaling.get("beta_slow") or 1.0),
                       truncate=bool(scaling.get("truncate", True)))  # transformers' default when the key is absent


def args_from_hf_config(family: str, config: dict[str, Any]) -> GptOssArgs:
    """GptOssArgs equivalent to a Hugging Face GptOssConfig dict (config.json, or transformers 5's
    ``to_dict``). A published folder's ``quantization_config`` (MXFP4 experts) describes how the
    weights are stored, not the model: the args are those of the dequantised model."""
    quant = (config.get("quantization_config") or {}).get("quant_method")
    if quant not in (None, "mxfp4"):
        raise ValueError(f"config.json: quantization '{quant}' is not read for gpt_oss (meshpar dequantises mxfp4)")
    if config.get("attention_bias") is False:
        raise ValueError("config.json: attention_bias = false; meshpar's gpt_oss has biases on q, k, v and o")
    if config.get("sliding_window") is None:
        raise ValueError("config.json: sliding_window is null; gpt-oss's sliding layers need their window")
    n_layers, n_heads = config["num_hidden_layers"], config["num_attention_heads"]
    layer_types = tuple(config.get("layer_types") or _default_layer_types(n_layers))
    theta, yarn = _yarn(config)
    return GptOssArgs(
        dim=config["hidden_size"], n_layers=n_layers, n_heads=n_heads,
        n_kv_heads=config.get("num_key_value_heads") or n_heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // n_heads,
        ffn_dim=config["intermediate_size"], moe_ffn_dim=config["intermediate_size"],
        vocab_size=config["vocab_size"], norm_eps=config.get("rms_norm_eps", 1e-5), rope_theta=theta, yarn=yarn,
        max_seq_len=config["max_position_embeddings"], n_experts=config["num_local_experts"],
        top_k=config["num_experts_per_tok"], sliding_window=config["sliding_window"],
        layer_types=() if layer_types == _default_layer_types(n_layers) else layer_types,
        swiglu_alpha=config.get("swiglu_alpha", 1.702), swiglu_limit=config.get("swiglu_limit", 7.0),
        router_aux_loss_coef=config.get("router_aux_loss_coef", 0.001))


def _template(fqn: str) -> tuple[str | None, str]:
    """(block index or None, the name with {i} in its place)."""
    m = re.match(r"layers\.(\d+)\.(.+)", fqn)
    return (m.group(1), f"layers.{{i}}.{m.group(2)}") if m else (None, fqn)


_TO_MESHPAR = {hf: mp for mp, hf in KEYS.items()}


def to_hf(state_dict: Mapping[str, Tensor], args: GptOssArgs) -> dict[str, Tensor]:
    """meshpar state dict -> Hugging Face names (the same tensors); the aux-free bias, which has no
    Hugging Face equivalent, left out."""
    out = {}
    for fqn, t in state_dict.items():
        i, template = _template(fqn)
        if template == "layers.{i}.moe.expert_bias":
            continue
        if template not in KEYS:
            raise KeyError(f"tensor '{fqn}' has no Hugging Face name in meshpar/models/gpt_oss/convert.py KEYS")
        out[KEYS[template].replace("{i}", i or "")] = t
    return out


def from_hf(hf: Mapping[str, Tensor], args: GptOssArgs) -> dict[str, Tensor]:
    """A Hugging Face checkpoint's tensors -> a meshpar state dict (the same tensors; the aux-free bias
    zero where the args use it). MXFP4 experts (``{name}_blocks`` and ``{name}_scales``, as published)
    are dequantised in the dtype of their bias. Raises KeyError naming a tensor without a place."""
    hf = dict(hf)
    for name in [n for n in hf if n.endswith("_blocks")]:
        stem = name.removesuffix("_blocks")
        hf[stem] = dequantize_mxfp4(hf.pop(name), hf.pop(f"{stem}_scales"), hf[f"{stem}_bias"].dtype)
    out = {}
    for name, t in hf.items():
        m = re.match(r"model\.layers\.(\d+)\.(.+)", name)
        template = f"model.layers.{{i}}.{m.group(2)}" if m else name
        if template not in _TO_MESHPAR:
            if any(re.fullmatch(p, name) for p in IGNORED_HF):
                continue
            raise KeyError(f"Hugging Face tensor '{name}' has no place in meshpar's gpt_oss")
        out[_TO_MESHPAR[template].replace("{i}", m.group(1) if m else "")] = t
    if args.aux_free_bias:  # its value at initialization
        out.update({f"layers.{i}.moe.expert_bias": torch.zeros(args.n_experts) for i in range(args.n_layers)})
    return out

