"""The one way meshpar changes what a module's forward computes: ``wrap_forward``.

[Note: wrapping a forward]
Activation checkpointing, ``torch.compile`` per block and the vocabulary-parallel embedding
change a module's computation but must keep its parameter names (checkpoint keys, TP plan paths
and optimizer state all use the model's own names), so they cannot put a wrapper module in its
place. They set the module's ``forward`` on the instance instead, which shadows the class's and
runs inside ``__call__``: hooks on the module (FSDP's unshard and reshard, TP's redistributions)
stay outside the wrapped code. ``wrap_forward`` is the only place that does so; it records which
wrapper a module carries (``wrapped_by``), so no caller looks into an instance's ``__dict__``, and
wrapping twice with one kind is an error. (``FSDPModule``'s ``register_fsdp_forward_method`` wraps
other methods, as torch's API defines it.)
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from torch import nn

_WRAPPERS: weakref.WeakKeyDictionary[nn.Module, dict[str, dict[str, Any]]] = weakref.WeakKeyDictionary()


def wrap_forward(module: nn.Module, kind: str, wrap: Callable[[Callable], Callable], **info: Any) -> None:
    """Replace ``module``'s forward with ``wrap(<its current forward>)``, recorded as ``kind`` with
    ``info`` (read back by ``wrapped_by``)."""
    kinds = _WRAPPERS.setdefault(module, {})
    if kind in kinds:
        raise ValueError(f"{type(module).__name__}'s forward is already wrapped by {kind}")
    module.forward = wrap(module.forward)
    kinds[kind] = info


def wrapped_by(module: nn.Module, kind: str) -> dict[str, Any] | None:
    """The ``info`` that ``module``'s ``kind`` wrapper was recorded with, or None if it has none."""
    return _WRAPPERS.get(module, {}).get(kind)


def wrappers(module: nn.Module) -> tuple[str, ...]:
    """The kinds of wrapper on ``module``'s forward, innermost first."""
    return tuple(_WRAPPERS.get(module, {}))
