"""Activation checkpointing per transformer block: none, full, every k-th block, or selective.

    apply_activation_checkpointing(model, mode="full", every=2)   # blocks 0, 2, 4, ... recompute

``full`` keeps only a block's inputs and recomputes its whole forward in backward.
``selective`` keeps the outputs of matrix multiplies, attention and tensor-parallel
reduce-scatters and recomputes the cheap elementwise work around them (norms, RoPE,
SiLU/GELU, residual adds): most of the memory saving for a fraction of the recompute.

The block's forward is wrapped (meshpar/parallel/wrap.py, [Note: wrapping a forward]), so
parameter names do not change (no ``_checkpoint_wrapped_module`` in checkpoint keys). It runs after tensor parallelism
and before ``fully_shard`` (docs/architecture.md): FSDP's hooks wrap ``__call__``, so a block's
parameters are unsharded around the checkpointed forward and, in backward, before the
recomputation starts.

Limits: non-reentrant checkpointing only (``use_reentrant=False``); recomputation repeats
a block's forward collectives (tensor-parallel all-gathers) in backward.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Collection, Iterator

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from meshpar.distributed._torch import attention_ops, c10d_functional_ops
from meshpar.parallel.wrap import wrap_forward, wrapped_by

MODES = ("none", "full", "selective")

# [Note: what selective checkpointing keeps]
# Matmuls and attention are the FLOPs; everything else in a block is memory-bound
# elementwise work whose recomputation costs little. Saving the outputs of the ops below
# and recomputing the rest keeps per block about 2 x (q, k, v, o, w1, w3, w2 outputs)
# instead of every intermediate (norm outputs, RoPE halves, SiLU, products). A
# tensor-parallel reduce-scatter is kept too, so recomputation issues no collective
# for it (torchtitan's selective policy keeps it for the same reason).
_aten = torch.ops.aten
_SAVE = {
    _aten.mm.default,
    _aten.addmm.default,
    _aten.bmm.default,
    *attention_ops(),
    c10d_functional_ops().reduce_scatter_tensor.default,
}


# [Note: what selective checkpointing recomputes anyway]
# A ring's attention (meshpar/parallel/context_parallel/ring_flex.py) runs inside an autograd
# Function, a call per ring step; keeping those calls' outputs would hold cp partial outputs per
# layer (the Function saves the merged one itself), so its forward runs under ``not_kept()`` and
# selective checkpointing recomputes it whole, as it recomputes ring.py's score blocks (not on the
# list) and as the planner prices it. Thread-local: a recompute runs where backward runs.
_inside = threading.local()


@contextlib.contextmanager
def not_kept() -> Iterator[None]:
    """Selective checkpointing keeps no op run inside: [Note: what selective checkpointing recomputes anyway]."""
    _inside.depth = getattr(_inside, "depth", 0) + 1
    try:
        yield
    finally:
        _inside.depth -= 1


def _selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    keep = op in _SAVE and not getattr(_inside, "depth", 0)
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    return create_selective_checkpoint_contexts(_selective_policy)


def _checkpointed(block: nn.Module, forward: Callable, context_fn: Callable | None,
                  forget: Callable[[nn.Module], None] | None) -> Callable:
    @functools.wraps(forward)
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():  # evaluation: nothing to save, nothing to recompute
            return forward(*args, **kwargs)
        extra = {"context_fn": context_fn} if context_fn is not None else {}
        if forget is None:  # nothing to let go of; and compiled (apply_compile), no counter for dynamo
            return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=False, **extra, **kwargs)
        calls = 0

        def once_then_recompute(*a, **k):
            nonlocal calls
            calls += 1
            try:
                return forward(*a, **k)
            finally:  # also when the recompute stops early (torch raises out of it)
                if calls > 1:
                    forget(block)

        return checkpoint(once_then_recompute, *args, use_reentrant=False, preserve_rng_state=False, **extra,
                          **kwargs)

    return run


def is_checkpointed(block: nn.Module) -> bool:
    """Whether ``apply_activation_checkpointing`` wrapped ``block``'s forward."""
    return wrapped_by(block, "checkpoint") is not None


def sets_side_outputs_under_checkpoint(block: nn.Module) -> bool:
    """Whether ``block`` is checkpointed and its forward leaves side outputs on its modules (an MoE
    layer's routing record): a side effect dynamo refuses inside checkpoint, so compiling it would
    graph-break ([Note: a recompute's side outputs])."""
    return (wrapped_by(block, "checkpoint") or {}).get("side_outputs", False)


# [Note: a recompute's side outputs]
# A block may leave results on its modules besides its return value: a mixture-of-experts layer
# keeps its ``aux_loss``, a graph over the layer's input and router probabilities that the step adds
# to the loss. The recompute in backward runs the same forward, so it leaves ``aux_loss`` again,
# and nothing consumes that second graph: held by the module, it would keep every recomputed
# layer's input and probabilities alive until the step dropped it after the whole backward
# (docs/performance.md#activation-checkpointing-of-sparse-layers). The wrapper lets go of them
# (``forget``, the family's ``MoEPart.forget``) as soon as the recompute returns; the forward's own
# (first call) stay for the loss. Under torch.compile the setting of aux_loss inside checkpoint is a
# side effect dynamo refuses: such a block would graph-break and run eagerly without this wrapper,
# so apply_compile leaves it uncompiled instead (parallelize.py).


def apply_activation_checkpointing(model: nn.Module, mode: str, every: int = 1, *,
                                   forget: Callable[[nn.Module], None] | None = None,
                                   leaving: Collection[int] = ()) -> nn.Module:
    """Checkpoint the blocks of ``model.layers`` whose global index is a multiple of ``every``.

    ``mode``: ``none`` (no change), ``full`` or ``selective``. Blocks are chosen by their key in
    ``model.layers`` (the index in the whole model), so a pipeline stage checkpoints the same
    blocks the whole model would. ``forget(block)``: drops the side outputs a forward of a block
    whose index is in ``leaving`` leaves (the family's ``MoEPart.forget`` and its sparse layers;
    [Note: a recompute's side outputs]).
    """
    if mode not in MODES:
        raise ValueError(f"activation checkpointing mode '{mode}': choose one of {', '.join(MODES)}")
    if every < 1:
        raise ValueError(f"activation checkpointing every = {every}: must be >= 1")
    if mode == "none":
        return model
    context_fn = _selective_contexts if mode == "selective" else None
    for key, block in model.layers.items():
        if int(key) % every == 0:
            # no dropout in meshpar's models, so the RNG state need not be replayed
            leaves = forget if int(key) in leaving else None
            wrap_forward(block, "checkpoint", lambda forward: _checkpointed(block, forward, context_fn, leaves),  # noqa: B023 - called at once
                         side_outputs=leaves is not None)
    return model
