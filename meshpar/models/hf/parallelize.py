"""Tensor parallelism for ``model.family = "hf"``: transformers' own plan (the config's
``base_model_tp_plan``) as a meshpar plan table, built only where tp > 1.

Megatron-style without sequence parallelism, as transformers plans it: the residual stream stays a
whole, plain tensor on every tp rank; in each layer the plan's ``colwise`` projections take it and
give each rank its heads (or hidden units), ``rowwise`` ones sum the ranks' parts with an
all-reduce. transformers' attention reshapes by ``head_dim``, so it runs on the local heads as is.
The output projection is split on the vocabulary, its logits a vocab-sharded DTensor for loss
parallel (gathered with ``parallel.loss_parallel = false``); the norms are replicated, their
gradients whole on every rank (the styles' backward all-reduces their inputs' gradients). Plan
styles (the keys are transformers' names, ``STYLES``):

    colwise                         ColwiseParallel(): [B, T, D] whole -> local [B, T, N/tp]
    rowwise                         RowwiseParallel(): local [B, T, N/tp] -> all-reduce -> [B, T, D] whole
    colwise_gather_output           ColwiseParallel(output_layouts=Replicate()): a fused projection, gathered
    rowwise_split_input             RowwiseParallel(input_layouts=Replicate()): its whole input split here
    embedding_rowwise               the embedding's rows (the vocabulary) split, its output all-reduced
    replicated_with_grad_allreduce  a norm over local heads: the weight whole, its gradient summed over tp
    replicate                       nothing to do: whole parameters over whole inputs, the same gradient

An entry outside the decoder layers (GPT-NeoX's ``embed_in``) applies to the base model's module of
that name. Every other style transformers registers (``REFUSED``) is refused before launch by name,
and so are tied embeddings (the output's vocabulary shards would be the embedding's).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from meshpar.config.errors import RecipeError
from meshpar.parallel.tensor_parallel.checks import check_tp_degree
from meshpar.parallel.tensor_parallel.plan import TPPlan, vocab_parallel_output
from meshpar.parallel.tensor_parallel.styles import ReplicateParallel

if TYPE_CHECKING:
    from meshpar.distributed.mesh import Layout
    from meshpar.models.hf import HFArgs

# [Note: a norm over local heads]
# ``replicated_with_grad_allreduce`` marks a module whose whole weight acts on this rank's part of a
# tensor (Qwen3's q_norm over its local heads): the forward needs no collective, and the weight's
# gradient is the sum of every rank's. Each rank's input is declared one shard of a tensor stacked
# on dim 0 (Shard(0)): a norm over the last dim is independent along dim 0, so the DTensor forward
# is the local one, and the weight's gradient comes out Partial, summed by reduce_partial_grads.
STYLES = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
    "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
    "replicated_with_grad_allreduce": lambda: ReplicateParallel(input_layout=Shard(0), use_local_output=True),
    "replicate": None,
}
REFUSED = {  # transformers' other styles -> why meshpar's plan does not take them
    "mla_kv_a_proj": "multi-head latent attention's shared K/V projection",
    "local_params": "parameters kept per rank outside a module's forward",
    "packed_colwise": "packed (fused gate/up) projections", "packed_rowwise": "packed (fused gate/up) projections",
    "moe_tp_experts": "experts split across tp", "unit_colwise": "unit-split projections",
    "unit_rowwise": "unit-split projections", "embedding_colwise": "an embedding split on its width",
    "sequence_parallel": "sequence parallelism", "all_reduce": "a module's output all-reduced",
    "colwise_rep": "replicated column projections", "rowwise_rep": "replicated row projections",
}


def _plan_entries(args: HFArgs) -> tuple[dict[str, str], dict[str, str]]:
    """transformers' ``base_model_tp_plan`` of the architecture: (entries relative to a decoder layer,
    entries outside the layers as paths in the model's state dict)."""
    from meshpar.models.hf import build_config, meta_model

    plan = getattr(build_config(args), "base_model_tp_plan", None) or {}
    model = meta_model(args.config)
    base = model.path_of(model.hf.base_model)
    block, root = {}, {}
    for key, style in plan.items():
        if ".*." in key:
            block[key.split(".*.", 1)[1]] = style
        else:
            root[f"{base}.{key}" if base else key] = style
    return block, root


# [Note: parameters the plan leaves out]
# transformers' plans name the projections, not every parameter: Apertus's learned activation
# (mlp.act_fn.alpha_p) sits between a colwise and a rowwise projection, and SarvamMoE's q_norm acts on
# the local heads without a replicated_with_grad_allreduce entry. Each tp rank would then hold only
# its shard's part of such a parameter's gradient, and the replicas would drift apart: a wrong number
# with no error. So a parameter outside the plan is refused when it, or its module's parent, sits in
# a module with a colwise or rowwise child (a region whose activations are tp-sharded); norms
# between the layers, and parameters next to colwise_gather_output / rowwise_split_input projections
# (whose activations are whole), are not.
SHARDING = frozenset({"colwise", "rowwise"})


