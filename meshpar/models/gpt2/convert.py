"""Hugging Face <-> meshpar for GPT-2: the key map, the Conv1D transposes and ``config.json`` both ways.

A pure adapter; the streaming machinery is ``meshpar/convert/``. meshpar's GPT-2 already
uses Hugging Face's module names (blocks in ``layers`` instead of ``transformer.h``), so the
map is a prefix; what differs is the orientation of the four projections per block: Hugging
Face's ``Conv1D`` stores weight [in, out], meshpar's ``nn.Linear`` [out, in], so they are
transposed each way (biases and LayerNorms are unchanged). ``lm_head.weight`` is tied to
``wte.weight`` and absent from Hugging Face folders.
"""

from __future__ import annotations

from typing import Any

import torch

from meshpar.models.gpt2.model import GPT2Args
from meshpar.models.gpt2.parallelize import gpt2_tp_plan

TP_PLAN = gpt2_tp_plan

# meshpar name -> Hugging Face name; {i} is a block index.
KEYS: dict[str, str] = {
    "wte.weight": "transformer.wte.weight",
    "wpe.weight": "transformer.wpe.weight",
    **{f"layers.{{i}}.{m}.{p}": f"transformer.h.{{i}}.{m}.{p}"
       for m in ("ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj") for p in ("weight", "bias")},
    "ln_f.weight": "transformer.ln_f.weight",
    "ln_f.bias": "transformer.ln_f.bias",
    "lm_head.weight": "lm_head.weight",  # tied: never written, read from wte
}

# Conv1D weights: [in, out] in Hugging Face, [out, in] here.
TRANSPOSED = frozenset(f"layers.{{i}}.{m}.weight" for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"))

# The causal-mask buffers older GPT-2 checkpoints saved (h.{i}.attn.bias / masked_bias), and a
# tied lm_head saved anyway. OpenAI's original upload has no "transformer." prefix: both read.
IGNORED_HF = (r"(transformer\.)?h\.\d+\.attn\.(masked_)?bias", r"lm_head\.weight")
HF_PREFIX = "transformer."  # names may lack it (OpenAI's original upload): see ``meshpar.convert``


def tied(args: GPT2Args) -> dict[str, str]:
    """meshpar names that hold the same tensor as another name: {copy: source}."""
    return {"lm_head.weight": "wte.weight"}


def args_from_dict(d: dict[str, Any]) -> GPT2Args:
    """GPT2Args from ``dataclasses.asdict`` (meshpar.json's ``model_args``)."""
    return GPT2Args(**d)


def hf_config(family: str, args: GPT2Args, dtype: torch.dtype) -> dict[str, Any]:
    """``config.json`` for GPT2LMHeadModel. Dropouts are 0: meshpar's GPT-2 has none, so training
    the exported model in transformers continues the same function."""
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "n_embd": args.dim,
        "n_layer": args.n_layers,
        "n_head": args.n_heads,
        "n_inner": None,  # 4 * n_embd, as meshpar's MLP
        "n_positions": args.max_seq_len,
        "n_ctx": args.max_seq_len,
        "vocab_size": args.vocab_size,
        "layer_norm_epsilon": args.norm_eps,
        "activation_function": "gelu_new",  # the tanh approximation meshpar's MLP uses
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
        "scale_attn_weights": True,
        "tie_word_embeddings": True,
        "initializer_range": 0.02,
        # <|endoftext|> where the vocabulary is GPT-2's (50257, or padded); meshpar's own BPE has no fixed id
        "bos_token_id": 50256 if args.vocab_size > 50256 else None,
        "eos_token_id": 50256 if args.vocab_size > 50256 else None,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def args_from_hf_config(family: str, config: dict[str, Any]) -> GPT2Args:
    """GPT2Args equivalent to a Hugging Face GPT-2 config."""
    act = config.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ValueError(f"config.json: activation_function '{act}' differs from meshpar's GPT-2 (tanh GELU, "
                         "'gelu_new')")
    dim = config["n_embd"]
    if config.get("n_inner") not in (None, 4 * dim):
        raise ValueError(f"config.json: n_inner = {config['n_inner']}; meshpar's GPT-2 MLP is 4 * n_embd = {4 * dim}")
    return GPT2Args(dim=dim, n_layers=config["n_layer"], n_heads=config["n_head"], vocab_size=config["vocab_size"],
                    max_seq_len=config.get("n_positions", 1024), norm_eps=config.get("layer_norm_epsilon", 1e-5))
