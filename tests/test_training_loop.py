"""The training loop's small pieces, in one process: when a step logs, evaluates, saves and asks
for a stop signal (meshpar/training/loop.py); its metric reductions, the ops and dims they run
on; and the planner search's flat generator of parallel configs (meshpar/planner/candidates.py),
which yields exactly what its nested loop did."""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from meshpar.config import recipe as recipelib
from meshpar.distributed import comm
from meshpar.models import get_family
from meshpar.planner.candidates import AC_MODES, MICRO_BATCHES, MIN_CP_TOKENS, configs, layouts
from meshpar.training import loop
from meshpar.training.loop import (
    Throughput,
    agreed_stop,
    reduce_aux_loss,
    reduce_expert_load,
    reduce_loss,
    should_evaluate,
    should_log,
    should_save,
    step_record,
)
from meshpar.training.step import StepResult

AVG, SUM = dist.ReduceOp.AVG, dist.ReduceOp.SUM


# --- when a step logs, evaluates, saves -----------------------------------------------------------
@pytest.mark.parametrize("step, every, last, expected", [
    (10, 10, 100, True), (11, 10, 100, False), (100, 10, 100, True), (7, 10, 7, True), (1, 1, 5, True),
])
def test_should_log(step, every, last, expected):
    assert should_log(step, every, last) is expected


@pytest.mark.parametrize("decide", [should_evaluate, should_save])
@pytest.mark.parametrize("step, every, last, expected", [
    (50, 50, 100, True), (49, 50, 100, False), (100, 50, 100, True), (7, 50, 7, True),
    (50, 0, 100, False), (100, 0, 100, False),  # 0: never, not even after the last step
])
def test_should_evaluate_and_save(decide, step, every, last, expected):
    assert decide(step, every, last) is expected


def test_a_resumed_run_logs_evaluates_and_saves_at_these_steps():
    steps = range(7, 21)  # resumed from step 6's checkpoint, train.steps = 20
    assert [s for s in steps if should_log(s, 4, 20)] == [8, 12, 16, 20]
    assert [s for s in steps if should_evaluate(s, 6, 20)] == [12, 18, 20]
    assert [s for s in steps if should_save(s, 5, 20)] == [10, 15, 20]
    assert [s for s in steps if should_save(s, 0, 20)] == []


class _Signals:
    """StopSignals' agree() without a process group: every rank's answer is this rank's."""

    def __init__(self, received: str | None):
        self.received, self.asked = received, []

    def agree(self) -> str | None:
        self.asked.append(self.received)
        return self.received


def test_agreed_stop_asks_every_agree_every_steps_but_not_after_the_last():
    quiet = _Signals(None)
    assert [agreed_stop(s, 3, 9, quiet) for s in range(1, 10)] == [None] * 9
    assert len(quiet.asked) == 2  # steps 3 and 6: the collective runs at the same steps on every rank
    term = _Signals("SIGTERM")
    assert [agreed_stop(s, 3, 9, term) for s in range(4, 10)] == [None, None, "SIGTERM", None, None, None]
    assert agreed_stop(9, 3, 9, term) is None  # the last step: the run ends (and saves) anyway
    assert agreed_stop(8, 1, 9, term) == "SIGTERM"


# --- the metrics of a step, reduced across ranks --------------------------------------------------
@pytest.fixture
def all_reduces(monkeypatch) -> list[tuple[str, object, object]]:
    """comm.all_reduce recorded as (dim, group, op), the tensor left as it is (one process)."""
    calls = []
    monkeypatch.setattr(comm, "all_reduce", lambda t, group, *, dim, op=SUM, async_op=False:
                        calls.append((dim, group, op)))
    return calls


def _sync(pp: bool = False, cp: bool = False) -> SimpleNamespace:
    """A GradSync's process groups, as names."""
    return SimpleNamespace(pp_groups=["pp group"] if pp else [], dp=SimpleNamespace(get_group=lambda: "dp group"),
                           cp=SimpleNamespace(get_group=lambda: "cp group") if cp else None, groups=None)


def test_the_loss_is_summed_over_stages_and_averaged_over_dp_and_cp(all_reduces):
    loss = torch.tensor(2.5)
    out = reduce_loss(loss, _sync(pp=True, cp=True))
    assert all_reduces == [("pp", "pp group", SUM), ("dp", "dp group", AVG), ("cp", "cp group", AVG)]
    assert out is not loss and out.item() == 2.5
    all_reduces.clear()
    reduce_loss(loss, _sync())
    assert all_reduces == [("dp", "dp group", AVG)]


