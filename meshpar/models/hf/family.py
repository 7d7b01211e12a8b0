"""``model.family = "hf"``: any transformers causal LM ([Note: a transformers model as a meshpar
family] in meshpar/models/hf), tp by its own plan, cp through its attention interface."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from meshpar.config.errors import RecipeError
from meshpar.config.keys import ModelConfig
from meshpar.models.family import ROPE_DIMS, Family
from meshpar.models.hf import HFArgs, HFCausalLM, meta_model
from meshpar.models.hf import convert as hf_convert
from meshpar.models.hf.parallelize import check_hf_layout, hf_tp_plan
from meshpar.parallel.tensor_parallel.plan import TPPlan


class HFFamily(Family):
    """The architecture of ``model.hf_path``'s config.json, built by transformers."""

    def model_args(self, cfg: ModelConfig) -> Any:
        if not cfg.hf_path:
            raise RecipeError("model.family = 'hf' needs the model's folder: set model.hf_path (or "
                              "checkpoint.hf_weights, which it defaults to)", "model.hf_path")
        args = HFArgs.from_folder(cfg.hf_path, cfg.n_layers, cfg.vocab_size)
        meta_model(args.config)  # built on meta once: what meshpar cannot build is refused before launch
        return args

    def chunked_loss_refusal(self, args: Any) -> str | None:
        if meta_model(args.config).head is not None:
            return None
        return (f"{args.model_type}'s forward does more to its logits than apply its output embedding to the last "
                "hidden states, or its code does not show that it does not (a scale or a soft-cap after it: [Note: "
                "the head the chunked loss applies] in meshpar/models/hf/head.py)")

    def label(self, cfg: ModelConfig, args: Any) -> str:
        return f"hf {args.model_type} ({meta_model(args.config).attention} attention)"


def _model(args: HFArgs) -> nn.Module:
    return HFCausalLM(args)


def _cut(model: HFCausalLM, keep: Sequence[int], first: bool, last: bool) -> nn.Module:
    return model.copy_with_layers(keep, first=first, last=last)


FAMILIES = (HFFamily("hf", _model, HFArgs, {}, TPPlan({}, {}, "model.embed_tokens", "lm_head", sequence_parallel=False),
                     check_hf_layout, ROPE_DIMS, hf_convert, plan_of=hf_tp_plan, cut=_cut,
                     sample_refusal="the sampler runs meshpar's own KV cache; transformers' models keep theirs: "
                                    "sample a converted checkpoint with transformers' generate"),)
