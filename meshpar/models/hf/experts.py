"""Family hf's tensors in a Hugging Face folder's layout, both ways, as transformers maps them.

transformers 5 keeps a sparse layer's experts fused in memory (OLMoE's ``mlp.experts.gate_up_proj``
[E, 2F, D], ``mlp.experts.down_proj`` [E, D, F]) but ``save_pretrained`` writes them, as published
checkpoints hold them, one tensor per expert (``mlp.experts.{j}.gate_proj.weight`` [F, D]), and some
types rename modules on the way (Mixtral's ``block_sparse_moe`` for ``mlp``). The authority on which
folder tensors make which model tensor is transformers' own conversion mapping
(transformers/conversion_mapping.py), which this module runs: [Note: transformers' conversion run lazily].

    model = meta_model(args.config).hf               # transformers' model on meta: names, shapes, its mapping
    made = FromFolder(model, {name: shape}, read)    # made[model name]: a Lazy; load_hf.py reads boxes of it
    layout, refusal = saved_layout(model)            # model name -> Saved: what the export writes for it
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

Box = tuple[slice, ...]  # one contiguous range per dim

# [Note: transformers' conversion run lazily]
# transformers maps checkpoint keys to a model's names with WeightRenaming and WeightConverter
# entries; a converter's operations are torch calls on the tensors it collected, in its order:
# on load MergeModulelist stacks the experts (torch.stack, dim 0) and Concatenate joins gate and
# up (torch.cat, dim 1: gate_up_proj[j] = [gate_j; up_j], each [F, D]); on save the reversed
# operations (Chunk, SplitModulelist) cut them apart again. Here the same converters run, in
# transformers' own code and order, on ``Lazy`` stand-ins: torch.stack / cat / transpose / chunk /
# split and squeeze on a Lazy build an expression (``__torch_function__``) instead of data. So
# loading reads only the folder tensors' parts in a rank's box of the result (the experts of its
# shard, and their rows), and saving finds each saved tensor's place in the model tensor's bytes.
# Any other torch call (a reshape, a dequantization) reads its inputs whole and runs for real, so
# the values stay transformers' own, only not sliced. Invariant: a Lazy's ``read(box)`` equals
# the real conversion's result [box], which tests/test_hf_experts.py checks against
# ``from_pretrained`` and ``save_pretrained`` for each layout.


class Lazy:
    """A tensor not read yet: ``shape``, and ``read(box)`` -> its values in ``box`` (a slice per dim)."""

    shape: torch.Size

    def read(self, box: Box) -> Tensor:
        raise NotImplementedError

    def whole(self) -> Tensor:
        return self.read(tuple(slice(0, n) for n in self.shape))

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Sequence = (), kwargs: Mapping | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func in _OPS:  # bind positional arguments to the names _OPS uses
            return _OPS[func](**dict(zip(_PARAMS[func], args, strict=False)), **kwargs)
        return func(*_real(args), **_real(kwargs))

    # the tensor methods transformers' operations call
    def size(self, dim: int | None = None) -> Any:
        return self.shape if dim is None else self.shape[dim]

    def dim(self) -> int:
        return len(self.shape)

    def contiguous(self) -> Lazy:
        return self

    def transpose(self, dim0: int, dim1: int) -> Lazy:
        return Transposed(self, dim0, dim1)

    def squeeze(self, dim: int) -> Lazy:
        return Select(self, dim % self.dim(), 0) if self.shape[dim] == 1 else self

    def __getitem__(self, index: Any) -> Tensor:  # indexing (a vocabulary trimmed): on the values, read whole
        return self.whole()[index]

    def __getattr__(self, name: str) -> Any:  # any other tensor method: on the values, read whole
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.whole(), name)


class Leaf(Lazy):
    """A tensor of a file or of memory: ``get(box)`` reads that part of it."""

    def __init__(self, name: str, shape: Sequence[int], get: Callable[[Box], Tensor]) -> None:
        self.name, self.shape, self.get = name, torch.Size(shape), get

    def read(self, box: Box) -> Tensor:
        return self.get(box)


def _agree(op: str, parts: Sequence[Lazy], but: int | None = None) -> None:
    """ValueError, as torch's own call would raise one, when ``parts`` differ in shape (but in dim ``but``)."""
    trim = [[n for d, n in enumerate(p.shape) if d != but] for p in parts]
    if any(len(p.shape) != len(parts[0].shape) or t != trim[0] for p, t in zip(parts, trim, strict=True)):
        raise ValueError(f"{op} of tensors of shapes {', '.join(str(list(p.shape)) for p in parts)}")


