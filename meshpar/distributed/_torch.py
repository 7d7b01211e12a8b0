"""Every private PyTorch name meshpar relies on, looked up in this one module.

PyTorch's underscore names (``_StridedShard``, ``DeviceMesh._flatten``, ``torch.utils._pytree``,
``MemTracker`` internals, ...) carry no compatibility promise and move between releases. The
rest of meshpar imports them from here, under a public meshpar name or behind a small
function, so that a torch upgrade breaks in one file, and ``tests/test_torch_compat.py``
resolves every entry of ``REQUIRED`` against the installed torch and names the meshpar
feature that loses its footing when one is gone.

Per name below: why meshpar needs it and the public alternative, if any. Written against
torch 2.13.

Import cost: the names used by FSDP, tensor parallelism and checkpoints are cheap (their
modules are loaded by ``torch.distributed.tensor`` anyway) and bound at import. The memory
tracker, the fake process group and fake tensors, DTensor's sharding-propagation module, the
profiler ops, the CUDA allocator hooks and the pipeline schedules' point-to-point issue are
imported on first use (module ``__getattr__`` or inside a function), so ``import meshpar``
and ``import meshpar.fsdp`` pull in none of them.

What cannot go through here: a meshpar subclass overriding a torch base class's private
method (``AllocationTracker._track`` over ``MemTracker._track``, ``FSDPModule._apply`` over
``nn.Module._apply``, the ``ParallelStyle._apply`` of meshpar's styles) or reading its own
inherited private state (``self._WINFO``). Those names are in ``REQUIRED`` all the same.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import sys
from collections.abc import Callable, Iterator
from types import MappingProxyType
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

# --- DTensor placements ---------------------------------------------------------------------------
# StridedShard(dim, split_factor): dim cut into split_factor chunks, each sharded over the mesh dim,
# a rank's pieces concatenated. PyTorch's own fully_shard places a parameter that tensor parallelism
# already shards on dim 0 this way, and GPT-2's fused q|k|v projection needs it ([Note: fused
# projections] in meshpar/parallel/tensor_parallel/styles.py). Public alternative: none (it is not a Shard subclass
# in every release, so isinstance checks name it explicitly).
from torch.distributed.tensor.placement_types import _StridedShard as StridedShard

# --- pytrees --------------------------------------------------------------------------------------
# The tensors in a module's nested inputs / outputs (the trace labels; FSDP walks them itself,
# dataclasses included: meshpar/fsdp/tree.py), and those of an op's result the planner's tracker
# does not walk itself (planner/tracker.py). Public alternative: ``torch.utils.pytree`` is
# announced but not in 2.13; ``optree`` would add a dependency.
from torch.utils._pytree import tree_leaves, tree_map_only

# Bound at import; the names of _LAZY below (MemTracker, FakeTensorMode, FakeStore, ...) on first use.
__all__ = [
    "REQUIRED", "CUDA_ONLY", "StridedShard", "tree_leaves", "tree_map_only", "flatten_mesh",
    "unflatten_mesh", "concatenate_meshes", "dtensor_like", "dtensor_where_it_is", "foreach_norm", "foreach_mul_",
    "foreach_copy_",
    "local_tensor", "adam_init_group",
    "module_parameters", "forward_hook_dicts",
    "queue_backward_callback", "post_accumulate_grad_hooks", "preserve_version_counter", "c10d_functional_ops",
    "attention_ops",
    "profiler_enabled", "record_function_enter", "record_function_exit", "record_cuda_memory_history",
    "dump_cuda_memory_snapshot", "attach_cuda_oom_observer", "schedule_p2p_through",
    "backward_launch_context", "clear_dtensor_caches", "stop_dcp_save_process", "resolve",
    "shard_placement_result", "fsdp_mesh_info_parts",
]


# --- device meshes --------------------------------------------------------------------------------

def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """``mesh``'s dims merged into one 1-D mesh named ``name`` (the flattened ``dp`` = dp_replicate x
    dp_shard that data is sharded over), registered on the root mesh so ``root[name]`` finds it.
    Public alternative: none; a fresh ``init_device_mesh`` would make new process groups and not
    share the root's."""
    return mesh._flatten(name)


