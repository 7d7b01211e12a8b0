"""One cp rank's attention at a recipe's shape, timed on one device: the all-gather's fused chunks
against the ring's explicit matmuls, beside one attention over the whole sequence, and against what
the planner charges for it.

    python -m tests.benchmarks.bench_cp_attention [--cases llama3_8b_128k,llama3_70b_128k]
        [--device cuda|cpu] [--dtype bfloat16] [--score-elements 4194304,67108864] [--repeats 3]
        [--hardware h200] [--json runs/cp_attention.json]

A case is a recipe: its model's query and kv heads divided by ``parallel.tp`` (what one tensor-
parallel rank holds), ``parallel.cp``, ``train.micro_batch`` sequences of ``train.seq_len`` tokens.
From one random q, k, v of the whole sequence (float64 on the CPU, then the case's dtype on the
device), cp rank 0 of the balanced split ([Note: balanced sequence split]; every rank does the same
attention work under it) runs, forward and backward:

- ``gather``: what ``context_parallel._attend`` computes once K and V are gathered, its two query
  chunks over the keys up to each chunk's end (``chunk_attention`` in gather.py: the flash kernel with
  ``causal_lower_right`` on CUDA; a built mask elsewhere);
- ``gather-repeat``: the same with K and V first repeated to the query heads (a GQA kernel's
  alternative: more bytes read, perhaps a faster kernel);
- ``gather-flex`` (``--flex`` on CUDA: flex_attention's call has no backward on the CPU): the gather on
  flex as training runs it with ``Kernels(flex=True)`` (meshpar/parallel/context_parallel/flex.py):
  both chunks in one compiled ``flex_attention`` call under the block mask of the rank's positions;
- ``ring-flex`` (``--flex``): the ring on flex ([Note: the ring on flex], ring_flex.py), one
  compiled flex call per ring step (flex's eager reference on the CPU) and each step's forward
  again in backward, its hops replaced as the ring's below;
- ``ring@E``: ``ring_attention``'s forward and backward with blocks of at most E scores (one
  block of queries against one key chunk; ``ring_attention.score_elements``), its hops replaced by
  local copies of the K/V chunk the ring would receive (so the forward and dQ are exact; the dK/dV
  accumulators from other ranks arrive as zeros): the compute alone, what a hop hides behind
  ([Note: the ring's overlap]);
- ``whole``: one causal ``scaled_dot_product_attention`` over all T tokens on this one device (cp
  1), for the kernel's rate on the same shapes; its rank-0 rows are the values' reference.

Per row: the median forward + backward time (after one warmup), its rate in causal model FLOPs
(3 x the forward's 4 B H Dh per (query, key) pair, backward twice forward, as MFU counts; flash
also recomputes the scores, so it executes 3.5x), that rate over the profile's dense peak, the
planner's charge for the same work (``12 H Dh T`` per token from ``flops_per_token``, no causal
halving, at ``planner.cost.default_efficiency`` of the peak; [Note: the time model]) and
measured / planned, the peak memory it added (CUDA's allocator; none on CPU), and the largest
difference of its output and dQ from the ``whole`` rows relative to their largest entry, and the
attention kernels it ran (the profiler's aten op names: flash, efficient, cudnn, cpu-flash, math).

``--smoke`` (tests/test_bench_cp_attention.py): recipes/llama_debug_cp.toml on the CPU in float64.
Results (``scripts/gpu_checks.sh cp``): docs/performance.md#context-parallel-attention-on-a-gpu;
what they set: [Note: the ring on a GPU] in meshpar/parallel/context_parallel/ring.py.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F

from meshpar.config.hardware import load_profile
from meshpar.config.recipe import load
from meshpar.models import get_family
from meshpar.models.attention import Kernels
from meshpar.parallel.context_parallel import flex as flexlib
from meshpar.parallel.context_parallel import gather as gatherlib
from meshpar.parallel.context_parallel import layout as cplib
from meshpar.parallel.context_parallel import ring as ringlib
from meshpar.parallel.context_parallel import ring_flex
from meshpar.planner.cost import default_efficiency
from tests.benchmarks.probes import median_seconds
from tests.helpers import CpRank

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


class _Hops:
    """``comm.send_recv`` for cp rank ``rank`` alone: the n-th K/V hop of a pass delivers the chunk of
    rank (rank - 1 - n) mod cp, as the ring's neighbour would; a dK/dV hop (tag 1) delivers zeros."""

    def __init__(self, kv_of_rank: list[torch.Tensor], rank: int) -> None:
        self.kv, self.rank, self.n = kv_of_rank, rank, 0

    def __call__(self, send, recv, group, *, to, frm, dim, tag=0):
        cp = len(self.kv)
        if tag:
            recv.zero_()
        else:
            recv.copy_(self.kv[(self.rank - 1 - self.n % (cp - 1)) % cp])
            self.n += 1
        return mock.Mock()  # wait() does nothing: the copy has landed


