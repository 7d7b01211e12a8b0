"""Packing conversations for fine-tuning ([Note: packing conversations] in meshpar/data/packing.py):
the time every rank spends at start to lay N conversations into rows.

    .venv/bin/python -m tests.benchmarks.bench_packing [--conversations 1000000] [--seq-len 2048]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from meshpar.data.packing import pack


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=1_000_000)
    parser.add_argument("--seq-len", type=int, default=2048)
    args = parser.parse_args(argv)
    lengths = np.random.default_rng(0).integers(50, 900, size=args.conversations)  # tokens each, uniform
    start = time.perf_counter()
    starts, used, cut = pack(lengths, args.seq_len + 1)
    seconds = time.perf_counter() - start
    print(f"pack: {args.conversations:,} conversations of 50-900 tokens into {len(starts):,} rows of "
          f"{args.seq_len + 1}: {seconds:.2f} s ({seconds / args.conversations * 1e6:.2f} us each), "
          f"{used.sum() / (len(starts) * (args.seq_len + 1)):.1%} of the rows filled, {cut} cut")


if __name__ == "__main__":
    main()
