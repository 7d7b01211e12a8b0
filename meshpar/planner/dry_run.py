"""A recipe's ranks at the target world size, built in a fake process group on this machine.

    p = plan(recipe, world_size=64, profile=profile)
    p.ranks[0].rows        # parameter placements and local shapes of the first stage's rank
    p.ranks[0].peak_bytes  # its peak live bytes in a training step

One representative rank per pipeline stage (coordinate 0 on every other dim: under FSDP's
``torch.chunk`` sharding the lowest ranks hold the largest shards, so it is the fullest
rank of its stage) joins a ``fake`` process group (``FakeStore``: collectives return at once)
of the target world size and builds its part of the model exactly as ``meshpar train``
does (``meshpar/parallel/parallelize.py``: pipeline split -> tensor parallel -> activation
checkpointing -> ``fully_shard`` per block, then the stage root) on the meta device. The
parameter table, the sharded parameter, gradient and AdamW bytes and the FSDP units are
read off the result; ``simulate.py`` then runs the step on fake tensors. Stages alike in
shape (same number of blocks, neither end) are simulated once.

Limits: one stage per rank (``gpipe``, ``1f1b``; not yet the interleaved and zero-bubble
schedules); ``parallel.compile`` is ignored (memory is eager mode's).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from time import perf_counter

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from meshpar.config.hardware import HardwareProfile
from meshpar.config.recipe import Recipe, RecipeError
from meshpar.distributed import mesh as meshlib
from meshpar.distributed._torch import clear_dtensor_caches
from meshpar.fsdp import FSDPModule
from meshpar.models import get_family
from meshpar.parallel.parallelize import parallelize_transformer
from meshpar.parallel.pipeline import split_model, stage_layers
from meshpar.parallel.wrap import wrappers
from meshpar.planner import extrapolate
from meshpar.planner.cost import LinkDefaults, StepTime, step_time
from meshpar.planner.simulate import Measured, schedule_actions, simulate
from meshpar.training.loss import layout_chunks
from meshpar.training.preflight import check_layout

PLANNED_SCHEDULES = ("1f1b", "gpipe")


@dataclass(frozen=True)
class ParamRow:
    """Parameters alike in every block, as one row: ``layers.{0..79}.attention.wq.weight`` x 80."""

    name: str
    count: int
    global_shape: tuple[int, ...]
    placements: str  # "dp_shard:_S(0, 8) tp:S(0)"; "-" for a plain tensor
    local_shape: tuple[int, ...]
    dtype: str
    local_bytes: int  # each


@dataclass(frozen=True)
class Unit:
    """One FSDP unit (a block, or a stage root) of a rank."""

    name: str
    gathered_bytes: int  # unsharded parameters in the compute dtype (padded to equal shards)
    reduce_bytes: int  # the reduce-scatter's full input in the reduce dtype


@dataclass
class RankPlan:
    rank: int
    coordinate: dict[str, int]
    stage: int
    layers: range
    rows: list[ParamRow]
    n_params: int  # global elements of the parameters of this stage, each counted once
    param_bytes: int  # sharded parameters on this rank (exact)
    grad_bytes: int  # their gradients (exact)
    optim_bytes: int  # AdamW: exp_avg + exp_avg_sq + a float32 step per tensor (exact)
    units: list[Unit]
    p2p_bytes: int  # pipeline receive buffers, one per microbatch (activations in, gradients back)
    measured: Measured

    schedule: str | None  # the pipeline schedule, None without pipelining
    n_stages: int
    n_microbatches: int  # per optimizer step

    @property
    def actions(self) -> list[tuple[str, int]]:
        """This stage's step as (simulated phase, other microbatches in flight) per forward/backward."""
        return schedule_actions(self.schedule, self.n_microbatches, self.n_stages, self.stage, self.measured.n_run)

    @property
    def peak_phase(self) -> str:
        return self.measured.peak(self.actions)[1]

    @property
    def others_at_peak(self) -> int:
        return self.measured.peak(self.actions)[2]

    @property
    def peak_bytes(self) -> int:
        """The step's peak: the simulated phase's peak, the microbatches in flight beside it, AdamW
        state and the pipeline's receive buffers (both live through the whole step)."""
        return self.measured.peak(self.actions)[0] + self.optim_bytes + self.p2p_bytes