class Stack(Lazy):
    def __init__(self, parts: Sequence[Lazy], dim: int) -> None:
        _agree("torch.stack", parts)
        self.parts, self.d = list(parts), dim % (len(parts[0].shape) + 1)
        shape = list(parts[0].shape)
        shape.insert(self.d, len(parts))
        self.shape = torch.Size(shape)

    def read(self, box: Box) -> Tensor:
        d, rest = self.d, box[:self.d] + box[self.d + 1:]
        return torch.stack([self.parts[j].read(rest) for j in range(box[d].start, box[d].stop)], d)


class Cat(Lazy):
    def __init__(self, parts: Sequence[Lazy], dim: int) -> None:
        self.parts, self.d = list(parts), dim % len(parts[0].shape)
        _agree("torch.cat", parts, self.d)
        shape = list(parts[0].shape)
        shape[self.d] = sum(p.shape[self.d] for p in parts)
        self.shape = torch.Size(shape)

    def read(self, box: Box) -> Tensor:
        d, lo, hi, off, out = self.d, box[self.d].start, box[self.d].stop, 0, []
        for p in self.parts:  # the parts box[d] overlaps, each its own range of them
            a, b = max(lo, off), min(hi, off + p.shape[d])
            if a < b:
                out.append(p.read(box[:d] + (slice(a - off, b - off),) + box[d + 1:]))
            off += p.shape[d]
        return torch.cat(out, d)


class Transposed(Lazy):
    def __init__(self, part: Lazy, dim0: int, dim1: int) -> None:
        n = len(part.shape)
        self.part, self.d0, self.d1 = part, dim0 % n, dim1 % n
        shape = list(part.shape)
        shape[self.d0], shape[self.d1] = shape[self.d1], shape[self.d0]
        self.shape = torch.Size(shape)

    def read(self, box: Box) -> Tensor:
        b = list(box)
        b[self.d0], b[self.d1] = b[self.d1], b[self.d0]
        return self.part.read(tuple(b)).transpose(self.d0, self.d1)


class Narrow(Lazy):
    def __init__(self, part: Lazy, dim: int, start: int, length: int) -> None:
        self.part, self.d, self.start = part, dim % len(part.shape), start
        self.shape = torch.Size([*part.shape[:self.d], length, *part.shape[self.d + 1:]])

    def read(self, box: Box) -> Tensor:
        s = box[self.d]
        return self.part.read(box[:self.d] + (slice(s.start + self.start, s.stop + self.start),) + box[self.d + 1:])


class Select(Lazy):
    def __init__(self, part: Lazy, dim: int, index: int) -> None:
        self.part, self.d, self.index = part, dim, index
        self.shape = torch.Size([*part.shape[:dim], *part.shape[dim + 1:]])

    def read(self, box: Box) -> Tensor:
        return self.part.read(box[:self.d] + (slice(self.index, self.index + 1),) + box[self.d:]).select(self.d, 0)


def _chunk(input: Lazy, chunks: int, dim: int = 0) -> tuple[Lazy, ...]:
    size = math.ceil(input.shape[dim] / chunks)  # torch.chunk's sizes: equal, the last one smaller
    return _split(input, size, dim)