def unflatten_mesh(mesh: DeviceMesh, dim: int | str, sizes: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """``mesh`` with ``dim`` split into dims of ``sizes`` named ``names`` (FSDP's int
    ``reshard_after_forward`` keeps shards within the inner groups). Public alternative: none."""
    return mesh._unflatten(dim, sizes, names)


def concatenate_meshes(meshes: list[DeviceMesh]) -> DeviceMesh:
    """One mesh over the dims of ``meshes``, all slices of the same root (FSDP's data-parallel
    dims beside tensor parallel's ``tp``, the 2-D mesh of a sharded TP parameter). Public
    alternative: slicing the root by names, ``root["dp_shard", "tp"]``, which needs the root."""
    return DeviceMesh._concatenate(meshes)


# --- tensors and modules ----------------------------------------------------------------------------

def dtensor_where_it_is(local: torch.Tensor, mesh: DeviceMesh, placements: tuple, shape: torch.Size,
                        stride: tuple[int, ...]) -> DTensor:
    """A DTensor over ``local`` as it is, on its own device: ``DTensor.from_local`` moves a local tensor
    to the mesh's device type, so a CPU-offloaded shard on a CUDA mesh would come back on the GPU
    (tests/test_cuda.py's offload test). PyTorch's FSDP builds its offloaded
    shards through DTensor's constructor and a spec, as here. No public alternative keeps the device."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    spec = DTensorSpec(mesh, tuple(placements), tensor_meta=TensorMeta(torch.Size(shape), tuple(stride), local.dtype))
    return DTensor(local, spec, requires_grad=False)


def dtensor_like(local: torch.Tensor, like: DTensor) -> DTensor:
    """A DTensor over ``local`` with ``like``'s mesh, placements, global shape and stride (``local`` has
    ``like``'s local shape and dtype): a sharded gradient, every step for every parameter. Built
    through DTensor's constructor with ``like``'s spec, as PyTorch's own FSDP builds its gradients;
    the public ``DTensor.from_local`` runs an autograd function and rebuilds and validates the spec
    on every call, per parameter and step (docs/performance.md#per-step-host-costs). Public
    alternative: ``DTensor.from_local(local, mesh, placements, run_check=False, shape=..., stride=...)``."""
    return DTensor.__new__(DTensor, local, like._spec, requires_grad=False)  # [Note: DTensor without __init__]


# [Note: DTensor without __init__]
# ``DTensor(...)`` runs ``DTensor.__new__`` (C++: sets the spec and the local tensor) and then
# ``DTensor.__init__``, whose body only calls ``Tensor.__init__`` but which is wrapped for dynamo and
# torch.export: about 2 us more per call in eager, on every gradient of every step. Calling
# ``__new__`` alone makes the same object. tests/test_torch_compat.py checks that ``__init__`` still
# does nothing else.


def same_spec(a: DTensor, b: DTensor) -> bool:
    """Whether two DTensors share one spec object (mesh, placements, global shape and stride): true of
    FSDP's gradients and their parameters (``dtensor_like``), a check without comparing placements.
    Public alternative: ``a.placements == b.placements and a.device_mesh == b.device_mesh`` and the shapes."""
    return a._spec is b._spec


def foreach_norm(tensors: list[torch.Tensor], ord: float, dtype: torch.dtype) -> list[torch.Tensor]:
    """Each tensor's ``ord``-norm, accumulated in ``dtype``, in one multi-tensor kernel per device and
    dtype (gradient clipping: one call where a loop over 147 gradients launched 147). Public
    alternative: ``torch.linalg.vector_norm`` per tensor."""
    return list(torch._foreach_norm(tensors, ord, dtype=dtype))


def foreach_copy_(dst: list[torch.Tensor], src: list[torch.Tensor], non_blocking: bool = False) -> None:
    """``d.copy_(s)`` for every pair, casting as ``copy_`` does, in one dispatched call (an FSDP unit's
    parameters cast for compute: one call where a loop over a unit's parameters made one each). Public
    alternative: a loop of ``copy_``."""
    torch._foreach_copy_(dst, src, non_blocking=non_blocking)


def chunk_cat(tensors: list[torch.Tensor], num_chunks: int, out: torch.Tensor) -> None:
    """Row i of ``out`` (``[num_chunks, m]``) <- chunk i of every tensor's dim 0, flattened, one tensor
    after another; each dim 0 zero-padded to ``num_chunks`` x ceil(rows / num_chunks), cast to ``out``'s
    dtype, in one call (PyTorch's FSDP copies a reduce-scatter's gradients in with it). The tensors:
    one dtype, at least one dimension and one element each (else torch raises, or crashes on a 0-dim
    one). Public alternative: per tensor, ``F.pad`` to whole chunks and ``copy_`` into ``out``'s columns."""
    torch._chunk_cat(tensors, 0, num_chunks, out=out)


def foreach_mul_(tensors: list[torch.Tensor], scalar: torch.Tensor) -> None:
    """``t.mul_(scalar)`` for every tensor (a 0-dim tensor on their device), in multi-tensor kernels.
    Public alternative: a loop of ``mul_``."""
    torch._foreach_mul_(tensors, scalar)


def local_tensor(dt: DTensor) -> torch.Tensor:
    """The DTensor's local storage itself, outside autograd (in-place gradient accumulation into
    ``param.grad``). Public alternative: ``dt.to_local()``, which is autograd-aware and, under
    grad mode, returns a view through an autograd function."""
    return dt._local_tensor


def adam_init_group(optimizer: torch.optim.Adam, group: dict, *lists: list[torch.Tensor]) -> bool:
    """``Adam._init_group``: fills ``lists`` (parameters with a gradient, gradients, exp_avg, exp_avg_sq,
    max_exp_avg_sq, step) for ``group``, creating missing state as AdamW itself does, so a
    checkpoint sees AdamW's state; returns whether any parameter is complex. Public alternative:
    rebuilding that state creation (dtypes and devices per option) in meshpar."""
    return optimizer._init_group(group, *lists)


def module_parameters(module: nn.Module) -> dict[str, nn.Parameter | None]:
    """``module``'s own parameter slots, the live dict: reading every slot (None ones too) and
    swapping a Parameter in place without ``__setattr__``/``register_parameter`` (FSDP's and
    tensor parallel's tied-parameter bookkeeping). Public alternative: ``named_parameters(recurse=
    False)`` to read, ``register_parameter`` to write (which also runs the global registration hooks)."""
    return module._parameters


def forward_hook_dicts(module: nn.Module) -> tuple[dict[int, Callable], dict[int, Callable]]:
    """``module``'s forward pre-hooks and forward hooks by handle id, live: the trace labels wrap the
    hooks a ParallelStyle installed, keeping their ids and order. Public alternative: none (handles
    can remove a hook, not replace it in place)."""
    return module._forward_pre_hooks, module._forward_hooks


# --- autograd ---------------------------------------------------------------------------------------

def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the current backward pass ends (FSDP's end of backward: wait for the
    last reduce-scatters, reshard). Public alternative: none in 2.13 (a hook on the root's inputs
    misses parameters whose gradients land later)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def backward_launch_context() -> contextvars.Context | None:
    """In a backward, a copy of the context of the thread that launched it, else None. On CUDA autograd
    runs hooks and ``backward`` functions on a device thread of its own, outside that context, and keeps
    this copy for them in its thread-local state (for compiled backwards' configuration): context
    variables the caller set can be read from it ([Note: the active record] in comm_record.py). Public
    alternative: none in 2.13 (``AutogradContextVar`` is proposed upstream)."""
    if torch._C._is_key_in_tls("context"):
        return torch._C._get_obj_in_tls("context")
    return None


def post_accumulate_grad_hooks(tensor: torch.Tensor) -> list[Callable[[torch.Tensor], None]]:
    """The hooks ``register_post_accumulate_grad_hook`` put on ``tensor``. FSDP assigns a sharded
    parameter's gradient itself (autograd only ever sees the unsharded one), so it runs them, as
    autograd would: an optimizer stepped in backward. Public alternative: none."""
    hooks = getattr(tensor, "_post_accumulate_grad_hooks", None)
    return list(hooks.values()) if hooks else []


def preserve_version_counter(tensors: torch.Tensor | tuple[torch.Tensor, ...]) -> contextlib.AbstractContextManager:
    """Write into ``tensors`` (one or a tuple) without bumping the version counter autograd checks
    (FSDP refills an unsharded parameter that forward already saved for backward). Public
    alternative: none."""
    return torch.autograd._unsafe_preserve_version_counter(tensors)


def c10d_functional_ops() -> Any:
    """The functional collectives' op namespace (``reduce_scatter_tensor`` ...): DTensor's
    redistributions issue these ops, which selective activation checkpointing keeps. Public
    alternative: none for the op overloads (``torch.distributed._functional_collectives`` is private too)."""
    return torch.ops._c10d_functional


def attention_ops() -> tuple[Any, ...]:
    """The aten kernels behind ``F.scaled_dot_product_attention`` (flash, memory-efficient, CPU
    flash, cuDNN) and flex_attention's operator, whose outputs selective activation checkpointing
    keeps. Public alternative: none; the public functions dispatch to these underscore-named ops."""
    aten = torch.ops.aten
    return (aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_flash_attention_for_cpu.default, aten._scaled_dot_product_cudnn_attention.default,
            torch.ops.higher_order.flex_attention)


def flex_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             block_mask: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """flex_attention's output and log-sum-exp (natural log) by its eager reference implementation,
    both differentiable on any device. The public function refuses inputs that need a gradient on
    CPU (its compiled CPU kernel has no backward); the operator it calls has a reference backward,
    so CPU runs meshpar's flex paths in float64 through this (ring_flex.py). Public alternative:
    ``flex_attention(..., return_aux=AuxRequest(lse=True))`` on CUDA only."""
    import math

    from torch._higher_order_ops.flex_attention import flex_attention as operator
    from torch.nn.attention import flex_attention as flex

    options = flex._apply_kernel_options(q, k, v, True, None, None)
    out, lse, _ = operator(q, k, v, flex._identity, block_mask.as_tuple(), q.shape[-1] ** -0.5, options)
    # the operator's statistics are in base 2 off its flash backend (the public function rescales them)
    return out, (lse if options["BACKEND"] == "FLASH" else lse * math.log(2))


# --- the profiler --------------------------------------------------------------------------------------

def profiler_enabled() -> bool:
    """Whether an autograd profiler is recording: trace labels cost one check when it is not.
    Public alternative: none (``torch.autograd.profiler`` keeps the state private)."""
    return torch._C._autograd._profiler_enabled()


def record_function_enter(name: str) -> Any:
    """Open a profiler range that a later ``record_function_exit(handle)`` closes, possibly from another
    autograd node (the trace labels' backward ranges). Public alternative: ``record_function``, a
    context manager, which cannot span two callbacks."""
    return torch.ops.profiler._record_function_enter_new(name, None)


def record_function_exit(handle: Any) -> None:
    """Close a range opened by ``record_function_enter``."""
    torch.ops.profiler._record_function_exit._RecordFunction(handle)


# --- the CUDA caching allocator -----------------------------------------------------------------------

def record_cuda_memory_history(max_entries: int) -> None:
    """Start recording the allocator's history (``[profile] profile_memory`` on CUDA). Public
    alternative: none; it is what https://pytorch.org/memory_viz documents."""
    torch.cuda.memory._record_memory_history(max_entries=max_entries)


def dump_cuda_memory_snapshot(path: str) -> None:
    """Write the allocator's snapshot (pickle, for https://pytorch.org/memory_viz)."""
    torch.cuda.memory._dump_snapshot(path)


def attach_cuda_oom_observer(observer: Callable[[int, int, int, int], None]) -> None:
    """Call ``observer(device, alloc, device_alloc, device_free)`` on a CUDA out-of-memory error
    (meshpar dumps a snapshot). CUDA builds only. Public alternative: none."""
    torch._C._cuda_attach_out_of_memory_observer(observer)


# --- pipeline schedules ----------------------------------------------------------------------------------
# [Note: torch's pipeline p2p issue, replaced for a block]
# torch's pipeline schedules issue every batch of point-to-point ops through one module-level function,
# ``schedules._batch_p2p``, and offer no hook for it. ``schedule_p2p_through(issue)`` routes it for the
# block that asks (a pipeline's step): while the block runs, the module's function is a router that
# calls the ``issue`` of the caller's context (a context variable: another thread's schedule, or one
# outside any block, goes straight to torch's function), and the block that installed the router puts
# torch's function back as it ends. A block nested in another, or beside it on another thread, finds
# the router in place and sets only its own ``issue``; one that outlives the installing block issues
# its remaining batches through torch's function. Public alternative: none.
_P2P_ISSUE: contextvars.ContextVar[Callable | None] = contextvars.ContextVar("meshpar_schedule_p2p", default=None)


@contextlib.contextmanager
def schedule_p2p_through(issue: Callable[[Callable, list, str | None], list]) -> Iterator[None]:
    """In this block (on this thread) torch's pipeline schedules issue each batch of point-to-point ops
    as ``issue(torch_issue, p2p_ops, desc)``: [Note: torch's pipeline p2p issue, replaced for a block]."""
    from torch.distributed.pipelining import schedules

    token = _P2P_ISSUE.set(issue)
    found, router = schedules._batch_p2p, None
    if not hasattr(found, "meshpar_routes"):
        router = _p2p_router(found)
        schedules._batch_p2p = router
    try:
        yield
    finally:
        _P2P_ISSUE.reset(token)
        if router is not None and schedules._batch_p2p is router:
            schedules._batch_p2p = found


def _p2p_router(torch_issue: Callable) -> Callable:
    def routed(p2p_ops: list, desc: str | None = None) -> list:
        issue = _P2P_ISSUE.get()
        return torch_issue(p2p_ops, desc) if issue is None else issue(torch_issue, p2p_ops, desc)

    routed.meshpar_routes = torch_issue
    return routed


# --- DCP's background save process ------------------------------------------------------------------------

def stop_dcp_save_process(timeout: float) -> None:
    """Stop the process DCP's process-based ``async_save`` started in this process, if any, and forget
    it, so that a later save starts a fresh one on the process group of its time. It is asked to stop
    (it finishes a save in flight first), given ``timeout`` seconds, then killed: meshpar starts it
    with the stop signals blocked ([Note: a save in another process] in meshpar/checkpoint/background.py),
    so ``terminate()`` would not end it. Public alternative: none (DCP stops it only when the module
    global holding it is garbage-collected, and multiprocessing's exit handler joins it first)."""
    from torch.distributed.checkpoint import _async_process_executor as executor

    saver, executor._CHECKPOINT_PROCESS = executor._CHECKPOINT_PROCESS, None
    if saver is None:
        return
    process = saver._save_process
    if process.is_alive():
        with contextlib.suppress(OSError, ValueError):  # its end of the pipe is gone: it is exiting
            saver._send(executor._CheckpointSaveProcessControlOpts.TERMINATE)
        process.join(timeout)
        if process.is_alive():
            process.kill()
            process.join()
    saver._process_pipe.close()


# --- DTensor's caches -------------------------------------------------------------------------------------

def clear_dtensor_caches() -> None:
    """Forget DTensor's cached sharding decisions and redistribution plans. They are keyed by
    mesh, and meshes compare equal by shape and names: an entry cached in one world (``meshpar
    plan``'s fake one, a real one) would hand the next world's DTensors the process groups of the
    last, destroyed ones. Public alternative: none."""
    from torch.distributed.tensor._redistribute import _gen_transform_infos

    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    propagator._propagate_tensor_meta_cached.cache_clear()
    _gen_transform_infos.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()  # its C++ fast path's own cache


# --- DTensor's shape propagation under a fake mode -------------------------------------------------------

@contextlib.contextmanager
def dtensor_shapes_in_own_fake_mode() -> Iterator[None]:
    """DTensor finds each op's output shapes by running it on fake tensors of the global shapes, in
    the fake mode ``torch._guards.detect_fake_mode()`` returns (else a new one). In this block that
    is a mode of its own: under a FakeTensorMode of the caller's, those ops stay out of what the
    caller's dispatch modes see ([Note: DTensor's shape propagation is not memory] in
    meshpar/planner/simulate.py). Mechanism: a ``TracingContext`` holding that mode, which
    ``detect_fake_mode`` consults first. Public alternative: none."""
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode

    with tracing(TracingContext(FakeTensorMode())):
        yield


# --- imported on first use ------------------------------------------------------------------------------
# name -> (module, attribute). Why meshpar needs each:
# - MemTracker and its enums / weakref record (torch.distributed._tools.mem_tracker): the base of
#   meshpar.profiling.memory.AllocationTracker (tensor memory per category on any device, the
#   planner's simulated peaks). Public alternative: none that categorizes tensors on CPU.
# - FakeTensorMode: the planner's memory simulation runs a step on fake tensors of the real sizes.
#   Public alternative: none (torch.export uses it internally).
# - FakeTensor, active_fake_mode: the simulation answers fake tensors' device queries itself
#   ([Note: device queries skip the tracker] in planner/tracker.py), with MemTracker's test for
#   which fake mode is running. Public alternative: none.
# - FakeStore: ``meshpar plan``'s dry run joins a "fake" process group, whose collectives return at
#   once. Public alternative: none outside torch.testing.
_FSDP_COMMON = "torch.distributed.fsdp._fully_shard._fsdp_common"
_LAZY: MappingProxyType[str, tuple[str, str | None]] = MappingProxyType({
    "MemTracker": ("torch.distributed._tools.mem_tracker", "MemTracker"),
    "MemRefType": ("torch.distributed._tools.mem_tracker", "_MemRefType"),
    "RefType": ("torch.distributed._tools.mem_tracker", "_RefType"),
    "UpdateType": ("torch.distributed._tools.mem_tracker", "_UpdateType"),
    "WeakRefInfo": ("torch.distributed._tools.mem_tracker", "_WeakRefInfo"),
    "FakeTensorMode": ("torch._subclasses.fake_tensor", "FakeTensorMode"),
    "FakeTensor": ("torch._subclasses.fake_tensor", "FakeTensor"),
    "active_fake_mode": ("torch._guards", "active_fake_mode"),
    "FakeStore": ("torch.testing._internal.distributed.fake_pg", "FakeStore"),
    # A mode seeing every op a thread runs (float8 collectives over gloo: meshpar/parallel/float8.py).
    # Public alternative: none (``torch.utils._python_dispatch`` is the only home of the base class).
    "TorchDispatchMode": ("torch.utils._python_dispatch", "TorchDispatchMode"),
})


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attr = _LAZY[name]
    value = importlib.import_module(module)
    if attr is not None:
        value = getattr(value, attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


# What ``fully_shard(shard_placement_fn=...)`` may return to put a parameter on a mesh of its own (a unit
# of several parameter groups: meshpar/fsdp/api.py), and the mesh infos it names. Public alternative:
# none (torch 2.13 exports neither from torch.distributed.fsdp). meshpar never imports torch's FSDP
# (DESIGN.md): a caller holding such an object has imported its module, so the classes are read from
# ``sys.modules``, and without that module no value can be one of them.
def _fsdp_class(name: str) -> type | None:
    module = sys.modules.get(_FSDP_COMMON)
    return getattr(module, name, None) if module is not None else None


def shard_placement_result(result: Any) -> tuple[Any, Any] | None:
    """``(placement, mesh_info)`` of a ``ShardPlacementResult`` that ``shard_placement_fn`` returned,
    None for anything else."""
    cls = _fsdp_class("ShardPlacementResult")
    return (result.placement, result.mesh_info) if cls is not None and isinstance(result, cls) else None


def fsdp_mesh_info_parts(info: Any) -> tuple[DeviceMesh, int, int | None]:
    """``(mesh, shard dim, replicate dim or None)`` of torch's ``FSDPMeshInfo`` / ``HSDPMeshInfo``;
    TypeError for anything else."""
    fsdp, hsdp = _fsdp_class("FSDPMeshInfo"), _fsdp_class("HSDPMeshInfo")
    if fsdp is None or not isinstance(info, fsdp):
        raise TypeError(f"ShardPlacementResult.mesh_info must be an FSDPMeshInfo or HSDPMeshInfo; got {info!r}")
    return info.mesh, info.shard_mesh_dim, info.replicate_mesh_dim if isinstance(info, hsdp) else None


# --- the classes of a DCP checkpoint's metadata ------------------------------------------------------------
# (module, name) of every class torch 2.13's FileSystemWriter pickles into ``.metadata`` (beside
# torch dtypes, layouts and ``torch.Size``, and the ``pathlib`` path of ``StorageMeta.checkpoint_id``):
# the allow-list of meshpar's restricted unpickler ([Note: loading never runs code from the file] in
# meshpar/checkpoint/format.py). Two are private; REQUIRED checks that they still exist. Public
# alternative: none (DCP's own reader unpickles without restriction).
_DCP_MD = "torch.distributed.checkpoint.metadata"
DCP_METADATA_GLOBALS = frozenset({
    *((_DCP_MD, name) for name in ("Metadata", "MetadataIndex", "ChunkStorageMetadata", "TensorProperties",
                                   "TensorStorageMetadata", "BytesStorageMetadata", "StorageMeta",
                                   "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    *(("pathlib", name) for name in ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")),
})


# --- what the installed torch must provide -----------------------------------------------------------------
_MT = "torch.distributed._tools.mem_tracker"
_MEMORY = "tensor memory by category ([profile] profile_memory, meshpar plan's memory simulation)"
_STAGE = "torch.distributed.pipelining.PipelineStage"
_PIPELINE_FSDP = "pipeline parallelism with FSDP: one reduce-scatter per step (meshpar/parallel/pipeline/schedule.py)"
_PIPELINE_LABELS = "pipeline transfers labelled in traces (meshpar/parallel/pipeline/schedule.py, profiling/labels.py)"

# Every private (or non-public) torch name meshpar uses, dotted from an importable module, ->
# the meshpar feature that needs it. ``X()`` instantiates X (instance attributes).
# tests/test_torch_compat.py resolves each one.
REQUIRED: MappingProxyType[str, str] = MappingProxyType({
    "torch.distributed.tensor.placement_types._StridedShard":
        "FSDP over tensor parallel, GPT-2's fused q|k|v (tensor_parallel/styles.py, fsdp/sharded_param.py, "
        "checkpoints, init, clipping, conversion)",
    "torch.utils._pytree.tree_leaves": "tensor-parallel trace labels (profiling/labels.py)",
    "torch.utils._pytree.tree_map_only": "the planner's tracker on an op's unusual result (planner/tracker.py)",
    "torch.distributed.device_mesh.DeviceMesh._flatten": "the flattened dp mesh (mesh.py)",
    "torch.distributed.device_mesh.DeviceMesh._unflatten": "fully_shard with an int reshard_after_forward",
    "torch.distributed.device_mesh.DeviceMesh._concatenate": "FSDP over tensor parallel (fsdp/sharded_param.py)",
    "torch.distributed.tensor.DTensor._local_tensor": "FSDP gradient accumulation (fsdp/sharded_param.py)",
    "torch.distributed.tensor.DTensor._spec": "FSDP's sharded gradients, built like their parameters (dtensor_like)",
    "torch.distributed.tensor._dtensor_spec.DTensorSpec": "FSDP's CPU-offloaded shards (dtensor_where_it_is)",
    "torch.distributed.tensor._dtensor_spec.TensorMeta": "FSDP's CPU-offloaded shards (dtensor_where_it_is)",
    "torch._foreach_norm": "gradient clipping (clip.py)",
    "torch.optim.Adam._init_group": "the optimizer on local shards (training/optim.py ShardLocalAdamW)",
    "torch._foreach_mul_": "gradient clipping (clip.py)",
    "torch._foreach_copy_": "FSDP: a unit's parameters cast for compute on one rank (fsdp/unshard.py)",
    "torch.nn.Module()._parameters": "FSDP and tensor parallel: tied and replaced parameters",
    "torch.nn.Module()._forward_pre_hooks": "tensor-parallel trace labels (profiling/labels.py)",
    "torch.nn.Module()._forward_hooks": "tensor-parallel trace labels (profiling/labels.py)",
    "torch.nn.Module._apply": "fully-sharded modules through to_empty / .to (fsdp/module.py overrides it)",
    "torch.distributed.tensor.parallel.ParallelStyle._apply":
        "meshpar's tensor-parallel styles: vocab-parallel embedding, fused and replicated parallel",
    "torch.autograd.Variable._execution_engine": "FSDP's end-of-backward callback (fsdp/state.py)",
    "torch._C._is_key_in_tls": "the run's comm record in a backward on CUDA (distributed/comm_record.py)",
    "torch._C._get_obj_in_tls": "the run's comm record in a backward on CUDA (distributed/comm_record.py)",
    "torch.autograd._unsafe_preserve_version_counter": "FSDP's all-gather copy-out (fsdp/param_group.py)",
    "torch.nn.Parameter()._post_accumulate_grad_hooks":
        "optimizer-in-backward hooks on fully-sharded parameters (fsdp/sharded_param.py)",
    "torch.ops._c10d_functional.reduce_scatter_tensor.default":
        "selective activation checkpointing keeps tensor-parallel reduce-scatters",
    "torch.ops.aten._scaled_dot_product_flash_attention.default": "selective activation checkpointing",
    "torch.ops.aten._scaled_dot_product_efficient_attention.default": "selective activation checkpointing",
    "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default": "selective activation checkpointing",
    "torch.ops.aten._scaled_dot_product_cudnn_attention.default": "selective activation checkpointing",
    "torch._higher_order_ops.flex_attention.flex_attention":
        "ring attention on flex_attention, differentiated off CUDA (flex_attention_reference)",
    "torch.nn.attention.flex_attention._apply_kernel_options": "flex_attention_reference",
    "torch.nn.attention.flex_attention._identity": "flex_attention_reference",
    "torch._C._autograd._profiler_enabled": "trace labels (profiling/labels.py)",
    "torch.ops.profiler._record_function_enter_new": "tensor-parallel backward labels (profiling/labels.py)",
    "torch.ops.profiler._record_function_exit._RecordFunction": "tensor-parallel backward labels",
    "torch.cuda.memory._record_memory_history": "[profile] profile_memory on CUDA (profiling/capture.py)",
    "torch.cuda.memory._dump_snapshot": "[profile] profile_memory on CUDA, out-of-memory snapshots",
    "torch._C._cuda_attach_out_of_memory_observer": "out-of-memory snapshots on CUDA (profiling/capture.py)",
    "torch.distributed.pipelining.schedules._batch_p2p": _PIPELINE_LABELS,
    f"{_STAGE}.forward_one_chunk": _PIPELINE_LABELS,
    f"{_STAGE}.backward_one_chunk": _PIPELINE_LABELS,
    f"{_STAGE}.get_fwd_recv_ops": _PIPELINE_LABELS,
    f"{_STAGE}.get_fwd_send_ops": _PIPELINE_LABELS,
    f"{_STAGE}.get_bwd_recv_ops": _PIPELINE_LABELS,
    f"{_STAGE}.get_bwd_send_ops": _PIPELINE_LABELS,
    f"{_STAGE}.backward_maybe_with_nosync": _PIPELINE_FSDP,
    f"{_STAGE}.perform_reduce_grad": _PIPELINE_FSDP,
    "torch.distributed.tensor.DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear":
        "meshpar plan: a fresh DTensor cache per (fake) world (planner/dry_run.py)",
    "torch.distributed.tensor.DTensor._op_dispatcher.sharding_propagator._propagate_tensor_meta_cached.cache_clear":
        "meshpar plan: a fresh DTensor cache per (fake) world",
    "torch.distributed.tensor._redistribute._gen_transform_infos.cache_clear": "meshpar plan: a fresh DTensor cache",
    "torch._C._clear_DTensor_sharding_propagator_cache": "meshpar plan: a fresh DTensor cache",
    "torch.distributed.checkpoint._async_process_executor._CHECKPOINT_PROCESS":
        "checkpoint.async = \"process\": stopping DCP's writer process at the end of a run (stop_dcp_save_process)",
    "torch.distributed.checkpoint._async_process_executor._AsyncCheckpointProcess._send":
        "checkpoint.async = \"process\": stopping DCP's writer process at the end of a run",
    "torch.distributed.checkpoint._async_process_executor._CheckpointSaveProcessControlOpts.TERMINATE":
        "checkpoint.async = \"process\": stopping DCP's writer process at the end of a run",
    "torch._guards.TracingContext": "meshpar plan's memory simulation: DTensor's shapes in a fake mode of their own",
    "torch._guards.tracing": "meshpar plan's memory simulation: DTensor's shapes in a fake mode of their own",
    "torch._subclasses.fake_tensor.FakeTensorMode": "meshpar plan's memory simulation (planner/simulate.py)",
    "torch._subclasses.fake_tensor.FakeTensor": "meshpar plan's memory simulation: device queries",
    "torch._guards.active_fake_mode": "meshpar plan's memory simulation: device queries",
    "torch.testing._internal.distributed.fake_pg.FakeStore": "meshpar plan's dry run (planner/dry_run.py)",
    f"{_FSDP_COMMON}.ShardPlacementResult": "fully_shard with a parameter on a mesh of its own (fsdp/api.py)",
    f"{_FSDP_COMMON}.FSDPMeshInfo": "fully_shard with a parameter on a mesh of its own (fsdp/api.py)",
    f"{_FSDP_COMMON}.HSDPMeshInfo": "fully_shard with a parameter on a mesh of its own (fsdp/api.py)",
    "torch.utils._python_dispatch.TorchDispatchMode":
        "float8 tensor parallelism over gloo: float8 all-gathers as bytes (meshpar/parallel/float8.py)",
    f"{_MT}.MemTracker": _MEMORY,
    f"{_MT}._MemRefType.PARAM": _MEMORY,
    f"{_MT}._RefType": _MEMORY,
    f"{_MT}._UpdateType.ADD": _MEMORY,
    f"{_MT}._UpdateType.SIZE": _MEMORY,
    f"{_MT}._WeakRefInfo.create_winfo": _MEMORY,
    f"{_MT}._WeakRefInfo.update_mem_consumed": _MEMORY,
    f"{_MT}.MemTracker._track": _MEMORY,
    f"{_MT}.MemTracker._update_snap": _MEMORY,
    f"{_MT}.MemTracker._pre_fw_hook": _MEMORY,
    f"{_MT}.MemTracker._track_resize": _MEMORY,
    f"{_MT}.MemTracker._delete_callback": _MEMORY,
    f"{_MT}.MemTracker._update_peak_stats": _MEMORY,
    f"{_MT}.MemTracker()._in_ac": _MEMORY,
    f"{_MT}.MemTracker()._in_opt": _MEMORY,
    f"{_MT}.MemTracker()._WINFO": _MEMORY,
    f"{_MT}.MemTracker()._mod_tracker": _MEMORY,
    f"{_MT}.MemTracker()._ref_class": _MEMORY,
    f"{_MT}.MemTracker()._orig_resize": _MEMORY,
    f"{_MT}.MemTracker()._peak_mem": _MEMORY,
    f"{_MT}.MemTracker()._peak_mem_snap": _MEMORY,
    f"{_MT}.MemTracker()._curr_mem_snap": _MEMORY,
    **{f"{module}.{name}": "loading DCP checkpoints: the allow-list of .metadata's unpickler (checkpoint/format.py)"
       for module, name in DCP_METADATA_GLOBALS if name.startswith("_")},
})

CUDA_ONLY = frozenset({"torch._C._cuda_attach_out_of_memory_observer"})  # absent from CPU-only builds


def resolve(dotted: str) -> Any:
    """The object ``dotted`` names: the longest importable module prefix, then attributes (a part
    ending in ``()`` is called with no arguments). Raises ImportError / AttributeError."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
            break
        except ImportError:
            if i == 1:
                raise
    for part in parts[i:]:
        call = part.endswith("()")
        obj = getattr(obj, part.removesuffix("()"))
        if call:
            obj = obj()
    return obj


def dcp_storage_info(relative_path: str, offset: int, length: int) -> Any:
    """DCP's record of where one item lies in a file of a checkpoint folder (what FileSystemWriter writes as
    a WriteResult's ``storage_data`` and its reader reads): meshpar's converter writes DCP folders itself
    (meshpar/convert/dcp.py). Public alternative: none."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return _StorageInfo(relative_path, offset, length)


__all__ += ["DCP_METADATA_GLOBALS", "dcp_storage_info"]
