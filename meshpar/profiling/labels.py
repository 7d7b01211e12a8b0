"""Trace labels for communication that PyTorch code issues on meshpar's behalf.

    label_new_hooks(module, before, "tp", "layers.0.attention.wq")  # after parallelize_module
    label_p2p_ops(ops, "pp.recv_forward[1,3]")                      # in the pipeline Stage
    with p2p_labels(): schedule.step(...)                           # around the schedule's step

Tensor-parallel redistributions and pipeline transfers run inside ``meshpar::tp.*`` and
``meshpar::pp.*`` ranges, forward and backward, so that ``meshpar profile summarize`` can put every
collective on its mesh dim (meshpar/profiling/report/attribution.py); the labels are listed in
docs/profiling.md#labels.

Limits: the pipeline's labels lean on a private name of torch's pipelining module, like the rest
of meshpar/parallel/pipeline/ (its docstring lists the others).

Notes: [Note: labelling collectives meshpar does not issue].
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.profiler import record_function

from meshpar.distributed._torch import (
    forward_hook_dicts,
    profiler_enabled,
    record_function_enter,
    record_function_exit,
    schedule_p2p_through,
    tree_leaves,
)

# [Note: labelling collectives meshpar does not issue]
# meshpar's own collectives run inside ``meshpar::comm.<op>[<dim>]`` ranges; two kinds come from PyTorch code:
# - Tensor parallelism: a ``ParallelStyle``'s forward (pre-)hooks redistribute a module's inputs and
#   outputs; DTensor's autograd runs the transposed collectives in backward. ``label_new_hooks`` runs
#   the hooks inside ``meshpar::tp.input|output[<path>]`` and, while the profiler is on, hooks the
#   autograd nodes each created (``_BackwardRange``: the first to run opens ``..._grad[<path>]``,
#   the last closes it). The graph is untouched, so gradients are bit-identical with and without
#   the profiler; with it off the wrapper costs one check per call.
# - Pipeline transfers: ``torch.distributed.pipelining`` issues point-to-point ops through a private
#   module-level function and has no hook for it. ``Stage`` tags its ops (``label_p2p_ops``), and
#   inside ``p2p_labels()`` (around a pipeline's step; importing meshpar changes nothing in torch) the
#   schedules issue through ``_labelled_p2p`` ([Note: torch's pipeline p2p issue, replaced for a block]
#   in meshpar/distributed/_torch.py): tagged ops are issued and waited on inside ``meshpar::pp.*``
#   ranges (a receive's wait is the bubble seen from that stage), untagged ones pass straight through.


def profiler_on() -> bool:
    return profiler_enabled()


_MAX_REGION = 64  # autograd nodes a labelled region may span; past it (no path to the inputs) it is left unlabelled


class _BackwardRange:
    """A profiler range over the backward of a forward region: opened by the first of the
    region's head nodes (the ``grad_fn`` of its outputs) to run, closed after the last of its
    tail nodes (those feeding the ``grad_fn`` of its inputs) has run. Only hooks are added to
    the existing nodes: the graph, and so the order in which the engine runs and sums, is
    unchanged (an identity node per boundary changed gradients in the last bit)."""

    def __init__(self, name: str) -> None:
        self.name, self.handle, self.pending = name, None, 0

    def bracket(self, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> None:
        stops = {t.grad_fn for t in inputs if t.grad_fn is not None}
        leaves = {id(t) for t in inputs if t.grad_fn is None}
        heads = {t.grad_fn for t in outputs if t.grad_fn is not None} - stops
        region, tails, todo = set(), set(), list(heads)
        while todo:
            node = todo.pop()
            if node in region:
                continue
            region.add(node)
            if len(region) > _MAX_REGION:
                return
            for nxt, _ in node.next_functions:
                if nxt in stops or id(getattr(nxt, "variable", None)) in leaves:
                    tails.add(node)
                elif nxt is not None:
                    todo.append(nxt)
        if not tails:
            return
        self.pending = len(tails)
        for node in heads:
            node.register_prehook(self._open)
        for node in tails:
            node.register_hook(self._close)

    def _open(self, grad_outputs: Any) -> None:
        if self.handle is None and self.pending:
            self.handle = record_function_enter(self.name)

    def _close(self, grad_inputs: Any, grad_outputs: Any) -> None:
        self.pending -= 1
        if self.pending == 0 and self.handle is not None:
            record_function_exit(self.handle)
            self.handle = None


def _tensors(values: Any) -> list[torch.Tensor]:
    """The tensors that need a gradient among a (nested) tuple / list / dict of values."""
    return [t for t in tree_leaves(values) if isinstance(t, torch.Tensor) and t.requires_grad]


def _labelled(kind: str, where: str, fn: Callable[..., Any], inputs: Any, *args: Any) -> Any:
    """``fn(*args)`` inside ``meshpar::<kind>[<where>]``, its backward from its result back to
    ``inputs`` inside ``meshpar::<kind>_grad[<where>]`` (when grad mode is on)."""
    with record_function(f"meshpar::{kind}[{where}]"):
        result = fn(*args)
    if torch.is_grad_enabled() and (ins := _tensors(inputs)):
        _BackwardRange(f"meshpar::{kind}_grad[{where}]").bracket(ins, _tensors(result))
    return result


def run_labelled(kind: str, where: str, fn: Callable[[Any], Any], x: Any) -> Any:
    """``fn(x)`` inside ``meshpar::<kind>[<where>]``, and while profiling its backward inside
    ``meshpar::<kind>_grad[<where>]``: for a redistribution outside any hook (a module's own
    forward, the loss)."""
    return _labelled(kind, where, fn, x, x) if profiler_on() else fn(x)


def _labelled_hook(hook: Callable, kind: str, where: str, *, pre: bool) -> Callable:
    """A forward pre-hook (``pre``) or forward hook run by ``_labelled`` while profiling; the
    region's inputs are the module's inputs (pre) or the output the hook transforms."""
    def wrapped(module: nn.Module, args: tuple, *rest: Any):  # rest: ([kwargs]) or ([kwargs,] output)
        if not profiler_on():
            return hook(module, args, *rest)
        return _labelled(kind, where, hook, (args, *rest) if pre else rest[-1], module, args, *rest)

    return wrapped


def hook_ids(module: nn.Module) -> tuple[set[int], set[int]]:
    """The ids of ``module``'s forward pre-hooks and forward hooks, to pass to ``label_new_hooks``."""
    pre, post = forward_hook_dicts(module)
    return set(pre), set(post)