def test_aux_losses_average_and_expert_loads_sum_over_dp(all_reduces):
    reduce_aux_loss(torch.tensor(0.1), _sync(pp=True, cp=True))
    assert all_reduces == [("pp", "pp group", SUM), ("dp", "dp group", AVG)]  # never over cp
    all_reduces.clear()
    load = torch.ones(2, 1, 4)
    assert reduce_expert_load(load, _sync(cp=True)) is not load
    assert all_reduces == [("dp", "dp group", SUM)]


def test_a_step_record_has_the_loops_fields_in_order(all_reduces, monkeypatch):
    clock_times = iter([100.0, 102.0, 103.0])
    monkeypatch.setattr(loop.time, "perf_counter", lambda: next(clock_times))
    clock = Throughput(tokens_per_step=1000, flops_per_token=6.0, peak_flops=12_000.0, device=torch.device("cpu"),
                       step=4)
    done = StepResult(torch.tensor(3.0), torch.tensor(0.5), 1e-3, aux_loss=torch.tensor(0.25),
                      expert_load=torch.tensor([[[3.0, 1.0]], [[1.0, 0.0]]]))
    record = step_record(8, done, 1e-3, _sync(), clock, [1], SimpleNamespace(capacity_factor=1.25))
    assert list(record) == ["step", "loss", "grad_norm", "lr", "tokens_per_s", "mfu", "mem_gb", "aux_loss",
                            "moe_layers", "moe_load_max", "moe_load_mean", "moe_imbalance", "moe_dropped"]
    assert record["tokens_per_s"] == 1000 * 4 / 2.0 and record["mfu"] == 6.0 * 2000 / 12_000
    assert (record["loss"], record["grad_norm"], record["aux_loss"], record["moe_dropped"]) == (3.0, 0.5, 0.25, [1.0])
    assert [dim for dim, _, _ in all_reduces] == ["dp", "dp", "dp"]  # loss, aux loss, expert loads
    dense = step_record(9, StepResult(torch.tensor(3.0), torch.tensor(0.5), 1e-3), 1e-3, _sync(), clock, [],
                        SimpleNamespace())  # a dense model's args: no capacity factor
    assert list(dense) == ["step", "loss", "grad_norm", "lr", "tokens_per_s", "mfu", "mem_gb"]


def test_throughput_leaves_out_the_time_of_validation_and_saving(monkeypatch):
    now = iter([0.0, 10.0, 15.0, 16.0])  # start; step 2 logged at 10 s; a save until 15 s; step 4 at 16 s
    monkeypatch.setattr(loop.time, "perf_counter", lambda: next(now))
    clock = Throughput(tokens_per_step=10, flops_per_token=1.0, peak_flops=1.0, device=torch.device("cpu"), step=0)
    assert clock.tokens_per_s(2) == 2.0
    clock.restart()
    assert clock.tokens_per_s(4) == 20.0