def _split(tensor: Lazy, split_size_or_sections: int | Sequence[int], dim: int = 0) -> tuple[Lazy, ...]:
    n = tensor.shape[dim]
    sizes = split_size_or_sections
    if isinstance(sizes, int):
        sizes = [min(sizes, n - s) for s in range(0, n, sizes)]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return tuple(Narrow(tensor, dim, s, k) for s, k in zip(starts, sizes, strict=True))


_OPS: dict[Any, Callable[..., Any]] = {
    torch.stack: lambda tensors, dim=0: Stack([as_lazy(t) for t in tensors], dim),
    torch.cat: lambda tensors, dim=0: Cat([as_lazy(t) for t in tensors], dim),
    torch.transpose: lambda input, dim0, dim1: Transposed(as_lazy(input), dim0, dim1),
    torch.chunk: _chunk,
    torch.split: _split,
}
_PARAMS = {torch.stack: ("tensors", "dim"), torch.cat: ("tensors", "dim"), torch.transpose: ("input", "dim0", "dim1"),
           torch.chunk: ("input", "chunks", "dim"), torch.split: ("tensor", "split_size_or_sections", "dim")}


def as_lazy(t: Lazy | Tensor) -> Lazy:
    return t if isinstance(t, Lazy) else Leaf("", t.shape, t.__getitem__)


def _real(x: Any) -> Any:
    """``x`` with every Lazy in it read whole (a torch call _OPS does not build lazily)."""
    if isinstance(x, Lazy):
        return x.whole()
    if isinstance(x, (list, tuple)):
        return type(x)(_real(v) for v in x)
    if isinstance(x, dict):
        return {k: _real(v) for k, v in x.items()}
    return x


class FromFolder:
    """The model tensors transformers makes from a folder's tensors (name -> shape; ``read(name, box)``
    reads a box of one) through its conversion mapping for ``model`` (a PreTrainedModel, on meta):
    ``made[name]`` is a Lazy of the model tensor ``name``. The grouping is the first half of
    transformers' ``core_model_loading.convert_and_load_state_dict_in_model`` (which loads into the
    model as well, so cannot be called); each group converts when one of its tensors is first asked for."""

    def __init__(self, model: nn.Module, folder: Mapping[str, Sequence[int]],
                 read: Callable[[str, Box], Tensor]) -> None:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

        transforms = get_model_conversion_mapping(model)  # as from_pretrained builds it
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        by_pattern = {p: c for c in converters for p in c.source_patterns}
        meta, prefix = model.state_dict(), model.base_model_prefix
        self.model, self.folder = model, folder
        self.groups: dict[str, Any] = {}  # first target -> its transform, holding its leaves
        for key in sorted(folder, key=dot_natural_key):  # transformers' order: experts 0, 1, ..., 10
            target, pattern = rename_source_key(key, renamings, converters, prefix, meta)
            if target not in meta and key in meta:
                target, pattern = rename_source_key(key, [], [], prefix, meta)
            if target not in meta:
                continue  # no parameter of this model (a layer the recipe does not build)
            if pattern is None:
                transform = self.groups.setdefault(target, WeightRenaming(key, target))
                pattern = key
            else:
                transform = self.groups.setdefault(target, copy.deepcopy(by_pattern[pattern]))
            transform.add_tensor(target, key, pattern, Leaf(key, folder[key], lambda box, key=key: read(key, box)))
        self.first = {first.replace(g.target_patterns[0], t, 1): first  # a one-to-many converter's every target
                      for first, g in self.groups.items() for t in g.target_patterns}
        self.made: dict[str, Lazy] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.first

    def __getitem__(self, name: str) -> Lazy:
        if name not in self.made:
            first = self.first[name]
            out = self.groups[first].convert(first, model=self.model, config=self.model.config)
            self.made.update({n: as_lazy(v[0] if isinstance(v, list) else v) for n, v in out.items()})
        return self.made[name]  # stand-ins, no data: kept for a second name (a tied output)

    def sources(self, name: str) -> list[str]:
        """The folder tensors ``name`` is made of."""
        return sorted(set().union(*self.groups[self.first[name]].layer_targets.values()))

    def near(self, name: str) -> list[str]:
        """The folder's tensors under the nearest module above ``name`` (what it holds instead)."""
        parts = name.split(".")
        for k in range(len(parts) - 1, 0, -1):
            prefix = ".".join(parts[:k]) + "."
            found = [n for n in self.folder if n.startswith(prefix)]
            if found:
                return sorted(found)
        return []


