"""The parallel styles meshpar adds to PyTorch's (torch.distributed.tensor.parallel), for the
plan tables of meshpar/models/<family>/parallelize.py:

- ``ReplicateParallel``: parameters replicated over tp, computing on sharded activations
  (Qwen3's per-head q/k norms, GPT-2's positions);
- ``FusedColwiseParallel``: column-wise for one ``nn.Linear`` holding several projections
  (GPT-2's fused q|k|v; [Note: fused projections]);
- ``VocabParallelEmbedding``: the embedding table sharded on the vocabulary, computed on the
  local shard ([Note: vocab-parallel embedding]).

Each makes a module's own parameters DTensors on the 1-D tp mesh; applying a plan is
meshpar/parallel/tensor_parallel/plan.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from meshpar.distributed._torch import StridedShard
from meshpar.parallel.wrap import wrap_forward
from meshpar.profiling.labels import run_labelled


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

        def forward(tokens: torch.Tensor) -> DTensor:  # in place of the module's own forward
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

        wrap_forward(module, "tp.vocab_parallel_embedding", lambda _: forward)  # [Note: wrapping a forward]
        return module
