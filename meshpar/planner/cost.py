"""Step time from FLOPs and bytes: compute against the profile's peak, collectives against its links.

    t = step_time(recipe, layout, args, profile, ranks, accum, gpus_per_node=8, efficiency=0.34,
                  links=LinkDefaults())
    t.step_s, t.tokens_per_s, t.mfu, t.comm   # per mesh dim: bytes, link, seconds

[Note: the time model]
- Compute: the model FLOPs of each pipeline stage's blocks (``flops_per_token``'s 6 per
  weight plus attention, split per block; the output projection on the last stage), plus
  one more forward of every checkpointed block under ``activation_checkpoint = "full"``
  ("selective" keeps matmul and attention outputs, so it recomputes no matmul FLOPs),
  on the stage's tokens divided over tp, at ``efficiency`` x the profile's dense peak for
  the compute dtype.
- ``efficiency`` (default 0.34) stands for everything a step does besides ideal matmuls.
  It is calibrated on a published measurement, not on this repository: no GPU was
  available. torchtitan's Llama 3.1 8B with FSDP on 8 H100s (its docs/performance.md:
  5,762 tokens/s per GPU at local batch 2, sequence 8192, selective checkpointing, eager)
  is 0.338 of the 17,039 this model predicts at efficiency 1. Out of sample, the same
  figure predicts torchtitan's Llama 3.1 405B at FSDP 16 x TP 8 on 128 H100s (local batch
  2, full checkpointing: 109 tokens/s per GPU published) at 86, 21% low; part of that is
  meshpar's own tensor-parallel backward, which all-reduces where torchtitan's
  reduce-scatters (twice the bytes), part larger matmuls running closer to peak.
- Tensor parallel and pipeline transfers sit on the critical path of every microbatch
  (sequence-parallel all-gathers and reduce-scatters run between the matmuls that need
  them; a stage waits for its input); data-parallel collectives (FSDP all-gathers and
  reduce-scatters, replica all-reduces) overlap with compute through prefetching, except
  the first unit's all-gather and the last unit's reduce-scatter of a step.
- The pipeline runs ``n + p - 1`` microbatch slots for n microbatches on p stages (1F1B
  and GPipe), so its bubble is ``(p - 1) / (n + p - 1)`` of the step.
- Links: a mesh dim's groups stay inside a node when the dim's degree times the degrees
  of every dim inside it is at most the GPUs per node (tp innermost, so it is the first to
  stay inside); otherwise they cross nodes and run at the inter-node bandwidth, per GPU
  per direction. Bytes are ring volumes per rank ([Note: bytes counted] in meshpar/comm.py),
  counted in the simulated step, at the full link bandwidth, which collectives do not
  reach: communication times are lower bounds.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import torch

from meshpar.hardware import HardwareProfile
from meshpar.mesh import DIMS, Layout
from meshpar.recipe import Recipe


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


@dataclass(frozen=True)
class StepTime:
    model_flops_per_token: float
    compute_s: float  # the busiest stage's matmul time for the step, recomputation included
    comm: list[DimComm]
    bubble: float
    step_s: float
    tokens_per_s: float
    mfu: float
    efficiency: float
    gpus_per_node: int


def _link(dim: str, layout: Layout, gpus_per_node: int, profile: HardwareProfile) -> tuple[str, float]:
    degrees = dict(zip(DIMS, layout.degrees, strict=True))
    outermost = "dp_replicate" if dim == "dp" else dim  # dp: dp_replicate x dp_shard flattened
    span = math.prod(degrees[d] for d in DIMS[DIMS.index(outermost):])  # the dim and every dim inside it
    if span <= gpus_per_node:
        return "intra-node", profile.intra_node_gbps
    return "inter-node", profile.inter_node_gbps


def _stage_flops_per_token(args, layers: range, last: bool, ac: str, ac_every: int, seq_len: int) -> tuple[float,
                                                                                                          float]:
    """(model FLOPs, executed FLOPs) per token of one pipeline stage: [Note: the time model]."""
    vocab_matmul = args.vocab_size * args.dim
    per_block_weights = (args.matmul_params() - vocab_matmul) / args.n_layers
    per_block_attention = (args.flops_per_token(seq_len) - 6.0 * args.matmul_params()) / args.n_layers
    per_block = 6.0 * per_block_weights + per_block_attention
    model = len(layers) * per_block + (6.0 * vocab_matmul if last else 0.0)
    recomputed = sum(1 for i in layers if i % ac_every == 0) if ac == "full" else 0
    return model, model + recomputed * per_block / 3  # a forward is a third of forward + backward


def step_time(recipe: Recipe, layout: Layout, args, profile: HardwareProfile, ranks, accum: int, *,
              gpus_per_node: int | None, efficiency: float, links: LinkDefaults) -> StepTime:
    """The step of the slowest pipeline stage; ``ranks`` are the planner's RankPlans (one per stage)."""
    t, p = recipe.train, recipe.parallel
    gpn = gpus_per_node or profile.devices_per_node or links.gpus_per_node
    peak = profile.peak_flops(getattr(torch, p.param_dtype))
    tokens_dp = t.global_batch * t.seq_len / layout.dp  # tokens per step on one data-parallel rank
    slowest, worst = None, -1.0
    for r in ranks:
        _, executed = _stage_flops_per_token(args, r.layers, r.stage == layout.pp - 1, p.activation_checkpoint,
                                             p.ac_every, t.seq_len)
        seconds = executed * tokens_dp / layout.tp / (peak * efficiency)
        if seconds > worst:
            slowest, worst = r, seconds
    compute = worst
    # per mesh dim: bytes per step from the slowest rank's simulated step, pipeline p2p by arithmetic
    per_dim: Counter = Counter()
    for (_, dim), nbytes in slowest.measured.comm_bytes.items():
        per_dim[dim] += nbytes
    if layout.pp > 1:  # each microbatch: activations to the next stage, gradients back (fp32 [mb, T/tp, D])
        hidden = t.micro_batch * (t.seq_len // layout.tp) * args.dim * 4
        per_dim["pp"] += 2 * hidden * accum
    comms, critical, overlappable = [], 0.0, 0.0
    for dim, nbytes in sorted(per_dim.items(), key=lambda kv: DIMS.index(kv[0]) if kv[0] in DIMS else -1):
        if dim not in DIMS and dim != "dp":
            continue
        link, gbps = _link(dim, layout, gpn, profile)
        seconds = nbytes / (gbps * 1e9)
        overlapped = dim not in ("tp", "pp")
        degree = layout.dp if dim == "dp" else getattr(layout, dim)
        comms.append(DimComm(dim, degree, link, gbps, nbytes, seconds, overlapped))
        if overlapped:
            overlappable += seconds
        else:
            critical += seconds
    slots = accum + layout.pp - 1
    pipeline = (compute + critical) / accum * slots
    # the first all-gather and the last reduce-scatter of a step cannot hide behind compute
    edge = 0.0
    if slowest.units and layout.dp_shard > 1:
        _, gbps = _link("dp_shard", layout, gpn, profile)
        unit = max(slowest.units, key=lambda u: u.gathered_bytes)
        edge = (unit.gathered_bytes + unit.reduce_bytes) * (layout.dp_shard - 1) / layout.dp_shard / (gbps * 1e9)
    step = pipeline + max(0.0, overlappable - compute) + edge
    tokens_per_s = t.global_batch * t.seq_len / step
    model_flops = args.flops_per_token(t.seq_len)
    mfu = model_flops * tokens_per_s / (layout.world_size * peak)
    return StepTime(model_flops, compute, comms, (layout.pp - 1) / slots, step, tokens_per_s, mfu, efficiency, gpn)
