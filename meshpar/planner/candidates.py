"""What the layout search tries: every parallel config of a model on N GPUs that the family's and
the planner's own checks accept, each with the tokens/s no dry run of it can exceed.

    cands = candidates(["--model.family=llama", "--model.size=70b"], 64, profile, 8, None)
    cands[0].recipe    # the best bound first; search.py dry-runs them in this order

Candidates are the combinations of pipeline, tensor, context and data-parallel degrees (tp a
divisor of the GPUs per node, pp at most 16 and at most half the blocks, cp as
[Note: which cp degrees the search tries] says; FSDP across
the data-parallel ranks, or hybrid: sharded within a node, replicated across), micro batch,
activation checkpointing, reshard_after_forward (without pipelining) and when gradients are
reduced (``parallel.grad_reduce``, with several microbatches under FSDP), micro batch 1, 2 or
4, that multiply to the GPU count, divide the model's dimensions (the family's own layout
check) and split the global batch: ``configs(layouts(...))``, each a flat product of the choices
with filters, yields them as typed ``Choice``s, each applied to the parsed base recipe. None of
them is trusted to arithmetic alone: search.py dry-runs them ([Note: branch and bound over dry
runs] there), with ``upper_bound`` as the bound.

[Note: which cp degrees the search tries]
For a family that runs context parallelism: cp a power of two that leaves every rank at least
``MIN_CP_TOKENS`` tokens of each sequence (so none at 8192 tokens; up to 16 at 131072, Llama 3's
own cp at that length), the sequence cut into 2cp chunks each divisible over tp (the launch
check, ``check_context_parallel``). A rank's work falls as 1/cp while its K/V all-gathers per
block stay near one sequence's K and V, so below that the gathers' share of a block grows
with cp and more data-parallel ranks, where the batch has the sequences, do the same work
without them. Where cp sits needs no choice: the mesh puts it just outside tp, so its groups
stay inside a node when cp x tp divides the GPUs per node and cross nodes otherwise; the
bound prices the gathers at that link, which ranks an intra-node cp first among equals.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from meshpar.config import recipe as recipelib
from meshpar.config.hardware import HardwareProfile
from meshpar.config.recipe import Recipe, RecipeError
from meshpar.distributed.mesh import Layout, resolve
from meshpar.models import get_family
from meshpar.parallel.context_parallel.apply import ATTENTIONS
from meshpar.parallel.parallelize import check_mixed_precision
from meshpar.parallel.pipeline import check_microbatches, stage_layers
from meshpar.planner.cost import _stage_flops_per_token, default_efficiency, float8_rate, host_share
from meshpar.training.preflight import check_context_parallel, check_model

AC_MODES = ("none", "selective", "full")
GRAD_REDUCE = ("step", "microbatch")
MICRO_BATCHES = (1, 2, 4)
DEGREES = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")  # the mesh's, as parallel.<dim>
MIN_CP_TOKENS = 8192  # tokens of each sequence a cp rank keeps at least: [Note: which cp degrees the search tries]


@dataclass(frozen=True)
class Choice:
    """One candidate's parallel config: its mesh and what each rank does on it."""

    layout: Layout  # the degrees; ep splits dp_shard
    micro_batch: int  # train.micro_batch
    activation_checkpoint: str  # one of AC_MODES
    reshard_after_forward: bool
    grad_reduce: str  # one of GRAD_REDUCE
    cp_attention: str = "allgather"  # one of ATTENTIONS; tried each where cp > 1

    def overrides(self, dims: frozenset[str]) -> tuple[str, ...]:
        """The recipe overrides that make it, in the table's order; ep and cp only where the
        family runs them (``dims``, its ``mesh_dims``)."""
        lay = self.layout
        cp = (f"--parallel.cp={lay.cp}", f'--parallel.cp_attention="{self.cp_attention}"') if "cp" in dims else ()
        return (f"--parallel.tp={lay.tp}", f"--parallel.pp={lay.pp}", f"--parallel.dp_replicate={lay.dp_replicate}",
                f"--parallel.dp_shard={lay.dp_shard}", *([f"--parallel.ep={lay.ep}"] if "ep" in dims else []),
                f"--train.micro_batch={self.micro_batch}",
                f'--parallel.activation_checkpoint="{self.activation_checkpoint}"',
                f"--parallel.reshard_after_forward={str(self.reshard_after_forward).lower()}",
                f'--parallel.grad_reduce="{self.grad_reduce}"', *cp)

    def apply(self, base: Recipe, dims: frozenset[str]) -> Recipe:
        """``base`` with this config: the recipe ``overrides`` load to, built from its sections."""
        lay = self.layout
        optional = {d: getattr(lay, d) for d in ("ep", "cp") if d in dims}
        if "cp" in dims:
            optional["cp_attention"] = self.cp_attention
        parallel = dataclasses.replace(base.parallel, tp=lay.tp, pp=lay.pp, dp_replicate=lay.dp_replicate,
                                       dp_shard=lay.dp_shard, activation_checkpoint=self.activation_checkpoint,
                                       reshard_after_forward=self.reshard_after_forward,
                                       grad_reduce=self.grad_reduce, **optional)
        return dataclasses.replace(base, parallel=parallel,
                                   train=dataclasses.replace(base.train, micro_batch=self.micro_batch))


