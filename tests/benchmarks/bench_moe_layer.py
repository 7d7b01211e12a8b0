"""One DeepSeek-V3 sparse layer's training step, its routed experts on the grouped kernel and on the
loop, side by side.

    python -m tests.benchmarks.bench_moe_layer [--sizes debug,16b] [--device cuda|cpu]
                                               [--dtype bfloat16] [--batch 1] [--seq 4096]
                                               [--repeats 10] [--hardware auto] [--json F]

Per size, one ``DeepSeekBlock`` of the published shapes (``meshpar/models/deepseek/args.py``; the
first sparse layer: MLA, the router with its groups, the shared and the routed experts) on one
device, random weights (std 0.02, norms 1) and inputs. A step is the block's forward and backward
over batch x seq tokens, with the load-balancing loss added as a real step adds it; routing is what
the random router chooses (not the planner's balanced routing: the busiest expert's share is
printed). Each kernel (``Experts.kernel``: "grouped" is ``F.grouped_mm``, one launch for all
experts; "loop" one matmul per expert) takes the median of ``--repeats`` steps after a warmup,
CUDA-synchronized. It prints ms per step, loop / grouped (> 1: the grouped kernel is faster),
tokens/s and TFLOP/s at the planner's FLOPs per token of a sparse layer (``layer_flops_per_token``),
with ``--hardware`` the share of that profile's peak, and the two kernels' largest relative
difference in the output and the input gradient (bf16 on a GPU: rounding of the same products).

Where the grouped kernel cannot run (``grouped_mm_supported``), the row says so and only the loop
is timed. The 16B layer is about 0.6 B parameters: on a GPU it takes a few GB, on a CPU minutes.
``tests/test_bench_moe_layer.py`` runs the debug size on the CPU; the GPU run is
``bash scripts/gpu_checks.sh moe``. Results: docs/performance.md#grouped-expert-matmuls.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch

from meshpar.config.hardware import load_profile
from meshpar.models.deepseek.args import DEEPSEEK_V3_SIZES, DeepSeekArgs
from meshpar.models.deepseek.model import DeepSeekBlock, rope_tables
from meshpar.models.moe.grouped import grouped_mm_supported
from tests.benchmarks.probes import median_seconds


def layer_flops_per_token(args: DeepSeekArgs, seq_len: int, *, sparse: bool = True) -> float:
    """Forward and backward FLOPs per token of one layer, as the planner prices a block
    (meshpar/planner/cost.py): the model's own ``flops_per_token`` of a one-layer model, less its
    output projection."""
    one = dataclasses.replace(args, n_layers=1, first_k_dense=0 if sparse else 1)
    return one.flops_per_token(seq_len) - 6.0 * one.vocab_size * one.dim


def build(args: DeepSeekArgs, device: str, dtype: torch.dtype, seed: int = 0) -> DeepSeekBlock:
    """The first sparse layer of ``args``, on ``device`` in ``dtype``, random weights."""
    torch.manual_seed(seed)
    with torch.device("meta"):
        block = DeepSeekBlock(args, args.first_k_dense)
    block.to_empty(device=device)
    with torch.no_grad():
        for p in block.parameters():  # norms' weights 1, matrices N(0, 0.02)
            if p.ndim == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
        for b in block.buffers():
            b.zero_()
    return block.to(dtype)


def measure(size: str, device: str, dtype: torch.dtype, batch: int, seq: int, repeats: int,
            peak_tflops: float | None) -> dict:
    args = DEEPSEEK_V3_SIZES[size]
    block = build(args, device, dtype)
    cos, sin = (t.to(device, dtype) for t in rope_tables(args, seq))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(batch, seq, args.dim, generator=gen).to(device, dtype).requires_grad_()
    grad = torch.randn(batch, seq, args.dim, generator=gen).to(device, dtype)
    experts = block.moe.experts
    runs_grouped = grouped_mm_supported(x.view(-1, args.dim), experts.w1.transpose(1, 2))
    kernels = ("grouped", "loop") if runs_grouped else ("loop",)
    results: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def step(kernel: str):
        def run():
            experts.kernel = kernel
            x.grad = None
            for p in block.parameters():
                p.grad = None
            out = block(x, cos, sin)
            aux = block.moe.aux_loss * args.router_aux_loss_coef
            torch.autograd.backward([out, aux], [grad, torch.ones_like(aux)])
            results[kernel] = (out.detach().float(), x.grad.float())
        return run

    ms = {k: 1e3 * median_seconds(step(k), repeats, device) for k in kernels}
    load = block.moe.tokens_per_expert.float()
    row = {"size": size, "device": device, "dtype": str(dtype).removeprefix("torch."), "batch": batch, "seq": seq,
           "experts": args.n_experts, "top_k": args.top_k,
           "busiest_expert_over_mean": (load.max() / load.mean()).item(),
           "flops_per_token": layer_flops_per_token(args, seq), "loop_ms": ms["loop"],
           "grouped_ms": ms.get("grouped")}
    tokens = batch * seq
    for k in kernels:
        row[f"{k}_tokens_per_s"] = tokens / (ms[k] / 1e3)
        row[f"{k}_tflops"] = row["flops_per_token"] * row[f"{k}_tokens_per_s"] / 1e12
        if peak_tflops:
            row[f"{k}_of_peak"] = row[f"{k}_tflops"] / peak_tflops
    if runs_grouped:
        row["loop_over_grouped"] = ms["loop"] / ms["grouped"]
        row["max_rel_diff"] = max(((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
                                  for a, b in zip(results["grouped"], results["loop"], strict=True))
    return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="debug", help=f"of {', '.join(DEEPSEEK_V3_SIZES)}")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="bfloat16 on a GPU, float32 on a CPU unless given")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=None, help="4096 on a GPU, 256 on a CPU unless given")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--hardware", default=None, help="a profile (profiles/*.toml, or auto) for the share of peak")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    gpu = args.device == "cuda"
    dtype = getattr(torch, args.dtype or ("bfloat16" if gpu else "float32"))
    seq = args.seq or (4096 if gpu else 256)
    unknown = [s for s in args.sizes.split(",") if s not in DEEPSEEK_V3_SIZES]
    if unknown:
        ap.error(f"--sizes: unknown {', '.join(unknown)}; choose from {', '.join(DEEPSEEK_V3_SIZES)}")
    peak = load_profile(args.hardware, args.device).peak_flops(dtype) / 1e12 if args.hardware else None
    print(f"{'size':<6} {'kernel':<8} {'ms/step':>9} {'tokens/s':>10} {'TFLOP/s':>8} {'of peak':>8} "
          f"{'loop/grouped':>12} {'max rel diff':>12} {'busiest/mean':>12}")
    rows = []
    for size in args.sizes.split(","):
        r = measure(size, args.device, dtype, args.batch, seq, args.repeats, peak)
        rows.append(r)
        for k in ("grouped", "loop"):
            if r[f"{k}_ms"] is None:
                print(f"{size:<6} {k:<8} does not run here ({r['dtype']} on {args.device})")
                continue
            share = f"{r[f'{k}_of_peak']:>8.3f}" if peak else f"{'-':>8}"
            ratio = f"{r['loop_over_grouped']:>12.2f}" if k == "grouped" else f"{'':>12}"
            diff = f"{r['max_rel_diff']:>12.1e}" if k == "grouped" else f"{'':>12}"
            print(f"{size:<6} {k:<8} {r[f'{k}_ms']:>9.2f} {r[f'{k}_tokens_per_s']:>10,.0f} "
                  f"{r[f'{k}_tflops']:>8.2f} {share} {ratio} {diff} {r['busiest_expert_over_mean']:>12.2f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
