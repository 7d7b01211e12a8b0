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

Notes: [Note: overlap on CPU and GPU], [Note: prefetch after our own unshard],
[Note: a group of several modules], [Note: units inside a unit].
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from meshpar.distributed import comm_record
from meshpar.distributed._torch import queue_backward_callback
from meshpar.distributed.tracing import trace_range
from meshpar.fsdp.param_group import ParamGroup
from meshpar.fsdp.policies import MixedPrecisionPolicy
from meshpar.fsdp.reduce import ReduceQueue
from meshpar.fsdp.streams import CudaStreams, streams_for
from meshpar.fsdp.tree import cast_floats, iter_tensors

# [Note: overlap on CPU and GPU]
# Prefetches are asynchronous collectives whose results are awaited just before the unit runs.
# gloo executes them on its own threads, so on CPU the all-gather of unit i+1 runs while unit i
# computes; NCCL runs them on its own stream likewise.

# [Note: prefetch after our own unshard]
# A unit first completes its own unshard (usually prefetched already: wait, copy out, free the
# all-gather buffer), then issues the next unit's all-gather. Prefetching before our own copy-out
# would hold three buffers of a unit's size at once (our gathered buffer, the unsharded parameters
# being filled, the prefetch's buffer) where PyTorch's engine holds two. No overlap is lost: on
# gloo the prefetch queues behind our own all-gather on the same group anyway
# (docs/performance.md#peak-memory-against-pytorchs-engine).

# [Note: a group of several modules]
# ``fully_shard([norm, head])`` makes one unit of several modules: one all-gather, one reduction.
# Every module's forward pre-hook unshards (a no-op once unsharded) and casts its inputs; the
# unit's post-forward work (reshard, backward hooks) runs when the last of its modules has run in
# this pass. A pass may run only some of them (a chunked loss: the model's forward runs ``norm``,
# the loss calls ``head`` per chunk): the root's post-forward then completes the unit, hooking the
# root's output so backward unshards it again, and later standalone calls leave it unsharded until
# its backward, as PyTorch's engine does. Autograd accumulates a parameter's gradient from every
# call before its hook fires, so the unit still reduces once.


class CommContext:
    """What roots that share communication share (``share_comm_ctx``: the model chunks of one
    pipeline stage): the queue bounding the reductions in flight, and on CUDA the streams."""

    def __init__(self) -> None:
        self.reduce_queue = ReduceQueue()
        self._streams: dict[torch.device, CudaStreams | None] = {}

    def streams(self, device: torch.device) -> CudaStreams | None:
        if device not in self._streams:
            self._streams[device] = streams_for(device)
        return self._streams[device]


class Iteration:
    """What the units of one root share."""

    def __init__(self, comm_ctx: CommContext) -> None:
        self.order: list[FSDPState] = []  # forward order of units with parameters
        self.order_frozen = False
        self.callback_queued = False
        self.states: list[FSDPState] = []
        self.comm_ctx = comm_ctx
        self.record: comm_record.CommRecord | None = None  # the one active at the root's last forward

    @property
    def reduce_queue(self) -> ReduceQueue:
        return self.comm_ctx.reduce_queue

    def use_record(self, record: comm_record.CommRecord | None) -> None:
        """Every unit's collectives report to ``record``, the one active where the root's forward runs,
        until the next forward; its backward may run on another thread: [Note: the active record]
        (meshpar/distributed/comm_record.py)."""
        if record is self.record:
            return
        self.record = record
        for state in self.states:
            for group in state.groups:
                group.record = record