@dataclass(frozen=True)
class Candidate:
    overrides: tuple[str, ...]  # recipe overrides that make it
    bound: float  # tokens/s no dry run of it can exceed: [Note: branch and bound over dry runs]
    recipe: Recipe = field(compare=False, repr=False)  # the search's base recipe with them applied


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(gpus: int, gpus_per_node: int, seq_len: int, args, dims: frozenset[str],
            fixed: Mapping[str, int] | None = None) -> Iterator[Layout]:
    """Every mesh of ``gpus`` ranks the search tries, tp slowest, then cp, pp, dp_replicate, ep.
    A dim the family does not run (``dims``) stays 1; tp divides the GPUs per node; cp as
    [Note: which cp degrees the search tries]; pp at most 16 and at most half the blocks; the
    rest is data parallel: dp_replicate 1, or hybrid (``_replicas``); ep, for a mixture-of-experts
    family, divides dp_shard (it borrows its ranks from there; with replicas the experts are
    hybrid-sharded over dp_replicate x dp_shard / ep, Mesh.sparse) and the expert count. A dim in
    ``fixed`` (degrees the user pinned: meshpar/planner/auto.py) takes only that degree."""
    fixed = fixed or {}

    def options(dim: str, default: list[int]) -> list[int]:
        return [fixed[dim]] if dim in fixed else default

    tps = options("tp", [d for d in _divisors(gpus_per_node) if d == 1 or "tp" in dims])
    pps = options("pp", [d for d in _divisors(gpus) if d <= min(16, args.n_layers // 2) and (d == 1 or "pp" in dims)])
    eps = options("ep", _divisors(gpus) if "ep" in dims else [1])
    cps = options("cp", _cp_degrees(gpus, seq_len, "cp" in dims))
    for tp, cp, pp, replicate, ep in itertools.product(tps, cps, pps, options("dp_replicate", _divisors(gpus)), eps):
        if gpus % (tp * cp * pp) or (gpus // (tp * cp * pp)) % replicate:
            continue
        dp = gpus // (tp * cp * pp)
        hybrid = "dp_replicate" in fixed or replicate in (1, _replicas(dp, gpus_per_node // (tp * cp)))
        if fixed.get("dp_shard", dp // replicate) != dp // replicate:
            continue
        if hybrid and (dp // replicate) % ep == 0 and (ep == 1 or args.n_experts % ep == 0):
            yield Layout(pp=pp, dp_replicate=replicate, dp_shard=dp // replicate, cp=cp, tp=tp, ep=ep)


def configs(meshes: Iterable[Layout], global_batch: int, pinned: Mapping[str, object] | None = None
            ) -> Iterator[Choice]:
    """Every parallel config the search tries on ``meshes``, in its order: mesh, micro batch,
    checkpointing, resharding, when gradients reduce, and with cp > 1 each cp attention. Each
    micro batch splits the global batch over dp; not resharding after forward only without
    pipelining (pipeline units keep their parameters gathered anyway) and reducing every
    microbatch only with several, and either only where FSDP shards (dp_shard > 1). A key in
    ``pinned`` ("train.micro_batch", "parallel.<key>") takes only that value."""
    pinned = pinned or {}

    def options(key: str, default: Iterable) -> tuple:
        return (pinned[key],) if key in pinned else tuple(default)

    for layout, mb, ac, reshard, reduce in itertools.product(
            meshes, options("train.micro_batch", MICRO_BATCHES), options("parallel.activation_checkpoint", AC_MODES),
            options("parallel.reshard_after_forward", (True, False)), options("parallel.grad_reduce", GRAD_REDUCE)):
        if global_batch % (layout.dp * mb):
            continue
        sharded = layout.dp_shard > 1
        n = global_batch // (layout.dp * mb)  # microbatches per step
        if (reshard or (layout.pp == 1 and sharded)) and (reduce == "step" or (n > 1 and sharded)):
            attentions = ATTENTIONS if layout.cp > 1 else ("allgather",)
            for attention in options("parallel.cp_attention", attentions):
                yield Choice(layout, mb, ac, reshard, reduce, attention)


def candidates(base: list[str], gpus: int, profile: HardwareProfile, gpus_per_node: int,
               efficiency: float | None, *, path: Path | None = None,
               pinned: Mapping[str, object] | None = None) -> list[Candidate]:
    """Every config of ``base`` (overrides naming model, sequence and global batch; on the recipe
    file ``path`` if given) on ``gpus`` that the family's and the planner's own checks accept, with
    the ``pinned`` keys' values (``configs``), best bound first; among equal bounds, the smaller
    memory first (``memory_key``)."""
    recipe = recipelib.load(path, base)
    family, args = check_model(recipe)
    t, dims = recipe.train, family.mesh_dims
    pinned = pinned or {}
    fixed = {k.split(".")[1]: v for k, v in pinned.items() if k.split(".")[1] in DEGREES}
    out = []
    for choice in configs(layouts(gpus, gpus_per_node, t.seq_len, args, dims, fixed), t.global_batch, pinned):
        lay = choice.layout
        n = t.global_batch // (lay.dp * choice.micro_batch)
        cand = choice.apply(recipe, dims)
        try:
            recipelib.check(cand)
            layout = resolve(cand.parallel, gpus)
            family.check_layout(args, layout)
            check_mixed_precision(cand.parallel, layout)
            if lay.cp > 1:
                check_context_parallel(cand, layout, args)
            if lay.pp > 1:
                check_microbatches("1f1b", n, lay.pp, local_batch=t.global_batch // lay.dp)
        except RecipeError:
            continue
        bound = upper_bound(args, cand, lay.pp, lay.tp, lay.cp, lay.dp, n, profile, gpus_per_node, efficiency)
        out.append(Candidate(choice.overrides(dims), bound, cand))
    return sorted(out, key=lambda c: (-round(c.bound, 6), memory_key(c.overrides)))


def _cp_degrees(ranks: int, seq_len: int, allowed: bool) -> list[int]:
    """[Note: which cp degrees the search tries]: 1, and with ``allowed`` the powers of two that
    divide ``ranks`` and leave each cp rank ``MIN_CP_TOKENS`` or more of a sequence."""
    out, cp = [1], 2
    while allowed and ranks % cp == 0 and seq_len // cp >= MIN_CP_TOKENS:
        out.append(cp)
        cp *= 2
    return out


def _replicas(dp: int, in_node: int) -> int:
    """dp_replicate of the hybrid layout: FSDP over a node's ``in_node`` data-parallel ranks,
    replicated across nodes; 1 where ``dp`` does not fill whole nodes."""
    in_node = max(1, in_node)
    return dp // in_node if dp > in_node and dp % in_node == 0 else 1


def upper_bound(args, recipe: Recipe, pp: int, tp: int, cp: int, dp: int, n: int, profile: HardwareProfile,
           gpus_per_node: int, efficiency: float | None) -> float:
    """tokens/s no dry run of this candidate can exceed: its compute (cost.py's term) plus the
    sequence-parallel collectives every block runs at least (2 all-gathers and 2 reduce-scatters
    of [micro_batch, T/cp, D] each way) and context parallelism's (K and V gathered in forward,
    their gradients reduce-scattered in backward: [micro_batch, Hkv/tp, T/cp, Dh] each, from
    cp - 1 ranks; with ``cp_attention = "ring"`` only each block's last dK/dV hop, the part
    cost.py leaves on the critical path: [Note: the ring's overlap]; with "ulysses" the all-to-alls
    of q, k, v and the output and of their gradients, (cp - 1) / cp of each, kv heads not
    repeated), stretched by the pipeline bubble."""
    t, p = recipe.train, recipe.parallel
    itemsize = getattr(torch, p.param_dtype).itemsize
    efficiency = efficiency or default_efficiency(p.compile, pp * tp * cp * dp)
    share = host_share(profile, pp * tp * cp * dp, gpus_per_node)  # a CPU's ranks share its cores
    peak = profile.peak_flops(getattr(torch, p.param_dtype)) / share
    float8 = recipe.model.float8
    peak8 = float8_rate(profile, float8) / share if float8 != "none" else peak
    gbps = profile.intra_node_gbps if tp <= gpus_per_node else profile.inter_node_gbps
    cp_gbps = profile.intra_node_gbps if gpus_per_node % (cp * tp) == 0 else profile.inter_node_gbps
    local = t.micro_batch * t.seq_len // cp  # a microbatch's tokens on one rank
    kv = 0.0  # K and V bytes a rank receives per block: none without cp (gpt2's args have no n_kv_heads)
    if cp > 1:
        hop = 2 * local * args.n_kv_heads // tp * args.resolved_head_dim * itemsize  # a rank's K and V (or dK, dV)
        if p.cp_attention == "ulysses":
            heads = 2 * args.n_heads // tp + 2 * args.n_kv_heads // tp  # q and the output; k and v
            kv = 2 * local * heads * args.resolved_head_dim * itemsize * (cp - 1) / cp
        else:
            kv = hop if p.cp_attention == "ring" else 2 * hop * (cp - 1)
    worst = 0.0
    for i, layers in enumerate(stage_layers(args.n_layers, pp)):
        _, executed, in_float8 = _stage_flops_per_token(args, layers, i == pp - 1, p.activation_checkpoint,
                                                        p.ac_every, t.seq_len, float8=float8,
                                                        sparse=get_family(recipe.model.family).moe is not None)
        compute = ((executed - in_float8) / peak + in_float8 / peak8) * t.global_batch * t.seq_len / dp / cp / tp
        compute /= efficiency
        gathered = 1 if float8 == "tensorwise" else itemsize  # tensorwise all-gathers activations in float8
        tp_bytes = 4 * (itemsize + gathered) * local * args.dim * (tp - 1) / tp * len(layers) * n
        comm = tp_bytes / (gbps * 1e9) + kv * len(layers) * n / (cp_gbps * 1e9)
        worst = max(worst, compute + comm + _all_to_all_s(args, recipe, layers, n, profile, gpus_per_node))
    return t.global_batch * t.seq_len / (worst * (n + pp - 1) / n)


def _all_to_all_s(args, recipe: Recipe, layers: range, n: int, profile: HardwareProfile, gpus_per_node: int) -> float:
    """Expert parallelism's all-to-alls of a balanced step (cost.py's term, by arithmetic): per sparse
    layer and microbatch, forward and backward (and the recomputed forward of a checkpointed block),
    2 x tokens x top_k x (ep - 1) / ep x D x itemsize each, the tokens a rank routes: its T / (cp tp)
    of each sequence; at the link of ep's span, ep x cp x tp (cost.py's ``_link``)."""
    ep, t, p = recipe.parallel.ep, recipe.train, recipe.parallel
    if ep == 1:
        return 0.0
    sparse = sum(args.is_sparse(i) * (3 if p.activation_checkpoint == "full" and i % p.ac_every == 0 else 2)
                 for i in layers)
    tokens = t.micro_batch * t.seq_len // (p.cp * p.tp)
    nbytes = 2 * tokens * args.top_k * (ep - 1) / ep * args.dim * sparse * n
    nbytes *= getattr(torch, recipe.parallel.param_dtype).itemsize
    gbps = profile.intra_node_gbps if gpus_per_node % (ep * p.cp * p.tp) == 0 else profile.inter_node_gbps
    return nbytes / (gbps * 1e9)


def memory_key(overrides: tuple[str, ...]) -> tuple:
    """Orders candidates of one layout by the memory they need, least first."""
    o = dict(x.removeprefix("--").split("=", 1) for x in overrides)
    ac = AC_MODES.index(o["parallel.activation_checkpoint"].strip('"'))
    return (int(o["train.micro_batch"]), -ac, o["parallel.reshard_after_forward"] == "false",
            o["parallel.grad_reduce"].strip('"') == "step")
