"""Cut a model built on meta into pipeline stages: which layers, which ranks, which modules.

    layers = stage_layers(n_layers=32, n_stages=4)              # [range(0, 8), range(8, 16), ...]
    stage_ids(pp_rank=1, pp=4, virtual=2, style="loop")         # [1, 5]
    stage = split_model(model, stage_index=1, n_stages=8, layers=layers[1])
    stages = split(model, pp_rank, pp, virtual=2)               # [(1, stage 1), (5, stage 5)]

A stage is the model's own class with some blocks deleted: the blocks it keeps stay in
``model.layers`` under their global index, so parameter names equal the whole model's
(``layers.17.attention.wq.weight`` on whichever stage holds block 17) and checkpoints do
not depend on the layout. The input end (embeddings) lives on stage 0 only and the output
end (final norm, output projection) on the last stage only; elsewhere those attributes
are None and the model's ``forward`` passes hidden states through.

Limits: tied input/output embeddings (GPT-2, Qwen2/Qwen3 debug and 0.5b/0.6b, Llama 3.2 1B)
are refused when the two ends land in different stages (see [Note: tied embeddings across
stages]). Every stage needs at least one block.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

from torch import nn

from meshpar.config.recipe import RecipeError

STYLES = ("loop", "v")

# [Note: where the ends of a model are]
# Model files register their children in data-flow order: the input end, then ``layers``,
# then the output end (Llama: tok_embeddings | layers | norm, output; GPT-2: wte, wpe |
# layers | ln_f, lm_head). So the ends are found generically, with no per-family table:
# the named children before ``layers`` belong to the first stage, those after it to the
# last. Buffers (RoPE tables) are not children and stay on every stage. A family whose
# registration order differs would need its own split.

# [Note: tied embeddings across stages]
# With tied embeddings, one matrix is both the first stage's lookup table and the last
# stage's output projection. Split across stages, each keeps a copy (both start equal:
# the model files initialize the output's copy under the embedding's name), and keeping
# them equal needs the two gradients summed every step over a group of the first and last
# pp ranks, also under FSDP sharding and with the copies' optimizer states in step. That
# is not built: ``split_model`` raises a RecipeError instead of training two drifting
# copies silently.


def stage_layers(n_layers: int, n_stages: int, boundaries: Sequence[int] = ()) -> list[range]:
    """The blocks of each stage, as ranges of global layer indices covering ``range(n_layers)``.

    By default the split is even and the first ``n_layers % n_stages`` stages take one
    block more (the last stage also carries the output projection and the loss).
    ``boundaries`` (``parallel.pp_boundaries``) overrides it: the first layer index of
    stages 1 .. n_stages - 1, strictly increasing within (0, n_layers).
    """
    if n_stages < 1:
        raise ValueError(f"n_stages must be >= 1, got {n_stages}")
    if boundaries:
        firsts = list(boundaries)
        if len(firsts) != n_stages - 1:
            raise RecipeError(f"parallel.pp_boundaries = {firsts}: {n_stages} pipeline stages need "
                              f"{n_stages - 1} boundaries (the first layer of stages 1..{n_stages - 1}), "
                              f"got {len(firsts)}", "parallel.pp_boundaries")
        edges = [0, *firsts, n_layers]
        if any(edges[i] >= edges[i + 1] for i in range(n_stages)):
            raise RecipeError(f"parallel.pp_boundaries = {firsts}: boundaries must increase strictly within "
                              f"(0, {n_layers}) (model.n_layers = {n_layers}) so every stage gets at least one "
                              f"layer; e.g. {_even_firsts(n_layers, n_stages) or 'fewer stages'}",
                              "parallel.pp_boundaries")
        return [range(edges[i], edges[i + 1]) for i in range(n_stages)]
    if n_layers < n_stages:
        raise RecipeError(f"{n_stages} pipeline stages need at least {n_stages} layers, but the model has "
                          f"{n_layers}; lower parallel.pp (or parallel.pp_virtual_stages), or raise model.n_layers",
                          "parallel.pp")
    base, extra = divmod(n_layers, n_stages)
    # stage i starts after i full stages and min(i, extra) extra layers
    starts = [i * base + min(i, extra) for i in range(n_stages + 1)]
    return [range(starts[i], starts[i + 1]) for i in range(n_stages)]


def _even_firsts(n_layers: int, n_stages: int) -> list[int] | None:
    if n_layers < n_stages:
        return None
    return [r.start for r in stage_layers(n_layers, n_stages)[1:]]


def stage_ids(pp_rank: int, pp: int, virtual: int = 1, style: str = "loop") -> list[int]:
    """Global stage indices held by ``pp_rank`` of ``pp`` ranks, ``virtual`` stages each, in order.

    ``loop`` (GPipe, 1F1B, interleaved schedules): rank r holds r, r + pp, r + 2 pp, ...
    ``v`` (ZBV): rank r holds r and 2 pp - 1 - r, so rank 0 holds the first and last stage
    and consecutive stages on the turn of the V share a rank. This is the mapping
    ``torch.distributed.pipelining`` assumes for each style.
    """
    if not 0 <= pp_rank < pp:
        raise ValueError(f"pp_rank {pp_rank} is not in [0, {pp})")
    if style == "loop":
        return [pp_rank + v * pp for v in range(virtual)]
    if style == "v":
        if virtual != 2:
            raise RecipeError(f"V-shaped schedules hold exactly 2 stages per rank; got parallel.pp_virtual_stages = "
                              f"{virtual}; set it to 2", "parallel.pp_virtual_stages")
        return [pp_rank, 2 * pp - 1 - pp_rank]
    raise ValueError(f"unknown stage style {style!r}; choose one of {STYLES}")


def _ends(model: nn.Module) -> tuple[list[str], list[str]]:
    """Names of the children before and after ``layers``: [Note: where the ends of a model are]."""
    names = [name for name, _ in model.named_children()]
    if "layers" not in names or not isinstance(model.layers, nn.ModuleDict):
        raise TypeError(f"{type(model).__name__} has no ModuleDict `layers`; pipeline stages need blocks in a "
                        f"ModuleDict keyed by str(i) (see STYLE.md #6)")
    i = names.index("layers")
    return names[:i], names[i + 1:]


def _check_untied(model: nn.Module, first: list[str], last: list[str]) -> None:
    def param_ids(names: list[str]) -> dict[int, str]:
        return {id(p): f"{n}.{pn}" for n in names if getattr(model, n) is not None
                for pn, p in getattr(model, n).named_parameters()}

    shared = param_ids(first).keys() & param_ids(last).keys()
    if shared:
        name = param_ids(first)[next(iter(shared))]
        raise RecipeError(f"{type(model).__name__} ties its input and output embeddings ({name}), and a pipeline "
                          f"split puts them on different stages, which meshpar does not support yet (see [Note: "
                          f"tied embeddings across stages] in meshpar/parallel/pipeline/split.py); set "
                          f"parallel.pp = 1, or use a model with untied embeddings", "parallel.pp")


# (model, the blocks kept, holds the input end, holds the output end) -> the stage: a family's own cut
StageCut = Callable[[nn.Module, Sequence[int], bool, bool], nn.Module]


def split_model(model: nn.Module, stage_index: int, n_stages: int, layers: Sequence[int], *,
                cut: StageCut | None = None) -> nn.Module:
    """A copy of ``model`` (built on meta, not yet sharded) reduced to one stage.

    The copy keeps the blocks in ``layers`` under their global keys, the input end only if
    ``stage_index == 0`` and the output end only if it is the last stage. ``model`` itself
    is not changed, so one meta model yields every stage of a rank. ``cut``: the family's own
    way to make that copy (``Family.cut``, for a model that keeps its blocks itself: family hf),
    else the copy below.
    """
    if not 0 <= stage_index < n_stages:
        raise ValueError(f"stage_index {stage_index} is not in [0, {n_stages})")
    if cut is not None:
        return cut(model, layers, stage_index == 0, stage_index == n_stages - 1)
    first, last = _ends(model)
    if n_stages > 1:
        _check_untied(model, first, last)
    missing = [i for i in layers if str(i) not in model.layers]
    if missing:
        raise ValueError(f"layers {missing} are not in {type(model).__name__}.layers (keys "
                         f"{list(model.layers)[:3]}...); split the whole model, not a stage")
    keep = {str(i) for i in layers}
    ends = (first if stage_index > 0 else []) + (last if stage_index < n_stages - 1 else [])
    dropped = [block for key, block in model.layers.items() if key not in keep]
    dropped += [getattr(model, name) for name in ends if getattr(model, name) is not None]
    # [Note: copying only a stage]: deepcopy's ``memo`` maps an object's id to its copy, so the
    # modules the stage drops "copy" to None and are never visited: a stage of 16 of 126 blocks
    # costs its 16. A parameter a kept module shares with a dropped one is still copied (only
    # modules are in the memo); no kept module refers to a dropped module.
    stage = copy.deepcopy(model, {id(module): None for module in dropped})
    for key in [k for k in stage.layers if k not in keep]:
        del stage.layers[key]
    for name in ends:
        setattr(stage, name, None)
    return stage


def split(model: nn.Module, pp_rank: int, pp: int, *, virtual: int = 1, style: str = "loop",
          boundaries: Sequence[int] = (), cut: StageCut | None = None) -> list[tuple[int, nn.Module]]:
    """This rank's stages of ``model`` (built on meta) as ``[(global stage index, module)]``.

    ``pp * virtual`` stages in all; ``boundaries`` as in ``stage_layers``; ``style`` must
    match the schedule (``schedule.SCHEDULES[name].style``); ``cut`` as ``split_model``'s.
    """
    n_stages = pp * virtual
    layers = stage_layers(len(model.layers), n_stages, boundaries)
    return [(i, split_model(model, i, n_stages, layers[i], cut=cut)) for i in stage_ids(pp_rank, pp, virtual, style)]