class FSDPState:
    def __init__(self, modules: list[nn.Module], groups: list[ParamGroup], mp: MixedPrecisionPolicy,
                 reshard_after_forward: bool | int | None):
        # one group per mesh: [Note: several parameter groups in one unit] in placement.py; none without parameters
        self.modules, self.groups, self.mp = modules, groups, mp
        self.module = modules[0]
        self.reshard_after_forward = reshard_after_forward  # None: True, except at the root
        self.is_root: bool | None = None
        self.iteration: Iteration | None = None
        self.comm_ctx: CommContext | None = None  # set by share_comm_ctx, else made at lazy init
        self.forward_prefetch: list[FSDPState] | None = None  # explicit lists override the order
        self.backward_prefetch: list[FSDPState] | None = None
        self._in_backward = False
        self._to_run: set[int] = set()  # ids of this unit's modules yet to run in this forward pass
        self.post_optim_event: Any = None  # FSDPModule.set_post_optim_event (read at the root)
        self.last_backward = True  # FSDPModule.set_is_last_backward: recorded, changes nothing here
        self._nested_units: list[FSDPState] = []  # _nested's answer for the Iteration in _nested_of
        self._nested_of: Iteration | None = None
        for module in modules:
            module.register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True)
            module.register_forward_hook(self._post_forward, prepend=False)

    @property
    def group(self) -> ParamGroup | None:
        """The unit's one parameter group (None without parameters); ``groups`` where there may be several."""
        if len(self.groups) > 1:
            raise RuntimeError(f"{self.name} has {len(self.groups)} parameter groups (shard_placement_fn put its "
                               f"parameters on several meshes); read FSDPState.groups")
        return self.groups[0] if self.groups else None

    @property
    def name(self) -> str:
        return ", ".join(type(m).__name__ for m in self.modules)

    # --- root and lazy initialization --------------------------------------------------------------
    def _lazy_init(self) -> None:
        self.is_root = True
        self.iteration = Iteration(self.comm_ctx or CommContext())
        seen: set[int] = set()
        for m in self.module.modules():
            state = getattr(m, "_fsdp_state", None)
            if state is None or id(state) in seen:
                continue
            seen.add(id(state))
            if state is not self:
                if state.is_root:
                    raise RuntimeError(f"{state.name} ran forward as an FSDP root before its parent "
                                       f"{self.name}; run the outermost module first")
                state.is_root = False
            state.iteration = self.iteration
            self.iteration.states.append(state)
            for group in state.groups:
                group.reduce_queue, group.record = self.iteration.reduce_queue, None
                params = group.all_params
                group.streams = self.iteration.comm_ctx.streams(params[0].compute_device) if params else None
                group.refresh()

    def _reshards_after_forward(self) -> bool:
        reshard = self.reshard_after_forward
        return not self.is_root if reshard is None else bool(reshard)

    # --- forward -------------------------------------------------------------------------------------
    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self.is_root is None:
            self._lazy_init()
        it = self.iteration
        if self.is_root and not self._in_backward:
            it.use_record(comm_record.active())
        with trace_range("meshpar::fsdp.pre_forward"):
            if self.post_optim_event is not None:  # the all-gathers wait for the optimizer step
                self.post_optim_event.wait()
                self.post_optim_event = None
            first = not self._to_run  # the first of this unit's modules in this pass
            if first:
                self._to_run = {id(m) for m in self.modules}
            if self.groups:
                if first and not self._in_backward and not it.order_frozen and torch.is_grad_enabled():
                    it.order.append(self)
                for group in self.groups:  # ours first: [Note: prefetch after our own unshard]
                    group.unshard()
                if first and not self._in_backward:
                    for target in self._forward_targets():
                        for group in target.groups:
                            group.unshard(async_op=True)
            if self.mp.cast_forward_inputs and self.mp.param_dtype is not None:
                args, kwargs = cast_floats((args, kwargs), self.mp.param_dtype)
        return args, kwargs

    def _forward_targets(self) -> list[FSDPState]:
        if self.forward_prefetch is not None:
            return [t for t in self.forward_prefetch if t.groups]
        order = self.iteration.order
        if not self.iteration.order_frozen or self not in order:
            return []
        i = order.index(self)
        return order[i + 1:i + 2]

    def _post_forward(self, module: nn.Module, args: tuple, output: Any) -> Any:
        with trace_range("meshpar::fsdp.post_forward"):
            if self._in_backward:  # recomputation (activation checkpointing): backward reshards
                return self._cast_output(output)
            self._to_run.discard(id(module))
            if self._to_run:  # [Note: a group of several modules]: the unit's other modules still to run
                return self._cast_output(output)
            output = self._complete_forward(output)
            if self.is_root:
                for state in self.iteration.states:  # units some of whose modules did not run
                    if state is not self and state._to_run:
                        output = state._complete_forward(output)
                        state._to_run.clear()
                if torch.is_grad_enabled():  # a no-grad forward records no order
                    self.iteration.order_frozen = True
        return self._cast_output(output)

    def _complete_forward(self, output: Any) -> Any:
        """The unit's post-forward: reshard (per ``reshard_after_forward``) and hook ``output``'s
        gradients to unshard this unit again in backward."""
        if not torch.is_grad_enabled():  # no backward will come: free everything now
            for group in self.groups:
                group.reshard()
            return output
        if self._reshards_after_forward():
            for group in self.groups:
                group.reshard(after_forward=True)
        self._register_pre_backward(output)
        return output

    def _cast_output(self, output: Any) -> Any:
        return output if self.mp.output_dtype is None else cast_floats(output, self.mp.output_dtype)

    # --- backward ------------------------------------------------------------------------------------
    def _register_pre_backward(self, output: Any) -> None:
        for t in iter_tensors(output):
            if t.requires_grad:
                t.register_hook(self._pre_backward)

    def _pre_backward(self, grad: torch.Tensor) -> torch.Tensor:
        it = self.iteration
        if not it.callback_queued:
            it.callback_queued = True
            queue_backward_callback(self._root_end_of_backward)
        with trace_range("meshpar::fsdp.pre_backward"):
            for group in self.groups:  # ours first: [Note: prefetch after our own unshard]
                if group.unshard_in_backward:
                    group.unshard()
            if not self._in_backward:
                self._in_backward = True
                for inner in self._nested():  # [Note: units inside a unit]
                    inner._in_backward = True  # its recompute, inside ours, neither prefetches nor reshards
                    inner._unshard_in_backward(async_op=True)
                for target in self._backward_targets():
                    target._unshard_in_backward(async_op=True)
        return grad

    def _unshard_in_backward(self, async_op: bool) -> None:
        for group in reversed(self.groups):  # backward's order, as PyTorch's engine prefetches them
            if group.unshard_in_backward:
                group.unshard(async_op=async_op)

    # [Note: units inside a unit]
    # A mixture-of-experts block is one unit with its experts (or whole sparse layer) a unit inside it,
    # sharded over other ranks (meshpar/parallel/parallelize.py). In forward, the order's prefetch issues
    # the inner unit's all-gather from the block's pre-forward, outside the block's own forward. Under
    # activation checkpointing the recompute runs the block's forward alone (no hooks of the block), and
    # selective checkpointing replays the forward's ops in order, so an all-gather issued inside the
    # recompute would be an op it never recorded. So a unit's pre-backward, which runs before its
    # recompute, also gathers the units inside it (in backward, as in forward, only the inner wait runs
    # inside the block's forward), and marks them in backward, so that inside the recompute they
    # neither prefetch the next block (the forward's order) nor reshard. The root does not: every
    # block is inside it.
    def _nested(self) -> list[FSDPState]:
        """The units inside this one, found once per root's lazy initialization (its ``Iteration``):
        every backward asks, and walking the module tree each time cost ~0.1 ms a unit."""
        if self.is_root or self.iteration is None:
            return []
        if self._nested_of is not self.iteration:
            inside = {id(m) for top in self.modules for m in top.modules() if m is not top}
            self._nested_units = [s for s in self.iteration.states
                                  if s is not self and s.groups and any(id(m) in inside for m in s.modules)]
            self._nested_of = self.iteration
        return self._nested_units

    def _backward_targets(self) -> list[FSDPState]:
        if self.backward_prefetch is not None:
            return [t for t in self.backward_prefetch if t.groups]
        order = self.iteration.order
        if self not in order:
            return []
        i = order.index(self)
        return order[i - 1:i] if i > 0 else []

    def _root_end_of_backward(self) -> None:
        with trace_range("meshpar::fsdp.end_of_backward"):
            self._end_iteration(ParamGroup.finish_backward)

    def _end_iteration(self, end_group: Callable[[ParamGroup], None]) -> None:
        """``end_group`` on every unit's groups (last first, as PyTorch's engine ends them), then clear the
        iteration's per-pass state."""
        for state in self.iteration.states:
            for group in reversed(state.groups):
                end_group(group)
            state._in_backward = False
            state._to_run.clear()
        self.iteration.callback_queued = False

    # --- recovery ------------------------------------------------------------------------------------
    def reset_iteration(self) -> None:
        """``FSDPModule.reset_iter_state``: see ``ParamGroup.reset``."""
        if self.is_root is False:
            raise RuntimeError(f"reset_iter_state must be called on the root FSDP module (the one fully_shard "
                               f"was applied to last, which runs forward first), not on {self.name}")
        if self.iteration is None:
            return
        self._end_iteration(ParamGroup.reset)
        if not self.iteration.order_frozen:  # a forward that raised recorded part of an order
            self.iteration.order.clear()
