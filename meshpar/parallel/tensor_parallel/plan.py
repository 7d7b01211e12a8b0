"""Tensor and sequence parallelism: apply a model family's plan table on the ``tp`` mesh.

    plan = LLAMA_TP_PLAN                             # meshpar/models/llama/parallelize.py
    apply_tp(model, mesh["tp"], plan)                # on the meta model, before fully_shard
    ...
    with loss_parallel_context(plan.loss_parallel):  # logits are vocab-sharded DTensors
        loss = cross_entropy(model(tokens), targets)
        loss.backward()
    reduce_partial_grads(model)                      # pure TP: before clipping and the step

A plan (``TPPlan``) is two tables of PyTorch ``ParallelStyle``s (torch.distributed.tensor.parallel):
``root`` for the modules outside the blocks (embedding, final norm, output) and ``block``,
applied to every block in ``model.layers``; each family declares its plan as data
(``models/<family>/parallelize.py``) and meshpar.parallel.parallelize applies it. Entries naming a
module the model lacks are skipped (a pipeline stage has no embedding, or no norm and output). This module adds the
machinery applying the tables needs beyond PyTorch's: tied-weight preservation, stage
boundaries, and the gradient reduction for replicated parameters. The styles meshpar adds
(``VocabParallelEmbedding``, ``FusedColwiseParallel`` for GPT-2's fused q/k/v projection,
``ReplicateParallel`` for replicated parameters over sharded activations) are tensor_parallel/styles.py;
the divisibility checks, run before launch, tensor_parallel/checks.py.

Limits: 1-D ``tp`` mesh; the residual stream between blocks is sharded on the sequence
(``Shard(1)``), so the sequence length must be divisible by the tp degree
(``check_seq_len``); sharded dims must divide evenly (``check_tp_degree``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    loss_parallel,
    parallelize_module,
)

from meshpar.distributed import comm
from meshpar.distributed._torch import module_parameters
from meshpar.profiling.labels import hook_ids, label_new_hooks

# [Note: the residual stream is a DTensor]
# Between blocks the hidden states h[B, T, D] are a DTensor placed Shard(1) on tp: each rank
# holds h[B, T/tp, D], and the global shape stays [B, T, D]. Keeping a DTensor (rather than
# its local tensor, PyTorch's default ``use_local_output=True``) matters because the models
# read the sequence length from ``h.shape[1]`` to slice RoPE tables or check max_seq_len; a
# local tensor would report T/tp. Inside attention and the feed-forward the styles hand
# plain local tensors to the model code (heads or hidden units are sharded, the sequence is
# whole), so the model's rearranges run on local heads unchanged.


# [Note: one reduce-scatter per sub-layer input in backward]
# Attention and the feed-forward take the all-gathered sequence [B, T, D] and feed it to
# several column-wise projections (Llama: wq, wk, wv; w1, w3). Each projection's input
# gradient is a partial sum over tp. If the sub-layer received a plain local tensor, every
# projection would wrap it with from_local(Replicate), whose backward all-reduces that
# projection's [B, T, D] gradient on its own: 3 all-reduces for attention, 2 for the
# feed-forward. Kept a Replicate DTensor (``use_local_output=False`` on the sub-layer's
# PrepareModuleInput), the projections' Partial gradients add up locally and the all-gather's
# backward turns the sum into the Shard(1) gradient with one reduce-scatter. Per block and
# microbatch that cuts the backward tp traffic from 10 to 2 x (tp-1)/tp of [B, T, D]
# (counted: docs/performance.md#tensor-parallel-backward). The model code only passes the
# sub-layer's input to its projections, whose column-wise outputs are local tensors.


@dataclass(frozen=True)
class TPPlan:
    """A family's tensor-parallel plan: module path -> ParallelStyle, read at a glance.

    ``root`` paths are relative to the model, ``block`` paths to each block of
    ``model.layers``. ``embedding`` and ``output`` name the modules whose absence marks a
    pipeline stage boundary: a stage without ``embedding`` receives hidden states
    ``[B, T/tp, D]`` (local, sequence-sharded) and one without ``output`` returns them.
    ``loss_parallel``: the output's logits are a DTensor sharded on the vocabulary, so the
    loss must run under ``loss_parallel_context(True)`` (``with_loss_parallel`` switches it).
    ``no_fsdp``: why the plan cannot be FSDP-sharded over its tp shard yet (dp_shard > 1 with
    tp > 1 is refused, naming it), or None.
    """

    root: Mapping[str, ParallelStyle]
    block: Mapping[str, ParallelStyle]
    embedding: str
    output: str
    loss_parallel: bool = True
    no_fsdp: str | None = None
    sequence_parallel: bool = True  # the residual stream sequence-sharded between blocks; False: whole

    def with_loss_parallel(self, enabled: bool) -> TPPlan:
        """This plan with the output projection's logits vocab-sharded (``enabled``) or gathered."""
        if enabled == self.loss_parallel:
            return self
        root = {**self.root, self.output: vocab_parallel_output(enabled, self.sequence_parallel)}
        return dataclasses.replace(self, root=root, loss_parallel=enabled)


