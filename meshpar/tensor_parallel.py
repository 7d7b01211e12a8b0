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
(``models/<family>/parallelize.py``) and meshpar.parallelize applies it. Entries naming a module the model lacks are
skipped (a pipeline stage has no embedding, or no norm and output). This module adds the
machinery the tables need beyond PyTorch's styles: ``VocabParallelEmbedding``,
``FusedColwiseParallel`` (GPT-2's fused q/k/v projection), ``ReplicateParallel``
(replicated parameters over sharded activations),
tied-weight preservation, stage boundaries, the divisibility checks, and the gradient
reduction for replicated parameters.

Limits: 1-D ``tp`` mesh; the residual stream between blocks is sharded on the sequence
(``Shard(1)``), so the sequence length must be divisible by the tp degree
(``check_seq_len``); sharded dims must divide evenly (``check_tp_degree``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    loss_parallel,
    parallelize_module,
)

from meshpar import comm
from meshpar._torch import StridedShard, module_parameters
from meshpar.errors import RecipeError
from meshpar.profiling.labels import hook_ids, label_new_hooks, run_labelled

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
# microbatch that cuts the backward tp traffic from 10 to 2 x (tp-1)/tp of [B, T, D].
# Measured on rank 0 of the 3D debug profile (2 steps): 56 -> 16 all-reduces, 20 -> 36
# reduce-scatters, same losses; planned for recipes/llama3_70b.toml: tp traffic 339 -> 189 GB
# per step. The model code only passes the sub-layer's input to its projections, whose
# column-wise outputs are local tensors as before.


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

    def with_loss_parallel(self, enabled: bool) -> TPPlan:
        """This plan with the output projection's logits vocab-sharded (``enabled``) or gathered."""
        if enabled == self.loss_parallel:
            return self
        root = {**self.root, self.output: vocab_parallel_output(enabled)}
        return dataclasses.replace(self, root=root, loss_parallel=enabled)


def _distribute_params(module: nn.Module, mesh: DeviceMesh, placement: Placement, src_data_rank: int | None) -> None:
    """Make each of ``module``'s own parameters a DTensor placed ``placement`` on the 1-D ``mesh``."""
    for name, param in list(module.named_parameters(recurse=False)):
        dtensor = distribute_tensor(param, mesh, [placement], src_data_rank=src_data_rank)
        module.register_parameter(name, nn.Parameter(dtensor, requires_grad=param.requires_grad))


class ReplicateParallel(ParallelStyle):
    """Parameters replicated over tp (a DTensor ``Replicate``), input converted from
    ``input_layout`` to ``desired_input_layout`` (first positional input only).

    For modules that compute on sharded activations with whole weights: Qwen3's per-head
    q/k norms (``Shard(1)`` on the heads of q[B, H/tp, T, Dh]), GPT-2's position embedding
    (positions sharded on the sequence). The weight's gradient is then a partial sum over tp
    ranks (``Partial``); see ``reduce_partial_grads``.
    """

    def __init__(self, *, input_layout: Placement, desired_input_layout: Placement | None = None,
                 use_local_output: bool = False) -> None:
        super().__init__()
        self.input_layout = input_layout
        self.desired_input_layout = desired_input_layout or input_layout
        self.use_local_output = use_local_output

    def _replicate(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        _distribute_params(module, mesh, Replicate(), self.src_data_rank)

    def _prepare_input(self, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        x, *rest = inputs
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, (self.input_layout,), run_check=False)
        if x.placements != (self.desired_input_layout,):
            x = x.redistribute(placements=(self.desired_input_layout,))
        return (x, *rest)

    def _prepare_output(self, module: nn.Module, output: DTensor, mesh: DeviceMesh):
        return output.to_local() if self.use_local_output else output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, self._replicate, self._prepare_input, self._prepare_output)


# [Note: fused projections]
# GPT-2's c_attn is one Linear whose output rows are laid out [q | k | v], each H heads of
# Dh. A plain column-wise shard (Shard(0) of the weight) would give rank 0 all of q and half
# of k. Rank r must instead hold heads r*H/tp .. (r+1)*H/tp of each third: its local weight
# is [q_r | k_r | v_r] (3*D/tp rows), and the model's rearrange "(three h d)" then yields
# its own H/tp heads of q, k and v. As a DTensor this is StridedShard(0, split_factor=3):
# split the rows into 3 chunks, shard each chunk over tp, concatenate a rank's pieces. The
# global view (full_tensor(), checkpoints, meshpar.models.init) is the unsharded weight itself,
# so layouts stay interchangeable. DTensor's linear propagates the placement to the output
# (StridedShard(-1, 3)), whose local tensor is exactly [q_r | k_r | v_r] per token.


class FusedColwiseParallel(ParallelStyle):
    """Column-wise parallel for an ``nn.Linear`` whose output concatenates ``n_fused`` equal
    projections (see [Note: fused projections]). Input: a replicated (whole-sequence) tensor;
    output: the local tensor [..., n_fused * out / (n_fused * tp)], each projection's shard in turn.
    """

    def __init__(self, n_fused: int) -> None:
        super().__init__()
        self.placement = StridedShard(0, split_factor=n_fused)

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        if not isinstance(module, nn.Linear):
            raise NotImplementedError(f"FusedColwiseParallel shards nn.Linear, not {type(module).__name__}")
        _distribute_params(module, mesh, self.placement, self.src_data_rank)  # weight[out, in], bias[out]

    @staticmethod
    def _prepare_input(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        x = inputs[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, (Replicate(),), run_check=False)
        return (x.redistribute(placements=(Replicate(),)), *inputs[1:])

    @staticmethod
    def _prepare_output(module: nn.Module, output: DTensor, mesh: DeviceMesh) -> torch.Tensor:
        return output.to_local()  # [..., q_r | k_r | v_r]

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, self._partition, self._prepare_input, self._prepare_output)


# [Note: vocab-parallel embedding]
# PyTorch's RowwiseParallel on an nn.Embedding shards the table on the vocabulary, but
# DTensor's embedding backward (torch 2.13) all-gathers the output gradient and returns a
# Replicate weight gradient: the whole [V, D] table's gradient on every rank (2 GiB in fp32
# for Llama 3 8B), sliced back only by the optimizer or FSDP. VocabParallelEmbedding
# computes on the local shard as Megatron-LM does: tokens outside this rank's rows
# [start, start + V/tp) are looked up as row 0 and their outputs zeroed, the partial sums
# are reduce-scattered (or all-reduced) to ``output_layout``, and the gradient flows back
# through ``to_local()`` into a Shard(0) gradient [V/tp, D].


class VocabParallelEmbedding(ParallelStyle):
    """``nn.Embedding`` sharded on the vocabulary (weight Shard(0)); tokens replicated; the
    output a DTensor placed ``output_layout`` (see [Note: vocab-parallel embedding])."""

    def __init__(self, *, output_layout: Placement) -> None:
        super().__init__()
        self.output_layout = output_layout

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        _distribute_params(module, mesh, Shard(0), self.src_data_rank)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Embedding) or module.padding_idx is not None or module.max_norm is not None:
            raise NotImplementedError("VocabParallelEmbedding shards a plain nn.Embedding (no padding_idx, max_norm)")
        distribute_module(module, device_mesh, self._partition)
        output_layout = self.output_layout

        def forward(tokens: torch.Tensor) -> DTensor:  # replaces the instance's forward
            weight = module.weight  # under FSDP, the unsharded TP DTensor of this step
            local = weight.to_local()  # [V/tp, D]
            start = device_mesh.get_local_rank() * -(-weight.shape[0] // device_mesh.size())  # torch.chunk rows
            tokens = tokens.to_local() if isinstance(tokens, DTensor) else tokens  # [B, T], same on every rank
            outside = (tokens < start) | (tokens >= start + local.shape[0])
            rows = (tokens - start).masked_fill(outside, 0)
            out = F.embedding(rows, local).masked_fill(outside.unsqueeze(-1), 0.0)  # partial [B, T, D]
            out = DTensor.from_local(out, device_mesh, (Partial(),), run_check=False)
            # Shard(1): reduce-scatter -> [B, T/tp, D]
            return run_labelled("tp.output", "embedding", lambda o: o.redistribute(placements=(output_layout,)), out)

        module.forward = forward
        return module


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


def _apply_table(root: nn.Module, tp_mesh: DeviceMesh, table: Mapping[str, ParallelStyle], prefix: str = "") -> None:
    for path, style in table.items():
        module = _find(root, path)
        if module is not None:
            _parallelize(module, tp_mesh, style, prefix + path)


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


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, plan: TPPlan) -> nn.Module:
    """Apply ``plan`` to ``model`` (a whole model or a pipeline stage) on the 1-D ``tp_mesh``, in place.

    Call it on the model as built on meta, before ``fully_shard``, ``to_empty`` and
    ``init_weights`` (only local shards are allocated; meshpar.models.init fills them with the
    values one process would have). Tied parameters stay one Parameter. At a stage boundary
    (``plan.embedding`` or ``plan.output`` missing), the stage takes and returns local
    sequence-sharded hidden states [B, T/tp, D]; see [Note: the residual stream is a DTensor].
    """
    if tp_mesh.ndim != 1:
        raise ValueError(f"apply_tp takes the 1-D tp mesh (mesh['tp']), got a {tp_mesh.ndim}-D mesh")
    tied = _tied_groups(model)
    _apply_table(model, tp_mesh, plan.root)
    for name, block in model.layers.items():
        _apply_table(block, tp_mesh, plan.block, prefix=f"layers.{name}.")
    _retie(tied)
    seq = (Shard(1),)  # h[B, T/tp, D] on each rank
    if _find(model, plan.embedding) is None:  # local [B, T/tp, D] in -> DTensor [B, T, D]
        _parallelize(model, tp_mesh, PrepareModuleInput(input_layouts=seq, desired_input_layouts=seq), "stage")
    if _find(model, plan.output) is None:  # DTensor [B, T, D] out -> local [B, T/tp, D]
        _parallelize(model, tp_mesh, PrepareModuleOutput(output_layouts=seq, desired_output_layouts=seq,
                                                         use_local_output=True), "stage")
    return model


