"""A plan as text: the parameter table, memory per rank, the step time, and the verdict.

``verdict`` says whether every rank fits and, when one does not, what to change, ordered by
the part of the peak the change shrinks most.
"""

from __future__ import annotations

from meshpar.models import get_family
from meshpar.planner.cost import RING_FLEX_SLOWDOWN, float8_rate, host_share, ring_slowdown
from meshpar.planner.dry_run import Plan, RankPlan

GIB = 2**30


def _g(n: float) -> str:
    return f"{n / GIB:,.2f}"  # GiB


def _shape(s: tuple[int, ...]) -> str:
    return "[" + ", ".join(f"{d}" for d in s) + "]"


def header(plan: Plan) -> str:
    r, layout, t, p = plan.recipe, plan.layout, plan.recipe.train, plan.recipe.parallel
    dtype = p.param_dtype
    ac = p.activation_checkpoint + (f" every {p.ac_every}" if p.ac_every > 1 and p.activation_checkpoint != "none"
                                    else "")
    pp = f" | {p.pp_schedule}" if layout.pp > 1 else ""
    return (f"meshpar plan: {r.model.family} {r.model.size} | {layout.world_size} x {plan.profile.name} "
            f"({plan.time.gpus_per_node} per node) | layout {layout}{pp}\n"
            f"  batch {t.global_batch} x {t.seq_len} tokens, micro_batch {t.micro_batch}, {plan.accum} "
            f"microbatch{'es' if plan.accum > 1 else ''} per step | compute {dtype}, reduce {p.reduce_dtype}\n"
            f"  activation checkpointing {ac} | reshard_after_forward {str(p.reshard_after_forward).lower()} | "
            f"{plan.n_params:,} parameters{_active(plan)} | "
            f"{_flops(plan.time.model_flops_per_token)} per token")


def _active(plan: Plan) -> str:
    """", 3,353,032,704 active" for a mixture of experts (total less the experts a token skips)."""
    moe = get_family(plan.recipe.model.family).moe
    return f", {plan.n_params - moe.inactive_params(plan.args):,} active" if moe is not None else ""


def params_table(r: RankPlan) -> str:
    c = " ".join(f"{d} {i}" for d, i in r.coordinate.items())
    out = [f"parameters of rank {r.rank} ({c}; stage {r.stage}, blocks {r.layers.start}..{r.layers.stop - 1}):",
           f"  {'name':<44} {'x':>4} {'global shape':<16} {'placements':<30} {'local shape':<14} {'MiB each':>9}"]
    for row in r.rows:
        out.append(f"  {row.name:<44} {row.count:>4} {_shape(row.global_shape):<16} {row.placements:<30} "
                   f"{_shape(row.local_shape):<14} {row.local_bytes / 2**20:>9.2f}")
    return "\n".join(out)


def memory_table(plan: Plan) -> str:
    """Memory per rank, one column per pipeline stage; the rows down to the peak add up to it."""
    ranks = plan.ranks
    unit, scale = ("GiB", GIB) if max(r.peak_bytes for r in ranks) >= GIB else ("MiB", 2**20)
    width = max(12, *(len(f"{r.others_at_peak} x {r.measured.activation_bytes / scale:,.2f}") + 2 for r in ranks))

    def b(n: float) -> str:
        return f"{n / scale:,.2f}"

    lines = []

    def row(label: str, values) -> None:
        lines.append(f"  {label:<48}" + "".join(f"{v:>{width}}" for v in values))

    row(f"memory per rank, {unit}", [f"stage {r.stage}" if plan.layout.pp > 1 else "every rank" for r in ranks])
    row("  (the rank planned)", [f"rank {r.rank}" for r in ranks])
    dtype = ranks[0].rows[0].dtype if ranks[0].rows else "float32"
    lines.append("  exact, from the local shapes:")
    row(f"  parameters (sharded, {dtype})", [b(r.param_bytes) for r in ranks])
    row(f"  gradients (sharded, {dtype})", [b(r.grad_bytes) for r in ranks])
    row("  AdamW state (2 moments + step)", [b(r.optim_bytes) for r in ranks])
    row("  largest FSDP unit, gathered", [b(max((u.gathered_bytes for u in r.units), default=0)) for r in ranks])
    lines.append("  at the step's peak (a phase of the simulated step):")
    row("  phase (F/B: forward/backward of microbatch i)", [r.peak_phase for r in ranks])
    at = [r.measured.phases[r.peak_phase].at_peak for r in ranks]
    row("  parameters, sharded and gathered", [b(a["Parameter"]) for a in at])
    row("  gradients", [b(a["Gradient"]) for a in at])
    row("  communication buffers", [b(a["Communication"]) for a in at])
    row("  activations", [b(a["Activation"]) for a in at])
    row("  temporaries (loss, backward)", [b(a["Temp"] + a["Other"]) for a in at])
    row("  buffers (RoPE tables)", [b(a["Buffer"]) for a in at])
    row("  other microbatches in flight x each", [f"{r.others_at_peak} x {b(r.measured.activation_bytes)}"
                                                  if r.others_at_peak else "0" for r in ranks])
    row("  pipeline receive buffers", [b(r.p2p_bytes) for r in ranks])
    row("  AdamW state", [b(r.optim_bytes) for r in ranks])
    row("peak", [b(r.peak_bytes) for r in ranks])
    row(f"free of {plan.profile.memory_gb:g} GB ({plan.usable_bytes / scale:,.2f} {unit})",
        [b(plan.usable_bytes - r.peak_bytes) for r in ranks])
    return "\n".join(lines)


