"""The all-gather extension protocol: a parameter's local tensor decides what is all-gathered.

    class MyWeight(torch.Tensor):
        def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
            return (self._data.to(torch.bfloat16),), None        # (all-gather inputs, metadata)
        def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
            if out is not None:                                  # every unshard after the first
                out.copy_(outputs[0]); return
            return outputs[0].to(param_dtype), (outputs[0],)     # (unsharded tensor, tensors to free)

PyTorch's FSDP2 contract, as its engine runs it (torchao's float8 weights and NF4 tensors are built
on it): a local shard defining both methods, on its class or on the instance, is all-gathered as
the tensors ``fsdp_pre_all_gather`` returns, called as ``(mesh)`` (v1) or ``(mesh, outer_size,
outer_stride, module, mp_policy)`` (v2), ``mesh`` the 1-D shard mesh and the outer size and stride
the parameter's (its tensor-parallel local tensor's). Each input's rows from every rank, in rank
order, are one output ``[world * rows, ...]``; the first unshard builds the unsharded parameter
with ``fsdp_post_all_gather(outputs, metadata, param_dtype)``, which also names the tensors to free
at reshard; later ones refill it in place with ``out=`` the same parameter, its outputs the same
storages, re-allocated. [Note: padding extension inputs] says what is done for uneven shards.
Gradients are reduced as for any parameter (the gradient autograd gives the unsharded one).
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from meshpar.fsdp.sharded_param import ShardedParam, _contiguous_stride

if TYPE_CHECKING:
    from meshpar.fsdp.policies import MixedPrecisionPolicy

# [Note: padding extension inputs]
# All ranks must send the same number of bytes. PyTorch's engine leaves it to a v2
# ``fsdp_pre_all_gather`` to pad its inputs to the largest shard's rows (it is told the outer size)
# and checks it did; inputs a v1 one returns on a short shard have the shard's own rows, which
# PyTorch's engine cannot gather. meshpar pads, on dim 0 with zeros, any input whose first dim is
# the shard's rows when those are fewer than the largest shard's (as the default path pads the
# shard itself), so both signatures work on uneven shards; ``fsdp_post_all_gather`` sees the
# padded rows, and the parameter keeps the first ``rows`` of what it returns.


def has_extension(local: torch.Tensor, name: str) -> bool:
    """Whether ``local`` (a shard's local tensor) defines the protocol; one method alone is an error."""
    pre, post = hasattr(local, "fsdp_pre_all_gather"), hasattr(local, "fsdp_post_all_gather")
    if pre != post:
        raise TypeError(f"{name}'s local tensor defines {'fsdp_pre_all_gather' if pre else 'fsdp_post_all_gather'} "
                        f"but not {'fsdp_post_all_gather' if pre else 'fsdp_pre_all_gather'}; the all-gather "
                        f"extension needs both")
    return pre


class Extension:
    """One parameter's side of the protocol: its all-gather inputs, then its unsharded parameter."""

    def __init__(self, name: str, local: torch.Tensor) -> None:
        self.name, self.local = name, local  # the shard's local tensor the protocol was found on
        self.metadata: Any = None
        self.sizes: list[torch.Size] = []  # the inputs' (padded) sizes, to shape the outputs
        self.outputs: list[torch.Tensor] = []  # 1-D [world * numel] per input, kept across unshards
        self.to_free: tuple[torch.Tensor, ...] = ()  # what fsdp_post_all_gather said reshard frees
        self._freed: list[tuple[torch.Tensor, int]] = []  # (tensor, its storage's bytes) while resharded
        self.built = False  # the first fsdp_post_all_gather has run

    def inputs(self, p: ShardedParam, local: torch.Tensor, mesh: DeviceMesh, module: nn.Module,
               mp_policy: MixedPrecisionPolicy) -> list[torch.Tensor]:
        """This rank's all-gather inputs, 1-D, padded as [Note: padding extension inputs] says."""
        pre = local.fsdp_pre_all_gather
        n_args = len(inspect.signature(pre).parameters)
        if n_args == 1:
            inputs, self.metadata = pre(mesh)
        elif n_args == 5:
            inputs, self.metadata = pre(mesh, p.shape, _contiguous_stride(p.shape), module, mp_policy)
        else:
            raise TypeError(f"{self.name}: fsdp_pre_all_gather{inspect.signature(pre)} takes (mesh) or (mesh, "
                            f"outer_size, outer_stride, module, mp_policy)")
        padded = []
        for t in inputs:
            if t.ndim and t.shape[0] == p.local_rows < p.rows_per_rank:
                full = t.new_zeros((p.rows_per_rank, *t.shape[1:]))
                full[:p.local_rows].copy_(t)
                t = full
            padded.append(t.contiguous())
        self.sizes = [t.shape for t in padded]
        return [t.view(-1) for t in padded]

    def output_buffers(self, dtypes: list[torch.dtype], world: int, device: torch.device) -> list[torch.Tensor]:
        """Where each input's gathered rows go: the same storages every unshard (re-allocated after
        a reshard freed them), as ``fsdp_post_all_gather(out=...)`` may rely on them aliasing ``out``."""
        numels = [world * s.numel() for s in self.sizes]
        for t, nbytes in self._freed:
            if t.untyped_storage().size() != nbytes:
                t.untyped_storage().resize_(nbytes)
        self._freed = []
        if [(o.numel(), o.dtype) for o in self.outputs] != list(zip(numels, dtypes, strict=True)):
            self.outputs = [torch.empty(n, dtype=d, device=device) for n, d in zip(numels, dtypes, strict=True)]
        return self.outputs

    def unsharded(self, local: torch.Tensor, param_dtype: torch.dtype, out: torch.Tensor | None,
                  rows: int) -> torch.Tensor | None:
        """After the outputs are filled: the unsharded tensor (its first ``rows`` rows) on the first
        unshard, None after (``out`` refilled in place)."""
        outputs = tuple(o.view(-1, *s[1:]) for o, s in zip(self.outputs, self.sizes, strict=True))
        post = local.fsdp_post_all_gather
        if self.built:
            post(outputs, self.metadata, param_dtype, out=out)
            return None
        tensor, self.to_free = post(outputs, self.metadata, param_dtype)
        self.to_free = tuple(self.to_free or ())
        self.built = True
        return tensor if tensor.shape[0] == rows else tensor.narrow(0, 0, rows)

    def free(self) -> None:
        """Reshard: free the outputs' and ``to_free``'s storages (their sizes kept for the next unshard)."""
        for t in (*self.outputs, *self.to_free):
            nbytes = t.untyped_storage().size()
            if nbytes:
                self._freed.append((t, nbytes))
                t.untyped_storage().resize_(0)