# --- the planner search's candidate generator ----------------------------------------------------
def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _nested_loop(gpus, gpus_per_node, seq_len, global_batch, args, dims) -> list[tuple[str, ...]]:
    """The reference: search.candidates' eight nested loops as they were before ``configs(layouts())``
    (commit 9111ec8), less the recipe loads and checks that followed each candidate, which stay."""
    def cp_degrees(ranks, allowed):
        out, cp = [1], 2
        while allowed and ranks % cp == 0 and seq_len // cp >= MIN_CP_TOKENS:
            out.append(cp)
            cp *= 2
        return out

    def with_ep(hybrids, dp, moe):
        if not moe:
            return [(r, 1) for r in hybrids]
        return [(r, ep) for r in hybrids for ep in _divisors(dp // r) if args.n_experts % ep == 0]

    out = []
    tps = [d for d in _divisors(gpus_per_node) if gpus % d == 0 and (d == 1 or "tp" in dims)]
    for tp, cp in [(d, c) for d in tps for c in cp_degrees(gpus // d, "cp" in dims)]:
        for pp in [d for d in _divisors(gpus // (tp * cp)) if d <= args.n_layers // 2 and d <= 16
                   and (d == 1 or "pp" in dims)]:
            dp = gpus // (tp * cp * pp)
            shard_in_node = max(1, gpus_per_node // (tp * cp))
            hybrids = [1] + ([dp // shard_in_node] if dp > shard_in_node and dp % shard_in_node == 0 else [])
            for replicate, ep in with_ep(hybrids, dp, "ep" in dims):
                for mb in MICRO_BATCHES:
                    if global_batch % (dp * mb):
                        continue
                    n = global_batch // (dp * mb)
                    for ac in AC_MODES:
                        sharded = dp // replicate > 1
                        for reshard, reduce, attention in itertools.product(
                                (True, False) if pp == 1 and sharded else (True,),
                                ("step", "microbatch") if n > 1 and sharded else ("step",),
                                ("allgather", "ring", "ulysses") if cp > 1 else ("allgather",)):
                            out.append((f"--parallel.tp={tp}", f"--parallel.pp={pp}",
                                        f"--parallel.dp_replicate={replicate}",
                                        f"--parallel.dp_shard={dp // replicate}",
                                        *([f"--parallel.ep={ep}"] if "ep" in dims else []),
                                        f"--train.micro_batch={mb}", f'--parallel.activation_checkpoint="{ac}"',
                                        f"--parallel.reshard_after_forward={str(reshard).lower()}",
                                        f'--parallel.grad_reduce="{reduce}"',
                                        *([f"--parallel.cp={cp}", f'--parallel.cp_attention="{attention}"']
                                          if "cp" in dims else [])))
    return out


DENSE, ALL = frozenset({"tp", "pp"}), frozenset({"tp", "pp", "cp", "ep"})


@pytest.mark.parametrize("dims, n_experts", [(frozenset(), 0), (DENSE, 0), (DENSE | {"cp"}, 0), (ALL, 8), (ALL, 60)])
def test_the_flat_generator_yields_the_nested_loops_candidates_in_order(dims, n_experts):
    cases = 0
    for gpus, gpus_per_node, seq_len, global_batch, n_layers in itertools.product(
            (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64), (4, 8), (2048, 131072), (6, 16), (1, 4, 80)):
        args = SimpleNamespace(n_layers=n_layers, n_experts=n_experts)
        want = _nested_loop(gpus, gpus_per_node, seq_len, global_batch, args, dims)
        got = [c.overrides(dims) for c in configs(layouts(gpus, gpus_per_node, seq_len, args, dims), global_batch)]
        assert got == want, (gpus, gpus_per_node, seq_len, global_batch, n_layers)
        cases += bool(want)
    assert cases > 50  # the others have no layout: no candidate either way


def test_the_generator_on_two_gpus_by_hand():
    args = SimpleNamespace(n_layers=4, n_experts=0)
    got = [(str(c.layout), c.micro_batch, c.activation_checkpoint, c.reshard_after_forward, c.grad_reduce)
           for c in configs(layouts(2, 2, 256, args, DENSE), 4) if c.activation_checkpoint == "none"]
    assert got == [
        ("dp_shard 2", 1, "none", True, "step"), ("dp_shard 2", 1, "none", True, "microbatch"),
        ("dp_shard 2", 1, "none", False, "step"), ("dp_shard 2", 1, "none", False, "microbatch"),
        ("dp_shard 2", 2, "none", True, "step"), ("dp_shard 2", 2, "none", False, "step"),  # 1 microbatch
        ("pp 2", 1, "none", True, "step"), ("pp 2", 2, "none", True, "step"), ("pp 2", 4, "none", True, "step"),
        ("tp 2", 1, "none", True, "step"), ("tp 2", 2, "none", True, "step"), ("tp 2", 4, "none", True, "step"),
    ]


@pytest.mark.parametrize("base", [
    ["--model.family=llama", "--model.size=debug", "--train.seq_len=256", "--train.global_batch=8"],
    ['--model.family="qwen3_moe"', '--model.size="debug"', "--train.seq_len=256", "--train.global_batch=8",
     '--parallel.param_dtype="bfloat16"', "--parallel.ep=2", "--train.steps=7"],
])
def test_a_choice_applied_is_the_recipe_its_overrides_load_to(base):
    recipe = recipelib.load(None, base)
    family = get_family(recipe.model.family)
    args = family.model_args(recipe.model)
    choices = list(configs(layouts(4, 4, recipe.train.seq_len, args, family.mesh_dims), recipe.train.global_batch))
    assert len(choices) > 20
    for c in choices[::3] + choices[-1:]:
        assert c.apply(recipe, family.mesh_dims) == recipelib.load(None, [*base, *c.overrides(family.mesh_dims)])
    assert math.prod(choices[-1].layout.degrees) == 4
