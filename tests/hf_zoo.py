"""The transformers zoo for ``model.family = "hf"``: every model type registered in transformers'
``AutoModelForCausalLM`` mapping, a tiny random config of each, and the rule that skips the types
that are not text-only decoders (tests/test_hf_zoo.py sweeps them; docs/huggingface.md lists the
state of each).

A tiny config is the type's own config class with its size fields made small (``TINY``, applied to
whichever of them the class has; ``SHRINK``, applied where the class's default is larger) and a few
per-type fixes (``TINY_BY_TYPE``): 2 decoder layers of width 64, 4 heads, a 256-token vocabulary, 4
experts where there are experts. Where the class lists a kind per layer (``layer_types``,
``mlp_layer_types``, ...) the tiny model keeps one layer of each kind (2 to 4 layers), so that a
hybrid keeps its attention layers; fields that the class derives from one another are kept
consistent (an alias sets its target; MLA: ``head_dim`` is ``qk_rope_head_dim`` and one K/V head
per query head, as in the class's defaults).
"""

from __future__ import annotations

from typing import Any

TINY: dict[str, Any] = {  # a size field -> its tiny value, set where the config class has the field
    "vocab_size": 256, "hidden_size": 64, "d_model": 64, "n_embd": 64, "intermediate_size": 128,
    "ffn_dim": 128, "n_inner": 128, "ffn_hidden_size": 128, "num_hidden_layers": 2, "n_layer": 2,
    "num_layers": 2, "n_layers": 2, "num_attention_heads": 4, "n_head": 4, "n_heads": 4, "num_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256, "n_positions": 256,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "num_experts": 4,
    "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4, "num_experts_per_tok": 2,
    "n_shared_experts": 1, "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8, "v_head_dim": 16, "qk_head_dim": 16, "sliding_window": 32,
    "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
}
SHRINK: dict[str, int] = {  # more size fields -> a tiny value, set where the class's default is larger
    "dense_intermediate_size": 128, "first_dense_intermediate_size": 128, "shared_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 32, "mlp_only_intermediate_size": 128, "dim_ff": 128, "dff": 128,
    "decoder_ffn_dim": 128, "d_inner": 128, "unpadded_vocab_size": 256, "dim_head": 16, "linear_head_dim": 16,
    "linear_key_head_dim": 16, "linear_value_head_dim": 16, "index_head_dim": 16, "swa_head_dim": 16,
    "mamba_d_ssm": 128, "mamba_n_heads": 8, "mamba_num_heads": 8, "mamba_head_dim": 16, "mamba_d_state": 16,
    "ssm_state_size": 16, "mamba_chunk_size": 32,  # Mamba-2 heads: mamba_n_heads * head dim = 2 * hidden_size
}
TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id", "cls_token_id",
             "decoder_start_token_id")
