"""Hugging Face <-> meshpar for the DeepSeek-V3 family (``DeepseekV3ForCausalLM``): the key map, the
experts stacked from one tensor each ([Note: stacked experts] in meshpar/convert/spec.py), and
``config.json`` both ways. The adapter interface of meshpar/models/moe/convert.py.

The routing bias is Hugging Face's ``e_score_correction_bias`` (a checkpoint tensor), so unlike the
other MoE families the aux-free bias exports. Not converted: a checkpoint's multi-token-prediction
layers, skipped on import by ``skipped_hf`` ([Note: the multi-token-prediction layer on import]).
"""

from __future__ import annotations

from typing import Any

import torch

from meshpar.models.deepseek.args import DeepSeekArgs, Yarn
from meshpar.models.deepseek.parallelize import deepseek_tp_plan
from meshpar.models.llama import convert as llama

_ATTENTION = {"wq": "q_proj", "wq_a": "q_a_proj", "q_norm": "q_a_layernorm", "wq_b": "q_b_proj",
              "wkv_a": "kv_a_proj_with_mqa", "kv_norm": "kv_a_layernorm", "wkv_b": "kv_b_proj", "wo": "o_proj"}
_SWIGLU = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}

KEYS: dict[str, str] = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "layers.{i}.attention_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "layers.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    **{f"layers.{{i}}.attention.{m}.weight": f"model.layers.{{i}}.self_attn.{h}.weight" for m, h in _ATTENTION.items()},
    **{f"layers.{{i}}.feed_forward.{m}.weight": f"model.layers.{{i}}.mlp.{h}.weight" for m, h in _SWIGLU.items()},
    **{f"layers.{{i}}.moe.shared.{m}.weight": f"model.layers.{{i}}.mlp.shared_experts.{h}.weight"
       for m, h in _SWIGLU.items()},
    "layers.{i}.moe.router.weight": "model.layers.{i}.mlp.gate.weight",
    "layers.{i}.moe.expert_bias": "model.layers.{i}.mlp.gate.e_score_correction_bias",
}
EXPERT_KEYS: dict[str, str] = {f"layers.{{i}}.moe.experts.{m}": f"model.layers.{{i}}.mlp.experts.{{j}}.{h}.weight"
                               for m, h in _SWIGLU.items()}
EXPERTS_KEY = "n_routed_experts"
TRANSPOSED: frozenset[str] = frozenset()
IGNORED_HF = (*llama.IGNORED_HF, r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
TRAINING_ONLY: tuple[str, ...] = ("router_aux_loss_coef", "capacity_factor", "bias_update_rate")
ARCHITECTURES = {"deepseek_v3": "DeepseekV3ForCausalLM"}


TP_PLAN = deepseek_tp_plan


def tied(args: DeepSeekArgs) -> dict[str, str]:
    return llama.tied(args)


# [Note: the multi-token-prediction layer on import]
# DeepSeek-V3's published folders append num_nextn_predict_layers (1) multi-token-prediction layers to
# the main model's num_hidden_layers, stored as model.layers.{n_layers + k}.*: a whole decoder layer
# (self_attn, mlp and its experts, the norms) plus eh_proj, enorm, hnorm, shared_head.{norm,head} and
# embed_tokens. meshpar's deepseek_v3 does not build them (docs/moe.md#deepseek-v3), and the main
# model's logits do not read them, so an import skips every tensor of exactly those layer indices,
# taken from the folder's config.json, and names them in HFSource.note. Any other layer beyond
# num_hidden_layers still has no place in the model and is an error.
def skipped_hf(config: dict[str, Any]) -> dict[str, str]:
    """The Hugging Face tensors a folder with this ``config.json`` holds that the model does not use, as
    {name pattern: what they are}: its multi-token-prediction layers ([Note: the multi-token-prediction
    layer on import]); none where ``num_nextn_predict_layers`` is 0 or absent."""
    n, mtp = int(config["num_hidden_layers"]), int(config.get("num_nextn_predict_layers") or 0)
    if mtp < 0:
        raise ValueError(f"num_nextn_predict_layers = {mtp} is negative")
    if not mtp:
        return {}
    layers = range(n, n + mtp)
    what = ", ".join(f"model.layers.{i}.*" for i in layers)
    return {rf"model\.layers\.({'|'.join(map(str, layers))})\..+":
            f"{what}: the multi-token-prediction layer{'s' if mtp > 1 else ''} (num_nextn_predict_layers = {mtp}), "
            "which meshpar's deepseek_v3 does not build"}


def args_from_dict(d: dict[str, Any]) -> DeepSeekArgs:
    """DeepSeekArgs from ``dataclasses.asdict`` (meshpar.json's ``model_args``)."""
    yarn = d.get("yarn")
    return DeepSeekArgs(**{**d, "rope_scaling": None, "mlp_only_layers": tuple(d.get("mlp_only_layers", ())),
                           "yarn": Yarn(**yarn) if yarn else None})


def hf_config(family: str, args: DeepSeekArgs, dtype: torch.dtype) -> dict[str, Any]:
    yarn = args.yarn
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "hidden_size": args.dim, "intermediate_size": args.ffn_dim, "moe_intermediate_size": args.moe_ffn_dim,
        "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_heads,
        "q_lora_rank": args.q_lora_rank or None, "kv_lora_rank": args.kv_lora_rank,
        "qk_nope_head_dim": args.qk_nope_head_dim, "qk_rope_head_dim": args.qk_rope_head_dim,
        "v_head_dim": args.v_head_dim, "n_routed_experts": args.n_experts, "n_shared_experts": args.n_shared_experts,
        "num_experts_per_tok": args.top_k, "first_k_dense_replace": args.first_k_dense, "n_group": args.n_group,
        "topk_group": args.topk_group, "routed_scaling_factor": args.routed_scaling_factor,
        "norm_topk_prob": args.norm_topk_prob, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
        "hidden_act": "silu", "max_position_embeddings": args.max_seq_len, "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta, "rope_interleave": True, "attention_bias": False,
        "rope_scaling": None if yarn is None else {
            "type": "yarn", "rope_type": "yarn", "factor": yarn.factor,
            "original_max_position_embeddings": yarn.original_max_seq_len, "beta_fast": yarn.beta_fast,
            "beta_slow": yarn.beta_slow, "mscale": yarn.mscale, "mscale_all_dim": yarn.mscale_all_dim},
        "vocab_size": args.vocab_size, "tie_word_embeddings": args.tie_embeddings, "aux_loss_alpha":
            args.router_aux_loss_coef, "seq_aux": args.balance_loss == "sequence", "num_nextn_predict_layers": 0,
        "attention_dropout": 0.0,
        "initializer_range": 0.02, "torch_dtype": str(dtype).removeprefix("torch."),
    }