@dataclass(frozen=True)
class Saved:
    """How a model tensor is written: ``names`` (one shape each, ``shape``) in the order of its bytes,
    or as one tensor ``transposed`` (2-D)."""

    names: tuple[str, ...]
    shape: tuple[int, ...]
    transposed: bool = False


def saved_layout(model: nn.Module) -> tuple[dict[str, Saved], str | None]:
    """What transformers' ``save_pretrained`` writes for each tensor of ``model`` (a PreTrainedModel,
    on meta): {model name: Saved} for the tensors it does not write as they are, and why the export
    cannot stream one model tensor at a time ([Note: streaming conversion]), or None. Each saved
    tensor must be one contiguous piece of one model tensor, the pieces tiling it in equal sizes
    (the experts, gate and up halves), or the whole of it transposed."""
    from transformers.core_model_loading import revert_weight_conversion

    shapes = {n: p.shape for n, p in model.state_dict().items()}
    metas = {n: torch.empty(s, device="meta") for n, s in shapes.items()}
    leaves = {n: Leaf(n, s, lambda box, n=n: metas[n][box]) for n, s in shapes.items()}
    saved = revert_weight_conversion(model, dict(leaves))
    pieces: dict[str, list[tuple[str, Tensor]]] = {}
    for name, value in saved.items():
        value = as_lazy(value)
        fqn = _view_of(value)
        if fqn is None:
            return {}, (f"transformers saves '{name}' by a conversion of {', '.join(sorted(_leaves(value))) or '?'} "
                        "that is not one piece of one model tensor; meshpar's one-tensor-at-a-time export does not "
                        "write that")
        pieces.setdefault(fqn, []).append((name, value.whole()))
    layout = {}
    for fqn, got in pieces.items():
        if [n for n, _ in got] == [fqn] and got[0][1].is_contiguous() and got[0][1].shape == shapes[fqn]:
            continue  # written as it is
        place = _place(got, math.prod(shapes[fqn]))
        if place is None:
            return {}, (f"transformers saves model tensor '{fqn}' as {', '.join(n for n, _ in got[:4])}, which are "
                        "not equal contiguous pieces of it; meshpar's export does not write that layout")
        layout[fqn] = place
    return layout, None


def _view_of(node: Lazy) -> str | None:
    """The model tensor ``node`` is a view of (narrowed, selected, transposed), or None (a copy, a computation)."""
    while isinstance(node, (Narrow, Select, Transposed)):
        node = node.part
    return node.name or None if isinstance(node, Leaf) else None


def _leaves(node: Lazy) -> set[str]:
    if isinstance(node, Leaf):
        return {node.name} - {""}
    parts = node.parts if isinstance(node, (Stack, Cat)) else [node.part]
    return set().union(*map(_leaves, parts))


def _place(got: list[tuple[str, Tensor]], numel: int) -> Saved | None:
    """Saved for pieces (name, a view of the model tensor on meta), None when they do not tile it."""
    if len(got) == 1 and got[0][1].dim() == 2 and got[0][1].t().is_contiguous() and got[0][1].numel() == numel:
        return Saved((got[0][0],), tuple(got[0][1].shape), transposed=True)
    got = sorted(got, key=lambda g: g[1].storage_offset())
    offset, shape = 0, got[0][1].shape
    for _, view in got:
        if not view.is_contiguous() or view.storage_offset() != offset or view.shape != shape:
            return None
        offset += view.numel()
    return Saved(tuple(n for n, _ in got), tuple(shape)) if offset == numel else None