def _flops(n: float) -> str:
    """FLOPs in GFLOP to one decimal, or MFLOP where that would print 0.0 (the debug models)."""
    return f"{n / 1e9:,.1f} GFLOP" if n >= 0.1e9 else f"{n / 1e6:,.1f} MFLOP"


def time_table(plan: Plan) -> str:
    t = plan.time
    peak = plan.profile.peak_tflops.get(plan.recipe.parallel.param_dtype, 0)
    share = host_share(plan.profile, plan.layout.world_size, t.gpus_per_node)
    each = f", shared by the {share} ranks on a host" if share > 1 else ""
    w = max([14, *(len(c.dim) for c in t.comm)])  # flattened dims' names: [Note: flattened dims] in cost.py
    lines = ["step time (the slowest stage):",
             f"  {'compute':<{w}} {t.compute_s:8.3f} s   at {t.efficiency:.2f} x {peak:g} TFLOP/s "
             f"{plan.recipe.parallel.param_dtype}{each} (recomputation included)",
             f"  {'optimizer':<{w}} {t.optimizer_s:8.3f} s   clipping + AdamW, memory-bound at "
             f"{plan.profile.memory_bandwidth_gbps:g} GB/s{each}"]
    slowdown = ring_slowdown(plan.recipe, plan.layout.cp, plan.profile.device)
    if slowdown == RING_FLEX_SLOWDOWN:
        lines.insert(2, f"  {'':<{w}} of which cp's ring attention on flex at {slowdown:.2f}x the all-gather's "
                        f"time (predicted: each ring step's forward runs again in backward; [Note: the ring on flex])")
    elif slowdown > 1:
        lines.insert(2, f"  {'':<{w}} of which cp's ring attention at {slowdown:g}x the all-gather's time on "
                        f"this device (measured: [Note: the ring on a GPU]); parallel.cp_attention = \"allgather\" "
                        f"is faster")
    for c in t.comm:
        how = "overlapped with compute" if c.overlapped else "on the critical path"
        if c.hidden_s and not c.overlapped:  # cp's ring: its hops run beside each ring step's attention
            how = f"{c.seconds - c.hidden_s:.3f} s of it on the critical path, the rest beside the attention"
        latency = plan.profile.latency_s
        calls = f" + {c.calls:,} collectives x {latency * 1e6:g} us" if latency else ""
        lines.append(f"  {c.dim:<{w}} {c.seconds:8.3f} s   {c.bytes_per_step / 1e9:9.2f} GB per step over {c.degree} "
                     f"ranks, {c.link} {c.gbps:g} GB/s{calls}, {how}")
    if plan.layout.pp > 1:
        lines.append(f"  pipeline bubble {t.bubble:.3f} = (p - 1) / (m + p - 1) with p = {plan.layout.pp}, "
                     f"m = {plan.accum}")
    world = plan.layout.world_size
    lines.append(f"  step {t.step_s:.3f} s | {t.tokens_per_s:,.0f} tokens/s ({t.tokens_per_s / world:,.0f} per GPU) | "
                 f"MFU {100 * t.mfu:.1f}%")
    float8 = plan.recipe.model.float8
    if float8 != "none":  # [Note: float8 in the time model]
        gathers = "FSDP gathers the converted weights and tp the activations in float8" if float8 == "tensorwise" \
            else "all-gathers in the parameter dtype"
        rate = float8_rate(plan.profile, float8) / 1e12
        lines.insert(2, f"  {'':<{w}} of which the blocks' linear layers (model.float8 = {float8!r}) at "
                        f"{t.efficiency:.2f} x {rate:g} TFLOP/s (float8 peak x FLOAT8_MATMUL, planner/cost.py); "
                        f"{gathers}; memory as without float8")
    return "\n".join(lines)


