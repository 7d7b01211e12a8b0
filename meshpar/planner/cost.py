"""Step time from FLOPs and bytes: compute against the profile's peak, collectives against its links.

    t = step_time(recipe, layout, args, profile, ranks, accum, gpus_per_node=8, efficiency=None,
                  links=LinkDefaults())
    t.step_s, t.tokens_per_s, t.mfu, t.comm   # per mesh dim: bytes, link, seconds

[Note: the time model]
- Compute: the model FLOPs of each pipeline stage's blocks (``flops_per_token``'s 6 per
  weight plus attention, split per block; the output projection on the last stage), plus
  one more forward of every checkpointed block under ``activation_checkpoint = "full"``
  ("selective" keeps matmul and attention outputs, so it recomputes no matmul FLOPs),
  on the stage's tokens divided over tp, at ``efficiency`` x the profile's dense peak for
  the compute dtype; then the optimizer step ([Note: the efficiency constants]).
- Context parallelism divides that work by cp: a rank runs every weight on its T/cp tokens,
  and its attention, T/cp queries over the keys up to each of its chunks, is 1/cp of the
  sequence's causal attention exactly under the balanced split ([Note: balanced sequence
  split] in meshpar/parallel/context_parallel/apply.py: 2cp x (T/2cp)^2 of T^2/2 (query, key) pairs on every
  rank), whatever convention counts the whole (``flops_per_token``'s, without the causal
  halving, as calibrated). Its K/V all-gathers (and their reduce-scatters in backward) sit on
  the critical path of every block: the attention waits for them. Under ``parallel.cp_attention
  = "ring"`` the cp bytes are the ring's hops, each beside one step's attention:
  [Note: the ring's overlap].
- ``efficiency`` stands for everything a step's compute does besides ideal matmuls;
  ``default_efficiency`` gives it from [Note: the efficiency constants]. The published
  figure it was first calibrated on: torchtitan's Llama 3.1 8B with FSDP on 8 H100s (its
  docs/performance.md: 5,762 tokens/s per GPU at local batch 2, sequence 8192, selective
  checkpointing, eager) is 0.342 of the 16,869 this model predicts at efficiency 1. Out of
  sample, the same figure predicts torchtitan's Llama 3.1 405B at FSDP 16 x TP 8 on 128 H100s
  (local batch 2, full checkpointing: 109 tokens/s per GPU published) at 90, 17% low; larger
  matmuls run closer to peak. Two differences from torchtitan sit inside the 0.34: its selective
  checkpointing recomputes every second matmul (its op-count policy) where meshpar's keeps
  every matmul output, so torchtitan executes up to a sixth more matmul FLOPs (half of
  each block's forward matmuls again) than counted here and predictions for meshpar's
  "selective" lean slow; and by the same token meshpar's selective keeps
  more: the 8B configuration above plans at 87.5 GiB here, over an H100's 74.5 usable, which
  torchtitan ran.
- Tensor parallel and pipeline transfers sit on the critical path of every microbatch
  (sequence-parallel all-gathers and reduce-scatters run between the matmuls that need
  them; a stage waits for its input), and so do expert parallelism's all-to-alls (the
  experts wait for their token slots, the block for their outputs; bytes of a balanced step,
  [Note: the planner routes tokens evenly] in planner/moe.py: per sparse layer and microbatch,
  forward and backward each, and the forward again under full checkpointing, 2 x tokens x
  top_k x (ep - 1) / ep x D x itemsize);
  data-parallel collectives (FSDP all-gathers and reduce-scatters, replica all-reduces)
  overlap with compute through prefetching, except the first unit's all-gather and the
  last unit's reduce-scatter of a step (over FSDP's mesh: dp_shard, x cp when context parallel).
- The pipeline runs ``n + p - 1`` microbatch slots for n microbatches on p stages (1F1B
  and GPipe), so its bubble is ``(p - 1) / (n + p - 1)`` of the step.
- Links: a mesh dim's groups stay inside a node when the dim's degree times the degrees
  of every dim inside it divides the GPUs per node (tp innermost, so it is the first to
  stay inside; tp 3 on nodes of 8 would put a group across two nodes; ep is the innermost
  part of dp_shard, so its span is ep x cp x tp; cp's is cp x tp, so cp stays inside a node
  when cp x tp divides its GPUs); otherwise they
  cross nodes and run at the inter-node bandwidth, per GPU per direction. Bytes are ring
  volumes per rank ([Note: bytes counted] in meshpar/distributed/comm.py), counted in the simulated
  step, at the full link bandwidth, which collectives do not reach: communication times
  are lower bounds.
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

# [Note: the efficiency constants]
# Measured with meshpar on one GPU (H200, torch 2.11, bf16, tests/benchmarks/bench_gpu.py and
# calibrate_gpu.py, 2026-11-26): the compute of a step runs at 0.41-0.45 of the dense bf16 peak
# eager (Llama 1B, sequence 4096) and 0.49-0.53 compiled per block (1B at batch 1 and 2; 0.60
# for 3B with full checkpointing, its recomputation counted), once the optimizer step is taken
# out: fused AdamW plus clipping read and write ~40 bytes per local parameter, memory-bound
# (``OPTIMIZER_BYTES_PER_PARAM`` at the profile's bandwidth: 10 ms of the 1B model's 86 ms step;
# the batch-1 and batch-2 steps imply the same compute efficiency only with that term). So one
# device computes at EFFICIENCY[compiled]. With collectives running beside the compute (any
# layout of more than one rank) the published 8-GPU figure above (0.342, eager) is 0.80 of the
# one-GPU eager one: NCCL's kernels take SMs and memory bandwidth from the matmuls they overlap,
# which the communication model (overlapped collectives cost nothing) does not see; that ratio is
# BESIDE_COLLECTIVES. Before this calibration the planner used 0.34 everywhere and predicted the
# one-GPU compiled 1B step 27% slow; calibrate_gpu prints every layout's error. A step bound by
# the host (1B at sequence 2048: the GPU waits for kernel launches) is not modeled.
EFFICIENCY = {False: 0.43, True: 0.52}  # one device, by parallel.compile
BESIDE_COLLECTIVES = 0.80
OPTIMIZER_BYTES_PER_PARAM = 40  # fp32 AdamW: param, grad, 2 moments read, 3 written (28 B); clip 12 B
# The ring's attention (``parallel.cp_attention = "ring"``), forward and backward, takes this many times
# the gather's on a device of the kind: 8.5x (Llama 3 8B at 131072 tokens, cp 4 x tp 4) and 7.9-8.0x
# (70B, cp 16 x tp 8) on one H200 ([Note: the ring on a GPU] in meshpar/parallel/context_parallel/ring.py); on the CPU
# the two steps are within 20% of each other (bench_cp), which the model leaves out.
RING_ATTENTION_SLOWDOWN = {"cuda": 8.0}


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
    first = _parts(dim)[0]
    outermost = _OUTER.get(first, first)
    span = math.prod(degrees[d] for d in DIMS[DIMS.index(outermost):])  # the dim and every dim inside it
    if first == "ep":  # the innermost part of dp_shard: ep x the dims inside dp_shard
        span = span // layout.dp_shard * layout.ep
    if gpus_per_node % span == 0:  # ranks are laid out row-major: a group is `span` consecutive ranks
        return "intra-node", profile.intra_node_gbps
    return "inter-node", profile.inter_node_gbps


def _stage_flops_per_token(args, layers: range, last: bool, ac: str, ac_every: int, seq_len: int, *,
                           ring: bool = False, ring_slowdown: float = 1.0) -> tuple[float, float]:
    """(model FLOPs, executed FLOPs) per token of one pipeline stage: [Note: the time model]. ``ring``:
    cp's attention is the ring, whose forward selective checkpointing recomputes ([Note: the ring's
    overlap]), and whose every attention FLOP costs ``ring_slowdown`` of the gather's (as executed
    FLOPs at the common rate: ``RING_ATTENTION_SLOWDOWN``)."""
    vocab_matmul = args.vocab_size * args.dim
    per_block_weights = (args.matmul_params() - vocab_matmul) / args.n_layers
    per_block_attention = (args.flops_per_token(seq_len) - 6.0 * args.matmul_params()) / args.n_layers
    per_block = 6.0 * per_block_weights + per_block_attention
    model = len(layers) * per_block + (6.0 * vocab_matmul if last else 0.0)
    checkpointed = sum(1 for i in layers if i % ac_every == 0)
    recomputed = {"full": per_block, "selective": per_block_attention if ring else 0.0}.get(ac, 0.0)
    executed = model + checkpointed * recomputed / 3  # a forward is a third of forward + backward
    if ring:  # its attention, the recomputed forward included, at 1 / ring_slowdown of the common rate
        again = checkpointed / 3 if ac in ("full", "selective") else 0.0
        executed += (ring_slowdown - 1.0) * per_block_attention * (len(layers) + again)
    return model, executed


def _stage_comms(r, recipe: Recipe, layout: Layout, args, accum: int, gpn: int,
                 profile: HardwareProfile) -> list[DimComm]:
    """A stage's communication per mesh dim in one step: the bytes of its simulated step, plus
    the pipeline's transfers by arithmetic: each microbatch a stage sends one fp32 [mb, T/(cp tp), D]
    to each neighbour (activations on, gradients back) and receives as many over the other
    direction of the link; an end stage has one neighbour."""
    t = recipe.train
    per_dim: Counter = Counter()
    for (_, dim), nbytes in r.measured.comm_bytes.items():
        per_dim[dim] += nbytes
    if layout.pp > 1:
        hidden = t.micro_batch * (t.seq_len // (layout.cp * layout.tp)) * args.dim * 4
        neighbours = (r.stage > 0) + (r.stage < layout.pp - 1)
        per_dim["pp"] += hidden * accum * neighbours
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
        comms.append(DimComm(dim, _degree(dim, layout), link, gbps, nbytes, nbytes / (gbps * 1e9),
                             dim not in ("tp", "pp", "ep", "cp")))
    return comms


# [Note: the ring's overlap]
# Ring attention ([Note: ring attention] in meshpar/parallel/context_parallel/ring.py) posts each hop of one K/V chunk,
# h = 2 x mb x Hkv/tp x T/cp x Dh x itemsize bytes, before the attention of the chunk in hand, so a hop
# costs only what it takes beyond that step's attention: a forward step is 1/cp of a block's attention
# forward (a = the forward's share of ``flops_per_token``'s attention term, on the rank's T/cp tokens,
# over tp), the same on every rank and step under the balanced split; a backward step does twice that
# work beside two hops (K/V, and the dK/dV accumulator a step behind). The last dK/dV hop of each
# block's backward, back to the chunk's owner, has no compute left beside it. With H hops counted on cp
# in the simulated step (every forward run, recomputation included) over n = blocks x microbatches:
#     exposed = (H - n) x max(0, h/bw - a) + n x h/bw
# Selective checkpointing keeps nothing of the ring's forward (meshpar/parallel/context_parallel/ring.py), so a
# checkpointed block recomputes its attention forward too: a third of the attention term more
# compute per block (``_stage_flops_per_token(ring=True)``), where the gather's fused attention
# output is kept. On a GPU the ring's explicit matmuls take 8x the gather's fused kernels
# (``RING_ATTENTION_SLOWDOWN``): its attention FLOPs, and so each step ``a`` below, count 8x.
# The arithmetic at 131072 tokens, bf16, micro_batch 1, efficiency 0.344 of 989 TFLOP/s, links 450 GB/s
# in a node and 50 GB/s across, per block and microbatch (G: the gather's critical path under selective
# checkpointing, 3 (cp - 1) h/bw; R: the ring's exposed time; C: the block's forward and backward):
#     model, layout          hop h    step a    in a node: G / R      across nodes: G / R     C
#     8B, cp 4 x tp 4         34 MB   12.9 ms   0.67 / 0.075 ms       6.0 / 0.67 ms          187 ms
#     8B, cp 8 x tp 1         67 MB   12.9 ms   3.1 / 0.15 ms         28 / 1.3 ms            373 ms
#     70B, cp 16 x tp 8      4.2 MB   0.81 ms   0.42 / 0.009 ms       3.8 / 0.084 ms          54 ms
#     70B, cp 2 x tp 4        67 MB    103 ms   0.45 / 0.15 ms        4.0 / 1.3 ms           867 ms
# A hop is far shorter than a step's attention (h/bw << a) in every case, so the ring hides all but
# its last dK/dV hop. For the recipes (8B: cp 4 x tp 4, a cp group across two nodes; 70B: cp 16 x
# tp 8, across 16), from their planned all-gather steps (8B 25.57 s with 0.77 s of cp on the critical
# path, 70B 19.51 s with 1.21 s): the ring's exposed hops are 0.09 s and 0.03 s, but with selective
# checkpointing its recomputed attention forward adds 6.6 s and 4.1 s at the gather's rate. Where
# nothing of the attention is kept either way (checkpointing none or full) the ring would save the
# gather's cp time less its last hops: 0.68 s (2.7%) and 1.18 s (6%) across nodes, under 1% inside a
# node (G / 9), if its attention ran as fast as the gather's. It does not: on a GPU it takes 8x
# (``RING_ATTENTION_SLOWDOWN``), and ``meshpar plan`` of llama3_8b_128k with the ring plans 216.7 s
# per step (4,838 tokens/s) against the gather's 25.6 s (41,013), llama3_70b_128k 138.2 s (7,585)
# against 19.5 s (53,760). ``allgather`` stays the default;
# the ring is for a gathered K/V that does not fit (it holds two chunks, not the sequence).
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
    return max(0.0, comm.seconds - exposed)


def step_time(recipe: Recipe, layout: Layout, args, profile: HardwareProfile, ranks, accum: int, *,
              gpus_per_node: int | None, efficiency: float | None, links: LinkDefaults) -> StepTime:
    """The step of the slowest pipeline stage; ``ranks`` are the planner's RankPlans (one per stage).
    ``efficiency`` None: ``default_efficiency`` for the recipe's compile setting and world size."""
    t, p = recipe.train, recipe.parallel
    if efficiency is None:
        efficiency = default_efficiency(p.compile, layout.world_size)
    gpn = gpus_per_node or profile.devices_per_node or links.gpus_per_node
    peak = profile.peak_flops(getattr(torch, p.param_dtype))
    tokens = t.global_batch * t.seq_len / (layout.dp * layout.cp)  # tokens per step on one rank (all its tp ranks)
    ring = p.cp_attention == "ring" and layout.cp > 1
    slowdown = RING_ATTENTION_SLOWDOWN.get(profile.device, 1.0) if ring else 1.0
    stages = []  # (compute s, critical comm s, DimComms) per stage; the step is set by the largest sum
    for r in ranks:
        _, executed = _stage_flops_per_token(args, r.layers, r.stage == layout.pp - 1, p.activation_checkpoint,
                                             p.ac_every, t.seq_len, ring=ring, ring_slowdown=slowdown)
        compute = executed * tokens / layout.tp / (peak * efficiency)
        comms = _stage_comms(r, recipe, layout, args, accum, gpn, profile)
        if ring:
            comms = [dataclasses.replace(c, hidden_s=_ring_hidden(c, recipe, layout, args, len(r.layers), accum,
                                                                  peak * efficiency / slowdown)) if c.dim == "cp" else c
                     for c in comms]
        # the optimizer step: every local fp32 parameter, memory-bound ([Note: the efficiency constants])
        optimizer = r.param_bytes / 4 * OPTIMIZER_BYTES_PER_PARAM / (profile.memory_bandwidth_gbps * 1e9)
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
