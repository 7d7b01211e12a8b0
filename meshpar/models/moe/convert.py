"""Hugging Face <-> meshpar for the mixture-of-experts families (Qwen3-MoE, Mixtral): the key maps,
the expert stacking, and ``config.json`` both ways.

A pure adapter with the dense families' interface (``KEYS``, ``TRANSPOSED``, ``IGNORED_HF``,
``ARCHITECTURES``, ``tied``, ``args_from_dict``, ``hf_config``, ``args_from_hf_config``, ``TP_PLAN``;
see meshpar/convert/spec.py), one object per family since their Hugging Face names differ, plus what
the dense families do not need: Hugging Face checkpoints store each expert's projections as its own
tensor (``...experts.{j}.gate_proj.weight`` [F, D]), meshpar one stacked tensor per layer
(``layers.{i}.moe.experts.w1`` [E, F, D]). ``EXPERT_KEYS`` names them, and the streaming converter
(``meshpar convert``, meshpar/convert/) stacks and unstacks one layer's one projection at a time
([Note: stacked experts] in meshpar/convert/spec.py); ``EXPERTS_KEY`` is the config.json key its
errors name. ``to_hf`` / ``from_hf`` map whole in-memory state dicts (every tensor keeps its
[out, in] orientation).

Limits: the aux-free routing bias (``aux_free_bias``) has no Hugging Face equivalent, so such a
model is refused for export (``hf_export_error``); transformers 5 loads these per-expert
checkpoints into its own fused ``gate_up_proj`` layout itself, and saves them back per expert.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from meshpar.models.llama import convert as llama
from meshpar.models.moe.args import MoEArgs
from meshpar.models.moe.parallelize import moe_tp_plan
from meshpar.parallel.tensor_parallel.plan import TPPlan

# attention, norms, embedding, output and Qwen3-MoE's dense layers: the Llama family's names (no biases)
_DENSE = {k: v for k, v in llama.KEYS.items() if not k.endswith(".bias")}


@dataclasses.dataclass(frozen=True)
class MoEAdapter:
    """The adapter of one family; attribute names are the dense adapters' module globals."""

    family: str
    architecture: str
    moe_prefix: str  # "mlp" (Qwen3-MoE) or "block_sparse_moe" (Mixtral)
    expert_names: tuple[str, str, str]  # HF names of w1, w2, w3 within an expert

    @property
    def KEYS(self) -> dict[str, str]:  # noqa: N802 (the adapter interface's name)
        p = f"model.layers.{{i}}.{self.moe_prefix}"
        return {**_DENSE, "layers.{i}.moe.router.weight": f"{p}.gate.weight"}

    @property
    def EXPERT_KEYS(self) -> dict[str, str]:  # noqa: N802
        """Stacked meshpar name -> per-expert Hugging Face name ({j}: the expert)."""
        p = f"model.layers.{{i}}.{self.moe_prefix}.experts.{{j}}"
        return {f"layers.{{i}}.moe.experts.{w}": f"{p}.{hf}.weight" for w, hf in zip(("w1", "w2", "w3"),
                                                                                       self.expert_names, strict=True)}

    TRANSPOSED: frozenset[str] = frozenset()
    IGNORED_HF: tuple[str, ...] = llama.IGNORED_HF  # old RoPE buffers; lm_head.weight saved although tied
    HF_PREFIX: str = ""
    # model_args that shape training, not the weights: a Hugging Face folder loads into a model whatever
    # their values (load_hf_weights), and the aux-free bias it lacks starts at zero, as init_weights sets it
    TRAINING_ONLY: tuple[str, ...] = ("router_aux_loss_coef", "capacity_factor", "aux_free_bias", "bias_update_rate")
    ZERO_INIT: tuple[str, ...] = (r"layers\.\d+\.moe\.expert_bias",)

    @property
    def EXPERTS_KEY(self) -> str:  # noqa: N802
        """The config.json key that counts the experts of a sparse layer."""
        return "num_local_experts" if self.family == "mixtral" else "num_experts"

    def hf_export_error(self, args: MoEArgs) -> str | None:
        """Why a model with these args cannot become a Hugging Face folder (None: it can)."""
        if args.aux_free_bias:
            return (f"model_args.aux_free_bias is true: its per-expert routing bias changes which experts a token "
                    f"picks and {self.architecture} has no such bias, so the exported model would route "
                    "differently; convert to dcp or torch instead, or train with aux_free_bias = false")
        return None

    @property
    def ARCHITECTURES(self) -> dict[str, str]:  # noqa: N802
        return {self.family: self.architecture}

    @staticmethod
    def TP_PLAN(loss_parallel: bool = True) -> TPPlan:  # noqa: N802
        return moe_tp_plan(loss_parallel)

    @staticmethod
    def tied(args: MoEArgs) -> dict[str, str]:
        return llama.tied(args)

    @staticmethod
    def args_from_dict(d: dict[str, Any]) -> MoEArgs:
        """MoEArgs from ``dataclasses.asdict`` (meshpar.json's ``model_args``)."""
        return MoEArgs(**{**d, "rope_scaling": None, "mlp_only_layers": tuple(d.get("mlp_only_layers", ()))})

    def hf_config(self, family: str, args: MoEArgs, dtype: torch.dtype) -> dict[str, Any]:
        config = {k: v for k, v in llama.hf_config("qwen3", args, dtype).items()
                  if k not in ("use_sliding_window", "sliding_window", "rope_scaling")}
        config.update(architectures=[self.architecture], model_type=family, num_experts_per_tok=args.top_k,
                      router_aux_loss_coef=args.router_aux_loss_coef, output_router_logits=False)
        if family == "mixtral":
            config.update(intermediate_size=args.moe_ffn_dim, num_local_experts=args.n_experts,
                          router_jitter_noise=0.0, sliding_window=None)
        else:
            config.update(moe_intermediate_size=args.moe_ffn_dim, num_experts=args.n_experts,
                          norm_topk_prob=args.norm_topk_prob, decoder_sparse_step=args.decoder_sparse_step,
                          mlp_only_layers=list(args.mlp_only_layers), use_sliding_window=False, sliding_window=None)
        return config

    def args_from_hf_config(self, family: str, config: dict[str, Any]) -> MoEArgs:
        """MoEArgs equivalent to a Hugging Face Qwen3MoeConfig / MixtralConfig dict."""
        base = llama.args_from_hf_config("qwen3" if family == "qwen3_moe" else "llama", config)
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
        if family == "mixtral":
            head_dim = config.get("head_dim") or 0
            fields["head_dim"] = 0 if head_dim in (0, config["hidden_size"] // config["num_attention_heads"]) \
                else head_dim
            moe = dict(n_experts=config["num_local_experts"], moe_ffn_dim=config["intermediate_size"],
                       norm_topk_prob=True)
        else:
            # config.json says num_experts; transformers 5's Qwen3MoeConfig.to_dict() num_local_experts
            moe = dict(n_experts=config.get("num_experts") or config["num_local_experts"],
                       moe_ffn_dim=config["moe_intermediate_size"],
                       norm_topk_prob=bool(config.get("norm_topk_prob", False)),
                       decoder_sparse_step=config.get("decoder_sparse_step", 1),
                       mlp_only_layers=tuple(config.get("mlp_only_layers") or ()))
        return MoEArgs(**fields, **moe, top_k=config["num_experts_per_tok"],
                       router_aux_loss_coef=config.get("router_aux_loss_coef", 0.001))

    def to_hf(self, state_dict: Mapping[str, Tensor], args: MoEArgs) -> dict[str, Tensor]:
        """meshpar state dict -> Hugging Face checkpoint names (experts unstacked, views of the
        stacked tensors); the tied output and the aux-free bias (no Hugging Face equivalent) left out."""
        out: dict[str, Tensor] = {}
        skip = set(self.tied(args)) | {k for k in state_dict if k.endswith("moe.expert_bias")}
        for fqn, t in state_dict.items():
            if fqn in skip:
                continue
            i, template = _template(fqn)
            if template in self.EXPERT_KEYS:
                for j in range(t.shape[0]):
                    out[self.EXPERT_KEYS[template].format(i=i, j=j)] = t[j]
            else:
                out[_fill(self.KEYS, template, i, fqn)] = t
        return out

    def from_hf(self, hf: Mapping[str, Tensor], args: MoEArgs) -> dict[str, Tensor]:
        """A Hugging Face checkpoint's tensors -> a meshpar state dict (experts stacked); raises
        KeyError naming a missing tensor."""
        with torch.device("meta"):
            from meshpar.models.moe.model import MoETransformer

            names = list(MoETransformer(args).state_dict())
        out: dict[str, Tensor] = {}
        for fqn in names:
            if fqn.endswith("moe.expert_bias"):
                out[fqn] = torch.zeros(args.n_experts)
                continue
            i, template = _template(fqn)
            if template in self.EXPERT_KEYS:
                out[fqn] = torch.stack([hf[self.EXPERT_KEYS[template].format(i=i, j=j)]
                                        for j in range(args.n_experts)])
            elif fqn in self.tied(args):
                out[fqn] = hf[self.KEYS[self.tied(args)[fqn]]]
            else:
                out[fqn] = hf[_fill(self.KEYS, template, i, fqn)]
        return out


def _template(fqn: str) -> tuple[str | None, str]:
    """("3", "layers.{i}.x") for "layers.3.x"; (None, fqn) outside the blocks."""
    m = re.match(r"layers\.(\d+)\.(.+)", fqn)
    return (m.group(1), "layers.{i}." + m.group(2)) if m else (None, fqn)


def _fill(keys: Mapping[str, str], template: str, i: str | None, fqn: str) -> str:
    if template not in keys:
        raise KeyError(f"tensor '{fqn}' has no Hugging Face name in meshpar/models/moe/convert.py; add it to KEYS")
    return keys[template].replace("{i}", i or "")


QWEN3_MOE = MoEAdapter("qwen3_moe", "Qwen3MoeForCausalLM", "mlp", ("gate_proj", "down_proj", "up_proj"))
MIXTRAL = MoEAdapter("mixtral", "MixtralForCausalLM", "block_sparse_moe", ("w1", "w2", "w3"))
ADAPTERS = {"qwen3_moe": QWEN3_MOE, "mixtral": MIXTRAL}
