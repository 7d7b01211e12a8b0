"""The tensors inside a module's inputs and outputs, however they are nested.

FSDP casts forward inputs and outputs (``MixedPrecisionPolicy``) and hooks the outputs'
gradients. Models pass tensors in tuples, lists, dicts, named tuples and dataclasses (a
``ModelOutput``, a batch object); ``map_tensors`` rebuilds each container around the mapped
tensors, as PyTorch's engine does, so a dataclass of inputs is cast like a tuple of them.
A frozen dataclass is rebuilt with ``dataclasses.replace``; fields declared ``init=False``
are copied over unchanged.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch

_LEAVES = frozenset({int, float, bool, str, bytes, torch.dtype, torch.device})


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], tree: Any) -> Any:
    """``tree`` with every tensor ``t`` replaced by ``fn(t)``; the same object where nothing changed."""
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if tree is None or type(tree) in _LEAVES:  # the common leaves first: is_dataclass costs a few lookups
        return tree
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        changes = {}
        for f in dataclasses.fields(tree):
            value = getattr(tree, f.name)
            new = map_tensors(fn, value)
            if new is not value:
                if not f.init:
                    raise TypeError(f"{type(tree).__name__}.{f.name} holds a tensor but is not an __init__ field; "
                                    f"FSDP cannot rebuild the dataclass around a cast copy of it")
                changes[f.name] = new
        return dataclasses.replace(tree, **changes) if changes else tree
    if isinstance(tree, dict):
        if not tree:
            return tree
        items = {k: map_tensors(fn, v) for k, v in tree.items()}
        if all(items[k] is v for k, v in tree.items()):
            return tree
        out = copy.copy(tree)  # OrderedDict, defaultdict, ...: keep the class and its attributes
        out.update(items)
        return out
    if isinstance(tree, (list, tuple)):
        items = [map_tensors(fn, v) for v in tree]
        if all(a is b for a, b in zip(items, tree, strict=True)):
            return tree
        if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # a named tuple
            return type(tree)(*items)
        return type(tree)(items)
    return tree


def iter_tensors(tree: Any) -> Iterator[torch.Tensor]:
    """Every tensor in ``tree``, in the order ``map_tensors`` visits them."""
    if isinstance(tree, torch.Tensor):
        yield tree
    elif dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        for f in dataclasses.fields(tree):
            yield from iter_tensors(getattr(tree, f.name))
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from iter_tensors(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from iter_tensors(v)


def cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    """Floating-point tensors in ``tree`` cast to ``dtype`` (others, and those already ``dtype``, as they are)."""
    return map_tensors(lambda t: t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t, tree)
