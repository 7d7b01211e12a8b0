"""The model-family registry: family name -> model class, named sizes, tensor-parallel plan, mesh dims.

A family is a pure-PyTorch model (no parallel code, constructible on the meta device,
``init_weights()``, layers in a ``ModuleDict`` keyed by index) plus its tensor-parallel plan
table and the check of its dimensions against a layout (``models/<family>/parallelize.py``),
both data that meshpar.parallel.parallelize applies from outside. ``mesh_dims`` lists the parallel
dimensions this family can run with today; a recipe asking for any other is refused before launch
(meshpar.training.preflight). The package imports only leaf modules of meshpar (tensor_parallel's
styles, errors, config keys), never meshpar.parallel.parallelize, so there is no import cycle.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from meshpar.config.errors import RecipeError
from meshpar.config.keys import MOE_KEYS, ModelConfig
from meshpar.models.deepseek import DEEPSEEK_V3_SIZES, DeepSeekTransformer
from meshpar.models.deepseek.convert import TP_PLAN as DEEPSEEK_TP_PLAN
from meshpar.models.gpt2 import GPT2, GPT2_SIZES
from meshpar.models.gpt2.parallelize import GPT2_TP_PLAN, check_gpt2_layout
from meshpar.models.hf.parallelize import check_hf_layout, hf_tp_plan
from meshpar.models.llama import LLAMA_SIZES, QWEN2_SIZES, QWEN3_SIZES, Transformer
from meshpar.models.llama.parallelize import LLAMA_TP_PLAN, check_llama_layout
from meshpar.models.moe import MIXTRAL_SIZES, QWEN3_MOE_SIZES, MoETransformer
from meshpar.models.moe.convert import MIXTRAL
from meshpar.models.moe.parallelize import check_moe_tp
from meshpar.parallel.tensor_parallel.plan import TPPlan


@dataclass(frozen=True)
class Family:
    name: str
    model_cls: type[nn.Module]
    sizes: Mapping[str, Any]  # size name -> the family's frozen args dataclass
    tp_plan: TPPlan  # the tensor-parallel plan table, applied by meshpar.parallel.parallelize
    check_layout: Callable[[Any, Any], None]  # (args, Layout) -> RecipeError: tp must divide the dims it shards
    mesh_dims: frozenset[str]  # parallel dims that may be > 1
    plan_of: Callable[[Any], TPPlan] | None = None  # a plan that depends on the args (family hf), else tp_plan

    def plan(self, args: Any, tp: int) -> TPPlan:
        """The tensor-parallel plan table of a model with ``args`` on ``tp`` ranks: a plan that depends on
        the args is built only where tensor parallelism runs (tp > 1); at tp 1 no plan entry applies."""
        return self.plan_of(args) if self.plan_of is not None and tp > 1 else self.tp_plan

    def model_args(self, cfg: ModelConfig) -> Any:
        """The named size's args with the recipe's overrides (n_layers, vocab_size, and for a
        mixture-of-experts family the balancing keys, ``moe_overrides``) applied."""
        if cfg.size not in self.sizes:
            raise RecipeError(f"model.size = '{cfg.size}': no such size for family '{self.name}'; "
                              f"choose one of {', '.join(self.sizes)}", "model.size")
        args = self.sizes[cfg.size]
        overrides = {k: getattr(cfg, k) for k in ("n_layers", "vocab_size") if getattr(cfg, k)}
        return dataclasses.replace(args, **overrides, **self.moe_overrides(cfg))

    def moe_overrides(self, cfg: ModelConfig) -> dict[str, Any]:
        """MoEArgs fields from the recipe's mixture-of-experts keys; on a dense family, a RecipeError
        for any of them that is not its default."""
        if not (isinstance(self.model_cls, type) and issubclass(self.model_cls, MoETransformer)):
            for key in MOE_KEYS:
                value = getattr(cfg, key)
                if value != getattr(ModelConfig, key):
                    raise RecipeError(f"model.{key} = {json.dumps(value)}: model family '{self.name}' has no experts "
                                      f"(it applies to {', '.join(MOE_FAMILIES)}); remove it", f"model.{key}")
            return {}
        out = {"capacity_factor": cfg.capacity_factor, "aux_free_bias": cfg.aux_free_bias,
               "bias_update_rate": cfg.bias_update_rate}
        if cfg.aux_loss_coef != -1:  # -1: the size's own
            out["router_aux_loss_coef"] = cfg.aux_loss_coef
        return out

    def check_degrees(self, degrees: Mapping[str, int]) -> None:
        """Refuse parallel dims (degree > 1) this family cannot run with yet, naming the key."""
        for dim, degree in degrees.items():
            if degree > 1 and dim not in self.mesh_dims:
                raise RecipeError(f"parallel.{dim} = {degree}: {NOT_BUILT[dim]} is not built yet for model family "
                                  f"'{self.name}' (built: {', '.join(sorted(self.mesh_dims)) or 'none'}); "
                                  f"set parallel.{dim} = 1", f"parallel.{dim}")

    def chunked_loss_refusal(self, args: Any) -> str | None:
        """Why ``train.loss_chunks`` > 1 cannot run a model with ``args`` (its logits are more than its
        ``head`` applied to the hidden states), or None: meshpar's own families' heads are plain."""
        return None

    def label(self, cfg: ModelConfig, args: Any) -> str:
        """The model as the run's start line names it."""
        return f"{self.name} {cfg.size}"

    def build(self, cfg: ModelConfig) -> nn.Module:
        """Construct on the current default device; use ``with torch.device("meta")`` for big models."""
        return self.model_cls(self.model_args(cfg))


