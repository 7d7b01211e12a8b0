"""Converter throughput and peak memory on a synthetic checkpoint of a few GB, against its largest tensor.

    python -m tests.benchmarks.bench_convert [--dim 4096] [--vocab 65536] [--layers 1] [--dir /tmp] [--verify]

Builds a Llama-shaped meshpar checkpoint (DCP + meshpar.json) of random fp32 weights: by default
2 x 1.07 GB embedding/output matrices and one block, 2.8 GB in all. Then times, each in a fresh
process so every peak is its own: DCP -> HF, HF -> DCP, DCP -> DCP re-chunked for dp_shard 4 x tp 2,
and DCP -> torch (which holds the whole model, for contrast). Peak memory is the process's RSS
high-water mark above its RSS when the conversion starts ([Note: measuring peak memory] in
meshpar/convert/). Every case starts after a sync and ends with its output fsynced, so its
time includes writing to disk; the inputs were just written, so reads come from the page cache.
Everything is removed at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from meshpar.convert import ModelSpec
from meshpar.models.llama.args import ModelArgs

RUN = """
import json, sys, warnings
from meshpar import convert as cv
warnings.filterwarnings("ignore")
src, dst, to, layout, verify = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), sys.argv[5] == "1"
s = cv.convert(src, dst, to, layout=layout or None, verify=verify, progress=False)
print(json.dumps(dict(bytes=s.bytes, seconds=s.seconds, peak=s.peak_bytes, method=s.peak_method)))
"""


def build(path: Path, args: ModelArgs) -> int:
    """A meshpar checkpoint of random weights for ``args``; returns the largest tensor's bytes."""
    state = {"model": {k: torch.randn(shape) for k, shape in ModelSpec("llama", args).shapes.items()}}
    largest = max(t.nbytes for t in state["model"].values())
    dcp.save(state, checkpoint_id=path, no_dist=True)
    info = {"format": 1, "step": 1, "family": "llama", "size": "custom", "model_args": dataclasses.asdict(args),
            "layout": {}, "world_size": 1, "saved_at": ""}
    (path / "meshpar.json").write_text(json.dumps(info))
    return largest


def run(src: Path, dst: Path, to: str, layout: dict[str, int], verify: bool) -> dict:
    out = subprocess.run([sys.executable, "-c", RUN, str(src), str(dst), to, json.dumps(layout), str(int(verify))],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=65536)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--verify", action="store_true", help="also reload and checksum every output tensor")
    opts = parser.parse_args()
    args = ModelArgs(dim=opts.dim, n_layers=opts.layers, n_heads=32, n_kv_heads=8, ffn_dim=2 * opts.dim,
                     vocab_size=opts.vocab)
    root = Path(tempfile.mkdtemp(prefix="bench_convert_", dir=opts.dir))
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # dcp.save(no_dist=True)
    try:
        largest = build(root / "ck", args)
        cases = [("DCP -> HF", root / "ck", root / "hf", "hf", {}),
                 ("HF -> DCP", root / "hf", root / "back", "dcp", {}),
                 ("DCP -> DCP dp_shard 4 x tp 2", root / "ck", root / "re", "dcp", {"dp_shard": 4, "tp": 2}),
                 ("DCP -> torch (holds the model)", root / "ck", root / "w.pt", "torch", {})]
        total = sum(f.stat().st_size for f in (root / "ck").iterdir())
        print(f"checkpoint: llama dim {opts.dim}, vocab {opts.vocab}, {opts.layers} block(s), fp32, "
              f"{total / 1e9:.2f} GB on disk; largest tensor {largest / 1e9:.2f} GB")
        print(f"{'conversion':<32} {'GB':>6} {'seconds':>8} {'GB/s':>6} {'peak GB':>8} {'peak / largest':>15}")
        for name, src, dst, to, layout in cases:
            os.sync()  # no writeback of the previous case's output competes with this one
            r = run(src, dst, to, layout, opts.verify)
            print(f"{name:<32} {r['bytes'] / 1e9:>6.2f} {r['seconds']:>8.2f} {r['bytes'] / 1e9 / r['seconds']:>6.2f} "
                  f"{r['peak'] / 1e9:>8.2f} {r['peak'] / largest:>15.2f}")
        print(f"peak: {r['method']} above the starting RSS; the page cache holds the inputs (warm reads)")
    finally:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
