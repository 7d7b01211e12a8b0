"""Layout-independent random initialization: the same values whatever the sharding.

    normal_(w, std=0.02, key="layers.0.attention.wq.weight", seed=s)
    trunc_normal_(w, std=0.02, a=-0.06, b=0.06, key=..., seed=s)
    uniform_(w, a=-0.1, b=0.1, key=..., seed=s)

Each fills ``w`` in place, a plain tensor or a DTensor (bare or in an ``nn.Parameter``),
and the global tensor's values depend only on (seed, key, global position): one process,
FSDP, HSDP, tensor parallel and pipeline stages all start from the same model, while a
rank only ever computes the blocks of rows that overlap its own shard
(see [Note: layout-independent init]). ``ParamInit`` is the form model files use: it draws
the base seed from the global RNG and keys each parameter by its name in the model.

Limits: placements must be ``Shard``, ``StridedShard`` or ``Replicate`` (a parameter is never
``Partial``); values are generated in float32 on the CPU, then cast and copied to the
tensor's dtype and device, so they are the same on every device but cost CPU time.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from meshpar.distributed._torch import StridedShard

# [Note: layout-independent init]
# Drawing from one generator per rank (what nn.init does on a DTensor's local shard) makes the
# global tensor a function of the layout. Here a tensor of global shape [R, ...] is cut along dim 0
# into blocks of ``max(1, BLOCK_NUMEL // row_numel)`` rows; block i is sampled whole, in float32 on
# the CPU, from its own generator seeded with blake2b(base seed, key, i), and only then sliced. So a
# value depends on (seed, key, global position) alone, bit for bit. A rank computes only the blocks
# its rows overlap (one block in memory at a time) and keeps the rows and columns its placements
# select, replayed left to right as DTensor defines them (Shard: its torch.chunk piece; StridedShard:
# its piece of each of sf chunks; Replicate: all); a dim-1 shard computes full-width blocks, so tp
# ranks repeat work, not memory. Keys are parameter names with wrapper components removed
# (``canonical_name``), so a pipeline stage or a compiled or checkpoint-wrapped block draws what the
# plain model draws. BLOCK_NUMEL and the hashing are part of the values' contract: changing either
# changes every model's initial weights.

BLOCK_NUMEL = 1 << 20  # elements per generated block (rounded to whole rows, at least one)

# a sampler turns a generator and a block shape into a float32 CPU block of values
Sampler = Callable[[torch.Generator, tuple[int, ...]], Tensor]
Runs = list[tuple[int, int]]  # (global start, length) pieces of one dim, in local order

_WRAPPER_NAMES = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})


def draw_seed() -> int:
    """A base seed from the global RNG: ``torch.manual_seed(s)`` then init stays reproducible,
    and ranks that seeded alike draw the same number."""
    return int(torch.randint(0, 2**62, (), dtype=torch.int64))


def canonical_name(name: str) -> str:
    """A parameter name without the components torch.compile and checkpoint wrappers insert."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_NAMES)


