"""``FSDPModule``, the class ``fully_shard`` mixes into a module, and the API around it:
``UnshardHandle``, ``register_fsdp_forward_method``, ``share_comm_ctx``.

Every public method follows PyTorch 2.13's FSDP2 API of the same name (tests/test_fsdp_api.py
checks the signatures; tests/test_fsdp_compat.py the behaviour); the README's FSDP API table
lists the two that raise and the two that change no result. Each method sets state on this
unit's parameter group (param_group.py) or hook state (state.py); ``fully_shard`` is api.py.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from meshpar.fsdp.param_group import ParamGroup
from meshpar.fsdp.state import CommContext, FSDPState


class UnshardHandle:
    """A handle on an ``FSDPModule.unshard(async_op=True)``: ``wait()`` completes it (forward waits
    for it anyway, so waiting is needed only to use the parameters before the forward)."""

    def wait(self) -> None:
        return


class _GroupsUnshardHandle(UnshardHandle):
    def __init__(self, groups: list[ParamGroup]):
        self._groups: list[ParamGroup] | None = groups

    def wait(self) -> None:
        for group in self._groups or ():
            group.wait_for_gather()
        self._groups = None  # hold no reference once done


class FSDPModule:
    """Mixed into every ``fully_shard``-ed module's class; the methods follow PyTorch's."""

    _fsdp_state: FSDPState

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # ``type(fsdp_module)(...)`` (e.g. indexing into a sharded container) builds the original class
        orig = next(c for c in cls.__mro__[1:] if c is not FSDPModule and not issubclass(c, FSDPModule))
        self = orig.__new__(orig)
        self.__init__(*args, **kwargs)
        return self

    def __deepcopy__(self, memo: dict) -> Any:
        raise AssertionError(f"a fully_shard-ed {type(self).__name__} cannot be deep-copied (its parameters are shards "
                             f"tied to process groups); copy the module before fully_shard, or move state with "
                             f"state_dict() / load_state_dict()")

    def _groups(self, recurse: bool) -> list[ParamGroup]:
        modules = self.modules() if recurse else [self]
        states = {id(m._fsdp_state): m._fsdp_state for m in modules if isinstance(m, FSDPModule)}
        return [g for s in states.values() for g in s.groups]

    # --- unshard / reshard ---------------------------------------------------------------------------
    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this unit's parameters now (not recursive). ``async_op``: start it and return
        an ``UnshardHandle``; forward waits for it, or call ``wait()`` to use them before."""
        groups = self._groups(recurse=False)
        for group in groups:
            group.unshard(async_op=async_op)
        if async_op:
            return _GroupsUnshardHandle(groups)
        return None

    def reshard(self) -> None:
        """Free this unit's unsharded parameters and register the sharded ones (not recursive)."""
        for group in self._groups(recurse=False):
            group.reshard()

    def reset_iter_state(self) -> None:
        """After a forward or backward that raised: on the root, drop the failed iteration's state
        (its gradients not yet reduced, accumulation without sync, HSDP partial sums), reshard
        every unit, and let the next iteration run normally."""
        self._fsdp_state.reset_iteration()

    # --- gradient accumulation -----------------------------------------------------------------------
    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: backward keeps unsharded gradients (no reduce-scatter, nor HSDP all-reduce) until a
        backward with True; they accumulate in ``reduce_dtype``."""
        for group in self._groups(recurse):
            group.requires_gradient_sync = requires_gradient_sync
            group.requires_all_reduce = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP, False: reduce-scatter each backward but all-reduce across replicas only on a later
        backward with True (the reduce-scatter outputs are summed meanwhile)."""
        for group in self._groups(recurse):
            group.requires_all_reduce = requires_all_reduce

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted for pipeline schedules and microbatching code. meshpar ends every backward with
        its reductions complete and its gradients written, which is what PyTorch's engine does only
        on the last one, so the flag changes no result (README: FSDP API)."""
        self._fsdp_state.last_backward = is_last_backward

    def reduce_grads(self) -> None:
        """Reduce now the gradients this unit holds unsharded (accumulated over no-sync
        microbatches, or written outside its hooks, e.g. by ``torch.autograd.grad`` in a
        zero-bubble weight pass), wait, add them to the sharded ``.grad`` and reshard if
        ``reshard_after_backward``. A no-op with nothing pending. Call with gradient sync on.
        (meshpar's addition; not in PyTorch's API.)"""
        for group in self._groups(recurse=False):
            group.finish_backward()

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Change ``reshard_after_forward`` at runtime (True on the root, or False for evaluation)."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"reshard_after_forward should be a bool, got {type(reshard_after_forward).__name__}; "
                             f"an int is accepted by fully_shard only")
        for state in self._states(recurse):
            state.reshard_after_forward = reshard_after_forward
            for group in state.groups:
                group.post_forward = None

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """False: keep the unsharded parameters after backward (no all-gather before the next
        microbatch's forward, at their memory's cost)."""
        for group in self._groups(recurse):
            group.reshard_after_backward = reshard_after_backward

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """False: backward does not all-gather this unit (its parameters are not needed for its
        gradients, e.g. an embedding's)."""
        for group in self._groups(recurse=False):
            group.unshard_in_backward = unshard_in_backward

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """True: a trainable parameter that got no gradient in a backward gets a zero gradient (so
        every rank's optimizer steps it). meshpar's reduce-scatter always holds a row for it, so
        ranks that used different parameters never mismatch either way."""
        for group in self._groups(recurse):
            group.reduce_unused = reduce_scatter_unused_params

    # --- prefetching -----------------------------------------------------------------------------------
    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather these units (asynchronously) right after this one's all-gather in forward."""
        self._fsdp_state.forward_prefetch = [_state_of(m) for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather these units right after this one's all-gather in backward (default: the unit
        before this one in forward order)."""
        self._fsdp_state.backward_prefetch = [_state_of(m) for m in modules]

    # --- reductions ------------------------------------------------------------------------------------
    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide this unit's reduced gradients by ``factor`` instead of the data-parallel world size
        (not recursive, as in PyTorch's engine: call it on each unit)."""
        for group in self._groups(recurse=False):
            group.divide_factor = factor

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated in PyTorch: ``set_gradient_divide_factor``."""
        warnings.warn("set_reduce_scatter_divide_factor is deprecated; use set_gradient_divide_factor",
                      FutureWarning, stacklevel=2)
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """meshpar's collectives always sum and divide after (no AVG or pre-multiplied sum), which is
        what this asks for; accepted with either value (README: FSDP API)."""
        for group in self._groups(recurse=False):
            group.force_sum = enable

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *, stream: Any = None) -> None:
        """Call ``hook(output)`` on this unit's reduced gradient (the reduce-scatter output, or the
        all-reduce output under HSDP), divided, before it is written to ``.grad``; ``hook`` may
        change it in place (e.g. all-reduce it over another group). ``stream``: a CUDA stream to
        run it on (not with HSDP)."""
        self._one_group("set_all_reduce_hook")
        for group in self._groups(recurse=False):
            if stream is not None and group.mesh_info.replicate_dim is not None:
                raise ValueError("set_all_reduce_hook: stream cannot be set under HSDP (the hook runs after "
                                 "the replicas' all-reduce); pass stream=None")
            group.all_reduce_hook = (hook, stream)

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """Reductions this unit may keep in flight before the next one waits for the oldest
        (default 1: [Note: one reduction in flight]); more overlap, more memory."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}")
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be a positive int, got {max_input_buffers}")
        for group in self._groups(recurse):
            group.max_in_flight = max_input_buffers

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        """Reduce-scatter on a process group of its own over the same ranks, so it can run beside
        the all-gathers (a collective over those ranks: call it on every one of them)."""
        made: dict[tuple[int, ...], dist.ProcessGroup] = {}
        for group in self._groups(recurse):
            if not enable:
                group.reduce_group = None
                continue
            ranks = tuple(dist.get_process_group_ranks(group.mesh_info.shard_group))
            if ranks not in made:
                made[ranks] = dist.new_group(list(ranks), use_local_synchronization=True)
            group.reduce_group = made[ranks]

    def set_custom_all_gather(self, comm: Any) -> None:
        """Use ``comm`` (PyTorch's ``AllGather`` interface: ``allocate(size, *, dtype, device)`` and
        ``comm(output_tensor, input_tensor, group, async_op)``) for this unit's all-gathers."""
        self._one_group("set_custom_all_gather")
        for group in self._groups(recurse=False):
            group.custom_all_gather = comm
            group.refresh_layout()  # no aliasing at one rank: the user's collective runs

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        """Use ``comm`` (PyTorch's ``ReduceScatter`` interface: ``allocate`` and ``comm(output_tensor,
        input_tensor, group, op, async_op)``) for this unit's reduce-scatters."""
        self._one_group("set_custom_reduce_scatter")
        for group in self._groups(recurse=False):
            group.custom_reduce_scatter = comm

    # --- GPU-side features --------------------------------------------------------------------------
    def set_post_optim_event(self, event: torch.Event) -> None:
        """The root's next all-gathers wait for ``event`` (recorded after the optimizer step) instead
        of for everything queued before; pass a new event each iteration."""
        self._fsdp_state.post_optim_event = event

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Not available: meshpar allocates communication buffers from the ordinary caching allocator
        (NCCL's zero-copy pools over NVLink SHARP are a GPU feature it does not use). False is
        accepted (it is the default)."""
        if enable:
            raise NotImplementedError(
                "set_allocate_memory_from_process_group_for_comm(True): meshpar does not allocate "
                "communication buffers from the process group's allocator (an NCCL feature for zero-copy "
                "transfers); its buffers come from the caching allocator. Leave it False.")

    def set_symm_mem_for_comm(self, backend: Literal["NCCL"] = "NCCL") -> None:
        """Not available: symmetric-memory all-gathers are an NCCL GPU feature meshpar does not use."""
        raise NotImplementedError(
            f"set_symm_mem_for_comm({backend!r}): meshpar's all-gathers do not use symmetric memory (an NCCL "
            f"copy-engine / symmetric-kernel GPU feature); drop the call, or use PyTorch's fully_shard for it.")

    # --- helpers ---------------------------------------------------------------------------------------
    def _one_group(self, method: str) -> None:
        """Refuse ``method`` on a unit of several parameter groups, as PyTorch's engine does: it names one
        collective (or hook) for the unit, and each group has its own process groups."""
        groups = self._fsdp_state.groups
        if len(groups) > 1:
            meshes = ", ".join(g.mesh_info.shard_dim_name for g in groups)
            raise ValueError(f"{method} on {self._fsdp_state.name}, a unit with {len(groups)} parameter groups "
                             f"(shard_placement_fn put its parameters on several meshes: {meshes}); one collective "
                             f"cannot serve them all. Call it on a unit of one mesh, or fully_shard the parameters "
                             f"of each mesh as a unit of their own")

    def _states(self, recurse: bool) -> list[FSDPState]:
        modules = self.modules() if recurse else [self]
        states = {id(m._fsdp_state): m._fsdp_state for m in modules if isinstance(m, FSDPModule)}
        return list(states.values())

    def _apply(self, fn, recurse: bool = True):
        # .to(dtype) / .to(device) / to_empty replace our sharded Parameters: reshard first (so the
        # sharded ones are registered and converted), then adopt the new ones (and keep ties)
        for group in self._groups(recurse=False):
            group.reshard()
        result = super()._apply(fn, recurse)
        for group in self._groups(recurse=False):
            group.refresh()
        return result


def _state_of(module: nn.Module) -> FSDPState:
    if not isinstance(module, FSDPModule):
        raise ValueError(f"{type(module).__name__} is not fully sharded; prefetch lists take fully_shard-ed modules")
    return module._fsdp_state


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>`` (a method other than ``forward`` that uses the parameters, e.g.
    ``generate``) unshard before it runs and reshard after, as ``forward`` does. A no-op on a
    module that is not fully sharded, so the same code runs with and without FSDP."""
    if not isinstance(module, FSDPModule):
        return
    if not hasattr(module, method_name):
        raise ValueError(f"{type(module).__name__} has no method {method_name!r} to register as a forward method")
    method = getattr(module, method_name)
    state = module._fsdp_state

    @functools.wraps(method)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = state._pre_forward(module, args, kwargs)
        return state._post_forward(module, args, method(*args, **kwargs))

    setattr(module, method_name, wrapped)


def share_comm_ctx(modules: list[FSDPModule]) -> None:
    """Let several roots (the model chunks of one pipeline stage) share their communication state:
    in meshpar, one bound on the reductions in flight across all of them."""
    if not modules:
        return
    for m in modules:
        if not isinstance(m, FSDPModule):
            raise ValueError(f"share_comm_ctx takes fully_shard-ed modules; got {type(m).__name__}")
    ctx = modules[0]._fsdp_state.comm_ctx or CommContext()
    for m in modules:
        state = m._fsdp_state
        state.comm_ctx = ctx
        if state.iteration is not None:  # already ran: switch the live iteration's queue too
            state.iteration.comm_ctx = ctx
            for s in state.iteration.states:
                for group in s.groups:
                    group.reduce_queue = ctx.reduce_queue
