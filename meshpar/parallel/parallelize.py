"""Apply parallelism to a model from outside, in one fixed order.

The order (docs/architecture.md) is: pipeline split -> tensor parallel -> context parallel ->
expert parallel -> activation checkpointing -> torch.compile per block -> fully_shard per block
(a MoE block's experts first, over the ranks ep leaves), then the stage root ->
to_empty + init_weights -> optimizer. It runs on the model as built on the meta device, so
only local shards are ever allocated. Model files hold no parallel code; this module, the
pipeline package and each family's plan table (``models/<family>/parallelize.py``, data this
module applies: ``family.plan(args, layout.tp)``) do.

    stages = build(family, args, mesh, recipe.parallel, device, seed)

With ``pp = 1`` there is one stage: the whole model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from meshpar.config.recipe import ParallelConfig, RecipeError
from meshpar.distributed.mesh import Mesh
from meshpar.fsdp import MixedPrecisionPolicy, fully_shard
from meshpar.parallel.activation_checkpoint import (
    apply_activation_checkpointing,
    is_checkpointed,
    sets_side_outputs_under_checkpoint,
)
from meshpar.parallel.context_parallel.apply import apply_context_parallel
from meshpar.parallel.expert_parallel import apply_expert_parallel, route_over_sequence
from meshpar.parallel.float8 import apply_float8, float8_all_gather, float8_tp_style
from meshpar.parallel.pipeline import SCHEDULES, split
from meshpar.parallel.tensor_parallel.checks import check_fsdp_over_tp
from meshpar.parallel.tensor_parallel.plan import TPPlan, apply_tp
from meshpar.parallel.wrap import wrap_forward

if TYPE_CHECKING:
    from meshpar.models.family import Family
    from meshpar.models.moe.part import MoEPart


def mixed_precision(cfg: ParallelConfig, *, logits_out: bool) -> MixedPrecisionPolicy:
    """The recipe's dtypes; only a unit whose output is logits (the root's, unless the loss applies the
    head) casts it back to fp32 for the loss."""
    param, reduce = getattr(torch, cfg.param_dtype), getattr(torch, cfg.reduce_dtype)
    if param == torch.float32 and reduce == torch.float32:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce,
                                output_dtype=torch.float32 if logits_out else None)


def apply_compile(model: nn.Module, *, cp: bool = False) -> None:
    """Compile each block's forward (inductor), wrapped in place ([Note: wrapping a forward] in
    meshpar/parallel/wrap.py), so names are unchanged and FSDP's hooks stay outside the graph.
    A checkpointed block that sets module attributes (a mixture-of-experts layer's ``aux_loss``)
    stays eager: dynamo refuses that side effect inside checkpoint, so it would graph-break and
    run eagerly anyway, without the wrapper that lets go of its recompute ([Note: a recompute's
    side outputs] in meshpar/parallel/activation_checkpoint.py). Under context parallelism (``cp``: the
    blocks' attention slots hold cp attention) attention runs eagerly, and a checkpointed block compiles
    its norms and feed-forward instead ([Note: compiling a block under cp] in
    meshpar/parallel/context_parallel/apply.py)."""
    for block in model.layers.values():
        if sets_side_outputs_under_checkpoint(block):
            continue
        if cp and is_checkpointed(block):  # [Note: compiling a block under cp]
            for part in (block.attention_norm, block.feed_forward, block.ffn_norm):
                wrap_forward(part, "compile", torch.compile)
        else:
            wrap_forward(block, "compile", torch.compile)


def apply_fsdp(model: nn.Module, mesh: Mesh, cfg: ParallelConfig, moe: MoEPart | None = None) -> None:
    """One FSDP unit per block, then the stage root (embeddings, final norm, output), on the
    ``dp_shard`` mesh (``dp_replicate x dp_shard`` when hybrid; ``dp_shard`` flattened with ``cp``
    under context parallelism: ``Mesh.fsdp``) of the same parent mesh as ``tp``.
    Under pipelining units keep their parameters through backward: the schedule runs every
    microbatch's forward before the backwards finish, so resharding would all-gather per microbatch.
    ``moe``: the family's mixture-of-experts part, whose sparse layers get units of their own."""
    layout = mesh.layout
    dp_mesh = mesh.fsdp  # dp_shard (x cp), replicas outermost
    reshard = cfg.reshard_after_forward and layout.pp == 1
    # microbatches without sync sum their gradients in the compute dtype (None, without mixed
    # precision: the parameters' own): [Note: accumulating in reduce_dtype] (meshpar/fsdp/reduce.py)
    block_mp = mixed_precision(cfg, logits_out=False)
    extras = dict(shard_threshold=cfg.shard_threshold, accumulate_dtype=block_mp.param_dtype)
    # [Note: the last block reshards too]
    # torchtitan keeps its last block's parameters after forward: backward needs them first, so
    # resharding them only gathers them again, exposed, at backward's start. Here every block
    # reshards: kept, the last block's gathered parameters sit beside the logits at the loss, and
    # every shipped single-stage recipe's planned peak rose, for one block's all-gather a step,
    # which the time model prices as overlapped (docs/performance.md#the-last-block-after-forward).
    sparse = dict(moe.sparse_layers(model)) if moe is not None else {}
    for key, block in model.layers.items():
        layer = sparse.get(int(key))
        if layer is not None and (layout.ep > 1 or layout.tp > 1):
            # the sparse layer's own units first, over the ranks that route different tokens through
            # them (mesh.sparse): a gradient there sums every such rank's token slots, so it is
            # averaged over the ranks with a loss of their own (dp x cp), not over the ranks of its
            # mesh (the tp ranks share one loss)
            layer_mesh, experts_mesh = mesh.sparse
            if layout.ep > 1:  # the experts, over the dp_shard ranks ep leaves (their DTensors span ep)
                fully_shard(layer.experts, mesh=experts_mesh, reshard_after_forward=reshard, mp_policy=block_mp,
                            **extras)
                layer.experts.set_gradient_divide_factor(layout.dp * layout.cp)
            if layout.tp > 1:  # router (and experts without ep) over dp_shard (x cp) x tp
                fully_shard(layer, mesh=layer_mesh, reshard_after_forward=reshard, mp_policy=block_mp, **extras)
                layer.set_gradient_divide_factor(layout.dp * layout.cp)
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=block_mp, **extras)
    # the root keeps its parameters after forward (None), backward needs them first
    logits_out = not model.head_in_loss  # else h[B, T, D], for the head in the loss (every family's slot)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=None if reshard else False,
                mp_policy=mixed_precision(cfg, logits_out=logits_out), **extras)


