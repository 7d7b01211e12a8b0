"""What a model family promises the code around it: one typed ``Family`` per family.

preflight, parallelize, the training step, build, the planner and convert ask the family, never a
model's attributes: which mesh dims it runs with, its tensor-parallel plan and the check of its
dims against a layout, its conversion adapter, and, for a mixture of experts, its ``moe`` part
(meshpar/models/moe/part.py). A family is a folder ``meshpar/models/<family>/`` whose ``family.py``
defines ``FAMILIES``, a tuple of ``Family`` objects, plus one line in the registry
(meshpar/models/__init__.py); docs/architecture.md lists the steps.

The model a family builds is pure PyTorch: constructible on the meta device, ``init_weights()``,
its ``args`` kept as ``model.args``, blocks in ``model.layers`` (a ``ModuleDict`` keyed by the
block's index), a forward that passes through a missing embedding / final norm / output (pipeline
stages drop them), and the slots parallelism fills (``head``, ``head_in_loss``, each block's
attention slots). This module imports only leaf modules of meshpar.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from meshpar.config.errors import RecipeError
from meshpar.config.keys import ModelConfig
from meshpar.parallel.tensor_parallel.plan import TPPlan

if TYPE_CHECKING:
    from meshpar.models.moe.part import MoEPart

NOT_BUILT = {
    "pp": "pipeline parallelism",
    "dp_replicate": "replicated data parallelism",
    "dp_shard": "sharded data parallelism (meshpar.fully_shard)",
    "cp": "context parallelism",
    "tp": "tensor parallelism",
    "ep": "expert parallelism (mixture-of-experts families only)",
}

DENSE_DIMS = frozenset({"pp", "dp_replicate", "dp_shard", "tp"})
ROPE_DIMS = DENSE_DIMS | {"cp"}  # context parallelism fills the attention's slots (context_parallel/apply.py)
MOE_DIMS = ROPE_DIMS | {"ep"}


@dataclass(frozen=True)
class Family:
    """One model family: what preflight, parallelize, the step, the planner and convert ask of it."""

    name: str
    model_cls: Callable[[Any], nn.Module]  # args -> the model (its class, or a factory)
    args_cls: type  # the frozen dataclass of its shapes (``sizes``' values, ``model.args``)
    sizes: Mapping[str, Any]  # size name -> args
    tp_plan: TPPlan  # the tensor-parallel plan table, applied by meshpar.parallel.parallelize
    check_layout: Callable[[Any, Any], None]  # (args, Layout) -> RecipeError: tp must divide the dims it shards
    mesh_dims: frozenset[str]  # parallel dims that may be > 1
    # the conversion adapter (meshpar/convert/spec.py reads it): Hugging Face names, transposes, expert
    # keys, the identity flag, args from and to a config.json
    adapter: Any
    moe: MoEPart | None = None  # the mixture-of-experts part; None for a dense family
    # why meshpar's sampler during training (``train.sample_every``) cannot run it, or None
    sample_refusal: str | None = None
    # why ``meshpar generate`` (meshpar/models/decode.py's KV cache) cannot run it, or None
    generate_refusal: str | None = None
    plan_of: Callable[[Any], TPPlan] | None = None  # a plan that depends on the args (family hf), else tp_plan
    # (model, blocks kept, holds the input end, holds the output end) -> a pipeline stage, for a model that
    # keeps its blocks itself (family hf); None: meshpar/parallel/pipeline/split.py copies the model
    cut: Callable[[nn.Module, Sequence[int], bool, bool], nn.Module] | None = None
    # dim -> why the family lacks it, for a dim outside ``mesh_dims`` that a reader would expect to run
    # (gpt-oss's cp); ``check_degrees`` quotes it
    not_built: Mapping[str, str] = dataclasses.field(default_factory=dict)

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
        """The ``moe`` part's args from the recipe's mixture-of-experts keys; none on a dense family
        (preflight's ``check_model`` refuses those keys there, naming the families they apply to)."""
        return {} if self.moe is None else self.moe.overrides(cfg)

    def check_degrees(self, degrees: Mapping[str, int]) -> None:
        """Refuse parallel dims (degree > 1) this family cannot run with yet, naming the key and, where
        the family gives one (``not_built``), the reason."""
        for dim, degree in degrees.items():
            if degree > 1 and dim not in self.mesh_dims:
                why = f": {self.not_built[dim]}" if dim in self.not_built else ""
                raise RecipeError(f"parallel.{dim} = {degree}: {NOT_BUILT[dim]} is not built yet for model family "
                                  f"'{self.name}'{why} (built: {', '.join(sorted(self.mesh_dims)) or 'none'}); "
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
