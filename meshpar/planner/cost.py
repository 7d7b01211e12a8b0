"""Step time from FLOPs and bytes: compute against the profile's peak, collectives against its links.

    t = step_time(recipe, layout, args, profile, ranks, accum, gpus_per_node=8, efficiency=None,
                  links=LinkDefaults())
    t.step_s, t.tokens_per_s, t.mfu, t.comm   # per mesh dim: bytes, link, seconds

Limits: collectives run at the full link bandwidth, so communication times are lower bounds; a
step bound by the host (Python and launches slower than the GPU) and the interleaved and
zero-bubble pipeline schedules are not modelled. The model in words:
docs/planner.md#the-time-model.

Notes: [Note: the time model], [Note: the efficiency constants], [Note: flattened dims],
[Note: the ring's overlap].
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from dataclasses import dataclass

import torch

from meshpar.config.hardware import HardwareProfile
from meshpar.config.recipe import Recipe
from meshpar.distributed.mesh import DIMS, Layout
from meshpar.models import get_family
from meshpar.parallel.context_parallel import flex as flexlib
from meshpar.training.loss import layout_chunks

# [Note: the time model]
# A step is the slowest pipeline stage's (compute + critical communication) per microbatch times
# the n + p - 1 slots of n microbatches on p stages, plus the data-parallel communication compute
# does not hide, the step's first all-gather and last reduce-scatter, and the optimizer step.
# Compute: the stage's model FLOPs (``flops_per_token``: 6 per weight plus attention), one more
# forward per checkpointed block under "full" (selective keeps matmul and attention outputs), one more
# forward of the output projection when the loss runs in chunks (meshpar/training/loss.py), over
# tp and cp (the balanced split gives each cp rank 1/cp of the causal attention exactly), at
# ``efficiency`` x the dense peak. Critical: tp, pp, ep and cp transfers (a matmul, stage, expert
# or attention waits for them; the ring's hops: [Note: the ring's overlap]). Hidden: FSDP and
# replica collectives, by prefetching. A dim is intra-node when its group (the dim times every dim
# inside it) divides the GPUs per node; bytes are the ring volumes per rank counted in the
# simulated step ([Note: bytes counted] in meshpar/distributed/comm.py).

# [Note: the efficiency constants]
# ``efficiency`` is the share of the dense peak a step's compute reaches, everything besides ideal
# matmuls included. EFFICIENCY is meshpar's own step on one GPU, eager and compiled per block,
# with the optimizer step taken out: fused AdamW plus clipping read and write
# OPTIMIZER_BYTES_PER_PARAM bytes per local parameter, memory-bound, so it is costed at the
# profile's memory bandwidth. BESIDE_COLLECTIVES scales it for any layout of more than one rank:
# NCCL's kernels take SMs and memory bandwidth from the matmuls they overlap, which the
# communication model (overlapped collectives cost nothing) does not see; it is a published 8-GPU
# figure's efficiency over the one-GPU eager one. The measurements and each layout's error:
# docs/performance.md#gpu-the-planner-calibrated; the published figures:
# docs/performance.md#against-torchtitans-published-figures.
EFFICIENCY = {False: 0.43, True: 0.52}  # one device, by parallel.compile
BESIDE_COLLECTIVES = 0.80
OPTIMIZER_BYTES_PER_PARAM = 40  # fp32 AdamW: param, grad, 2 moments read, 3 written (28 B); clip 12 B
# The ring's attention (``parallel.cp_attention = "ring"``), forward and backward, takes this many
# times the gather's on a device of the kind, as measured ([Note: the ring on a GPU] in
# meshpar/parallel/context_parallel/ring.py; docs/performance.md#context-parallel-attention-on-a-gpu).
# On the CPU the two are close, and the model leaves the difference out.
RING_ATTENTION_SLOWDOWN = {"cuda": 8.0}
# The ring on flex_attention (``parallel.cp_flex`` on CUDA: [Note: the ring on flex] in
# meshpar/parallel/context_parallel/ring_flex.py) runs each ring step's forward again in backward: 9
# matmul passes per (query, key) pair against the gather's 7 at the same kernel's rate. Predicted from
# that count, not measured: no GPU has run it.
RING_FLEX_SLOWDOWN = 9 / 7


def ring_slowdown(recipe: Recipe, cp: int, device: str) -> float:
    """How many times the gather's time cp's attention takes: 1 but for the ring (on flex or not)."""
    p = recipe.parallel
    if p.cp_attention != "ring" or cp <= 1:
        return 1.0
    local = recipe.train.seq_len // cp
    if p.cp_flex and device == "cuda" and flexlib.takes(local, local):
        return RING_FLEX_SLOWDOWN
    return RING_ATTENTION_SLOWDOWN.get(device, 1.0)

# [Note: float8 in the time model]
# ``model.float8`` converts the blocks' linear layers (not the output projection, not the experts of a
# mixture of experts: ``float8_params_per_block``). Their matmul FLOPs run at the profile's float8
# peak x ``efficiency`` x FLOAT8_MATMUL[mode]: the share of float8's rate a converted layer keeps
# once its casts (amax, scale, cast: memory-bound passes over inputs, weights and output gradients)
# are paid. ``rowwise_with_gw_hp`` keeps the weight gradient, a third of a layer's FLOPs, in high
# precision. Under tensorwise FSDP all-gathers the converted weights in float8 (1 byte a weight, not
# param_dtype's) and tensor parallelism its activations; rowwise gathers in param_dtype. The
# constants are fitted to torchao's published Llama 3 8B figures, float8 over bf16 on 8 H100s, with
# this model (docs/performance.md#float8-in-the-planner): no GPU has measured meshpar's float8 yet.
FLOAT8_MATMUL = {"tensorwise": 0.69, "rowwise": 0.57, "rowwise_with_gw_hp": 0.57}


def float8_params_per_block(args, *, sparse: bool = False) -> float:
    """Weights per block in the linear layers ``model.float8`` converts: every block linear (all of a
    shipped model's dims are multiples of 16), or for a mixture of experts (``sparse``: the family has a
    ``moe`` part) the attention projections only."""
    if sparse:
        d, dh = args.dim, args.resolved_head_dim
        return d * args.n_heads * dh * 2 + d * args.n_kv_heads * dh * 2  # wq, wo; wk, wv
    return (args.matmul_params() - args.vocab_size * args.dim) / args.n_layers


def float8_rate(profile: HardwareProfile, mode: str) -> float:
    """The FLOP/s a converted layer's float8 matmuls run at, before ``efficiency``: the float8 peak x
    ``FLOAT8_MATMUL[mode]`` ([Note: float8 in the time model])."""
    return profile.peak_flops(torch.float8_e4m3fn) * FLOAT8_MATMUL[mode]


def float8_gathered_share(args, n_params: int, *, sparse: bool = False) -> float:
    """The share of the parameters FSDP gathers in float8 under tensorwise: the converted weights."""
    return float8_params_per_block(args, sparse=sparse) * args.n_layers / n_params


def host_share(profile: HardwareProfile, world_size: int, gpus_per_node: int) -> int:
    """Ranks that share one device's peak and memory bandwidth: on a CPU the local ranks all run on
    the host's cores (profiles/cpu.toml gives per-host figures), so each computes at 1/share of
    them; on a GPU each rank has its own, 1."""
    return max(1, min(world_size, gpus_per_node)) if profile.device == "cpu" else 1


def default_efficiency(compiled: bool, world_size: int) -> float:
    """[Note: the efficiency constants]: compute efficiency of a step of ``world_size`` ranks."""
    return EFFICIENCY[bool(compiled)] * (BESIDE_COLLECTIVES if world_size > 1 else 1.0)


@dataclass(frozen=True)
class LinkDefaults:
    """Used where a hardware profile lacks them: an 8-GPU HGX node, NVLink 4 inside (450 GB/s per
    GPU per direction), 400 Gb/s InfiniBand per GPU across nodes (50 GB/s)."""

    gpus_per_node: int = 8
    intra_node_gbps: float = 450.0
    inter_node_gbps: float = 50.0


@dataclass(frozen=True)
class DimComm:
    dim: str
    degree: int
    link: str  # "intra-node" or "inter-node"
    gbps: float
    bytes_per_step: float  # on the wire from the busiest rank
    seconds: float
    overlapped: bool  # hidden behind compute (data parallel) or on the critical path (tp, pp)
    hidden_s: float = 0.0  # of a critical dim's seconds, what runs beside compute (cp's ring hops)
    calls: int = 0  # collectives per step; ``seconds`` includes calls x the profile's latency


@dataclass(frozen=True)
class StepTime:
    model_flops_per_token: float
    compute_s: float  # the busiest stage's matmul time for the step, recomputation included
    optimizer_s: float  # its optimizer step (clipping + AdamW), memory-bound
    comm: list[DimComm]
    bubble: float
    step_s: float
    tokens_per_s: float
    mfu: float
    efficiency: float
    gpus_per_node: int


# [Note: flattened dims]
# A step also communicates over dims that are not mesh DIMS: dp (dp_replicate x dp_shard), ep and
# dp_shard_mod_ep (dp_shard split into dp_shard_mod_ep (outer) x ep (inner): Mesh.experts), and FSDP
# meshes flattened from the ranks that see other tokens of the same parameters, named after their parts
# outermost first: dp_shard_cp (Mesh.fsdp), dp_replicate_cp (Mesh.replicas), a sparse layer's
# dp_shard_tp, dp_shard_cp_tp, and its experts' dp_shard_mod_ep_cp_tp and the like (Mesh.sparse). A
# dim's degree is the product of its parts'; its groups span its outermost part's mesh dim and every
# dim inside it (for ep, the innermost part of dp_shard: ep x cp x tp).
_PARTS = ("dp_replicate", "dp_shard_mod_ep", "dp_shard", "dp", "pp", "ep", "cp", "tp")  # longest prefix first
_OUTER = {"dp": "dp_replicate", "dp_shard_mod_ep": "dp_shard", "ep": "dp_shard"}  # a part's outermost mesh dim


def _parts(dim: str) -> list[str]:
    """``dp_shard_mod_ep_cp_tp`` -> [dp_shard_mod_ep, cp, tp]; [] for a name that is no mesh dim's."""
    parts, rest = [], dim
    while rest:
        part = next((p for p in _PARTS if rest == p or rest.startswith(p + "_")), None)
        if part is None:
            return []
        parts.append(part)
        rest = rest[len(part):].removeprefix("_")
    return parts