NOT_BUILT = {
    "pp": "pipeline parallelism",
    "dp_replicate": "replicated data parallelism",
    "dp_shard": "sharded data parallelism (meshpar.fully_shard)",
    "cp": "context parallelism",
    "tp": "tensor parallelism",
    "ep": "expert parallelism (mixture-of-experts families only)",
}

_ND = frozenset({"pp", "dp_replicate", "dp_shard", "tp"})
_LLAMA = _ND | {"cp"}  # context parallelism: the Llama model's slots, or family hf's (context_parallel/apply.py)
_MOE = frozenset({"pp", "dp_replicate", "dp_shard", "cp", "tp", "ep"})


def check_moe_layout(args: Any, layout: Any) -> None:
    """Tensor parallelism as meshpar/models/moe/parallelize.py builds it; ep divides the expert count."""
    if layout.tp > 1:
        check_moe_tp(args, layout)
    if layout.cp > 1 and args.capacity_factor > 0:
        raise RecipeError(f"model.capacity_factor = {args.capacity_factor} with parallel.cp = {layout.cp}: the "
                          f"capacity would apply to each cp rank's slice of the sequence, which is not built; "
                          f"set capacity_factor = 0 or cp = 1", "model.capacity_factor")
    if layout.ep == 1:
        return
    if args.n_experts % layout.ep:
        raise RecipeError(f"parallel.ep = {layout.ep}: {args.n_experts} experts do not split over {layout.ep} ranks; "
                          f"choose an ep that divides the expert count", "parallel.ep")

class HFFamily(Family):
    """``model.family = "hf"``: the architecture of ``model.hf_path``'s config.json, built by
    transformers ([Note: a transformers model as a meshpar family] in meshpar/models/hf)."""

    def model_args(self, cfg: ModelConfig) -> Any:
        from meshpar.models.hf import HFArgs

        if not cfg.hf_path:
            raise RecipeError("model.family = 'hf' needs the model's folder: set model.hf_path (or "
                              "checkpoint.hf_weights, which it defaults to)", "model.hf_path")
        from meshpar.models.hf import meta_model

        self.moe_overrides(cfg)  # refuses the mixture-of-experts keys
        args = HFArgs.from_folder(cfg.hf_path, cfg.n_layers, cfg.vocab_size)
        meta_model(args.config)  # built on meta once: what meshpar cannot build is refused before launch
        return args

    def chunked_loss_refusal(self, args: Any) -> str | None:
        from meshpar.models.hf import meta_model

        if meta_model(args.config).head is not None:
            return None
        return (f"{args.model_type}'s forward does more to its logits than apply its output embedding to the last "
                "hidden states, or its code does not show that it does not (a scale or a soft-cap after it: [Note: "
                "the head the chunked loss applies] in meshpar/models/hf/head.py)")

    def label(self, cfg: ModelConfig, args: Any) -> str:
        from meshpar.models.hf import meta_model

        return f"hf {args.model_type} ({meta_model(args.config).attention} attention)"


def _hf_model(args: Any) -> nn.Module:
    from meshpar.models.hf import HFCausalLM

    return HFCausalLM(args)


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("llama", Transformer, LLAMA_SIZES, LLAMA_TP_PLAN, check_llama_layout, _LLAMA),
    Family("qwen2", Transformer, QWEN2_SIZES, LLAMA_TP_PLAN, check_llama_layout, _LLAMA),
    Family("qwen3", Transformer, QWEN3_SIZES, LLAMA_TP_PLAN, check_llama_layout, _LLAMA),
    Family("gpt2", GPT2, GPT2_SIZES, GPT2_TP_PLAN, check_gpt2_layout, _ND),
    Family("qwen3_moe", MoETransformer, QWEN3_MOE_SIZES, MIXTRAL.TP_PLAN(), check_moe_layout, _MOE),
    Family("mixtral", MoETransformer, MIXTRAL_SIZES, MIXTRAL.TP_PLAN(), check_moe_layout, _MOE),
    Family("deepseek_v3", DeepSeekTransformer, DEEPSEEK_V3_SIZES, DEEPSEEK_TP_PLAN(), check_moe_layout,
           _MOE),
    # any transformers causal LM, tp by its own plan, cp through its attention interface
    HFFamily("hf", _hf_model, {}, TPPlan({}, {}, "model.embed_tokens", "lm_head", sequence_parallel=False),
             check_hf_layout, _LLAMA, plan_of=hf_tp_plan),
)}


MOE_FAMILIES = tuple(name for name, f in FAMILIES.items()
                     if isinstance(f.model_cls, type) and issubclass(f.model_cls, MoETransformer))


def get_family(name: str) -> Family:
    try:
        return FAMILIES[name]
    except KeyError:
        raise RecipeError(f"model.family = '{name}': unknown family; choose one of {', '.join(FAMILIES)}",
                          "model.family") from None