# --- applying a plan -----------------------------------------------------------------------

def _find(root: nn.Module, path: str) -> nn.Module | None:
    """The submodule at ``path``, or None where any part of it is missing (None in a pipeline stage)."""
    module: nn.Module | None = root
    for part in path.split("."):
        module = getattr(module, part, None)
        if not isinstance(module, nn.Module):
            return None
    return module


def _parallelize(module: nn.Module, tp_mesh: DeviceMesh, style: ParallelStyle, path: str) -> None:
    """``parallelize_module`` with the style's redistributions labelled ``meshpar::tp.*[<path>]``
    in a trace ([Note: labelling collectives meshpar does not issue])."""
    before = hook_ids(module)
    parallelize_module(module, tp_mesh, style)
    label_new_hooks(module, before, "tp", path)


# ``restyle(module, style)``: the style to apply in place of the plan's for that module (float8's
# TP styles: meshpar/parallel/float8.py ``float8_tp_style``); plans stay data, written once per family.
Restyle = Callable[[nn.Module, ParallelStyle], ParallelStyle]


def _apply_table(root: nn.Module, tp_mesh: DeviceMesh, table: Mapping[str, ParallelStyle], prefix: str = "",
                 restyle: Restyle | None = None) -> None:
    for path, style in table.items():
        module = _find(root, path)
        if module is not None:
            _parallelize(module, tp_mesh, restyle(module, style) if restyle else style, prefix + path)


def _tied_groups(model: nn.Module) -> list[list[tuple[nn.Module, str, str]]]:
    """Parameters held by more than one (module, attribute): [(module, attr, name), ...] per parameter."""
    places: dict[int, list[tuple[nn.Module, str, str]]] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for attr, param in module_parameters(module).items():
            if param is not None:
                places.setdefault(id(param), []).append((module, attr, f"{mod_name}.{attr}".lstrip(".")))
    return [group for group in places.values() if len(group) > 1]


def _retie(groups: list[list[tuple[nn.Module, str, str]]]) -> None:
    """Make every place of a tied parameter hold one Parameter again after each was distributed
    separately; their placements must agree (e.g. a vocab-parallel embedding, Shard(0), and a
    column-wise output projection, Shard(0))."""
    for group in groups:
        first_module, first_attr, first_name = group[0]
        param = module_parameters(first_module)[first_attr]
        for module, attr, name in group[1:]:
            other = module_parameters(module)[attr]
            if other is param:
                continue
            layout = lambda p: tuple(p.placements) if isinstance(p, DTensor) else "not a DTensor"  # noqa: E731
            if layout(other) != layout(param):
                raise ValueError(f"tied parameters {first_name} and {name} are placed differently by the tensor-"
                                 f"parallel plan ({layout(param)} vs {layout(other)}); give both uses the same "
                                 f"placement, or untie them")
            module_parameters(module)[attr] = param


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, plan: TPPlan, restyle: Restyle | None = None) -> nn.Module:
    """Apply ``plan`` to ``model`` (a whole model or a pipeline stage) on the 1-D ``tp_mesh``, in place.

    Call it on the model as built on meta, before ``fully_shard``, ``to_empty`` and
    ``init_weights`` (only local shards are allocated; meshpar.models.init fills them with the
    values one process would have). Tied parameters stay one Parameter. At a stage boundary
    (``plan.embedding`` or ``plan.output`` missing), the stage takes and returns local
    sequence-sharded hidden states [B, T/tp, D]; see [Note: the residual stream is a DTensor].
    ``restyle`` swaps a plan entry's style for a module in its place (``Restyle``).
    """
    if tp_mesh.ndim != 1:
        raise ValueError(f"apply_tp takes the 1-D tp mesh (mesh['tp']), got a {tp_mesh.ndim}-D mesh")
    tied = _tied_groups(model)
    _apply_table(model, tp_mesh, plan.root, restyle=restyle)
    for name, block in model.layers.items():
        _apply_table(block, tp_mesh, plan.block, prefix=f"layers.{name}.", restyle=restyle)
    _retie(tied)
    seq = (Shard(1),)  # h[B, T/tp, D] on each rank
    if _find(model, plan.embedding) is None:  # local [B, T/tp, D] in -> DTensor [B, T, D]
        _parallelize(model, tp_mesh, PrepareModuleInput(input_layouts=seq, desired_input_layouts=seq), "stage")
    if _find(model, plan.output) is None:  # DTensor [B, T, D] out -> local [B, T/tp, D]
        _parallelize(model, tp_mesh, PrepareModuleOutput(output_layouts=seq, desired_output_layouts=seq,
                                                         use_local_output=True), "stage")
    return model


