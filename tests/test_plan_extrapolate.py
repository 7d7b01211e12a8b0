"""The planner's stage of many blocks, simulated as two short stages (meshpar/planner/extrapolate.py):
every figure of the simulated step equals simulating every block, in every layout the planner
builds; the arithmetic picks the right stretch where the peak moves from one to another."""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter
from pathlib import Path

import pytest

from meshpar.config.recipe import load
from meshpar.distributed import mesh as meshlib
from meshpar.models import get_family
from meshpar.planner import dry_run, extrapolate, tracker
from meshpar.planner.simulate import Measured, Phase, measured, simulate

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def _both(name: str, world: int, nccl: bool, overrides: list[str]) -> list[tuple[Measured, Measured]]:
    """(every block simulated, two short stages extrapolated) for each pipeline stage of the recipe."""
    recipe = load(RECIPES / f"{name}.toml", overrides)
    layout, accum = dry_run.check(recipe, world)
    family = get_family(recipe.model.family)
    args = family.model_args(recipe.model)
    if recipe.model.attention == "document":
        args = dataclasses.replace(args, document_eos=0)
    out = []
    for s in range(layout.pp):
        with dry_run.fake_world(s * (world // layout.pp), world):
            mesh = meshlib.build(layout, "cpu")
            full = simulate(dry_run._build(family, args, mesh, recipe), mesh, recipe, accum, nccl=nccl)
            stages = dry_run._build(family, args, mesh, recipe)
            blocks = [dry_run._alike(b) for b in stages[0][1].layers.values()]
            head, period = extrapolate.pattern(blocks)
            assert extrapolate.short_counts(len(blocks), period, head) is not None
            ends = (s == 0, s == layout.pp - 1)
            out.append((full, dry_run._simulate(family, args, mesh, recipe, stages, accum, nccl, {}, ends)))
    return out


def _differences(full: Measured, short: Measured) -> list[tuple]:
    """Every figure the plan reads that differs: bytes and collectives issued exactly, bytes sent (floats) to 1e-12."""
    out = []
    assert list(full.phases) == list(short.phases)
    for name, f in full.phases.items():
        s = short.phases[name]
        out += [(name, k, getattr(f, k), getattr(s, k)) for k in ("start", "end", "peak", "saved", "at_peak")
                if getattr(f, k) != getattr(s, k)]
        out += [(name, "comm", k, f.comm[k], s.comm[k]) for k in f.comm.keys() | s.comm.keys()
                if abs(f.comm[k] - s.comm[k]) > 1e-12 * max(abs(f.comm[k]), 1)]
    out += [("comm_bytes", k, full.comm_bytes[k], short.comm_bytes[k]) for k in full.comm_bytes.keys()
            | short.comm_bytes.keys() if abs(full.comm_bytes[k] - short.comm_bytes[k]) > 1e-12 * full.comm_bytes[k]]
    out += [("comm_calls", k, full.comm_calls[k], short.comm_calls[k]) for k in full.comm_calls.keys()
            | short.comm_calls.keys() if full.comm_calls[k] != short.comm_calls[k]]
    if (full.activation_bytes, full.n_run) != (short.activation_bytes, short.n_run):
        out.append(("activation_bytes, n_run", full.activation_bytes, short.activation_bytes))
    return out


# a layout per dim and checkpointing period, gradient reduction and attention path the planner
# builds, and a head of unlike blocks, at block counts of both parities, extrapolated 2 to 5 blocks
# past the short stages; pipeline cases check the first and the last stage. The shipped recipes'
# header tests check the same at their real block counts (from a few to about 95 blocks past) in
# other layouts.
LAYOUTS = {
    "fsdp-ac-every-2": ("llama_debug_fsdp", 2, False, ["--model.n_layers=11", "--parallel.ac_every=2",
                                                       "--parallel.activation_checkpoint=selective"]),
    "pp-fsdp-tp-microbatch-reduce": ("llama_debug_3d", 8, True, ["--model.n_layers=14",
                                                                 "--parallel.grad_reduce=microbatch"]),
    "cp-ring-cuda-full-ac": ("llama_debug_cp", 4, True, ["--model.n_layers=8",
                                                         "--parallel.activation_checkpoint=full"]),
    "hsdp": ("llama_debug_hsdp", 4, False, ["--model.n_layers=7"]),
    "gpt2-replicate-tp": ("gpt2_debug_2d", 4, False, ["--model.n_layers=9"]),
    "moe-ep-tp": ("mixtral_debug", 8, True, ["--model.n_layers=7", "--parallel.tp=2", "--parallel.ep=2",
                                             "--train.micro_batch=2"]),
    "deepseek-dense-head-ep": ("deepseek_v3_debug", 4, True, ["--model.n_layers=7"]),  # a dense block, then MoE
}
FAST = ("gpt2-replicate-tp",)  # the inner loop's one, the cheapest (docs/performance.md#test-suite-and-set-up)


@pytest.mark.parametrize("case", [pytest.param(k, marks=() if k in FAST else pytest.mark.slow) for k in LAYOUTS])
def test_two_short_stages_give_every_figure_of_the_whole_one(case):
    for full, short in _both(*LAYOUTS[case]):
        assert not _differences(full, short)


# pipelines of 3 stages whose first and last stages borrow the middle one's slopes: the debug Llama
# (full checkpointing, tp and FSDP), the debug DeepSeek-V3 (its dense first block a head before the
# MoE ones, ep and FSDP, selective checkpointing)
BORROWING = {
    "llama-pp3-tp": ("llama_debug_3d", 12, True, ["--model.n_layers=15", "--parallel.pp=3",
                                                  "--parallel.activation_checkpoint=full", "--train.micro_batch=1"]),
    "deepseek-pp3-head-ep": ("deepseek_v3_debug", 12, True, ["--model.n_layers=16", "--parallel.pp=3",
                                                             "--parallel.activation_checkpoint=selective",
                                                             "--train.micro_batch=1", "--train.global_batch=12"]),
}


@functools.cache
def _middle_stage_slopes(name: str, world: int, nccl: bool, overrides: tuple[str, ...]) -> dict:
    """The slopes stage 1, a middle one, lends: the same for every test of one case (they differ in
    the end stages), so simulated once per case. A middle stage runs no module after its blocks, so
    unmarking the head (the test below) leaves them as they are."""
    recipe = load(RECIPES / f"{name}.toml", list(overrides))
    layout, accum = dry_run.check(recipe, world)
    family = get_family(recipe.model.family)
    args = family.model_args(recipe.model)
    lent: dict = {}
    with dry_run.fake_world(world // layout.pp, world):
        mesh = meshlib.build(layout, "cpu")
        stages = dry_run._build(family, args, mesh, recipe)
        assert tracker._after_blocks(stages[0][1]) is None
        dry_run._simulate(family, args, mesh, recipe, stages, accum, nccl, {}, (False, False), lent)
    assert len(lent) == 1
    return lent


def _ends_borrowing(name: str, world: int, nccl: bool, overrides: list[str], first: bool = True,
                    ) -> dict[int, tuple[Measured, Measured, list]]:
    """By end stage (the first unless not ``first``, the last): (every block of it simulated, what its short stage
    extrapolated with the middle stage's slopes gives as dry_run.plan takes them, the windowed
    stretches that differ between the two); fails unless both borrowed."""
    recipe = load(RECIPES / f"{name}.toml", overrides)
    layout, accum = dry_run.check(recipe, world)
    family = get_family(recipe.model.family)
    args = family.model_args(recipe.model)
    lent = dict(_middle_stage_slopes(name, world, nccl, tuple(overrides)))
    borrowed, real, out = [], extrapolate.borrow, {}

    def spy(*a, **k):
        borrowed.append(real(*a, **k))
        return borrowed[-1]

    for s in (0, layout.pp - 1)[0 if first else 1:]:
        with dry_run.fake_world(s * (world // layout.pp), world), pytest.MonkeyPatch.context() as patch:
            mesh = meshlib.build(layout, "cpu")
            stages = dry_run._build(family, args, mesh, recipe)
            n = len(stages[0][1].layers)
            head, _ = extrapolate.pattern([dry_run._alike(b) for b in stages[0][1].layers.values()])
            patch.setattr(extrapolate, "borrow", spy)
            ends = (s == 0, s == layout.pp - 1)
            short = dry_run._simulate(family, args, mesh, recipe, stages, accum, nccl, {}, ends, lent)
            assert borrowed[-1] is short, f"stage {s} simulated its own pair"
            full = simulate(dry_run._build(family, args, mesh, recipe), mesh, recipe, accum, nccl=nccl)
        stretches = []  # every stretch of the long stage's windows, not only each phase's peak
        for phase, f in full.phases.items():
            want = extrapolate._windowed(f.segments, n, head + extrapolate.EDGE + 1, extrapolate.EDGE + 1)
            got = short.phases[phase].segments
            stretches += [(phase, k, want.get(k), got.get(k)) for k in want.keys() | got.keys()
                          if want.get(k) != got.get(k)]
        out[s] = (full, short, stretches)
    return out


@pytest.mark.slow  # simulations of debug models, two of them every block of a stage
@pytest.mark.parametrize("case", list(BORROWING))
def test_the_end_stages_borrowing_a_middle_stages_slopes_give_every_figure(case):
    """... and every stretch of the long stage's windows."""
    for s, (full, short, stretches) in _ends_borrowing(*BORROWING[case]).items():
        assert not _differences(full, short) and not stretches, s


@pytest.mark.slow  # simulations of a debug model
def test_the_last_stage_borrows_only_with_its_head_marked(monkeypatch):
    """Unmarked, the last stage's head and loss run in its last block's stretch, and the debug
    DeepSeek-V3's loss keeps other tensors per block alive than a middle stage's send does: that
    stretch then grows unlike the middle stage's, and the comparison above fails."""
    monkeypatch.setattr(tracker, "_after_blocks", lambda stage: None)
    stretches = _ends_borrowing(*BORROWING["deepseek-pp3-head-ep"], first=False)[2][2]
    assert stretches and {k[0] for _, k, _, _ in stretches} == {"out"}, stretches


@pytest.mark.slow  # two simulations of a debug model
def test_the_comparison_fails_without_the_edge_blocks(monkeypatch):
    """With no edge blocks the first block is taken for a middle one: the figures differ, so the
    comparison above can fail; or, where the one-block short stage's block runs nothing between
    its output and the head, the two short stages' stretches differ and the extrapolation refuses."""
    monkeypatch.setattr(extrapolate, "EDGE", 0)
    overrides = ["--model.n_layers=6", "--parallel.activation_checkpoint=full"]
    try:
        (full, short), = _both("llama_debug_fsdp", 2, False, overrides)
    except ValueError as e:
        assert "the stretches of 1 and 2 blocks differ" in str(e)
    else:
        assert _differences(full, short)


def test_the_period_is_how_often_the_blocks_repeat():
    assert extrapolate.period("aaaaaaaa") == 1
    assert extrapolate.period("abababab") == 2 and extrapolate.period("ababababa") == 2
    assert extrapolate.period("abcabcab") == 3
    assert extrapolate.period("abaaaaaa") == 7 and extrapolate.period("a") == 1 and extrapolate.period("") == 1


def test_blocks_before_the_repetition_are_kept_whole():
    """The debug Qwen3-MoE keeps layer 1 dense among sparse ones (``mlp_only_layers``): the stage's
    blocks repeat with no period shorter than the stage, but those after the first two do, so the
    short stages keep those two and one period of the sparse ones between their edge blocks. With
    too few blocks after the head, the planner simulates every one of them."""
    recipe = load(RECIPES / "qwen3_moe_debug.toml", ["--model.n_layers=12"])
    family = get_family(recipe.model.family)
    args = family.model_args(recipe.model)
    layout, _ = dry_run.check(recipe, 1)
    with dry_run.fake_world(0, 1):
        (_, stage), = dry_run._build(family, args, meshlib.build(layout, "cpu"), recipe)
        blocks = [dry_run._alike(b) for b in stage.layers.values()]
    assert blocks[1] != blocks[0] == blocks[2] and extrapolate.period(blocks) == 11
    assert extrapolate.short_counts(12, 11) is None
    assert extrapolate.pattern(blocks) == (2, 1) and extrapolate.short_counts(12, 1, 2) == (5, 6)
    assert extrapolate.kept(12, 5, 2) == [0, 1, 2, 10, 11] and extrapolate.kept(12, 6, 2) == [0, 1, 2, 3, 10, 11]
    assert extrapolate.pattern(blocks[:6]) == (0, 5) and extrapolate.short_counts(6, 1, 2) is None


def test_short_stages_keep_each_blocks_class():
    for n, period, head in [(80, 1, 0), (126, 1, 0), (20, 2, 0), (21, 2, 0), (31, 3, 0), (16, 1, 3), (21, 2, 3)]:
        n1, n2 = extrapolate.short_counts(n, period, head)
        assert n2 - n1 == period and (n - n1) % period == 0 and n1 >= head + 2 * extrapolate.EDGE + period
        for short in (n1, n2):
            kept = extrapolate.kept(n, short, head)
            assert len(kept) == short and kept == sorted(set(kept)) and kept[:head] == list(range(head))
            # checkpointed alike: the classes of the blocks after the head
            assert [(j - head) % period for j in kept[head:]] == [j % period for j in range(short - head)]
    assert extrapolate.short_counts(4, 1) is None and extrapolate.short_counts(3, 1) is None  # no longer
    assert extrapolate.short_counts(7, 1, 3) is None and extrapolate.short_counts(8, 1, 3) == (6, 7)


def _phase(n: int, stretches: dict) -> Phase:
    """A phase of ``n`` blocks whose stretch at block j peaks at ``f(j, n)`` (bytes, all "Activation")."""
    segments = {"start": (10, {"Activation": 10, "Total": 10})}
    for kind, f in stretches.items():
        for j in range(n):
            v = f(j, n)
            segments[(kind, j)] = (v, {"Activation": v, "Total": v})
    peak, at = max(segments.values(), key=lambda s: s[0])
    return Phase(10, 10 + n, peak, n, at, Counter({("all_gather", "dp_shard"): 3.0 * n}), segments)


def test_the_peak_moves_between_stretches_as_blocks_are_added():
    """Backward's first block falls with n while its last block grows (gradients of the others):
    at 4 and 5 blocks the first is the peak, at 40 the last; the middle ones never are."""
    def grad(j, n):
        return 1000 - 20 * n if j == n - 1 else 100 + 30 * n + (j == 0) * 7 + j

    def run(n):
        return measured({"F0": _phase(n, {"in": lambda j, n: 50 + j}), "B0": _phase(n, {"grad": grad})}, 1, 1)

    for n in (6, 9, 40):
        got = extrapolate.extrapolate(run(4), 4, run(5), 5, n=n, period=1, accum=1)
        want = run(n)
        assert not _differences(want, got), n
    assert run(4).phases["B0"].peak == 920 and run(40).phases["B0"].peak == 100 + 30 * 40 + 38