def one_device_fsdp(layout) -> bool:
    """Whether a one-rank layout gets FSDP units anyway, for mixed precision on one device: the
    units keep fp32 shards (the whole parameters here), cast them to ``param_dtype`` for compute
    when they unshard, and hand back fp32 gradients, with no collective ([Note: one data-parallel
    rank] in meshpar/fsdp/param_group.py). Only the plain case: no tp, pp or replicas."""
    return layout.world_size == 1


def check_mixed_precision(cfg: ParallelConfig, layout) -> None:
    """``param_dtype`` / ``reduce_dtype`` act through FSDP: with ``dp_shard = 1`` on several ranks no
    unit exists and the model would silently compute in float32, so a lower precision there is
    refused (one rank alone gets its units: ``one_device_fsdp``)."""
    for key in ("param_dtype", "reduce_dtype"):
        if layout.dp_shard * layout.cp == 1 and not one_device_fsdp(layout) and getattr(cfg, key) != "float32":
            raise RecipeError(f"parallel.{key} = {getattr(cfg, key)!r} takes effect through FSDP, and "
                              f"parallel.dp_shard = 1 makes no FSDP unit (the model would run in float32); set "
                              f"parallel.{key} = \"float32\", or shard over data-parallel ranks (dp_shard > 1)",
                              key=f"parallel.{key}")