def block_seed(seed: int, key: str, block: int) -> int:
    digest = hashlib.blake2b(f"{seed}\0{key}\0{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # 63 bits


def normal_(tensor: Tensor, mean: float = 0.0, std: float = 1.0, *, key: str, seed: int) -> Tensor:
    """Fill with N(mean, std^2) values that depend on (seed, key, global position) only."""
    def sample(g: torch.Generator, shape: tuple[int, ...]) -> Tensor:
        return torch.randn(shape, generator=g).mul_(std).add_(mean)
    return _fill(tensor, key, seed, sample)


def trunc_normal_(tensor: Tensor, mean: float = 0.0, std: float = 1.0, a: float = -2.0, b: float = 2.0, *,
                  key: str, seed: int) -> Tensor:
    """N(mean, std^2) truncated to [a, b] (absolute bounds, as ``nn.init.trunc_normal_``), by the
    same inverse-CDF method, layout-independent like ``normal_``."""
    if not (std > 0 and a < b):
        raise ValueError(f"trunc_normal_ needs std > 0 and a < b, got std={std}, a={a}, b={b}")
    lo, hi = _norm_cdf((a - mean) / std), _norm_cdf((b - mean) / std)

    def sample(g: torch.Generator, shape: tuple[int, ...]) -> Tensor:
        u = torch.empty(shape).uniform_(2 * lo - 1, 2 * hi - 1, generator=g)
        return u.erfinv_().mul_(std * math.sqrt(2.0)).add_(mean).clamp_(a, b)
    return _fill(tensor, key, seed, sample)


def uniform_(tensor: Tensor, a: float = 0.0, b: float = 1.0, *, key: str, seed: int) -> Tensor:
    """Fill with U(a, b) values, layout-independent like ``normal_``."""
    def sample(g: torch.Generator, shape: tuple[int, ...]) -> Tensor:
        return torch.empty(shape).uniform_(a, b, generator=g)
    return _fill(tensor, key, seed, sample)


class ParamInit:
    """The initializers above for one model's ``init_weights``: one base seed, and each parameter
    keyed by its (canonical) name in ``module``; a tied Parameter takes its first name.

        init = ParamInit(model)  # draws the base seed from the global RNG
        init.trunc_normal_(model.layers["0"].attention.wq.weight, std=0.02, a=-0.06, b=0.06)
    """

    def __init__(self, module: nn.Module, seed: int | None = None) -> None:
        self.seed = draw_seed() if seed is None else seed
        self._keys: dict[int, str] = {}
        for name, param in module.named_parameters(remove_duplicate=False):
            self._keys.setdefault(id(param), canonical_name(name))

    def key(self, param: Tensor) -> str:
        try:
            return self._keys[id(param)]
        except KeyError:
            raise KeyError(f"parameter of shape {tuple(param.shape)} is not in the module ParamInit was "
                           "built from; build ParamInit from the root module, or pass key=") from None

    def normal_(self, param: Tensor, *, std: float, mean: float = 0.0, key: str | None = None) -> Tensor:
        return normal_(param, mean, std, key=self.key(param) if key is None else key, seed=self.seed)

    def trunc_normal_(self, param: Tensor, *, std: float, a: float, b: float, mean: float = 0.0,
                      key: str | None = None) -> Tensor:
        return trunc_normal_(param, mean, std, a, b, key=self.key(param) if key is None else key, seed=self.seed)

    def uniform_(self, param: Tensor, *, a: float, b: float, key: str | None = None) -> Tensor:
        return uniform_(param, a, b, key=self.key(param) if key is None else key, seed=self.seed)


# --- the blocks ------------------------------------------------------------------------------

def _norm_cdf(x: float) -> float:
    return (1.0 + math.erf(x / math.sqrt(2.0))) / 2.0


def _generate_block(seed: int, key: str, block: int, shape: tuple[int, ...], sample: Sampler) -> Tensor:
    """Block ``block`` of the tensor ``key``: rows [block * block_rows, ...) of the global tensor."""
    return sample(torch.Generator().manual_seed(block_seed(seed, key, block)), shape)


def _fill(tensor: Tensor, key: str, seed: int, sample: Sampler) -> Tensor:
    with torch.no_grad():  # no_grad also makes DTensor.to_local() return the local tensor itself
        local, shape, runs = _local_region(tensor)
        if runs is None or local.is_meta or local.numel() == 0:
            return tensor
        shape = shape or (1,)  # a 0-d tensor is one row of one element
        target = local.view(1) if local.ndim == 0 else local
        row_numel = math.prod(shape[1:])
        block_rows = max(1, BLOCK_NUMEL // row_numel)
        pick_columns = [_indexer(runs[d], d, shape[d]) for d in range(1, len(shape))]
        for block, pieces in _pieces_by_block(runs[0], block_rows).items():
            first = block * block_rows
            values = _generate_block(seed, key, block, (min(block_rows, shape[0] - first), *shape[1:]), sample)
            for local_start, start, length in pieces:
                src = values[start - first:start - first + length]
                for pick in pick_columns:
                    src = pick(src)
                target[local_start:local_start + length].copy_(src)
    return tensor


def _pieces_by_block(row_runs: Runs, block_rows: int) -> dict[int, list[tuple[int, int, int]]]:
    """Split the local rows at block boundaries: block -> [(local start, global start, length)]."""
    pieces: dict[int, list[tuple[int, int, int]]] = {}
    local = 0
    for start, length in row_runs:
        end = start + length
        while start < end:
            block = start // block_rows
            stop = min(end, (block + 1) * block_rows)
            pieces.setdefault(block, []).append((local, start, stop - start))
            local, start = local + stop - start, stop
    return dict(sorted(pieces.items()))


def _indexer(dim_runs: Runs, dim: int, size: int) -> Callable[[Tensor], Tensor]:
    """Takes this rank's indices of dim ``dim`` out of a block (a slice when they are contiguous)."""
    if len(dim_runs) == 1:
        start, length = dim_runs[0]
        if (start, length) == (0, size):
            return lambda t: t
        return lambda t: t.narrow(dim, start, length)
    index = torch.cat([torch.arange(start, start + length) for start, length in dim_runs])
    return lambda t: t.index_select(dim, index)


# --- which global indices a local tensor holds -------------------------------------------

def _local_region(tensor: Tensor) -> tuple[Tensor, tuple[int, ...], list[Runs] | None]:
    """(local tensor, global shape, per-dim runs of global indices); runs is None off the mesh."""
    shape = tuple(tensor.shape)
    if not isinstance(tensor, DTensor):
        return tensor, shape, [[(0, n)] for n in shape] or [[(0, 1)]]
    local = tensor.to_local()
    coordinate = tensor.device_mesh.get_coordinate()
    if coordinate is None:
        return local, shape, None
    runs: list[Runs] = [[(0, n)] for n in shape] or [[(0, 1)]]
    for mesh_dim, placement in enumerate(tensor.placements):
        n, i = tensor.device_mesh.size(mesh_dim), coordinate[mesh_dim]
        if isinstance(placement, StridedShard):  # not a Shard subclass in every torch release
            d = placement.dim
            pieces = [_chunk(runs[d], placement.split_factor, j) for j in range(placement.split_factor)]
            runs[d] = _coalesce([run for piece in pieces for run in _chunk(piece, n, i)])
        elif isinstance(placement, Shard):
            runs[placement.dim] = _chunk(runs[placement.dim], n, i)
        elif not isinstance(placement, Replicate):
            raise ValueError(f"cannot initialize a DTensor placed {placement} on mesh dim {mesh_dim}: "
                             "parameters are Shard or Replicate")
    expected = tuple(sum(length for _, length in r) for r in runs) if shape else ()
    if tuple(local.shape) != expected:
        raise ValueError(f"local tensor {tuple(local.shape)} does not match the shard {expected} that "
                         f"placements {tensor.placements} give of {shape} (a padded local tensor?)")
    return local, shape, runs


def _chunk(runs: Runs, n: int, i: int) -> Runs:
    """Piece ``i`` of ``n`` of an index list, as torch.chunk cuts it (ceil-sized, trailing pieces short or empty)."""
    total = sum(length for _, length in runs)
    size = -(-total // n)
    return _slice(runs, min(total, i * size), min(total, (i + 1) * size))


def _slice(runs: Runs, lo: int, hi: int) -> Runs:
    out: Runs = []
    pos = 0
    for start, length in runs:
        a, b = max(lo, pos), min(hi, pos + length)
        if a < b:
            out.append((start + a - pos, b - a))
        pos += length
    return out


def _coalesce(runs: Runs) -> Runs:
    out: Runs = []
    for start, length in runs:
        if out and out[-1][0] + out[-1][1] == start:
            out[-1] = (out[-1][0], out[-1][1] + length)
        else:
            out.append((start, length))
    return out
