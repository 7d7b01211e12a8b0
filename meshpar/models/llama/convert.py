"""Hugging Face <-> meshpar for the Llama family (Llama 3.x, Qwen2, Qwen3): the key map, the
``config.json`` both ways, and the rotary layouts.

A pure adapter: names and configurations only. The streaming machinery that applies it to
checkpoints is ``meshpar/convert/``. Every weight is an ``nn.Linear`` / ``nn.Embedding`` /
RMSNorm on both sides, stored [out, in], so no tensor changes on the way: see
[Note: RoPE layout and conversion].

Limits: Llama configs with ``attention_bias`` (a bias on o_proj too) or ``mlp_bias``, and RoPE
scaling types other than ``llama3``, have no meshpar equivalent and are refused by name.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from meshpar.models.llama.args import ModelArgs, RopeScaling
from meshpar.models.llama.parallelize import llama_tp_plan

# [Note: RoPE layout and conversion]
# meshpar's Llama rotates element j of each head with element j + Dh/2 ([Note: RoPE layout]
# in meshpar/models/llama/model.py), the "rotate_half" layout Hugging Face's Llama, Qwen2 and
# Qwen3 use. So wq and wk convert by renaming alone: no row permutation in either direction
# (the logits test in tests/test_convert.py proves it against transformers). Meta's original
# Llama checkpoints (consolidated.*.pth) rotate adjacent pairs (2j, 2j + 1); for those,
# ``interleaved_to_half`` / ``half_to_interleaved`` permute the rows of wq (n_heads) and wk
# (n_kv_heads), the permutation of Hugging Face's convert_llama_weights_to_hf.py. They are
# helpers, tested, and not wired into a converter: meshpar reads Hugging Face folders.

TP_PLAN = llama_tp_plan

# meshpar name -> Hugging Face name; {i} is a block index.
KEYS: dict[str, str] = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "layers.{i}.attention.wq.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "layers.{i}.attention.wk.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "layers.{i}.attention.wv.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "layers.{i}.attention.wq.bias": "model.layers.{i}.self_attn.q_proj.bias",  # Qwen2
    "layers.{i}.attention.wk.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "layers.{i}.attention.wv.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "layers.{i}.attention.q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",  # Qwen3
    "layers.{i}.attention.k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    "layers.{i}.attention.wo.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "layers.{i}.attention_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "layers.{i}.feed_forward.w1.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "layers.{i}.feed_forward.w3.weight": "model.layers.{i}.mlp.up_proj.weight",
    "layers.{i}.feed_forward.w2.weight": "model.layers.{i}.mlp.down_proj.weight",
    "layers.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",  # absent from Hugging Face folders when tied
}

TRANSPOSED: frozenset[str] = frozenset()  # nn.Linear on both sides: no weight changes orientation

# Hugging Face tensors that carry nothing meshpar keeps: old checkpoints' RoPE buffers, and
# lm_head.weight saved although tied (meshpar takes the embedding then).
IGNORED_HF = (r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq", r"lm_head\.weight")

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def tied(args: ModelArgs) -> dict[str, str]:
    """meshpar names that hold the same tensor as another name: {copy: source}."""
    return {"output.weight": "tok_embeddings.weight"} if args.tie_embeddings else {}


def args_from_dict(d: dict[str, Any]) -> ModelArgs:
    """ModelArgs from ``dataclasses.asdict`` (meshpar.json's ``model_args``)."""
    d = dict(d)
    if d.get("rope_scaling") is not None:
        d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
    return ModelArgs(**d)


def hf_config(family: str, args: ModelArgs, dtype: torch.dtype) -> dict[str, Any]:
    """``config.json`` for LlamaForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM.

    RoPE is written with the keys every transformers release reads (``rope_theta``,
    ``rope_scaling``); transformers 5 turns them into ``rope_parameters`` itself.
    """
    scaling = args.rope_scaling
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[family]],
        "model_type": family,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.resolved_head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": None if scaling is None else {
            "rope_type": "llama3", "factor": scaling.factor, "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_seq_len},
        "vocab_size": args.vocab_size,
        "tie_word_embeddings": args.tie_embeddings,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if family == "llama":
        config.update(attention_bias=False, mlp_bias=False)
    elif family == "qwen2":  # Qwen2 always has q/k/v biases; there is no attention_bias key
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=args.n_layers)
    else:
        config.update(attention_bias=False, use_sliding_window=False, sliding_window=None)
    return config


def _rope(config: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from either the legacy keys or transformers 5's ``rope_parameters``."""
    params = config.get("rope_parameters") or {}
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    scaling = config.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    if not scaling or scaling.get("rope_type", scaling.get("type")) in (None, "default"):
        return float(theta), None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind != "llama3":
        raise ValueError(f"config.json: RoPE scaling type '{kind}' has no meshpar equivalent (meshpar implements "
                         "Llama 3.1's 'llama3' scaling only); remove rope_scaling or convert another model")
    return float(theta), RopeScaling(factor=scaling["factor"], low_freq_factor=scaling["low_freq_factor"],
                                     high_freq_factor=scaling["high_freq_factor"],
                                     original_max_seq_len=scaling["original_max_position_embeddings"])


def args_from_hf_config(family: str, config: dict[str, Any]) -> ModelArgs:
    """ModelArgs equivalent to a Hugging Face config of ``family`` (its ``model_type``)."""
    for key in ("attention_bias", "mlp_bias"):
        if family != "qwen2" and config.get(key):
            raise ValueError(f"config.json: {key} = true puts biases where meshpar's {family} has none "
                             "(meshpar supports q/k/v biases only, as Qwen2 has them)")
    n_heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or 0
    if family != "qwen3" and head_dim == config["hidden_size"] // n_heads:
        head_dim = 0  # meshpar's canonical form: dim // n_heads (Qwen3 sizes state it explicitly)
    theta, scaling = _rope(config)
    return ModelArgs(dim=config["hidden_size"], n_layers=config["num_hidden_layers"], n_heads=n_heads,
                     n_kv_heads=config.get("num_key_value_heads") or n_heads, head_dim=head_dim,
                     ffn_dim=config["intermediate_size"], vocab_size=config["vocab_size"],
                     norm_eps=config.get("rms_norm_eps", 1e-6), rope_theta=theta, rope_scaling=scaling,
                     max_seq_len=config.get("max_position_embeddings", 2048), qkv_bias=family == "qwen2",
                     qk_norm=family == "qwen3", tie_embeddings=bool(config.get("tie_word_embeddings", False)))


def interleaved_to_half(w: Tensor, n_heads: int) -> Tensor:
    """Rows of wq / wk [n_heads * Dh, D] from Meta's adjacent-pair RoPE layout to the half-split one
    meshpar and Hugging Face use ([Note: RoPE layout and conversion]): per head, rows
    (0, 1, 2, 3, ...) -> (0, 2, 4, ..., 1, 3, 5, ...)."""
    dh = w.shape[0] // n_heads
    return w.reshape(n_heads, dh // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def half_to_interleaved(w: Tensor, n_heads: int) -> Tensor:
    """The inverse of ``interleaved_to_half``: half-split rows back to Meta's adjacent pairs."""
    dh = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, dh // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