def label_new_hooks(module: nn.Module, before: tuple[set[int], set[int]], dim: str, path: str) -> None:
    """Wrap the forward (pre-)hooks installed on ``module`` since ``before = hook_ids(module)``:
    [Note: labelling collectives meshpar does not issue]. ``path`` names the module in the
    labels (``meshpar::<dim>.input[<path>]``)."""
    where = path or "model"
    pre_hooks, hooks = forward_hook_dicts(module)
    for hid, hook in list(pre_hooks.items()):
        if hid not in before[0]:
            pre_hooks[hid] = _labelled_hook(hook, f"{dim}.input", where, pre=True)
    for hid, hook in list(hooks.items()):
        if hid not in before[1]:
            hooks[hid] = _labelled_hook(hook, f"{dim}.output", where, pre=False)


# --- pipeline point-to-point ----------------------------------------------------------------

_LABEL = "_meshpar_label"


def label_p2p_ops(ops: Iterable[dist.P2POp], name: str) -> list[dist.P2POp]:
    """Tag ``ops`` (from a ``PipelineStage.get_*_ops``) so that issuing and waiting on them is
    labelled ``meshpar::<name>`` in a trace."""
    ops = list(ops)
    for op in ops:
        setattr(op, _LABEL, name)
    return ops


class _LabelledWork:
    """A ``dist.Work`` whose ``wait`` runs inside a profiler range."""

    def __init__(self, work: dist.Work, name: str) -> None:
        self._work, self._name = work, name

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        with record_function(self._name):
            return self._work.wait(*args, **kwargs)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._work, attr)


def _labelled_p2p(torch_issue: Callable, p2p_ops: list[dist.P2POp], desc: str | None = None) -> list[Any]:
    names = [getattr(op, _LABEL, None) for op in p2p_ops]
    if not names or None in names or not profiler_on():
        return torch_issue(p2p_ops, desc)
    name = "meshpar::" + "+".join(dict.fromkeys(names))  # a mixed batch: pp.send_forward[0,2]+pp.recv_backward[0,1]
    with record_function(name):
        works = torch_issue(p2p_ops, desc)
    return [_LabelledWork(w, f"{name}.wait") for w in works]


def p2p_labels() -> contextlib.AbstractContextManager:
    """In this block torch's pipeline schedules issue and wait on tagged point-to-point ops inside
    ``meshpar::pp.*`` ranges: [Note: labelling collectives meshpar does not issue]."""
    return schedule_p2p_through(_labelled_p2p)
