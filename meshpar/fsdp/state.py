"""Hook state: when each unit unshards, prefetches, reshards and reduces.

One ``FSDPState`` per ``fully_shard`` call, attached to its module. The outermost one that
runs forward first becomes the root; it owns what every unit shares for an iteration:
the forward order (recorded on the first iteration, used for implicit prefetching) and
the end-of-backward callback.

    forward   pre:  unshard (wait if prefetched) -> prefetch the next unit -> cast inputs
              post: reshard (unless reshard_after_forward=False, or None at the root)
                    -> hook the outputs' gradients (pre-backward) -> cast outputs
    backward  pre:  (first one queues the end-of-backward callback) unshard
                    -> prefetch the unit before this one in forward order
              post: when the group's last gradient accumulates: reduce-scatter, reshard
    end of backward: reduce what was not reduced (unused parameters), wait, reshard all

[Note: overlap on CPU and GPU]
Prefetches are asynchronous collectives whose results are awaited just before the unit
runs. gloo executes them on its own threads, so on CPU the all-gather of unit i+1 runs
while unit i computes; NCCL runs them on its own stream likewise.

[Note: prefetch after our own unshard]
A unit first completes its own unshard (usually prefetched already: wait, copy out, free the
all-gather buffer), then issues the next unit's all-gather. Issuing the prefetch before
our own copy-out held three buffers of a unit's size at once (our gathered buffer, the
unsharded parameters being filled, the prefetch's buffer) where PyTorch's engine holds two:
debug Llama, 4 gloo ranks, peak 49.6 MiB against PyTorch's 48.8; after, 48.8 against 48.8.
Step time did not move (median ms over 16 steps, two runs each, bench_fsdp):

    ranks   prefetch first   ours first   PyTorch's engine
      2      190.7, 194.1    189.0, 192.7    220.7-230.1
      4      287.4, 276.3    271.0, 286.9    348.4-361.0

On gloo the prefetch queues behind our own all-gather on the same group anyway.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.autograd.profiler import record_function

from meshpar._torch import queue_backward_callback, tree_flatten, tree_map
from meshpar.fsdp.param_group import ParamGroup, ReduceQueue
from meshpar.fsdp.policies import MixedPrecisionPolicy


class Iteration:
    """What the units of one root share."""

    def __init__(self) -> None:
        self.order: list[FSDPState] = []  # forward order of units with parameters
        self.order_frozen = False
        self.callback_queued = False
        self.states: list[FSDPState] = []
        self.reduce_queue = ReduceQueue()


class FSDPState:
    def __init__(self, module: nn.Module, group: ParamGroup | None, mp: MixedPrecisionPolicy,
                 reshard_after_forward: bool | int | None):
        self.module, self.group, self.mp = module, group, mp
        self.reshard_after_forward = reshard_after_forward
        self.is_root: bool | None = None
        self.iteration: Iteration | None = None
        self.forward_prefetch: list[FSDPState] | None = None  # explicit lists override the order
        self.backward_prefetch: list[FSDPState] | None = None
        self._in_backward = False
        module.register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True)
        module.register_forward_hook(self._post_forward, prepend=False)

    # --- root and lazy initialization --------------------------------------------------------------
    def _lazy_init(self) -> None:
        self.is_root = True
        self.iteration = Iteration()
        for m in self.module.modules():
            state = getattr(m, "_fsdp_state", None)
            if state is None:
                continue
            if state is not self:
                if state.is_root:
                    raise RuntimeError(f"{type(m).__name__} ran forward as an FSDP root before its parent "
                                       f"{type(self.module).__name__}; run the outermost module first")
                state.is_root = False
            state.iteration = self.iteration
            self.iteration.states.append(state)
            if state.group is not None:
                state.group.reduce_queue = self.iteration.reduce_queue
                for p in state.group.all_params:
                    p.refresh_after_apply()

    # --- forward -------------------------------------------------------------------------------------
    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self.is_root is None:
            self._lazy_init()
        it = self.iteration
        with record_function("meshpar::fsdp.pre_forward"):
            if self.group is not None:
                if not it.order_frozen and torch.is_grad_enabled():
                    it.order.append(self)
                self.group.unshard()  # ours first: [Note: prefetch after our own unshard]
                for target in self._forward_targets():
                    target.group.unshard(async_op=True)
            if self.mp.cast_forward_inputs and self.mp.param_dtype is not None:
                args, kwargs = _cast_floats((args, kwargs), self.mp.param_dtype)
        return args, kwargs

    def _forward_targets(self) -> list[FSDPState]:
        if self.forward_prefetch is not None:
            return self.forward_prefetch
        order = self.iteration.order
        if not self.iteration.order_frozen or self not in order:
            return []
        i = order.index(self)
        return order[i + 1:i + 2]

    def _post_forward(self, module: nn.Module, args: tuple, output: Any) -> Any:
        with record_function("meshpar::fsdp.post_forward"):
            if not torch.is_grad_enabled():  # no backward will come: free everything now
                if self.group is not None:
                    self.group.reshard()
            else:
                reshard = self.reshard_after_forward
                if self.group is not None and (not self.is_root if reshard is None else reshard):
                    self.group.reshard(after_forward=True)
                self._register_pre_backward(output)
            if self.is_root and torch.is_grad_enabled():  # a no-grad forward records no order
                self.iteration.order_frozen = True
            if self.mp.output_dtype is not None:
                output = _cast_floats(output, self.mp.output_dtype)
        return output

    # --- backward ------------------------------------------------------------------------------------
    def _register_pre_backward(self, output: Any) -> None:
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        for t in tensors:
            t.register_hook(self._pre_backward)

    def _pre_backward(self, grad: torch.Tensor) -> torch.Tensor:
        it = self.iteration
        if not it.callback_queued:
            it.callback_queued = True
            queue_backward_callback(self._root_end_of_backward)
        if self._in_backward:
            return grad
        self._in_backward = True
        with record_function("meshpar::fsdp.pre_backward"):
            if self.group is not None:
                self.group.unshard()  # ours first: [Note: prefetch after our own unshard]
                for target in self._backward_targets():
                    target.group.unshard(async_op=True)
        return grad

    def _backward_targets(self) -> list[FSDPState]:
        if self.backward_prefetch is not None:
            return self.backward_prefetch
        order = self.iteration.order
        if self not in order:
            return []
        i = order.index(self)
        return order[i - 1:i] if i > 0 else []

    def _root_end_of_backward(self) -> None:
        with record_function("meshpar::fsdp.end_of_backward"):
            for state in self.iteration.states:
                if state.group is not None:
                    state.group.finish_backward()
                state._in_backward = False
            self.iteration.reduce_queue.clear()
            self.iteration.callback_queued = False


def _cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    def cast(x: Any) -> Any:
        return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    return tree_map(cast, tree)