@dataclass
class Plan:
    recipe: Recipe
    layout: meshlib.Layout
    profile: HardwareProfile
    args: object  # the family's model args
    accum: int  # microbatches per optimizer step on each data-parallel rank
    n_params: int  # the whole model's parameters (sum over stages)
    ranks: list[RankPlan]
    time: StepTime
    nccl: bool  # collectives sized as NCCL runs them (a CUDA profile), else as gloo does

    @property
    def usable_bytes(self) -> int:
        """[Note: usable device memory] The profile's ``memory_gb`` in units of 1e9 bytes: 74.5 GiB
        for an 80 GB H100, whose CUDA runtime reports 79.6 GiB. The planner counts live tensor
        bytes; the difference (5 GiB, 6%) is left to what that count cannot see: the CUDA
        context, NCCL's own buffers and the caching allocator's fragmentation."""
        return int(self.profile.memory_gb * 1e9)


@contextlib.contextmanager
def fake_world(rank: int, world_size: int) -> Iterator[None]:
    """This process as ``rank`` of ``world_size`` in a process group whose collectives do nothing."""
    if dist.is_initialized():
        raise RuntimeError("meshpar plan runs outside any process group; call it before init_process_group")
    from meshpar.distributed._torch import FakeStore  # torch.testing's fake process group, on first use

    clear_dtensor_caches()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        clear_dtensor_caches()  # cached plans hold the process groups of the world just destroyed


def check(recipe: Recipe, world_size: int) -> tuple[meshlib.Layout, int]:
    """The launch checks of ``meshpar train`` that need no data: (layout, microbatches per step)."""
    p = recipe.parallel
    layout, accum, _, _ = check_layout(recipe, world_size)
    if layout.pp > 1 and (p.pp_schedule not in PLANNED_SCHEDULES or p.pp_virtual_stages != 1):
        raise RecipeError(f"parallel.pp_schedule = '{p.pp_schedule}': meshpar plan models one stage per rank "
                          f"({', '.join(PLANNED_SCHEDULES)}) and not yet the interleaved or zero-bubble "
                          f"schedules; plan with --parallel.pp_schedule=1f1b --parallel.pp_virtual_stages=1")
    return layout, accum