def args_from_hf_config(family: str, config: dict[str, Any]) -> DeepSeekArgs:
    """DeepSeekArgs equivalent to a Hugging Face DeepseekV3Config dict (config.json, or transformers 5's
    ``to_dict`` with ``rope_parameters``)."""
    if config.get("scoring_func", "sigmoid") != "sigmoid" or config.get("topk_method", "noaux_tc") != "noaux_tc":
        raise ValueError("config.json: meshpar's deepseek_v3 routes with sigmoid scores and the aux-free bias "
                         f"(scoring_func 'sigmoid', topk_method 'noaux_tc'), not {config.get('scoring_func')!r} / "
                         f"{config.get('topk_method')!r}")
    if config.get("rope_interleave") is False:
        raise ValueError("config.json: rope_interleave = false is not built (DeepSeek's checkpoints interleave)")
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    yarn = None
    if scaling:
        if scaling.get("rope_type", scaling.get("type")) != "yarn":
            raise ValueError(f"config.json: RoPE scaling {scaling!r} is not YaRN, which is the one meshpar's "
                             "deepseek_v3 implements")
        yarn = Yarn(factor=float(scaling["factor"]),
                    original_max_seq_len=int(scaling["original_max_position_embeddings"]),
                    beta_fast=float(scaling.get("beta_fast") or 32), beta_slow=float(scaling.get("beta_slow") or 1),
                    mscale=float(scaling.get("mscale") or 0), mscale_all_dim=float(scaling.get("mscale_all_dim") or 0))
    rope = int(config["qk_rope_head_dim"])
    return DeepSeekArgs(
        dim=config["hidden_size"], n_layers=config["num_hidden_layers"], n_heads=config["num_attention_heads"],
        n_kv_heads=config["num_attention_heads"], head_dim=rope, ffn_dim=config["intermediate_size"],
        vocab_size=config["vocab_size"], norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=float(params.get("rope_theta", config.get("rope_theta", 10000.0))),
        max_seq_len=config["max_position_embeddings"], tie_embeddings=bool(config.get("tie_word_embeddings")),
        n_experts=config.get("n_routed_experts") or config["num_local_experts"], top_k=config["num_experts_per_tok"],
        moe_ffn_dim=config["moe_intermediate_size"], norm_topk_prob=bool(config.get("norm_topk_prob", True)),
        router_aux_loss_coef=config.get("aux_loss_alpha", 0.001), aux_free_bias=True,
        balance_loss="sequence" if config.get("seq_aux", True) else "forward",
        q_lora_rank=config.get("q_lora_rank") or 0, kv_lora_rank=config["kv_lora_rank"],
        qk_nope_head_dim=config["qk_nope_head_dim"], qk_rope_head_dim=rope, v_head_dim=config["v_head_dim"],
        n_shared_experts=config.get("n_shared_experts") or 0, first_k_dense=config.get("first_k_dense_replace", 0),
        n_group=config.get("n_group") or 1, topk_group=config.get("topk_group") or 1,
        routed_scaling_factor=float(config.get("routed_scaling_factor", 1.0)), yarn=yarn)

