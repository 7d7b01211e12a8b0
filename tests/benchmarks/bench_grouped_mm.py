"""The experts' two kernels side by side: ``F.grouped_mm`` (one launch for all experts) against a
loop of one matmul per expert.

    python -m tests.benchmarks.bench_grouped_mm [--device cpu|cuda] [--dtypes float32,bfloat16]
                                                [--repeats 5] [--json runs/grouped_mm.json]

Each case is one sparse layer's SwiGLU experts (``meshpar.models.moe.model.swiglu_experts``) over
tokens sorted by expert, forward and backward, at the expert shapes of a real model: E experts of
[D -> F -> D] and S token slots routed evenly (the planner's assumption) or skewed (half
the slots to a tenth of the experts, one expert left empty: what a real step sees early in
training). It prints the median time of each kernel over the repeats (after one warmup) and the
ratio loop / grouped (> 1: the grouped kernel is faster), and checks the two agree. The 235B case
is slow on a CPU (``--cases`` to pick). Results: docs/performance.md#grouped-expert-matmuls.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from meshpar.models.moe.grouped import grouped_mm_supported
from meshpar.models.moe.model import swiglu_experts
from tests.benchmarks.probes import median_seconds

# (name, experts, dim, expert ffn dim, token slots): a layer of the debug model, and one ep rank's
# share of a Qwen3-30B-A3B / 235B-A22B layer at ep 8 (16 experts), at a CPU's worth of slots (a
# GPU case takes 16x more: 4096 tokens x top 8 / ep 8 x 8 ranks' tokens... 32768).
CASES = {
    "debug": (8, 256, 256, 1024),
    "qwen3_30b_a3b/ep8": (16, 2048, 768, 2048),
    "qwen3_235b_a22b/ep8": (16, 4096, 1536, 1024),
}


def _counts(experts: int, slots: int, skewed: bool) -> torch.Tensor:
    if not skewed:
        counts = torch.full((experts,), slots // experts)
        counts[: slots - int(counts.sum())] += 1
        return counts
    hot = max(1, experts // 10)
    counts = torch.zeros(experts, dtype=torch.long)
    counts[:hot] = slots // 2 // hot
    rest = slots - int(counts.sum())
    cold = experts - hot - 1  # the last expert gets nothing
    counts[hot:hot + cold] = rest // cold
    counts[hot] += rest - int(counts.sum() - counts[:hot].sum())
    return counts


def measure(case: str, dtype: torch.dtype, skewed: bool, device: str, repeats: int) -> dict | None:
    experts, dim, ffn, slots = CASES[case]
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(slots, dim, generator=gen) * 0.5).to(device, dtype).requires_grad_()
    w1, w3 = ((torch.randn(experts, ffn, dim, generator=gen) * dim**-0.5).to(device, dtype).requires_grad_()
              for _ in range(2))
    w2 = (torch.randn(experts, dim, ffn, generator=gen) * ffn**-0.5).to(device, dtype).requires_grad_()
    if not grouped_mm_supported(x, w1.transpose(1, 2)):
        return None
    counts = _counts(experts, slots, skewed).to(device)
    grad = torch.randn(slots, dim, generator=gen).to(device, dtype)
    outs = {}

    def step(kernel: str):
        def run():
            for t in (x, w1, w2, w3):
                t.grad = None
            out = swiglu_experts(x, w1, w2, w3, counts, kernel)
            out.backward(grad)
            outs[kernel] = (out.detach().float(), x.grad.float(), w1.grad.float())
        return run

    ms = {k: 1e3 * median_seconds(step(k), repeats, device) for k in ("grouped", "loop")}
    worst = max(((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
                for a, b in zip(outs["grouped"], outs["loop"], strict=True))
    return {"case": case, "dtype": str(dtype).removeprefix("torch."), "routing": "skewed" if skewed else "even",
            "experts": experts, "slots": slots, "grouped_ms": ms["grouped"], "loop_ms": ms["loop"],
            "loop_over_grouped": ms["loop"] / ms["grouped"], "max_rel_diff": worst}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--cases", default="debug,qwen3_30b_a3b/ep8", help=f"of {', '.join(CASES)}")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.device == "cuda":  # a GPU's worth of slots
        for name, (e, d, f, slots) in CASES.items():
            CASES[name] = (e, d, f, 16 * slots)
    rows = []
    print(f"{'case':<20} {'dtype':<9} {'routing':<7} {'slots':>6} {'grouped ms':>11} {'loop ms':>9} "
          f"{'loop/grouped':>12} {'max rel diff':>12}")
    for case in args.cases.split(","):
        for dtype in args.dtypes.split(","):
            for skewed in (False, True):
                r = measure(case, getattr(torch, dtype), skewed, args.device, args.repeats)
                if r is None:
                    print(f"{case:<20} {dtype:<9} grouped_mm does not run here")
                    continue
                rows.append(r)
                print(f"{case:<20} {r['dtype']:<9} {r['routing']:<7} {r['slots']:>6} {r['grouped_ms']:>11.2f} "
                      f"{r['loop_ms']:>9.2f} {r['loop_over_grouped']:>12.2f} {r['max_rel_diff']:>12.1e}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
