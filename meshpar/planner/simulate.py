"""One rank's part of a training step on fake tensors: live bytes over time, collectives per mesh dim.

    measured = simulate(stages, mesh, recipe, accum=8, nccl=True)
    measured.phases["B1"].peak, measured.activation_bytes, measured.comm_bytes[("all_gather", "tp")]
    measured.peak(schedule_actions("1f1b", n=8, pp=4, stage=0, n_run=measured.n_run))

The stages come from meshpar's own parallelize path, built on meta in a fake process group
(``dry_run.py``). Here they are materialized as ``FakeTensor``s (shapes, dtypes and storages of
the real sizes, no memory, no arithmetic) and run through ``meshpar.training.step.train_step``,
the step ``meshpar train`` runs: FSDP units all-gather, prefetch, reshard and reduce-scatter as
on a GPU, gradients are reduced per step or per microbatch (``parallel.grad_reduce``) and
clipped. Under pipelining ``_OneAtATime`` stands in for the schedule. A tracker (``tracker.py``,
meshpar's ``AllocationTracker``) follows every storage created, freed or resized, phase by phase
(``train_step``'s ``phase`` hook) and stretch by stretch (``label_blocks``: what ``extrapolate.py``
needs to simulate a long stage as two short ones).

Limits: the optimizer step, microbatches beyond three, pipeline microbatches in flight and
receive buffers are arithmetic, and routing is balanced; what only a GPU has (allocator
fragmentation, library workspaces) is left to a margin. How the planner uses it: docs/planner.md.

Notes: [Note: what the simulation leaves to arithmetic], [Note: how close the simulated peak is],
[Note: DTensor's shape propagation is not memory], [Note: context parallel attention on fake
tensors], [Note: the first step's prefetch].
"""

from __future__ import annotations

import contextlib
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from meshpar.config.recipe import Recipe
from meshpar.distributed import comm_record
from meshpar.distributed._torch import FakeTensorMode, dtensor_shapes_in_own_fake_mode
from meshpar.distributed.mesh import Mesh
from meshpar.fsdp import FSDPModule
from meshpar.models import get_family
from meshpar.models.attention import Kernels, use_kernels
from meshpar.parallel.context_parallel import ring as ringlib
from meshpar.parallel.pipeline import Stage
from meshpar.planner.moe import balance_routing
from meshpar.planner.tracker import Phase, StepTracker, groups_by_name, label_blocks, priced
from meshpar.training.loss import TokenLoss, last_head, layout_chunks
from meshpar.training.step import GradSync, Microbatch, Model, train_step

# [Note: what the simulation leaves to arithmetic]
# - The optimizer step is not run: under FakeTensorMode fused AdamW decomposes into ops that
#   allocate temporaries several times its state, where the real kernel updates in place. AdamW
#   state is arithmetic from local shapes, live through the whole step.
# - At most 3 microbatches run (first, middle, last: the middle ones are alike), 2 without
#   pipelining (the last backward starts with accumulated gradients, as a middle one's does);
#   the middle (or first) one's collectives are counted for the microbatches not run.
# - Pipeline microbatches in flight (1F1B: up to ``pp - stage`` on a stage; GPipe: all before
#   the first backward) add what a forward leaves alive to the phase each action of the real
#   order is priced as (``schedule_actions``). Receive buffers (one per microbatch, kept by
#   ``torch.distributed.pipelining``) are arithmetic from the stage's shapes.
# - MoE routing is balanced ([Note: the planner routes tokens evenly] in planner/moe.py).

# [Note: how close the simulated peak is]
# ``tests/benchmarks/calibrate_plan.py`` trains the debug Llama on gloo in layouts of every dim,
# checkpointing mode, gradient reduction and pipeline schedule, and compares each stage's peak
# (AllocationTracker over a real step) with this one (docs/performance.md#against-real-steps-on-cpu;
# under pipelining the planned side is the higher). That checks the simulation against the code
# it simulates, on CPU. It cannot check what only a GPU has: the caching allocator's
# fragmentation, cuBLAS and NCCL workspaces (left to the margin of [Note: usable device
# memory]), and kernels that save other tensors than the CPU's (fake tensors on "cpu" take the
# CPU's attention kernel, which saves the output and the log-sum-exp, as CUDA's flash does).