def vocab_parallel_output(loss_parallel: bool, sequence_parallel: bool = True) -> ParallelStyle:
    """The output projection of a plan: [B, T/tp, D] -> all-gather -> [B, T, D] @ w[D, V/tp] ->
    logits [B, T, V/tp], kept as a vocab-sharded DTensor with ``loss_parallel``, else
    all-gathered to a plain [B, T, V] on every rank. Without ``sequence_parallel`` its input
    arrives whole, [B, T, D] on every rank."""
    given = Shard(1) if sequence_parallel else Replicate()
    if loss_parallel:
        return ColwiseParallel(input_layouts=given, output_layouts=Shard(-1), use_local_output=False)
    return ColwiseParallel(input_layouts=given, output_layouts=Replicate())


def loss_parallel_context(enabled: bool) -> contextlib.AbstractContextManager:
    """Wrap forward, loss and backward when the logits are vocab-sharded (``plan.loss_parallel``).

    Under it, ``F.cross_entropy`` on logits[B*T, V/tp] (a DTensor) computes the loss without
    gathering the logits, and returns a replicated DTensor scalar; backward must run inside
    it too. Off, it is a no-op context.
    """
    return loss_parallel() if enabled else contextlib.nullcontext()


# [Note: gradients of replicated parameters]
# A parameter replicated over tp but used on sharded activations (sequence-parallel norms,
# a row-wise layer's bias, Qwen3's per-head norms, GPT-2's positions) gets from each rank
# the gradient of its own tokens or heads only: DTensor marks it Partial(sum). Under
# meshpar.fully_shard the engine redistributes it to the parameter's placement before its
# reduce-scatter. Without FSDP the training step calls reduce_partial_grads once per
# optimizer step, after the last microbatch: accumulation sums partial gradients locally
# (summing partial sums is exact), then one flat all-reduce per mesh makes them Replicate,
# before gradient clipping (which reads local tensors) and the optimizer.


def _partial_grads(module: nn.Module) -> Iterator[tuple[nn.Parameter, DTensor]]:
    for param in module.parameters():
        grad = param.grad
        if isinstance(grad, DTensor) and any(isinstance(pl, Partial) for pl in grad.placements):
            yield param, grad


@torch.no_grad()
def reduce_partial_grads(module: nn.Module) -> None:
    """All-reduce the Partial gradients of replicated tp parameters so each equals its
    parameter's placement ([Note: gradients of replicated parameters]); a no-op when none."""
    by_mesh: dict[tuple, list[tuple[nn.Parameter, DTensor]]] = {}
    for param, grad in _partial_grads(module):
        if grad.device_mesh.ndim != 1 or grad.placements[0] != Partial("sum"):
            raise NotImplementedError(f"gradient placed {grad.placements} on a {grad.device_mesh.ndim}-D mesh; "
                                      f"reduce_partial_grads handles Partial(sum) on the 1-D tp mesh")
        by_mesh.setdefault((grad.device_mesh, grad.dtype), []).append((param, grad))
    for (mesh, _), pairs in by_mesh.items():
        locals_ = [grad.to_local() for _, grad in pairs]
        flat = torch.cat([g.reshape(-1) for g in locals_])
        name = mesh.mesh_dim_names[0] if mesh.mesh_dim_names else "tp"
        comm.all_reduce(flat, mesh.get_group(), dim=name)
        for (param, grad), reduced in zip(pairs, flat.split([g.numel() for g in locals_]), strict=True):
            param.grad = DTensor.from_local(reduced.view_as(grad.to_local()), mesh, param.placements,
                                            run_check=False, shape=grad.shape, stride=grad.stride())