def _kernels(fn) -> str:
    """The scaled-dot-product kernels one call of ``fn`` runs, by the profiler's op names."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    names = {e.key for e in prof.key_averages()}
    kinds = {"flash": ("_scaled_dot_product_flash_attention", "_flash_attention_forward"),
             "efficient": ("_scaled_dot_product_efficient_attention", "_efficient_attention_forward"),
             "cudnn": ("_scaled_dot_product_cudnn_attention",),
             "cpu-flash": ("_scaled_dot_product_flash_attention_for_cpu",),
             "math": ("_scaled_dot_product_attention_math",), "flex": ("flex_attention",)}
    found = [kind for kind, ops in kinds.items()
             if any(f"aten::{op}" in names or (kind == "flex" and any(op in n for n in names)) for op in ops)]
    return "+".join(found) or "-"


def _peak_added(fn, device: str) -> float | None:
    """MiB the allocator's peak rose above what was allocated before one call (CUDA only)."""
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def shapes(case: str) -> dict:
    """The per-rank attention shape of recipe ``case`` (a name in recipes/ or a path)."""
    path = Path(case) if case.endswith(".toml") else RECIPES / f"{case}.toml"
    recipe = load(path)
    args = get_family(recipe.model.family).model_args(recipe.model)
    p, t = recipe.parallel, recipe.train
    return {"case": path.stem, "b": t.micro_batch, "h": args.n_heads // p.tp, "hkv": args.n_kv_heads // p.tp,
            "t": t.seq_len, "dh": args.resolved_head_dim, "cp": p.cp, "compiled": p.compile,
            "world": p.pp * p.dp_replicate * p.dp_shard * p.cp * p.tp,
            # one block's attention FLOPs per token on a tp rank, as the planner counts them (cost.py)
            "attention_flops": (args.flops_per_token(t.seq_len) - 6.0 * args.matmul_params()) / args.n_layers / p.tp}