def _degree(dim: str, layout: Layout) -> int:
    special = {"dp": layout.dp, "ep": layout.ep, "dp_shard_mod_ep": layout.dp_shard // layout.ep}
    return math.prod(special[p] if p in special else getattr(layout, p) for p in _parts(dim))


def _link(dim: str, layout: Layout, gpus_per_node: int, profile: HardwareProfile) -> tuple[str, float]:
    degrees = dict(zip(DIMS, layout.degrees, strict=True))
    parts = _parts(dim)
    # a part of degree 1 spans nothing: dp_shard_mod_ep_tp under ep = dp_shard is the tp ranks alone
    first = next((p for p in parts if _degree(p, layout) > 1), parts[0])
    outermost = _OUTER.get(first, first)
    span = math.prod(degrees[d] for d in DIMS[DIMS.index(outermost):])  # the dim and every dim inside it
    if first == "ep":  # the innermost part of dp_shard: ep x the dims inside dp_shard
        span = span // layout.dp_shard * layout.ep
    if gpus_per_node % span == 0:  # ranks are laid out row-major: a group is `span` consecutive ranks
        return "intra-node", profile.intra_node_gbps
    return "inter-node", profile.inter_node_gbps


def _stage_flops_per_token(args, layers: range, last: bool, ac: str, ac_every: int, seq_len: int, *,
                           ring: bool = False, ring_slowdown: float = 1.0, float8: str = "none",
                           head_recomputed: bool = False, sparse: bool = False) -> tuple[float, float, float]:
    """(model FLOPs, executed FLOPs, of those in float8) per token of one pipeline stage: [Note: the time
    model]. ``ring``: cp's attention is the ring, whose forward selective checkpointing recomputes
    ([Note: the ring's overlap]), and whose every attention FLOP costs ``ring_slowdown`` of the gather's
    (as executed FLOPs at the common rate: ``ring_slowdown``). ``float8``: ``model.float8``
    ([Note: float8 in the time model]). ``head_recomputed``: the loss runs in chunks, recomputing the output
    projection's forward in backward ([Note: chunked cross-entropy] in meshpar/training/loss.py)."""
    vocab_matmul = args.vocab_size * args.dim
    per_block_weights = (args.matmul_params() - vocab_matmul) / args.n_layers
    per_block_attention = (args.flops_per_token(seq_len) - 6.0 * args.matmul_params()) / args.n_layers
    per_block = 6.0 * per_block_weights + per_block_attention
    model = len(layers) * per_block + (6.0 * vocab_matmul if last else 0.0)
    checkpointed = sum(1 for i in layers if i % ac_every == 0)
    recomputed = {"full": per_block, "selective": per_block_attention if ring else 0.0}.get(ac, 0.0)
    executed = model + checkpointed * recomputed / 3  # a forward is a third of forward + backward
    if last and head_recomputed:
        executed += 2.0 * vocab_matmul
    if ring:  # its attention, the recomputed forward included, at 1 / ring_slowdown of the common rate
        again = checkpointed / 3 if ac in ("full", "selective") else 0.0
        executed += (ring_slowdown - 1.0) * per_block_attention * (len(layers) + again)
    in_float8 = 0.0
    if float8 != "none":  # forward (2), input gradient (2), weight gradient (2, or 0 kept in high precision)
        per_weight = 4.0 if float8 == "rowwise_with_gw_hp" else 6.0
        recomputed_forward = checkpointed * 2.0 if ac == "full" else 0.0
        in_float8 = float8_params_per_block(args, sparse=sparse) * (per_weight * len(layers) + recomputed_forward)
    return model, executed, in_float8


def _stage_comms(r, recipe: Recipe, layout: Layout, args, accum: int, gpn: int,
                 profile: HardwareProfile, float8_share: float = 0.0) -> list[DimComm]:
    """A stage's communication per mesh dim in one step: the bytes of its simulated step, plus
    the pipeline's transfers by arithmetic: each microbatch a stage sends one fp32 [mb, T/(cp tp), D]
    to each neighbour (activations on, gradients back) and receives as many over the other
    direction of the link; an end stage has one neighbour. ``float8_share``: of FSDP's all-gathered
    parameters, the share gathered in float8 ([Note: float8 in the time model])."""
    t = recipe.train
    per_dim: Counter = Counter()
    calls: Counter = Counter()
    for (_, dim), n in r.measured.comm_calls.items():
        calls[dim] += n
    float8 = recipe.model.float8 == "tensorwise"  # [Note: float8 in the time model]
    itemsize = torch.tensor([], dtype=getattr(torch, recipe.parallel.param_dtype)).element_size()
    for (op, dim), nbytes in r.measured.comm_bytes.items():
        if float8 and op == "all_gather" and dim == "tp":  # the blocks' activations (output: 1 in 4L + 1)
            nbytes /= itemsize
        elif float8 and op == "all_gather" and _parts(dim)[:1] == ["dp_shard"]:  # FSDP's: the converted weights
            nbytes *= 1.0 - float8_share * (1.0 - 1.0 / itemsize)
        per_dim[dim] += nbytes
    if layout.pp > 1:
        hidden = t.micro_batch * (t.seq_len // (layout.cp * layout.tp)) * args.dim * 4
        neighbours = (r.stage > 0) + (r.stage < layout.pp - 1)
        per_dim["pp"] += hidden * accum * neighbours
        calls["pp"] += accum * neighbours
    comms = []
    known = {dim: _parts(dim) for dim in per_dim if _parts(dim)}  # [Note: flattened dims]

    def order(dim: str) -> tuple[int, int]:  # outermost first; a part (ep) after the whole (dp_shard)
        first = known[dim][0]
        return DIMS.index(_OUTER.get(first, first)), first in _OUTER

    for dim in sorted(known, key=order):
        nbytes = per_dim[dim]
        if _degree(dim, layout) == 1:  # dp_shard_mod_ep 1 under ep = dp_shard: no wire
            continue
        link, gbps = _link(dim, layout, gpn, profile)
        seconds = nbytes / (gbps * 1e9) + calls[dim] * profile.latency_s
        comms.append(DimComm(dim, _degree(dim, layout), link, gbps, nbytes, seconds,
                             dim not in ("tp", "pp", "ep", "cp"), calls=calls[dim]))
    return comms


# [Note: the ring's overlap]
# Ring attention ([Note: ring attention] in meshpar/parallel/context_parallel/ring.py) posts each
# hop of one K/V chunk, h = 2 x mb x Hkv/tp x T/cp x Dh x itemsize bytes, before the attention of
# the chunk in hand, so a hop costs only what it takes beyond that step's attention a (1/cp of a
# block's attention forward on the rank's tokens, over tp: the same on every rank and step under
# the balanced split; a backward step does twice the work beside two hops). The last dK/dV hop of
# each block's backward has no compute beside it. With H hops on cp in the simulated step
# (recomputation included) over n = blocks x microbatches:
#     exposed = (H - n) x max(0, h/bw - a) + n x h/bw
# Selective checkpointing keeps nothing of the ring's forward, so a checkpointed block recomputes
# its attention forward (``_stage_flops_per_token(ring=True)``), and on CUDA every attention FLOP
# of the ring counts ``RING_ATTENTION_SLOWDOWN`` times, a included. Worked figures for the 128k
# recipes: docs/performance.md#the-rings-overlap-at-131072-tokens.
def _ring_hidden(comm: DimComm, recipe: Recipe, layout: Layout, args, blocks: int, accum: int,
                 flops: float) -> float:
    """[Note: the ring's overlap]: of the cp dim's ``comm.seconds``, what hides behind the attention
    (``flops``: the compute rate, FLOP/s)."""
    t = recipe.train
    itemsize = torch.tensor([], dtype=getattr(torch, recipe.parallel.param_dtype)).element_size()
    local = t.micro_batch * (t.seq_len // layout.cp)  # a microbatch's tokens on the rank
    hop = 2 * local * args.n_kv_heads // layout.tp * args.resolved_head_dim * itemsize
    hop_s = hop / (comm.gbps * 1e9)
    attention = (args.flops_per_token(t.seq_len) - 6.0 * args.matmul_params()) / args.n_layers  # a block's, per token
    step_s = attention / 3 * local / layout.tp / flops / layout.cp  # one ring step of its forward
    hops, last = comm.bytes_per_step / hop, blocks * accum
    exposed = max(0.0, hops - last) * max(0.0, hop_s - step_s) + min(hops, last) * hop_s
    return max(0.0, comm.bytes_per_step / (comm.gbps * 1e9) - exposed)  # each hop's latency stays exposed


def step_time(recipe: Recipe, layout: Layout, args, profile: HardwareProfile, ranks, accum: int, *,
              gpus_per_node: int | None, efficiency: float | None, links: LinkDefaults) -> StepTime:
    """The step of the slowest pipeline stage; ``ranks`` are the planner's RankPlans (one per stage).
    ``efficiency`` None: ``default_efficiency`` for the recipe's compile setting and world size."""
    t, p = recipe.train, recipe.parallel
    if efficiency is None:
        efficiency = default_efficiency(p.compile, layout.world_size)
    gpn = gpus_per_node or profile.devices_per_node or links.gpus_per_node
    share = host_share(profile, layout.world_size, gpn)
    peak = profile.peak_flops(getattr(torch, p.param_dtype)) / share
    tokens = t.global_batch * t.seq_len / (layout.dp * layout.cp)  # tokens per step on one rank (all its tp ranks)
    ring = p.cp_attention == "ring" and layout.cp > 1
    slowdown = ring_slowdown(recipe, layout.cp, profile.device)
    stages = []  # (compute s, critical comm s, DimComms) per stage; the step is set by the largest sum
    float8 = recipe.model.float8
    sparse = get_family(recipe.model.family).moe is not None
    peak8 = float8_rate(profile, float8) / share if float8 != "none" else peak
    chunks = layout_chunks(t.loss_chunks, t.micro_batch, t.seq_len, args.vocab_size, layout, p.loss_parallel)
    for r in ranks:
        _, executed, in_float8 = _stage_flops_per_token(args, r.layers, r.stage == layout.pp - 1,
                                                        p.activation_checkpoint, p.ac_every, t.seq_len, ring=ring,
                                                        ring_slowdown=slowdown, float8=float8,
                                                        head_recomputed=chunks > 1, sparse=sparse)
        compute = ((executed - in_float8) / peak + in_float8 / peak8) * tokens / layout.tp / efficiency
        comms = _stage_comms(r, recipe, layout, args, accum, gpn, profile,
                             float8_gathered_share(args, sum(x.n_params for x in ranks), sparse=sparse)
                             if float8 != "none" else 0)
        if ring:
            comms = [dataclasses.replace(c, hidden_s=_ring_hidden(c, recipe, layout, args, len(r.layers), accum,
                                                                  peak * efficiency / slowdown)) if c.dim == "cp" else c
                     for c in comms]
        # the optimizer step: every local fp32 parameter, memory-bound ([Note: the efficiency constants])
        optimizer = r.param_bytes / 4 * OPTIMIZER_BYTES_PER_PARAM / (profile.memory_bandwidth_gbps * 1e9) * share
        stages.append((compute, sum(c.seconds - c.hidden_s for c in comms if not c.overlapped), comms, r, optimizer))
    compute, critical, comms, slowest, optimizer = max(stages, key=lambda x: x[0] + x[1] + x[4])
    overlappable = sum(c.seconds for c in comms if c.overlapped)
    slots = accum + layout.pp - 1
    pipeline = (compute + critical) / accum * slots
    # the first all-gather and the last reduce-scatter of a step cannot hide behind compute
    edge = 0.0
    shard = layout.dp_shard * layout.cp  # FSDP's mesh: Mesh.fsdp
    if slowest.units and shard > 1:
        _, gbps = _link("dp_shard" if layout.cp == 1 else "dp_shard_cp", layout, gpn, profile)
        unit = max(slowest.units, key=lambda u: u.gathered_bytes)
        edge = (unit.gathered_bytes + unit.reduce_bytes) * (shard - 1) / shard / (gbps * 1e9)
    step = pipeline + max(0.0, overlappable - compute) + edge + optimizer
    tokens_per_s = t.global_batch * t.seq_len / step
    model_flops = args.flops_per_token(t.seq_len)
    mfu = model_flops * tokens_per_s / (layout.world_size * peak)
    return StepTime(model_flops, compute, optimizer, comms, (layout.pp - 1) / slots, step, tokens_per_s, mfu,
                    efficiency, gpn)
