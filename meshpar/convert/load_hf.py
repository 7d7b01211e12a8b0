"""Starting training from a Hugging Face folder: each rank reads only its own shard of every tensor."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from meshpar.convert.hf import HFSource
from meshpar.convert.layout import boxes, index_lists
from meshpar.convert.spec import ConvertError, Decode, ModelSpec


@torch.no_grad()
def load_hf_weights(state_dict: Mapping[str, Tensor], hf_dir: str | os.PathLike, family: str, args: Any) -> str:
    """Fill a meshpar model's state dict in place from a Hugging Face folder, one tensor at a time.

    Values may be plain tensors or DTensors (any mix of Shard, StridedShard and Replicate on
    any mesh, e.g. after tensor parallelism and ``meshpar.fully_shard``): each rank reads only
    the rows and columns of its local shard (``safe_open(...).get_slice``), so no rank ever
    holds a whole tensor; a stacked expert tensor reads only the experts of the shard
    ([Note: stacked experts]), and a tensor the folder stores quantised (gpt-oss's MXFP4 experts) only
    the dim-0 rows (experts) of the shard, decoded in the value's dtype ([Note: quantised tensors on
    import]). ``config.json`` must describe the same model as ``family``/``args``
    (``max_seq_len`` and the adapter's ``TRAINING_ONLY`` args may differ; entries it marks
    ``ZERO_INIT``, which no Hugging Face folder holds, are zeroed); a missing tensor or a wrong
    shape raises ConvertError naming it. Returns a line on what the folder holds that was skipped (the
    adapter's ``skipped_hf``), or "".
    """
    from safetensors import safe_open

    if family == "hf":
        return _load_same_names(state_dict, Path(hf_dir), args)
    hf = HFSource(Path(hf_dir))
    spec = ModelSpec(family, args)
    free = [f for f in ("max_seq_len", *getattr(spec.adapter, "TRAINING_ONLY", ()))
            if hasattr(hf.spec.args, f) and hasattr(args, f)]  # these may differ from config.json's
    theirs = dataclasses.replace(hf.spec.args, **{f: getattr(args, f) for f in free})
    if hf.spec.family != family or theirs != args:
        diff = [f"{f.name} {getattr(theirs, f.name)} vs {getattr(args, f.name)}" for f in dataclasses.fields(args)
                if getattr(theirs, f.name) != getattr(args, f.name)]
        raise ConvertError(f"{hf_dir}: config.json describes a {hf.spec.family} model that differs from this "
                           f"{family} model ({'; '.join(diff) or 'family'}); set model.family / model.size / overrides "
                           "to match config.json")
    with contextlib.ExitStack() as stack:
        handles = {file: stack.enter_context(safe_open(file, framework="pt"))
                   for file in {file for file, _, _ in hf.where_hf.values()}}
        for fqn, value in state_dict.items():
            if fqn not in hf.names and any(re.fullmatch(p, fqn) for p in getattr(spec.adapter, "ZERO_INIT", ())):
                value.zero_()  # no Hugging Face equivalent (the aux-free bias): its value at initialization
                continue
            if fqn not in hf.names:
                raise ConvertError(f"state dict entry '{fqn}' is not a parameter of the {family} model; "
                                   "load_hf_weights takes model.state_dict()")
            pieces = [handles[hf.where_hf[name][0]].get_slice(name) for name in hf.names[fqn]]
            if fqn in hf.quantized:
                _fill(value, _decoded(pieces, hf.quantized[fqn], value.dtype))
            else:
                _load_one(value, pieces, spec.stacked(fqn), spec.transposed(fqn))
    return hf.note


def _load_same_names(state_dict: Mapping[str, Tensor], folder: Path, args: Any) -> str:
    """``model.family = "hf"``: the state dict's names are the model's own ([Note: a transformers model
    as a meshpar family]); a tensor the folder holds under that name is read as it is (a tied output
    is the embedding, read once), any other is made from the folder's tensors as transformers' own
    conversion mapping makes it: per-expert tensors into fused experts, renamed modules
    ([Note: transformers' conversion run lazily], meshpar/models/hf/experts.py), reading only the
    experts and rows of this rank's shard. Returns a line naming the folder's tensors the whole model
    does not read (transformers' own rule for the class, ``_keys_to_ignore_on_load_unexpected``: rotary
    caches, multi-token-prediction layers; or anything else), or "": never skipped silently."""
    from safetensors import safe_open

    from meshpar.convert.hf import _st_header, safetensors_files
    from meshpar.models.hf import convert as hf_convert
    from meshpar.models.hf import experts, meta_model

    where: dict[str, tuple[Path, list[int]]] = {}
    for file in safetensors_files(folder):
        header, _ = _st_header(file)
        where.update({name: (file, entry["shape"]) for name, entry in header.items()})
    tied = hf_convert.tied(args)  # {copy: source}: a folder may hold the source alone
    with contextlib.ExitStack() as stack:
        handles: dict[Path, Any] = {}

        def get_slice(name: str) -> Any:
            file = where[name][0]
            if file not in handles:
                handles[file] = stack.enter_context(safe_open(file, framework="pt"))
            return handles[file].get_slice(name)

        made = None  # what transformers' mapping makes from the folder, built at the first name it lacks
        for fqn, value in state_dict.items():
            name = fqn if fqn in where else tied.get(fqn, fqn)
            if name in where:
                _check_shape(folder, f"tensor '{name}'", where[name][1], value)
                _load_one(value, [get_slice(name)], False, False)
                continue
            if made is None:
                made = experts.FromFolder(meta_model(args.config).hf, {n: s for n, (_, s) in where.items()},
                                          lambda n, box: get_slice(n)[box])
            if name not in made:  # ``name``: a tied output's source, made once per name it is read under
                near = made.near(fqn)
                instead = f"; it holds {_some(near)} there" if near else ""
                raise ConvertError(f"{folder}: no tensor '{fqn}' in its safetensors, which this {args.model_type} "
                                   f"model has, and transformers' conversion mapping for {args.model_type} makes it "
                                   f"from none of the folder's tensors{instead}: the weights do not match config.json")
            what = f"tensor '{fqn}' (made from {_some(made.sources(name))})"
            try:
                lazy = made[name]
            except (ValueError, RuntimeError) as e:  # transformers' operations on pieces that do not fit
                raise ConvertError(f"{folder}: {what} cannot be made as transformers' conversion mapping for "
                                   f"{args.model_type} makes it ({e}); the folder is incomplete or does not match "
                                   "config.json") from e
            _check_shape(folder, what, lazy.shape, value)
            _fill(value, lazy.read)
    return _unread(folder, where, args, tied)


def _unread(folder: Path, where: Mapping[str, Any], args: Any, tied: Mapping[str, str]) -> str:
    """A line on the folder's tensors no parameter of the whole model (every stage) is read from."""
    from meshpar.models.hf import experts, meta_model

    model = meta_model(args.config)
    used, lacking = set(), []
    for fqn in model.state_dict():
        name = fqn if fqn in where else tied.get(fqn, fqn)
        (used.add(name) if name in where else lacking.append(name))
    if lacking:
        made = experts.FromFolder(model.hf, {n: s for n, (_, s) in where.items()}, lambda n, box: None)
        used.update(*(made.sources(n) for n in lacking if n in made))
    unread = sorted(set(where) - used)
    if not unread:
        return ""
    rules = getattr(model.hf, "_keys_to_ignore_on_load_unexpected", None) or []
    by_rule = [n for n in unread if any(re.search(r, n) for r in rules)]
    why = "transformers' own rule for the class" if len(by_rule) == len(unread) else "the model has no place for them"
    return f"meshpar: {folder}: {len(unread)} tensors not read ({_some(unread)}): {why}"


def _some(names: list[str], k: int = 4) -> str:
    return ", ".join(names[:k]) + (f", ... ({len(names)} tensors)" if len(names) > k else "")


def _check_shape(folder: Path, what: str, shape: Any, value: Tensor) -> None:
    if list(shape) != list(value.shape):
        raise ConvertError(f"{folder}: {what} has shape {list(shape)}, but the model built from config.json (and "
                           f"the recipe's overrides) needs {list(value.shape)}")


def _load_one(value: Tensor, pieces: list[Any], stacked: bool, transposed: bool) -> None:
    """Copy this rank's part of ``value`` (a tensor or DTensor) from ``pieces``, safetensors slices:
    one, or one per expert when ``value`` stacks them along dim 0."""

    def read(where: tuple[slice, ...]) -> Tensor:
        if stacked:  # experts where[0] of the stack, each its own Hugging Face tensor
            return torch.stack([pieces[j][where[1:]] for j in range(where[0].start, where[0].stop)])
        return pieces[0][tuple(reversed(where))].t() if transposed else pieces[0][where]  # Conv1D

    _fill(value, read)


def _decoded(sources: list[Any], decode: Decode, dtype: torch.dtype) -> Callable[[tuple[slice, ...]], Tensor]:
    """``read`` for ``_fill`` of a tensor decoded from ``sources`` (safetensors slices): only the box's
    dim-0 rows are read and decoded, the rest of the box cut from them ([Note: quantised tensors on import])."""

    def read(where: tuple[slice, ...]) -> Tensor:
        return decode(*(source[where[0]] for source in sources), dtype=dtype)[(slice(None), *where[1:])]

    return read


def _fill(value: Tensor, read: Callable[[tuple[slice, ...]], Tensor]) -> None:
    """Copy this rank's part of ``value`` (a tensor or DTensor), box by box: ``read(box)`` gives the
    values of a box (one slice per dim) of the whole tensor."""
    if isinstance(value, DTensor):
        coord = value.device_mesh.get_coordinate()
        if coord is None:
            return  # this rank holds no shard
        idx = index_lists(value.shape, value.device_mesh.shape, coord, value.placements)
        local = value.to_local()
    else:
        idx, local = [range(n) for n in value.shape], value
    for off, size, loc in boxes(idx):
        where = tuple(slice(o, o + n) for o, n in zip(off, size, strict=True))
        local[tuple(slice(o, o + n) for o, n in zip(loc, size, strict=True))].copy_(read(where))