def measure(case: str, device: str, dtype: torch.dtype, score_elements: list[int], repeats: int,
            hardware: str, flex: bool = False, warmup: bool = True) -> list[dict]:
    s = shapes(case)
    b, h, hkv, t, dh, cp = (s[k] for k in ("b", "h", "hkv", "t", "dh", "cp"))
    local = t // cp
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, n, t, dh, generator=gen, dtype=torch.float64).to(device, dtype) for n in (h, hkv, hkv))
    grad = torch.randn(b, h, local, dh, generator=gen, dtype=torch.float64).to(device, dtype)
    idx = [cplib.sequence_indices(t, cp, r).to(device) for r in range(cp)]
    layout = cplib.SequenceLayout(CpRank(cp, 0), balanced=True)
    chunks = layout.query_chunks(local)
    pairs = sum(n * (keys - n) + n * (n + 1) // 2 for _, n, keys in chunks)
    model_flops = 3 * 4 * b * h * dh * pairs
    profile = load_profile(hardware, device)
    peak = profile.peak_flops(dtype if dtype != torch.float64 else torch.float32)
    planned_s = s["attention_flops"] * b * local / (peak * default_efficiency(s["compiled"], s["world"]))

    ql = q[:, :, idx[0]].detach().requires_grad_()
    kg, vg = k.detach().requires_grad_(), v.detach().requires_grad_()
    kv_of_rank = [torch.stack([k[:, :, i], v[:, :, i]]).flatten(1, 2) for i in idx]
    kl, vl = (x[:, :, idx[0]].detach().requires_grad_() for x in (k, v))
    qw = q.detach().requires_grad_()
    grad_whole = torch.zeros(b, h, t, dh, dtype=dtype, device=device)
    grad_whole[:, :, idx[0]] = grad
    got = {}

    def whole():
        qw.grad = None
        out = F.scaled_dot_product_attention(qw, k, v, is_causal=True, enable_gqa=True)
        out.backward(grad_whole)
        got["whole"] = (out[:, :, idx[0]].detach(), qw.grad[:, :, idx[0]])

    def gather():
        ql.grad = kg.grad = vg.grad = None
        out = torch.cat([gatherlib.chunk_attention(ql[:, :, first:first + n], kg[:, :, :keys], vg[:, :, :keys])
                         for first, n, keys in chunks], dim=2)
        out.backward(grad)
        got["gather"] = (out.detach(), ql.grad)

    def gather_repeat():
        ql.grad = kg.grad = vg.grad = None
        kr, vr = (x.repeat_interleave(h // hkv, dim=1) for x in (kg, vg))
        out = torch.cat([gatherlib.chunk_attention(ql[:, :, first:first + n], kr[:, :, :keys], vr[:, :, :keys])
                         for first, n, keys in chunks], dim=2)
        out.backward(grad)
        got["gather-repeat"] = (out.detach(), ql.grad)

    def gather_flex():
        mask = flexlib.block_mask(idx[0], t)  # meshpar's path: [Note: cp attention on flex_attention]

        def run():
            ql.grad = kg.grad = vg.grad = None
            out = flexlib.attend(ql, kg, vg, mask)
            out.backward(grad)
            got["gather-flex"] = (out.detach(), ql.grad)
        return run

    def rank_zero(kernels: Kernels) -> ringlib.Ring:
        ring_ = ringlib.Ring.__new__(ringlib.Ring)
        ring_.group, ring_.cp, ring_.rank, ring_.balanced = None, cp, 0, True
        ring_.next, ring_.prev = 1 % cp, (cp - 1) % cp
        ring_.kernels = kernels
        return ring_

    def ring_flex_run():
        ring_ = rank_zero(Kernels(flex=True))
        masks = ring_flex.step_masks(ring_, torch.stack(idx), None)

        def run():
            ql.grad = kl.grad = vl.grad = None
            with mock.patch.object(ringlib.comm, "send_recv", _Hops([x.unflatten(1, (b, hkv)) for x in kv_of_rank], 0)):
                out = ring_flex.flex_ring_attention(ql, kl, vl, ring_, masks)
                out.backward(grad)
            got["ring-flex"] = (out.detach(), ql.grad)
        return run

    def ring(elements: int):
        ring_ = rank_zero(Kernels(ring_scores=elements))

        def run():
            ql.grad = kl.grad = vl.grad = None
            with mock.patch.object(ringlib.comm, "send_recv", _Hops(kv_of_rank, 0)):
                out = ringlib._RingAttention.apply(ql, kl, vl, None, ring_)
                out.backward(grad)
            got[f"ring@{elements}"] = (out.detach(), ql.grad)
        return run

    runs = {"whole": whole, "gather": gather, "gather-repeat": gather_repeat}
    if flex and device == "cuda":  # the gather's flex call has no CPU backward
        runs["gather-flex"] = gather_flex()
    if flex:  # on CPU, flex's eager reference ([Note: the ring on flex])
        runs["ring-flex"] = ring_flex_run()
    runs |= {f"ring@{e}": ring(e) for e in score_elements}
    rows = []
    for name, fn in runs.items():
        ms = 1e3 * median_seconds(fn, repeats, device, warmup)
        mib = _peak_added(fn, device)
        # off CUDA the ring on flex runs flex's eager reference (no kernel to name; its slowest row)
        kernel = "flex-reference" if name == "ring-flex" and device != "cuda" else _kernels(fn)
        flops = model_flops * (cp if name == "whole" else 1)
        planned_ms = 1e3 * planned_s * (cp if name == "whole" else 1)
        rows.append({**s, "attention": name, "ms": ms, "tflops": flops / ms / 1e9, "of_peak": flops / ms * 1e3 / peak,
                     "planned_ms": planned_ms, "measured_over_planned": ms / planned_ms, "peak_mib": mib,
                     "kernels": kernel})
        if device == "cuda":
            torch.cuda.empty_cache()
    ref = got["whole"]
    for row in rows:
        out, dq = got[row["attention"]]
        row["out_diff"], row["dq_diff"] = (((a.double() - r.double()).abs().max() / r.double().abs().max()).item()
                                           for a, r in zip((out, dq), ref, strict=True))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="llama3_8b_128k,llama3_70b_128k", help="recipe names or paths")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--score-elements", default=f"{ringlib.SCORE_ELEMENTS},{ringlib.SCORE_ELEMENTS_CUDA}")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hardware", default="auto", help="profile for the peak (auto: this device's)")
    ap.add_argument("--flex", action="store_true", help="also the ring on flex_attention, and on CUDA the gather")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--smoke", action="store_true",
                    help="recipes/llama_debug_cp.toml on the CPU in float64, with --flex, no warmup call "
                         "(a check of the rows, not a timing)")
    a = ap.parse_args()
    if a.smoke:
        a.cases, a.device, a.dtype, a.repeats, a.score_elements = "llama_debug_cp", "cpu", "float64", 1, "65536"
        a.flex = True  # the ring on flex, by its eager reference
    dtype = getattr(torch, a.dtype)
    elements = [int(e) for e in a.score_elements.split(",")]
    print(f"one cp rank's attention, forward + backward, {a.dtype} on {a.device}")
    print(f"{'case':16} {'attention':14} {'B H/Hkv T cp':>22} {'ms':>9} {'TFLOP/s':>8} {'of peak':>7} "
          f"{'planned ms':>10} {'meas/plan':>9} {'peak MiB':>9} {'out diff':>9} {'dQ diff':>9}")
    rows = []
    for case in a.cases.split(","):
        for r in measure(case, a.device, dtype, elements, a.repeats, a.hardware, a.flex, warmup=not a.smoke):
            rows.append(r)
            shape = f"{r['b']} {r['h']}/{r['hkv']} {r['t']} {r['cp'] if r['attention'] != 'whole' else 1}"
            mib = "-" if r["peak_mib"] is None else f"{r['peak_mib']:.0f}"
            print(f"{r['case']:16} {r['attention']:14} {shape:>22} {r['ms']:9.2f} {r['tflops']:8.1f} "
                  f"{r['of_peak']:7.3f} {r['planned_ms']:10.2f} {r['measured_over_planned']:9.2f} {mib:>9} "
                  f"{r['out_diff']:9.1e} {r['dq_diff']:9.1e}  {r['kernels']}", flush=True)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