def report(plan: Plan, *, all_params: bool = False) -> str:
    shown = plan.ranks if all_params else [r for r in plan.ranks if r.stage in (0, plan.layout.pp - 1)]
    parts = [header(plan), *(params_table(r) for r in shown), memory_table(plan), time_table(plan)]
    return "\n\n".join(parts)


def verdict(plan: Plan) -> tuple[bool, str]:
    """(fits, one line): the headroom, or what to change when some rank does not fit."""
    usable = plan.usable_bytes
    worst = max(plan.ranks, key=lambda r: r.peak_bytes)
    if worst.peak_bytes <= usable:
        return True, (f"fits: peak {_g(worst.peak_bytes)} GiB on rank {worst.rank} (stage {worst.stage}) of "
                      f"{_g(usable)} GiB; {plan.time.tokens_per_s:,.0f} tokens/s, MFU {100 * plan.time.mfu:.1f}%")
    return False, (f"does not fit: peak {_g(worst.peak_bytes)} GiB on rank {worst.rank} (stage {worst.stage}) > "
                   f"{_g(usable)} GiB on {plan.profile.name}; {advice(plan, worst)}")


def advice(plan: Plan, r: RankPlan) -> str:
    """What to change, the largest part of the peak it shrinks first (at most three)."""
    p, t, layout = plan.recipe.parallel, plan.recipe.train, plan.layout
    at = r.measured.phases[r.peak_phase].at_peak
    in_flight = r.others_at_peak * r.measured.activation_bytes
    activations = at["Activation"] + at["Temp"] + at["Other"] + in_flight
    states = r.param_bytes + r.grad_bytes + r.optim_bytes
    gathered = max(0, at["Parameter"] - r.param_bytes) + at["Gradient"]
    fixes: list[tuple[int, str]] = []
    if p.activation_checkpoint != "full":
        fixes.append((activations, 'set parallel.activation_checkpoint = "full"'))
    elif p.ac_every > 1:
        fixes.append((activations, f"lower parallel.ac_every (now {p.ac_every}) to 1"))
    if t.micro_batch > 1:
        fixes.append((activations, f"lower train.micro_batch (now {t.micro_batch}; activations scale with it)"))
    if in_flight:
        fixes.append((in_flight, f"stage {r.stage} holds {r.others_at_peak + 1} microbatches at once under "
                      f"{p.pp_schedule}: fewer pipeline stages (parallel.pp, now {layout.pp}) hold fewer"))
    if layout.tp < plan.time.gpus_per_node:  # past a node, tp's collectives would cross the network
        fixes.append((activations + gathered, f"raise parallel.tp (now {layout.tp}; divides activations and "
                      f"gathered parameters, best within a node of {plan.time.gpus_per_node})"))
    if "cp" in get_family(plan.recipe.model.family).mesh_dims and t.seq_len % (4 * layout.cp * layout.tp) == 0:
        fixes.append((activations, f"raise parallel.cp (now {layout.cp}; each rank holds train.seq_len / cp tokens of "
                      f"every sequence: divides activations)"))
    fixes.append((states, f"raise parallel.dp_shard (now {layout.dp_shard}; shards parameters, gradients and AdamW "
                  f"state, {_g(states)} GiB here) or parallel.pp"))
    if plan.accum > 1 and layout.dp_shard > 1 and p.grad_reduce == "step" and at["Gradient"] > r.grad_bytes:
        fixes.append((at["Gradient"] - r.grad_bytes, f"accumulating {plan.accum} microbatches keeps every unit's "
                      f"unsharded gradients ({_g(at['Gradient'])} GiB): set parallel.grad_reduce = \"microbatch\" "
                      f"(reduce-scatter after each microbatch; gradients stay sharded, {_g(r.grad_bytes)} GiB)"))
    fixes.sort(key=lambda f: -f[0])
    return "to fit: " + "; or ".join(text for _, text in fixes[:3])
