"""Tensor parallelism for ``model.family = "hf"``: transformers' own plan (the config's
``base_model_tp_plan``) as a meshpar plan table.

Megatron-style without sequence parallelism, as transformers plans it: the residual stream stays a
whole, plain tensor on every tp rank; in each layer the plan's ``colwise`` projections take it and
give each rank its heads (or hidden units), ``rowwise`` ones sum the ranks' parts with an
all-reduce. transformers' attention reshapes by ``head_dim``, so it runs on the local heads as is.
The output projection is split on the vocabulary, its logits a vocab-sharded DTensor for loss
parallel (gathered with ``parallel.loss_parallel = false``); the embedding and the norms are
replicated, their gradients whole on every rank (the styles' backward all-reduces their inputs'
gradients). Plan styles:

    colwise                 ColwiseParallel(): [B, T, D] whole -> local [B, T, N/tp]
    rowwise                 RowwiseParallel(): local [B, T, N/tp] -> all-reduce -> [B, T, D] whole
    colwise_gather_output   ColwiseParallel(output_layouts=Replicate()): a fused projection, gathered
    rowwise_split_input     RowwiseParallel(input_layouts=Replicate()): its whole input split here

Other styles (``replicated_with_grad_allreduce``, expert and packed styles) are refused before launch,
and so are tied embeddings (the output's vocabulary shards would be the embedding's).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from meshpar.config.errors import RecipeError
from meshpar.parallel.tensor_parallel.checks import check_tp_degree
from meshpar.parallel.tensor_parallel.plan import TPPlan, vocab_parallel_output

if TYPE_CHECKING:
    from meshpar.distributed.mesh import Layout
    from meshpar.models.hf import HFArgs

STYLES = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
}


def _plan_entries(args: HFArgs) -> dict[str, str]:
    """transformers' ``base_model_tp_plan`` of the architecture, keys relative to a decoder layer."""
    from meshpar.models.hf import build_config

    plan = getattr(build_config(args), "base_model_tp_plan", None) or {}
    entries = {}
    for key, style in plan.items():
        if ".*." not in key:
            raise RecipeError(f"parallel.tp: {args.model_type}'s base_model_tp_plan entry {key!r} is not inside its "
                              "decoder layers, which meshpar's plan for family hf does not take; set parallel.tp = 1",
                              "parallel.tp")
        entries[key.split(".*.", 1)[1]] = style
    return entries


def hf_tp_plan(args: HFArgs) -> TPPlan:
    """The plan table of ``args``' architecture (see the module docstring)."""
    block = {path: STYLES[style]() for path, style in _plan_entries(args).items()}
    return TPPlan(root={"lm_head": vocab_parallel_output(True, sequence_parallel=False)}, block=block,
                  embedding="model.embed_tokens", output="lm_head", sequence_parallel=False)


def check_hf_layout(args: Any, layout: Layout) -> None:
    """Before launch: tp only where transformers plans it, with styles meshpar takes, untied, dividing."""
    if layout.tp == 1:
        return
    entries = _plan_entries(args)
    if not entries:
        raise RecipeError(f"parallel.tp = {layout.tp}: {args.model_type}'s config carries no base_model_tp_plan "
                          "(transformers has no tensor-parallel plan for it); set parallel.tp = 1", "parallel.tp")
    unknown = sorted({s for s in entries.values() if s not in STYLES})
    if unknown:
        raise RecipeError(f"parallel.tp = {layout.tp}: {args.model_type}'s base_model_tp_plan uses {unknown}, which "
                          f"meshpar's plan for family hf does not take (it takes {', '.join(STYLES)}); set "
                          "parallel.tp = 1", "parallel.tp")
    if args.tie_embeddings:
        raise RecipeError(f"parallel.tp = {layout.tp}: {args.model_type} ties its output to its embedding, and "
                          "splitting the output on the vocabulary would split the embedding too, which is not "
                          "built for family hf; set parallel.tp = 1", "parallel.tp")
    config = args.hf_config
    check_tp_degree(layout.tp, {"num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads,
                                "intermediate_size": int(config.get("intermediate_size") or args.dim),
                                "vocab_size": args.vocab_size})