@dataclass
class Measured:
    """What the simulated step showed, for one rank (all its stages)."""

    phases: dict[str, Phase]  # "F0", "B0", "F1", ..., "sync" in order
    n_run: int  # microbatches run (at most 3)
    activation_bytes: int  # left alive by one microbatch's forward: what a microbatch in flight costs
    comm_bytes: Counter  # (op, mesh dim) -> bytes per optimizer step, all microbatches
    comm_calls: Counter = field(default_factory=Counter)  # (op, mesh dim) -> collectives per optimizer step

    def peak(self, actions: list[tuple[str, int]]) -> tuple[int, str, int]:
        """(peak live bytes, its phase, other microbatches in flight then) over a step's ``actions``
        (``schedule_actions``), each priced as its simulated phase plus the others' activations."""
        best = (-1, "", 0)
        for name, others in [*actions, ("sync", 0)]:
            total = self.phases[name].peak + others * self.activation_bytes
            if total > best[0]:
                best = (total, name, others)
        return best


def schedule_actions(schedule: str | None, n: int, pp: int, stage: int, n_run: int) -> list[tuple[str, int]]:
    """A stage's forwards and backwards in one step, in order, as (simulated phase, other
    microbatches in flight). ``schedule`` None: no pipeline (one microbatch at a time).

    The simulation ran ``n_run`` microbatches: F0/B0 the first (no gradients yet, parameters
    gathered in F0), B{n_run - 1} the last (gradient sync on), and with 3, F1/B1 a middle one
    (accumulated gradients, sync off). A forward after gradients exist is priced as F1, one
    before as F0; a backward as the first, the last or a middle one.
    """
    if schedule is None or pp == 1:
        order = ["F", "B"] * n
    elif schedule == "gpipe":
        order = ["F"] * n + ["B"] * n
    else:  # 1f1b (torch's Schedule1F1B): warmup forwards, then one backward and one forward, then the rest
        warmup = min(n, pp - stage)
        order = ["F"] * warmup + ["B", "F"] * (n - warmup) + ["B"] * warmup
    actions, forwards, backwards = [], 0, 0
    for kind in order:
        if kind == "F":
            phase = "F0" if backwards == 0 else "F1"
            actions.append((phase, forwards - backwards))
            forwards += 1
        else:
            last = backwards == n - 1
            phase = f"B{n_run - 1}" if last else ("B0" if backwards == 0 else "B1")
            actions.append((phase, forwards - backwards - 1))
            backwards += 1
    return actions


# [Note: DTensor's shape propagation is not memory]
# DTensor finds its output shapes by running each op on fake tensors of the *global* shapes, in
# the fake mode it detects, which here is the simulation's own: the tracker would count a
# [B, T, V] logits tensor where each rank holds [B, T, V/tp] (how much that adds:
# docs/performance.md#the-simulations-own-costs). Given a fresh fake mode, as it makes outside
# one, those ops run below the tracker's notice, as MemTracker intends.

# [Note: context parallel attention on fake tensors]
# Each chunk of a cp rank's queries attends with ``causal_lower_right(n, keys)`` ([Note: attention
# per query chunk] in meshpar/parallel/context_parallel/gather.py), a tensor subclass fake tensors
# cannot become. On a GPU it runs the flash kernel with its causal flag, no mask built, saving q,
# k, v, the output and the log-sum-exp; off the GPU it would materialize a [n, keys] boolean mask.
# So the simulated model takes ``_kernels``: the fused path, called unmasked (the CPU's flash kernel
# saves the same tensors; FLOPs are cost.py's arithmetic); the ring runs one score block per chunk
# pair (the same peak and hops), of the GPU's size for a CUDA profile (``SCORE_ELEMENTS_CUDA``);
# document-causal attention builds its masks as on a GPU and repeats K/V to the query heads before
# a masked call ([Note: masked grouped-query attention on CUDA] in meshpar/models/attention.py); its
# FLOPs are planned as causal attention's.


