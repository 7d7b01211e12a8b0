"""Which part of a tensor each rank holds: DTensor's sharding as index lists and boxes, and the
chunks a target layout writes ([Note: chunks for a target layout])."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence

from torch.distributed.tensor import Placement, Replicate, Shard

from meshpar.config.keys import DIMS
from meshpar.convert.spec import ConvertError
from meshpar.distributed._torch import StridedShard


def _chunks(seq: Sequence[int], n: int) -> list[Sequence[int]]:
    """``seq`` in n pieces as torch.chunk cuts a dimension (ceil-sized, trailing ones short or empty)."""
    size = -(-len(seq) // n) if len(seq) else 0
    return [seq[i * size:(i + 1) * size] for i in range(n)]


def index_lists(shape: Sequence[int], mesh_shape: Sequence[int], coord: Sequence[int],
                placements: Sequence[Placement]) -> list[Sequence[int]]:
    """The global indices, per tensor dim, of the local shard at mesh ``coord``: DTensor's
    left-to-right sharding with torch.chunk sizes. ``StridedShard(d, sf)`` cuts dim d in sf
    pieces and gives this rank its chunk of each (GPT-2's fused q|k|v, FSDP over a TP shard)."""
    idx: list[Sequence[int]] = [range(n) for n in shape]
    for n, c, placement in zip(mesh_shape, coord, placements, strict=True):
        if isinstance(placement, StridedShard):
            pieces = _chunks(idx[placement.dim], placement.split_factor)
            idx[placement.dim] = [i for piece in pieces for i in _chunks(piece, n)[c]]
        elif isinstance(placement, Shard):
            idx[placement.dim] = _chunks(idx[placement.dim], n)[c]
    return idx


def _runs(seq: Sequence[int]) -> list[tuple[int, int]]:
    """Contiguous runs of an increasing index list: [(start, length)]."""
    if isinstance(seq, range):
        return [(seq.start, len(seq))] if len(seq) else []
    runs: list[list[int]] = []
    for i in seq:
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1][1] += 1
        else:
            runs.append([i, 1])
    return [(s, n) for s, n in runs]


def boxes(idx: Sequence[Sequence[int]]) -> Iterator[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """Index lists -> hyper-rectangles (global offsets, sizes, offsets in the local shard)."""
    per_dim = [_runs(seq) for seq in idx]
    local = [[sum(n for _, n in runs[:k]) for k in range(len(runs))] for runs in per_dim]

    def rec(d: int, off: tuple, size: tuple, loc: tuple) -> Iterator:
        if d == len(per_dim):
            yield off, size, loc
            return
        for (s, n), lo in zip(per_dim[d], local[d], strict=True):
            yield from rec(d + 1, (*off, s), (*size, n), (*loc, lo))

    yield from rec(0, (), (), ())


# [Note: chunks for a target layout]
# DCP -> DCP for a layout writes each tensor as the chunks the layout's ranks hold, so a job at
# that layout reads exactly its own chunks, each from its own rank's file __<rank>_0.distcp.
# A parameter (and its exp_avg, exp_avg_sq) is placed as meshpar's engine and PyTorch's
# fully_shard place it: the family's TP plan table gives the tp placement, then FSDP cuts dim 0
# of the TP-local tensor in torch.chunk pieces over dp_shard (x cp, cp inner: Mesh.fsdp), which
# for a Shard(0) TP weight is StridedShard(0, tp) on dp_shard. A non-contiguous local shard
# (GPT-2's fused c_attn) is written as one chunk per contiguous run. Replicas (dp_replicate,
# replicated tp) are written once, like DCP's dedup, in the file of the least-loaded rank holding
# them. pp moves whole tensors only, to the files of an even split's stages
# (meshpar.parallel.pipeline.stage_layers). Other tensors (0-d optimizer steps, RNG states) keep
# the source's chunks, or are written whole.

def parse_layout(layout: Mapping[str, int] | None) -> dict[str, int]:
    """All five degrees (missing ones 1), checked: positive integers, known dims."""
    degrees = {d: 1 for d in DIMS}
    for key, value in (layout or {}).items():
        if key not in degrees:
            raise ConvertError(f"layout: unknown dimension '{key}'; use {', '.join(DIMS)} (e.g. dp_shard=4,tp=2)")
        if not isinstance(value, int) or value < 1:
            raise ConvertError(f"layout: {key} = {value!r}; give a positive integer degree (no -1 offline)")
        degrees[key] = value
    return degrees


def _rank(layout: Mapping[str, int], pp: int, rep: int, shard: int, cp: int, tp: int) -> int:
    """The global rank at these coordinates: meshpar.distributed.mesh's dims, outermost first."""
    return (((pp * layout["dp_replicate"] + rep) * layout["dp_shard"] + shard) * layout["cp"] + cp) * layout["tp"] + tp


def layout_chunks(shape: Sequence[int], layout: Mapping[str, int], tp_placement: Placement,
                  stage: int) -> dict[tuple[tuple[int, ...], tuple[int, ...]], list[int]]:
    """{(offsets, sizes): ranks holding that chunk} at ``layout``: [Note: chunks for a target layout]."""
    if tp_placement.is_shard() and tp_placement.dim >= len(shape):
        tp_placement = Replicate()
    placements = (tp_placement, Shard(0)) if shape else (Replicate(), Replicate())
    out: dict[tuple[tuple[int, ...], tuple[int, ...]], list[int]] = {}
    fsdp = layout["dp_shard"] * layout["cp"]  # meshpar.distributed.mesh.Mesh.fsdp: dp_shard flattened with cp, cp inner
    for t in range(layout["tp"]):
        for d in range(fsdp):
            idx = index_lists(shape, (layout["tp"], fsdp), (t, d), placements)
            for off, size, _ in boxes(idx):
                if math.prod(size):  # torch.chunk leaves trailing ranks empty on short dims
                    shard, cp = divmod(d, layout["cp"])
                    ranks = [_rank(layout, stage, r, shard, cp, t) for r in range(layout["dp_replicate"])]
                    out.setdefault((off, size), []).extend(ranks)
    return out