def vocab_parallel_output(loss_parallel: bool) -> ParallelStyle:
    """The output projection of a plan: [B, T/tp, D] -> all-gather -> [B, T, D] @ w[D, V/tp] ->
    logits [B, T, V/tp], kept as a vocab-sharded DTensor with ``loss_parallel``, else
    all-gathered to a plain [B, T, V] on every rank."""
    if loss_parallel:
        return ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
    return ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())


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


# --- checks, before any process starts ------------------------------------------------------

def check_tp_degree(tp: int, sizes: Mapping[str, int], fixes: Mapping[str, str] | None = None) -> None:
    """Raise RecipeError (key ``parallel.tp``) unless ``tp`` divides every size in ``sizes``
    (name -> length of a dimension the plan shards), listing the degrees that would work.
    ``fixes`` adds a remedy for a dimension by name (e.g. padding the vocabulary)."""
    if tp < 1:
        raise RecipeError(f"parallel.tp = {tp}: the degree must be >= 1", key="parallel.tp")
    bad = [name for name, size in sizes.items() if size % tp]
    if not bad:
        return
    common = math.gcd(*sizes.values())
    working = [d for d in range(1, common + 1) if common % d == 0]
    name = bad[0]
    fix = f"; {fixes[name]}" if fixes and name in fixes else ""
    raise RecipeError(f"parallel.tp = {tp}: {name} ({sizes[name]}) is not divisible by {tp}; tp degrees that "
                      f"divide every sharded dimension: {', '.join(map(str, working))}{fix}", key="parallel.tp")


def check_fsdp_over_tp(plan: TPPlan, tp: int, dp_shard: int) -> None:
    """Raise RecipeError (key ``parallel.dp_shard``) when ``plan`` cannot be FSDP-sharded over its
    tp shard yet (``plan.no_fsdp``) and the layout asks for both."""
    if plan.no_fsdp and tp > 1 and dp_shard > 1:
        raise RecipeError(f"parallel.tp = {tp} with parallel.dp_shard = {dp_shard}: {plan.no_fsdp}; use "
                          f"dp_replicate instead of dp_shard (and set dp_shard = 1), or tp = 1",
                          key="parallel.dp_shard")


def check_seq_len(seq_len: int, tp: int) -> None:
    """Sequence parallelism splits every sequence across the tp ranks: ``seq_len`` must divide."""
    if tp > 1 and seq_len % tp:
        fits = seq_len - seq_len % tp
        raise RecipeError(f"parallel.tp = {tp}: train.seq_len ({seq_len}) is not divisible by {tp} (sequence "
                          f"parallelism splits each sequence over the tp ranks); use a multiple of {tp}, "
                          f"e.g. {fits or tp}", key="parallel.tp")
