"""The device mesh: named parallel dimensions, validated before any process group exists.

Dimensions, outermost first: ``pp``, ``dp_replicate``, ``dp_shard``, ``cp``, ``tp``. The
innermost dims change fastest across ranks, so ``tp`` groups are neighbouring ranks (the
same host, the fastest links) and ``pp`` groups span hosts. Every dim is in the mesh even
at degree 1, so ``mesh["tp"]`` is always valid. A flattened ``dp`` (``dp_replicate x
dp_shard``) is what data is sharded over and loss is averaged over.

Rank layout, for pp=2, dp_shard=2, tp=2 on 8 ranks::

    pp 0: dp_shard 0 -> ranks 0 1 (tp)   dp_shard 1 -> ranks 2 3
    pp 1: dp_shard 0 -> ranks 4 5        dp_shard 1 -> ranks 6 7
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from meshpar.config.keys import DIMS
from meshpar.config.recipe import ParallelConfig, RecipeError
from meshpar.distributed._torch import concatenate_meshes, flatten_mesh, unflatten_mesh


@dataclass(frozen=True)
class Layout:
    """Resolved degrees: every dim >= 1 and their product is the world size."""

    pp: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    ep: int = 1  # not a mesh dim of its own: it splits dp_shard (``Mesh.ep``)

    @property
    def degrees(self) -> tuple[int, ...]:
        return tuple(getattr(self, d) for d in DIMS)

    @property
    def world_size(self) -> int:
        return math.prod(self.degrees)

    @property
    def dp(self) -> int:
        """Data-parallel degree: the number of distinct batch shards."""
        return self.dp_replicate * self.dp_shard

    def __str__(self) -> str:
        text = " x ".join(f"{d} {n}" for d, n in zip(DIMS, self.degrees, strict=True) if n > 1) or "single rank"
        return text + (f" (ep {self.ep} within dp_shard)" if self.ep > 1 else "")


def _equation(degrees: dict[str, int]) -> str:
    return " * ".join(f"{d}({n})" for d, n in degrees.items())


def resolve(cfg: ParallelConfig, world_size: int) -> Layout:
    """Fill ``dp_shard = -1`` with the ranks left over and check the product is the world size."""
    degrees = {d: getattr(cfg, d) for d in DIMS}
    if degrees["dp_shard"] == -1:
        others = math.prod(n for d, n in degrees.items() if d != "dp_shard")
        if world_size % others:
            shown = {d: n for d, n in degrees.items() if d != "dp_shard"}
            raise RecipeError(f"[parallel] dp_shard = -1 takes the ranks left over, but {_equation(shown)} = "
                              f"{others} does not divide the world size {world_size}; change the degrees or "
                              f"run on a multiple of {others} ranks")
        degrees["dp_shard"] = world_size // others
    if math.prod(degrees.values()) != world_size:
        raise RecipeError(f"[parallel] {_equation(degrees)} = {math.prod(degrees.values())} != world size "
                          f"{world_size}; make the degrees multiply to {world_size} or set dp_shard = -1")
    ep = cfg.ep
    if degrees["dp_shard"] % ep:
        raise RecipeError(f"[parallel] ep = {ep} borrows its ranks from dp_shard = {degrees['dp_shard']}, which it "
                          f"must divide; choose an ep that divides dp_shard, or more dp_shard ranks", key="parallel.ep")
    return Layout(**degrees, ep=ep)


@dataclass(frozen=True)
class Mesh:
    """The run's DeviceMesh with every dim named, plus the flattened ``dp`` mesh.

    ``mesh["tp"]`` (any dim of DIMS) and ``mesh["dp"]`` are 1-D sub-meshes; pass them to the
    part that needs them explicitly. There is no global mesh.
    """

    layout: Layout
    world: DeviceMesh  # all DIMS, outermost first
    dp: DeviceMesh  # dp_replicate x dp_shard flattened: what batches are sharded over

    def __getitem__(self, name: str) -> DeviceMesh:
        return self.dp if name == "dp" else self.world[name]

    @functools.cached_property
    def ep(self) -> DeviceMesh:
        """The expert-parallel ranks: the inner, neighbouring part of ``dp_shard`` (split into
        ``dp_shard_mod_ep x ep``), a sub-mesh of the same root as every dim, so an expert's DTensor
        spans it and the experts' FSDP mesh (``sparse``)."""
        return self._split["ep"]

    @functools.cached_property
    def fsdp(self) -> DeviceMesh:
        """The mesh FSDP shards every block over: ``dp_shard``, flattened with ``cp`` when context
        parallel (its ranks hold the same parameters and see other tokens of the same sequences:
        their gradients average like data-parallel ones), ``dp_replicate`` outermost when hybrid."""
        lay = self.layout
        shard = self.world["dp_shard"] if lay.cp == 1 else flatten_mesh(self.world["dp_shard", "cp"], "dp_shard_cp")
        return concatenate_meshes([self.world["dp_replicate"], shard]) if lay.dp_replicate > 1 else shard

    @functools.cached_property
    def replicas(self) -> DeviceMesh:
        """The ranks a parameter is whole on, when FSDP does not shard (``dp_shard = 1``), whose
        gradients the step averages: ``dp_replicate``, flattened with ``cp`` when context parallel."""
        if self.layout.cp == 1:
            return self.world["dp_replicate"]
        return flatten_mesh(self.world["dp_replicate", "cp"], "dp_replicate_cp")

    @functools.cached_property
    def sparse(self) -> tuple[DeviceMesh, DeviceMesh | None]:
        """FSDP meshes of a mixture-of-experts layer's parameters: (the layer's own: router, and the
        experts without ep; the experts' when ep > 1, else None). Each shards over the ranks that
        route different tokens through it: ``dp_shard`` (``dp_shard_mod_ep`` for the experts, which
        ep already splits), and ``cp`` and ``tp`` where they split the sequence ([Note: the tp ranks
        are data-parallel for the experts] in meshpar/parallel/expert_parallel.py), flattened into one dim
        named after its parts (``dp_shard_mod_ep_cp_tp``); replicas outermost (hybrid)."""
        lay = self.layout
        inner = [d for d in ("cp", "tp") if getattr(lay, d) > 1]

        def tokens_mesh(root: DeviceMesh, first: str) -> DeviceMesh:
            dims = (first, *inner)
            mesh = root[first] if not inner else flatten_mesh(root[dims], "_".join(dims))
            return concatenate_meshes([root["dp_replicate"], mesh]) if lay.dp_replicate > 1 else mesh

        layer = self.fsdp if inner == ["cp"] else tokens_mesh(self.world, "dp_shard")
        return layer, tokens_mesh(self._split, "dp_shard_mod_ep") if lay.ep > 1 else None

    @functools.cached_property
    def _split(self) -> DeviceMesh:
        """The world mesh with ``dp_shard`` split into ``dp_shard_mod_ep x ep``."""
        ep = self.layout.ep
        return unflatten_mesh(self.world, "dp_shard", (self.layout.dp_shard // ep, ep), ("dp_shard_mod_ep", "ep"))

    @property
    def dp_rank(self) -> int:
        """Which shard of the global batch this rank takes."""
        return self.dp.get_local_rank()


def build(layout: Layout, device_type: str) -> Mesh:
    """Create the mesh over the default process group (one sub-group per dim, plus ``dp``)."""
    world = init_device_mesh(device_type, layout.degrees, mesh_dim_names=DIMS)
    return Mesh(layout, world, flatten_mesh(world["dp_replicate", "dp_shard"], "dp"))