def parallelize_transformer(model: nn.Module, mesh: Mesh, cfg: ParallelConfig, tp_plan: TPPlan, *,
                            moe: MoEPart | None = None, float8: str = "none", cp_flex: bool = False) -> nn.Module:
    """Tensor parallel -> activation checkpointing -> compile -> FSDP on one stage (or the whole
    model) built on meta. ``tp_plan`` is the family's plan table (``family.plan(args, layout.tp)``). FSDP shards
    over ``dp_shard x cp`` (``Mesh.fsdp``: the cp ranks hold the same parameters); with both 1 no
    FSDP unit is made and the training step averages gradients over ``dp_replicate``
    (meshpar.parallel.data_parallel), except on one rank with mixed precision (``one_device_fsdp``).
    ``float8``: ``model.float8`` the stage was converted with; tensorwise takes torchao's float8 TP styles.
    ``cp_flex``: cp attention on flex_attention (``parallel.cp_flex``, on a CUDA device only). ``moe``: the
    family's mixture-of-experts part (``Family.moe``), None for a dense family."""
    layout = mesh.layout
    check_fsdp_over_tp(tp_plan, layout.tp, layout.dp_shard)  # a plan that cannot be sharded yet
    if layout.tp > 1:
        apply_tp(model, mesh["tp"], tp_plan.with_loss_parallel(cfg.loss_parallel),
                 restyle=float8_tp_style if float8 == "tensorwise" else None)
    if layout.cp > 1:
        apply_context_parallel(model, mesh["cp"], attention=cfg.cp_attention, tp=layout.tp, flex=cp_flex)
    layers = moe.sparse_layers(model) if moe is not None else []
    if layers and (layout.tp > 1 or layout.cp > 1):
        route_over_sequence(layers, mesh["tp"] if layout.tp > 1 else None, mesh["cp"] if layout.cp > 1 else None)
    if layout.ep > 1:
        apply_expert_parallel(layers, mesh.ep)
    apply_activation_checkpointing(model, cfg.activation_checkpoint, cfg.ac_every,
                                   forget=moe.forget if moe is not None else None, leaving=[i for i, _ in layers])
    if cfg.compile:
        apply_compile(model, cp=layout.cp > 1)
    mixed = cfg.param_dtype != "float32" or cfg.reduce_dtype != "float32"
    if layout.dp_shard * layout.cp > 1 or (mixed and one_device_fsdp(layout)):  # Mesh.fsdp: dp_shard x cp
        apply_fsdp(model, mesh, cfg, moe)
    return model


def build(family: Family, args, mesh: Mesh, cfg: ParallelConfig, device: torch.device, seed: int, *,
          float8: str = "none", float8_emulate: bool = False,
          head_in_loss: bool = False) -> list[tuple[int, nn.Module]]:
    """This rank's stages of the model, parallelized and initialized: ``[(stage index, module)]``.
    ``family``: what the model is (its class, plan table ``family.plan(args, tp)`` and mixture-of-experts
    part, meshpar/models/family.py). ``float8``: ``model.float8``, its
    linear layers converted first (meshpar/parallel/float8.py). ``head_in_loss``: the stage holding the
    output projection returns hidden states and the loss applies it (``train.loss_chunks``,
    meshpar/training/loss.py).

    Every stage is initialized from the same base seed, so by meshpar.models.init's layout-independent
    initialization each holds exactly the values of the same layers of the whole model.
    """
    with torch.device("meta"):
        whole = family.model_cls(args)
    layout = mesh.layout
    tp_plan = family.plan(args, layout.tp)
    if layout.pp > 1:
        style = SCHEDULES[cfg.pp_schedule].style
        stages = split(whole, mesh["pp"].get_local_rank(), layout.pp, virtual=cfg.pp_virtual_stages, style=style,
                       boundaries=cfg.pp_boundaries, cut=family.cut)
    else:
        stages = [(0, whole)]
    built = []
    for index, stage in stages:
        stage.head_in_loss = head_in_loss and stage.head is not None
        if float8 != "none":  # before any parallel dim wraps the linears
            apply_float8(stage, float8, emulate=float8_emulate, fsdp_all_gather=float8_all_gather(float8, layout))
        # still on meta: shards only from here on
        cp_flex = cfg.cp_flex and torch.device(device).type == "cuda"  # CPU flex has no backward for the gather
        stage = parallelize_transformer(stage, mesh, cfg, tp_plan, moe=family.moe, float8=float8, cp_flex=cp_flex)
        stage.to_empty(device=device)
        torch.manual_seed(seed)
        stage.init_weights()
        built.append((index, stage))
    return built
