"""``python -m tests.benchmarks.bench_moe_layer`` runs a DeepSeek-V3 sparse layer's step with both expert
kernels and the same numbers, and prices it at the planner's FLOPs per token."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from meshpar.models.deepseek.args import DEEPSEEK_V3_SIZES
from meshpar.models.deepseek.model import DeepSeekBlock
from tests.benchmarks.bench_moe_layer import layer_flops_per_token

ROOT = Path(__file__).resolve().parents[1]


def test_debug_layer_runs_both_kernels_with_the_same_numbers(tmp_path):
    out = tmp_path / "moe_layer.json"
    proc = subprocess.run([sys.executable, "-m", "tests.benchmarks.bench_moe_layer", "--sizes", "debug", "--device",
                           "cpu", "--dtype", "float32", "--seq", "64", "--repeats", "1", "--hardware", "cpu",
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (row,) = json.loads(out.read_text())
    assert (row["size"], row["seq"], row["experts"], row["top_k"]) == ("debug", 64, 8, 2)
    assert row["grouped_ms"] > 0 and row["loop_ms"] > 0 and row["loop_over_grouped"] > 0
    assert row["max_rel_diff"] <= 1e-6  # fp32: the same dot products in either kernel
    assert row["busiest_expert_over_mean"] >= 1.0
    assert row["grouped_tflops"] == pytest.approx(row["flops_per_token"] * 64 / (row["grouped_ms"] / 1e3) / 1e12)


@pytest.mark.parametrize("size", ["debug", "16b", "671b"])
def test_layer_flops_are_the_planners_and_the_layers_own_shapes(size):
    args = DEEPSEEK_V3_SIZES[size]
    seq = 4096
    dense = layer_flops_per_token(args, seq, sparse=False)
    sparse = layer_flops_per_token(args, seq)
    # the layers add up to the model's figure (what meshpar plan prices), output projection aside
    total = args.first_k_dense * dense + (args.n_layers - args.first_k_dense) * sparse
    assert total + 6.0 * args.vocab_size * args.dim == pytest.approx(args.flops_per_token(seq), rel=1e-12)
    # by hand, from the layer's shapes (built on meta): 6 per weight a token runs through (every matrix
    # of MLA and the shared experts, the router, top_k of the E routed experts), and attention's
    # q k^T and p v, causal
    with torch.device("meta"):
        block = DeepSeekBlock(args, args.first_k_dense)
    attention = sum(p.numel() for p in block.attention.parameters() if p.ndim == 2)
    moe = block.moe
    routed = sum(p.numel() for p in moe.experts.parameters()) * args.top_k // args.n_experts
    shared = sum(p.numel() for p in moe.shared.parameters())
    weights = attention + moe.router.weight.numel() + routed + shared
    heads = args.n_heads
    scores = 2 * 2 * heads * seq * (args.qk_head_dim + args.v_head_dim) / 2 * 3
    assert sparse == pytest.approx(6.0 * weights + scores, rel=1e-12)