def plan(recipe: Recipe, world_size: int, profile: HardwareProfile, *, gpus_per_node: int | None = None,
         efficiency: float | None = None, links: LinkDefaults | None = None,
         progress: Callable[[str], None] | None = None) -> Plan:
    """Plan ``recipe`` on ``world_size`` devices of ``profile``; raises RecipeError for a bad recipe.
    ``progress``: told a line as each pipeline stage's step is simulated (the dry run's long part)."""
    layout, accum = check(recipe, world_size)
    if progress is not None:
        progress(f"a dry run of {recipe.model.family} {recipe.model.size} at {world_size} ranks: each pipeline "
                 f"stage's step simulated on fake tensors")
    family = get_family(recipe.model.family)
    args = family.model_args(recipe.model)
    if recipe.model.attention == "document":  # its masks' memory; any EOS id will do: fake tokens hold no values
        args = dataclasses.replace(args, document_eos=0)
    p = recipe.parallel
    layers = stage_layers(args.n_layers, layout.pp, p.pp_boundaries)
    nccl = profile.device == "cuda"
    ranks: dict[int, RankPlan] = {}
    simulated: dict[tuple, Measured] = {}
    shorts: dict[tuple, Measured] = {}  # the short stages simulated, shared by stages whose own differ
    lent: dict[tuple, extrapolate.Slopes] = {}  # middle stages' slopes, by repeating block, for the ends
    first_of: dict[tuple, int] = {}  # the stage that simulated each role (the progress lines)
    for s in sorted(range(layout.pp), key=lambda s: s in (0, layout.pp - 1)):  # the ends last: they borrow
        rank = s * (world_size // layout.pp)
        # stages alike in blocks, ends and which blocks are checkpointed (ac_every counts global indices)
        checkpointed = tuple(i % p.ac_every == 0 for i in layers[s]) if p.activation_checkpoint != "none" else ()
        role = (len(layers[s]), s == 0, s == layout.pp - 1, checkpointed)
        start, alike = perf_counter(), first_of.setdefault(role, s)
        with fake_world(rank, world_size):
            mesh = meshlib.build(layout, "cpu")
            stages = _build(family, args, mesh, recipe)
            rank_plan = _describe(rank, mesh, stages, recipe, layers[s], accum)
            if role not in simulated:
                simulated[role] = _simulate(family, args, mesh, recipe, stages, accum, nccl, shorts, role[1:3], lent)
            rank_plan.measured = simulated[role]
        ranks[s] = rank_plan
        if progress is not None:
            where = f"pipeline stage {s} of {layout.pp}" if layout.pp > 1 else "the step"
            how = f"as stage {alike}'s" if alike != s else f"in {perf_counter() - start:.1f} s"
            n = len(layers[s])
            progress(f"{where} ({n} block{'s' if n != 1 else ''}) simulated {how}")
    ranks = [ranks[s] for s in range(layout.pp)]
    n_params = sum(r.n_params for r in ranks)
    time = step_time(recipe, layout, args, profile, ranks, accum, gpus_per_node=gpus_per_node,
                     efficiency=efficiency, links=links or LinkDefaults())
    return Plan(recipe, layout, profile, args, accum, n_params, ranks, time, nccl)


def _simulate(family, args, mesh: meshlib.Mesh, recipe: Recipe, stages: list[tuple[int, torch.nn.Module]],
              accum: int, nccl: bool, shorts: dict[tuple, Measured], ends: tuple[bool, bool],
              lent: dict[tuple, extrapolate.Slopes] | None = None) -> Measured:
    """The simulated step of ``stages`` (built, not yet run); a stage of many blocks that repeat
    (after a head of others, as DeepSeek-V3's dense first layers) through two short ones
    (``extrapolate.py``), which give the same figures in a fraction of the time. ``shorts``: short
    stages simulated before, by (blocks, ``ends``: first and last stage, each kept block's
    ``_alike``), which stages of other lengths share. ``lent``: a middle stage (period 1) leaves
    its slopes there, by its repeating block, and a first or last stage of that block takes them
    instead of its second short stage ([Note: the end stages borrow a middle stage's slopes])."""
    (_, stage), = stages
    blocks = [_alike(block) for block in stage.layers.values()]
    n = len(blocks)
    head, period = extrapolate.pattern(blocks)
    counts = extrapolate.short_counts(n, period, head)
    if counts is None:
        return simulate(stages, mesh, recipe, accum, nccl=nccl)

    def short(c: int) -> Measured:
        kept = extrapolate.kept(n, c, head)
        key = (c, ends, tuple(blocks[j] for j in kept))
        if key not in shorts:
            shorts[key] = simulate(_build(family, args, mesh, recipe, keep=kept), mesh, recipe, accum, nccl=nccl)
        return shorts[key]

    repeating = (period, blocks[-1])
    if lent is not None and period == 1 and ends in ((True, False), (False, True)) and repeating in lent:
        borrowed = extrapolate.borrow(short(counts[0]), counts[0], lent[repeating], n=n, head=head, accum=accum)
        if borrowed is not None:
            return borrowed
    m1, m2 = short(counts[0]), short(counts[1])
    if lent is not None and period == 1 and ends == (False, False) and repeating not in lent:
        slopes = extrapolate.slopes(m1, counts[0], m2, counts[1], head)
        if slopes is not None:
            lent[repeating] = slopes
    return extrapolate.extrapolate(m1, counts[0], m2, counts[1], n=n, period=period, accum=accum, head=head)


def _alike(block: torch.nn.Module) -> tuple:
    """What makes two blocks run the same ops: their kind, wrappers (checkpointing) and parameters."""
    return (type(block).__qualname__, wrappers(block),
            tuple((name, tuple(p.shape), _placements(p), p.dtype) for name, p in block.named_parameters()))


@functools.lru_cache(maxsize=1)
def _meta_model(model_cls: type, args) -> torch.nn.Module:
    """The whole model on meta, built once per plan instead of once per build (its cost:
    docs/performance.md#the-simulations-own-costs); never changed: ``_build`` parallelizes a copy
    of the stage it needs."""
    with torch.device("meta"):
        return model_cls(args)


def _build(family, args, mesh: meshlib.Mesh, recipe: Recipe,
           keep: list[int] | None = None) -> list[tuple[int, torch.nn.Module]]:
    """This rank's stages, parallelized on meta: the steps of meshpar.parallel.parallelize.build before
    to_empty. ``keep``: positions of the only blocks to keep (their keys, the global indices, kept)."""
    layout, p = mesh.layout, recipe.parallel
    whole = _meta_model(family.model_cls, args)
    index = mesh["pp"].get_local_rank() if layout.pp > 1 else 0
    layers = stage_layers(len(whole.layers), layout.pp, p.pp_boundaries)[index]
    if keep is not None:
        layers = [layers[j] for j in keep]
    stage = split_model(whole, index, layout.pp, layers, cut=family.cut)  # a copy: ``whole`` is shared
    cfg = dataclasses.replace(p, compile=False)  # compiled or not, eager memory is what is planned
    t = recipe.train  # the loss in chunks: as meshpar.parallel.parallelize.build defers the head
    chunks = layout_chunks(t.loss_chunks, t.micro_batch, t.seq_len, args.vocab_size, layout, p.loss_parallel)
    stage.head_in_loss = chunks > 1 and stage.head is not None
    return [(index, parallelize_transformer(stage, mesh, cfg, family.plan(args, layout.tp), moe=family.moe))]


def _placements(p: torch.Tensor) -> str:
    if not isinstance(p, DTensor):
        return "-"
    names = p.device_mesh.mesh_dim_names or [f"dim{i}" for i in range(p.device_mesh.ndim)]
    return " ".join(f"{n}:{pl}" for n, pl in zip(names, p.placements, strict=True))


_BLOCK = re.compile(r"^layers\.(\d+)\.")


def _rows(stage: torch.nn.Module) -> tuple[list[ParamRow], int, int, int]:
    """(rows, global elements, local bytes, tensors) over the stage's distinct parameters."""
    groups: dict[tuple, list[int]] = {}
    n_global = local_bytes = n_tensors = 0
    for name, p in stage.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        n_global += p.numel()
        local_bytes += local.numel() * local.element_size()
        n_tensors += 1
        m = _BLOCK.match(name)
        pattern = _BLOCK.sub("layers.{}.", name) if m else name
        key = (pattern, tuple(p.shape), _placements(p), tuple(local.shape), str(p.dtype).removeprefix("torch."),
               local.numel() * local.element_size())
        groups.setdefault(key, []).append(int(m.group(1)) if m else -1)
    rows = []
    for (pattern, shape, placements, local_shape, dtype, nbytes), idx in groups.items():
        name = pattern.format(f"{min(idx)}..{max(idx)}" if len(idx) > 1 else idx[0]) if "{}" in pattern else pattern
        rows.append(ParamRow(name, len(idx), shape, placements, local_shape, dtype, nbytes))
    return rows, n_global, local_bytes, n_tensors


def _units(stage: torch.nn.Module) -> list[Unit]:
    units = []
    for name, m in stage.named_modules():
        groups = [g for g in m._fsdp_state.groups if g.params] if isinstance(m, FSDPModule) else []
        for group in groups:  # a unit holds one group per mesh its parameters shard over
            compute, reduce = group.compute_dtype(group.params[0]), group.reduce_dtype()
            n = group.world * group.per_rank_numel
            label = (name or "root") + (f" ({group.mesh_info.shard_dim_name})" if len(groups) > 1 else "")
            units.append(Unit(label, n * compute.itemsize, n * reduce.itemsize))
    return units


def _describe(rank: int, mesh: meshlib.Mesh, stages: list[tuple[int, torch.nn.Module]], recipe: Recipe,
              layers: range, accum: int) -> RankPlan:
    (index, stage), = stages
    rows, n_global, param_bytes, n_tensors = _rows(stage)
    layout, t, p = mesh.layout, recipe.train, recipe.parallel
    coordinate = dict(zip(meshlib.DIMS, mesh.world.get_coordinate(), strict=True))
    # [Note: what the simulation leaves to arithmetic]: receive buffers, fp32 [micro_batch, T/(cp tp), D]
    hidden = t.micro_batch * (t.seq_len // (layout.cp * layout.tp)) * stage.args.dim * 4
    ends = (index > 0) + (index < layout.pp - 1)
    p2p = accum * hidden * ends
    optim = 2 * param_bytes + 4 * n_tensors
    schedule = p.pp_schedule if layout.pp > 1 else None
    return RankPlan(rank, coordinate, index, layers, rows, n_global, param_bytes, param_bytes, optim,
                    _units(stage), p2p, None, schedule, layout.pp, accum)  # measured: set by plan()