TINY_BY_TYPE: dict[str, dict[str, Any]] = {  # model type -> the fields its config class needs on top of TINY
    # its sliding layers take their (large) sizes from the swa_* fields; indexer sizes
    "dots3_note_text": {"index_head_dim": 16, "index_n_heads": 4, "swa_num_attention_heads": 4,
                        "swa_num_key_value_heads": 4, "swa_q_lora_rank": 32, "swa_kv_lora_rank": 16, "swa_head_dim": 16,
                        "swa_qk_nope_head_dim": 8, "swa_v_head_dim": 16},
    # sub-configs; the modeling reads attn_config.rope_theta (DbrxAttentionConfig has no default) and
    # clamps with clip_qkv (None fails)
    "dbrx": {"attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
             "ffn_config": {"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2}},
    # a looped model: n_input_layers + n_recurrent_layers (run n_recurrent_loops times) + n_output_layers
    "dory": {"num_hidden_layers": 3, "n_input_layers": 1, "n_output_layers": 1, "n_recurrent_loops": 2,
             "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
    # the shared transformer block is tied across the hybrid layers: at least 2 of them
    "zamba": {"num_hidden_layers": 3, "layers_block_type": ["linear_attention", "hybrid", "hybrid"]},
    "zamba2": {"num_hidden_layers": 3, "layers_block_type": ["linear_attention", "hybrid", "hybrid"]},
    # hybrids whose default (or truncated) layout has no attention layer: one layer of each kind
    "bamba": {"attn_layer_indices": [1]},
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 0},
    "recurrent_gemma": {"block_types": ["recurrent", "attention"]},
    # hidden_size * expand must equal num_heads * head_dim; a small SSM state
    "mamba2": {"num_heads": 8, "state_size": 16},
    # the indexed-attention layers need the QSA indexer fields (no defaults)
    "qwen4_exp_text": {"indexer_n_heads": 4, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 32,
                       "indexer_compress_ratio": 4, "hc_lowrank": 32},
    # rotary dims within the head dim (hidden 64 / 4 heads)
    "codegen": {"rotary_dim": 8},
    "gptj": {"rotary_dim": 8},
    # RoPE parameters per layer type (none by default)
    "cohere_compass_text": {"layer_types": ["sliding_attention", "full_attention"], "rope_parameters": {
        t: {"rope_type": "default", "rope_theta": 10000.0} for t in ("sliding_attention", "full_attention")}},
    # index_num_heads must be at most the query heads per K/V head (4 / 2)
    "kolibri1_1": {"index_num_heads": 2},
    # layer_types has no default; one conv and one attention layer, the first dense and the second MoE
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    # hidden_size * qk_dim_factor must be a multiple of 64 (the model rounds qk_dim up to one, its states do not)
    "xlstm": {"hidden_size": 128},
    # top-1 routing only; one layer of each kind
    "zaya": {"num_experts_per_tok": 1, "layer_types": ["hybrid", "hybrid_sliding"]},
    # the last num_kv_shared_layers layers reuse the K/V of an earlier layer of their type: both types
    # before them; per-layer inputs and activation sparsity (first layer) made small
    "gemma3n_text": {"num_hidden_layers": 4, "num_kv_shared_layers": 2, "vocab_size_per_layer_input": 256,
                     "layer_types": ["sliding_attention", "full_attention"] * 2, "hidden_size_per_layer_input": 16,
                     "laurel_rank": 8, "activation_sparsity_pattern": [0.95, 0.0, 0.0, 0.0]},
    # full-attention layers take their head dim from global_head_dim (512 by default); per-layer inputs small
    "gemma4_text": {"global_head_dim": 32, "vocab_size_per_layer_input": 256, "hidden_size_per_layer_input": 16},
    "gemma4_unified_text": {"global_head_dim": 32},
    # attention-residual blocks of 1 layer (6 by default: one partial block of 2 layers); the loop model loops its
    # middle layer (the loop bounds are multiples of the block size)
    "inkling2_text": {"n_layers_per_attn_res_block": 1},
    "inkling2_loop_text": {"num_hidden_layers": 3, "layer_types": ["hybrid_sliding", "hybrid", "hybrid_sliding"],
                           "n_layers_per_attn_res_block": 1, "loop_layer_index_start": 1, "loop_layer_index_end": 2,
                           "loop_num_passes": 2, "loop_gate_rank": 8},
    # zero (identity) experts next to the routed ones: 256 by default
    "longcat_flash": {"zero_expert_num": 2},
}
LAYER_COUNTS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")  # the layer-count fields


def causal_lm_types() -> list[str]:
    """Every model type of transformers' AutoModelForCausalLM mapping, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def skip_rule(model_type: str) -> str | None:
    """Why ``model_type`` is not a text-only decoder (so not swept), or None. The rule, stated once:
    an encoder-decoder config (``is_encoder_decoder``), an encoder (the type has a masked-LM head in
    transformers: its causal LM is the encoder run with ``is_decoder``), or a composite config (a
    ``text_config``, or a sub-config that is a registered model of its own: multimodal or several
    models in one)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    cls = CONFIG_MAPPING[model_type]
    subs = getattr(cls, "sub_configs", None) or {}
    if "text_config" in subs or any(getattr(s, "model_type", "") in CONFIG_MAPPING for s in subs.values()):
        return "composite (multimodal)"
    if cls().to_dict().get("is_encoder_decoder"):
        return "encoder-decoder"
    if model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return "encoder"
    return None


def _per_layer_kinds(defaults: dict[str, Any]) -> dict[str, list[str]]:
    """The config's per-layer kind lists (its lists of strings with one entry per layer, e.g.
    ``layer_types``, ``mlp_layer_types``, ``layers_block_type``), cut down to a few layers: the first
    layer that brings a new kind to any of them, in the original order (so a hybrid model keeps one
    layer of each kind), and at least 2 layers. Empty where the config has no such list."""
    n = next((defaults[k] for k in LAYER_COUNTS if isinstance(defaults.get(k), int)), 0)
    lists = {k: v for k, v in defaults.items()
             if isinstance(v, list) and n and len(v) == n and all(isinstance(x, str) for x in v)}
    if not lists:
        return {}
    keep: list[int] = []
    seen: set[tuple[str, str]] = set()
    for i in range(n):
        kinds = {(k, v[i]) for k, v in lists.items()}
        if not kinds <= seen:
            keep.append(i)
            seen |= kinds
    keep += [i for i in range(n) if i not in keep][:max(0, 2 - len(keep))]
    keep.sort()
    return {k: [v[i] for i in keep] for k, v in lists.items()}


def tiny_config(model_type: str) -> Any:
    """A tiny random-init config of ``model_type`` (a transformers PretrainedConfig)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    defaults = cls().to_dict()
    aliases = getattr(cls, "attribute_map", None) or {}
    kwargs = {k: v for k, v in TINY.items() if k in defaults and k not in aliases}
    kwargs.update({k: v for k, v in SHRINK.items() if isinstance(defaults.get(k), int) and defaults[k] > v})
    for k, target in aliases.items():  # an alias sets its target, unless a TINY field sets it already
        if k in TINY and target in defaults and target not in kwargs:
            kwargs[target] = TINY[k]
    if "head_dim" in kwargs and "qk_rope_head_dim" in kwargs and defaults["head_dim"] == defaults["qk_rope_head_dim"]:
        kwargs["head_dim"] = kwargs["qk_rope_head_dim"]  # MLA: the rotary head dim is the config's head_dim
    if "kv_lora_rank" in kwargs and defaults.get("num_key_value_heads") == defaults.get("num_attention_heads"):
        kwargs["num_key_value_heads"] = kwargs.get("num_attention_heads")  # MLA: one K/V head per query head
    for k in TOKEN_IDS:
        if isinstance(defaults.get(k), int) and defaults[k] >= kwargs.get("vocab_size", 256):
            kwargs[k] = {"pad_token_id": 0, "bos_token_id": 1}.get(k, 2)
    kwargs.update({k: 0.0 for k, v in defaults.items()  # dropout off: a loss that depends on the RNG has no reference
                   if isinstance(v, float) and ("dropout" in k or "pdrop" in k or "jitter" in k)})
    kinds = _per_layer_kinds(defaults)
    if kinds:
        kwargs.update(kinds)
        n = len(next(iter(kinds.values())))
        kwargs.update({k: n for k in LAYER_COUNTS if k in kwargs})
    kwargs.update(TINY_BY_TYPE.get(model_type, {}))
    return cls(**kwargs)
