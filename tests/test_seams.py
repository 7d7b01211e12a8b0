"""Parallelism enters a model through the slots it exposes, and a forward changes only through
meshpar/parallel/wrap.py (STYLE.md 16): checked on the debug models in one process."""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from torch import nn

from meshpar.models.attention import CausalAttention, SequencePositions
from meshpar.models.moe.family import MOE
from meshpar.models.moe.model import ChosenSlots, LocalExperts, LocalTotals
from meshpar.parallel import expert_parallel as eplib
from meshpar.parallel.activation_checkpoint import apply_activation_checkpointing, is_checkpointed
from meshpar.parallel.context_parallel.apply import (
    ContextParallelAttention,
    ContextParallelPositions,
    apply_context_parallel,
    attends_over_cp,
)
from meshpar.parallel.wrap import wrap_forward, wrappers
from tests.helpers import build_model


class _Mesh:
    """Stands in for a 1-D cp mesh: applying cp only records it (its collectives run in forward)."""

    def size(self) -> int:
        return 2

    def get_local_rank(self) -> int:
        return 0


def _instance_methods(model: nn.Module) -> list[str]:
    """Every callable set on a module instance that shadows a method of its class, and is not a
    recorded wrapper (wrap.py): a method replaced outside the one mechanism."""
    found = []
    for name, m in model.named_modules():
        for attr, value in vars(m).items():
            shadows = callable(value) and not isinstance(value, nn.Module) and hasattr(type(m), attr)
            if shadows and not (attr == "forward" and wrappers(m)):
                found.append(f"{name or 'model'}.{attr}")
    return found


def test_a_fresh_model_holds_its_default_slots():
    model = build_model("llama")
    assert type(model.positions) is SequencePositions
    assert all(type(b.attention.inner_attention) is CausalAttention for b in model.layers.values())
    moe = build_model("qwen3_moe")
    assert all(type(m.totals) is LocalTotals and type(m.experts.dispatch) is LocalExperts
               and type(m.slots) is ChosenSlots for m in moe.moe_layers())


@pytest.mark.parametrize("attention", ["allgather", "ring"])
def test_context_parallelism_fills_slots_and_replaces_no_method(attention):
    model = build_model("llama")
    names = [n for n, _ in model.named_parameters()]
    apply_context_parallel(model, _Mesh(), attention=attention)
    assert isinstance(model.positions, ContextParallelPositions)
    assert all(isinstance(b.attention.inner_attention, ContextParallelAttention) for b in model.layers.values())
    assert all(attends_over_cp(b) for b in model.layers.values())
    assert [n for n, _ in model.named_parameters()] == names  # slots hold no parameters
    assert model.state_dict().keys() == build_model("llama").state_dict().keys()
    assert _instance_methods(model) == []


def test_expert_parallel_slots_replace_no_method():
    model = build_model("qwen3_moe")
    eplib.route_over_sequence(MOE.sparse_layers(model), tp=None, cp=None)
    for moe in model.moe_layers():
        moe.experts.dispatch = eplib.ExpertParallelDispatch(_Mesh(), 0)  # what apply_expert_parallel sets
    assert all(isinstance(m.totals, eplib.SequenceTotals) for m in model.moe_layers())
    assert _instance_methods(model) == []


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointing_wraps_through_the_one_mechanism(mode):
    model = build_model("qwen3_moe")
    apply_activation_checkpointing(model, mode, every=2)
    assert [is_checkpointed(b) for b in model.layers.values()] == [int(k) % 2 == 0 for k in model.layers]
    assert [wrappers(b) for b in model.layers.values() if is_checkpointed(b)][0] == ("checkpoint",)
    assert _instance_methods(model) == []
    with pytest.raises(ValueError, match="already wrapped by checkpoint"):
        wrap_forward(model.layers["0"], "checkpoint", lambda f: f)