def _unplanned_in_shards(args: HFArgs, block_plan: dict[str, str]) -> list[str]:
    """The parameters of a decoder layer, outside the plan, that act on tp-sharded activations."""
    from meshpar.models.hf import meta_model

    found = []
    for layer in meta_model(args.config).layers.values():  # layers differ (dense and sparse, attention kinds)
        found += [p for p in _unplanned_in(layer, block_plan) if p not in found]
    return found


def _unplanned_in(layer: nn.Module, block_plan: dict[str, str]) -> list[str]:
    paths = {path for path, _ in layer.named_modules()}
    sharding = {path.rpartition(".")[0] for path, style in block_plan.items() if style in SHARDING and path in paths}
    found = []
    for path, module in layer.named_modules():
        if any(path == p or path.startswith(f"{p}.") for p in block_plan):
            continue  # a planned module (its style places its parameters) or inside one
        own = [name for name, _ in module.named_parameters(recurse=False)]
        if own and (path in sharding or path.rpartition(".")[0] in sharding):
            found += [f"{path}.{name}" if path else name for name in own]
    return found


def _style(style: str) -> Any:
    make = STYLES[style]
    return make() if make is not None else None


def hf_tp_plan(args: HFArgs) -> TPPlan:
    """The plan table of ``args``' architecture (see the module docstring); only for tp > 1."""
    from meshpar.models.hf import meta_model

    model = meta_model(args.config)
    block, root = _plan_entries(args)
    head = model.path_of(model.hf.get_output_embeddings())
    table = {path: s for path, s in ((p, _style(style)) for p, style in root.items()) if s is not None}
    return TPPlan(root={**table, head: vocab_parallel_output(True, sequence_parallel=False)},
                  block={path: s for path, s in ((p, _style(style)) for p, style in block.items()) if s is not None},
                  embedding=model.path_of(model.hf.get_input_embeddings()), output=head, sequence_parallel=False)


def check_hf_layout(args: Any, layout: Layout) -> None:
    """Before launch: tp only where transformers plans it, with styles meshpar takes, untied, dividing;
    pp untied ([Note: tied embeddings across stages] in meshpar/parallel/pipeline/split.py); cp where
    attention is the layers' one exchange between tokens that can be seen before launch ([Note: routing a
    transformers model's attention] in meshpar/models/hf/attention.py: the rest is checked at the first
    forward)."""
    if layout.cp > 1:
        from meshpar.models.hf import meta_model
        from meshpar.models.hf.attention import check

        if not args.n_heads:
            raise RecipeError(f"parallel.cp = {layout.cp}: {args.model_type} has no attention heads (its layers mix "
                              "tokens by recurrence), and context parallelism splits attention over the sequence; set "
                              "parallel.cp = 1", "parallel.cp")
        check(meta_model(args.config), args.model_type)
    if layout.pp > 1 and args.tie_embeddings:
        raise RecipeError(f"parallel.pp = {layout.pp}: {args.model_type} ties its output to its embedding, and a "
                          "pipeline split puts them on different stages, which meshpar does not support yet; set "
                          "parallel.pp = 1", "parallel.pp")
    if layout.tp == 1:
        return
    block, root = _plan_entries(args)
    if not block:
        raise RecipeError(f"parallel.tp = {layout.tp}: {args.model_type}'s config carries no tensor-parallel plan "
                          "for its decoder layers (base_model_tp_plan); set parallel.tp = 1", "parallel.tp")
    styles = {*block.values(), *root.values()}
    refused = sorted(s for s in styles if s not in STYLES)
    if refused:
        why = "; ".join(f"{s} ({REFUSED.get(s, 'a style meshpar does not know')})" for s in refused)
        raise RecipeError(f"parallel.tp = {layout.tp}: {args.model_type}'s base_model_tp_plan uses {why}, which "
                          f"meshpar's plan for family hf does not take (it takes {', '.join(STYLES)}); set "
                          "parallel.tp = 1", "parallel.tp")
    unplanned = _unplanned_in_shards(args, block)
    if unplanned:
        raise RecipeError(f"parallel.tp = {layout.tp}: {args.model_type}'s base_model_tp_plan leaves out "
                          f"{', '.join(unplanned[:3])}, which act{'s' if len(unplanned) == 1 else ''} on tp-sharded "
                          "activations, so each tp rank would compute only part of its gradient ([Note: parameters "
                          "the plan leaves out]); set parallel.tp = 1", "parallel.tp")
    if args.tie_embeddings:
        raise RecipeError(f"parallel.tp = {layout.tp}: {args.model_type} ties its output to its embedding, and "
                          "splitting the output on the vocabulary would split the embedding too, which is not "
                          "built for family hf; set parallel.tp = 1", "parallel.tp")
    config = args.hf_config
    check_tp_degree(layout.tp, {"num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads,
                                "intermediate_size": int(config.get("intermediate_size") or args.dim),
                                "vocab_size": args.vocab_size})