def _kernels(nccl: bool, flex: bool = False) -> Kernels:
    """The attention paths of a GPU step, on fake tensors: [Note: context parallel attention on fake tensors];
    ``flex``: cp attention on flex_attention (``parallel.cp_flex`` on CUDA)."""
    return Kernels(fused_causal=True, expands_kv=True, ring_scores=ringlib.SCORE_ELEMENTS_CUDA if nccl else None,
                   fake=True, flex=flex)


@contextlib.contextmanager
def _step_context(nccl: bool) -> Iterator[comm_record.CommRecord]:
    """The simulation's own comm record, with NCCL's reduce-scatter buffers when ``nccl`` ([Note: the
    native reduce-scatter layout] in meshpar/distributed/comm_record.py); DTensor's shape propagation in
    a fake mode of its own ([Note: DTensor's shape propagation is not memory])."""
    with comm_record.CommRecord(native_layout=nccl).active() as record, dtensor_shapes_in_own_fake_mode(), \
            warnings.catch_warnings():
        # MemTracker on ops that return None among their outputs
        warnings.filterwarnings("ignore", message="Expected a tensor or a traceable wrapper-subclass")
        yield record


def _steady_prefetch(stage: torch.nn.Module) -> None:
    """Each unit prefetches the next in forward order, as from the second step on.

    [Note: the first step's prefetch] The engine records the forward order during the first
    step and prefetches by it afterwards, so a simulated first step would not prefetch in
    forward. Explicit lists in the same order make the one simulated step a steady-state one."""
    units = [m for m in stage.modules() if isinstance(m, FSDPModule)]
    for unit, nxt in zip(units, units[1:], strict=False):
        unit.set_modules_to_forward_prefetch([nxt])


class _OneAtATime:
    """``Pipeline.step_microbatches`` on this rank's stage, one microbatch at a time: a forward,
    then its backward as the schedule runs it ([Note: one reduce-scatter per step under
    pipelining]), and after the last the schedule's ``perform_reduce_grad``. The stage keeps
    its output until its backward; the order the schedule interleaves microbatches in is
    priced apart (``schedule_actions``). ``received``: the activations the previous stage sends
    (a stage after the first reads them instead of the microbatch's tokens, as the schedule
    does), ``grads``: the gradients the next stage sends back."""

    def __init__(self, stage: Stage, accum: int, received: list[torch.Tensor], grads: list[torch.Tensor],
                 phase: Callable[..., contextlib.AbstractContextManager], loss: TokenLoss) -> None:
        self.stage, self.accum, self.received, self.grads, self.phase = stage, accum, received, grads, phase
        self.stages, self.loss = [stage], loss

    def step_microbatches(self, microbatches: Sequence[Microbatch]) -> None:
        pipe, n = self.stage, len(microbatches)
        for i, (tokens, targets) in enumerate(microbatches):
            inputs = tokens if pipe.is_first else self.received[i]
            with self.phase("forward", i):
                with pipe.scheduled():  # [Note: forwards outside the schedule]
                    out = pipe.submod(inputs)
                loss = self.loss(out, targets) / self.accum if pipe.is_last else None
            with self.phase("backward", i):
                kwargs = {"stage_output": loss if pipe.is_last else (out,),
                          "output_grads": None if pipe.is_last else (self.grads[i],),
                          "input_values": () if pipe.is_first else (inputs,)}
                pipe.backward_maybe_with_nosync("full", kwargs, last_backward=i == n - 1)
                inputs.grad = None  # sent to the previous stage
                if i == n - 1:
                    pipe.perform_reduce_grad(1)
            del out, loss