def test_a_method_replaced_outside_wrap_is_found():
    model = build_model("llama")
    model.layers["0"].forward = lambda *a: a  # what the checks above must catch
    model.layers["1"].attention.init_weights = types.MethodType(lambda self, *a: None, model.layers["1"].attention)
    assert _instance_methods(model) == ["layers.0.forward", "layers.1.attention.init_weights"]


def test_importing_meshpar_changes_nothing_in_torch():
    """The pipeline's p2p labels are installed by ``build_schedule``, not by an import."""
    code = ("import torch.distributed.pipelining.schedules as s\n"
            "before = {k: v for k, v in vars(s).items()}\n"
            "import meshpar.train, meshpar.cli, meshpar.parallel.pipeline.schedule, meshpar.planner.cli\n"
            "changed = [k for k, v in before.items() if vars(s)[k] is not v]\n"
            "assert not changed, changed\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_forward_is_unchanged_by_the_slots():
    """The default slots compute what the model computed before they existed: causal attention."""
    torch.manual_seed(0)
    model = build_model("llama").double()
    tokens = torch.randint(0, model.args.vocab_size, (2, 16))
    logits = model(tokens)
    block = model.layers["0"].attention
    q = torch.randn(2, 4, 16, 8, dtype=torch.float64)
    k = v = torch.randn(2, 2, 16, 8, dtype=torch.float64)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                           is_causal=True)
    torch.testing.assert_close(block.inner_attention(q, k, v, None), ref)
    assert torch.isfinite(logits).all()


def _functions() -> dict[tuple[str, str], int]:
    """Identity of every function, class and class attribute bound in a loaded meshpar or torch module."""
    out = {}
    for modname, module in list(sys.modules.items()):
        if module is None or modname.split(".")[0] not in ("meshpar", "torch"):
            continue
        for name, value in list(vars(module).items()):
            if not callable(value):
                continue
            out[(modname, name)] = id(value)
            if isinstance(value, type) and vars(value).get("__module__") == modname:  # its methods, where defined
                for attr, member in list(vars(value).items()):
                    if callable(member) or isinstance(member, (staticmethod, classmethod, property)):
                        out[(modname, f"{name}.{attr}")] = id(member)
    return out


@pytest.mark.parametrize("recipe,world,hardware,overrides", [
    ("qwen3_moe_debug_ep", 8, "h100_sxm", ["--parallel.tp=2"]),  # ep routing, DTensor shapes under tp, NCCL buffers
    ("llama_debug_cp", 4, "cpu", []),  # cp attention kernels, gloo buffers
])
def test_the_planners_simulated_step_changes_no_module(recipe, world, hardware, overrides, monkeypatch):
    """``meshpar plan`` passes its options down (slots, Kernels, context managers): during its
    simulated step and after it, every module of meshpar and torch holds the same objects."""
    from meshpar.config.hardware import load_profile
    from meshpar.config.recipe import load
    from meshpar.planner import dry_run, simulate

    real_step = simulate.train_step
    before = _functions()
    during = []

    def step(*args, **kwargs):  # the one attribute this test replaces, excluded below
        during.append(_functions())
        return real_step(*args, **kwargs)

    monkeypatch.setattr(simulate, "train_step", step)
    device = "cpu" if hardware == "cpu" else "cuda"
    path = Path(__file__).resolve().parents[1] / "recipes" / f"{recipe}.toml"
    plan = dry_run.plan(load(path, overrides), world, load_profile(hardware, device))
    monkeypatch.undo()
    after = _functions()
    assert plan.ranks[0].peak_bytes > 0 and during
    # this test's own replacement; torch's MemTracker (the tracker's base) follows storage resizes by
    # wrapping UntypedStorage.resize_ while it tracks, as it does under `meshpar profile`
    allowed = {("meshpar.planner.simulate", "train_step"), ("torch.storage", "UntypedStorage.resize_")}
    for snapshot in (*during, after):
        changed = sorted(k for k, v in before.items() if k in snapshot and snapshot[k] != v and k not in allowed)
        assert not changed, changed