def simulate(stages: list[tuple[int, torch.nn.Module]], mesh: Mesh, recipe: Recipe, accum: int, *,
             nccl: bool) -> Measured:
    """Run one optimizer step's forward/backward passes and gradient work of ``stages`` (this
    rank's, built on meta) on fake tensors through ``meshpar.training.step.train_step``; see the module
    docstring and [Note: what the simulation leaves to arithmetic]. ``accum``: microbatches per
    step on this rank."""
    t, p, layout = recipe.train, recipe.parallel, mesh.layout
    n_run = min(accum, 3 if layout.pp > 1 else 2)
    device = torch.device("cpu")
    sync = GradSync.of(mesh, p, recipe.optim)  # flattens Mesh.replicas on real tensors: not under the fake mode
    moe = get_family(recipe.model.family).moe
    with FakeTensorMode(allow_non_fake_inputs=True), _step_context(nccl) as record:
        for _, stage in stages:
            stage.to_empty(device=device)  # values are never read: no init_weights
            use_kernels(stage, _kernels(nccl, flex=p.cp_flex and nccl))
            balance_routing(moe.sparse_layers(stage) if moe is not None else [])
            _steady_prefetch(stage)
        (index, stage), = stages  # one stage per rank (checked by the planner)
        tokens = torch.zeros(t.micro_batch, t.seq_len, dtype=torch.long)
        # the stage's received activations and gradients, [mb, T/(cp tp), D] (kept by the schedule,
        # counted by the planner, not here); every stage's microbatches are token ids, as in training
        dim, seq = _hidden_dim(stage), t.seq_len // (layout.cp * layout.tp)
        received = [torch.empty(t.micro_batch, seq, dim, requires_grad=True) for _ in range(n_run)]
        grads = [torch.empty(t.micro_batch, seq, dim) for _ in range(n_run)]
        microbatches = [(tokens, tokens)] * n_run
        chunks = layout_chunks(t.loss_chunks, t.micro_batch, t.seq_len, stage.args.vocab_size, layout, p.loss_parallel)
        loss = TokenLoss(last_head([stage]), chunks)
        model = Model(torch.nn.ModuleList([stage]), None, layout.tp > 1 and p.loss_parallel, loss=loss, moe=moe)
        pipe = None
        if layout.pp > 1:
            pipe = Stage(stage, index, layout.pp, device, mesh["pp"].get_group(), p.grad_reduce == "microbatch")
        phases: dict[str, Phase] = {}
        with StepTracker(stage, groups=groups_by_name(mesh), record=record) as tracker, label_blocks(stage, tracker):
            phase = priced(tracker, phases)
            if pipe is not None:
                model.pipeline = _OneAtATime(pipe, accum, received, grads, phase, loss)
            train_step(model, lambda: microbatches, accum, sync, device, phase=phase)
    return measured(phases, n_run, accum)


def measured(phases: dict[str, Phase], n_run: int, accum: int) -> Measured:
    """The step's figures from its simulated phases (``n_run`` of ``accum`` microbatches)."""
    # what a forward leaves alive besides parameters (saved activations, the output, the loss's
    # graph): the price of a microbatch in flight
    activation = phases["F0"].saved
    step_comm: Counter = Counter()
    step_calls: Counter = Counter()
    for ph in phases.values():
        step_comm.update(ph.comm)
        step_calls.update(ph.calls)
    if accum > n_run:  # the middle microbatches are alike, and like the first without pipelining
        for name in (("F1", "B1") if n_run == 3 else ("F0", "B0")):
            for k, v in phases[name].comm.items():
                step_comm[k] += v * (accum - n_run)
            for k, v in phases[name].calls.items():
                step_calls[k] += v * (accum - n_run)
    return Measured(phases, n_run, activation, step_comm, step_calls)


def _hidden_dim(stage: torch.nn.Module) -> int:
    """Width of the residual stream a stage receives and sends (D)."""
    return stage.args.dim
