"""``meshpar data prepare`` throughput and peak memory, against ``tokenizers``' own batch encoding.

    python -m tests.benchmarks.bench_prepare [--copies 4] [--files 8] [--vocab 32000] [--workers 1,2]

The built-in corpus, cut into its scenes (~750 documents of ~6 KB) and repeated ``--copies`` times, is
written as ``--files`` .jsonl.gz files. A byte-level BPE tokenizer of ``--vocab`` tokens is
trained on it and saved as tokenizer.json (a Hugging Face tokenizer file, as a model folder holds).
Then, each in a fresh process so that every peak RSS is its own:

- the limit: ``Tokenizer.encode_batch`` over every document already in memory, with one thread
  (``RAYON_NUM_THREADS=1``) and with one per core, no file reading, no writing;
- ``meshpar data prepare`` of the files with ``--workers`` N (one process per file, each
  tokenizing with one thread), reading gzip JSON Lines and writing shards.

Printed: tokens/s, tokens/s per core used, the ratio to the limit on as many cores, and peak RSS.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LIMIT = """
import json, resource, sys, time, tokenizers
tok = tokenizers.Tokenizer.from_file(sys.argv[1])
docs = [json.loads(line)["text"] for f in sys.argv[2:] for line in __import__("gzip").open(f, "rt")]
start = time.perf_counter()
n = sum(len(e.ids) + 1 for e in tok.encode_batch(docs, add_special_tokens=False))
seconds = time.perf_counter() - start
rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"tokens": n, "seconds": seconds, "rss_mb": rss_mb}))
"""


def _documents(copies: int) -> list[str]:
    from meshpar.data.prepared import builtin_text

    scenes = [d for d in re.split(r"\n(?=SCENE )", builtin_text()) if d.strip()]
    return [f"{d}\n[{k}]" for k in range(copies) for d in scenes]  # copies differ: no cache effects


def _write(folder: Path, docs: list[str], files: int) -> list[Path]:
    paths = []
    for i in range(files):
        path = folder / f"part-{i:03d}.jsonl.gz"
        with gzip.open(path, "wt", encoding="utf-8") as f:
            for d in docs[i::files]:
                f.write(json.dumps({"text": d}) + "\n")
        paths.append(path)
    return paths


def _tokenizer(folder: Path, docs: list[str], vocab: int) -> Path:
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs[:3000], trainer=trainer)
    path = folder / "tokenizer.json"
    tok.save(str(path))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--copies", type=int, default=4)
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--workers", default="1,2")
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    root = Path(tempfile.mkdtemp(prefix="bench_prepare."))
    try:
        docs = _documents(args.copies)
        tokenizer = _tokenizer(root, docs, args.vocab)
        files = _write(root, docs, args.files)
        text_mb = sum(len(d.encode()) for d in docs) / 1e6
        print(f"corpus: {len(docs):,} documents, {text_mb:.1f} MB of text in {len(files)} .jsonl.gz files; "
              f"BPE tokenizer of {args.vocab} tokens; {cores} cores")
        limit = {}
        for threads in sorted({1, cores}):
            env = dict(os.environ, RAYON_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="true")
            out = subprocess.run([sys.executable, "-c", LIMIT, str(tokenizer), *map(str, files)], env=env,
                                 capture_output=True, text=True, check=True)
            r = json.loads(out.stdout)
            limit[threads] = r["tokens"] / r["seconds"]
            print(f"limit   encode_batch, {threads} thread(s): {limit[threads]:>12,.0f} tokens/s "
                  f"({limit[threads] / threads:,.0f} per core), peak RSS {r['rss_mb']:,.0f} MB (documents in memory)")
        for workers in (int(w) for w in args.workers.split(",")):
            out_dir = root / f"prepared-{workers}"
            cmd = [sys.executable, "-m", "meshpar.cli", "data", "prepare", *map(str, files), "--tokenizer",
                   str(tokenizer), "--out", str(out_dir), "--workers", str(workers), "--progress", "off"]
            start = time.perf_counter()
            done = subprocess.run(cmd, capture_output=True, text=True, check=True)
            wall = time.perf_counter() - start
            meta = json.loads((out_dir / "meta.json").read_text())
            rate = meta["tokens"] / meta["seconds"]
            used = cores if workers == 1 else min(workers, cores)  # one process: tokenizers uses every core
            rss = done.stdout.split("peak RSS ")[1].split(" MB")[0]
            print(f"prepare --workers {workers}:            {rate:>12,.0f} tokens/s ({rate / used:,.0f} per core), "
                  f"{rate / limit.get(used, limit[1]):.2f}x the limit on {used} core(s), peak RSS {rss} MB, "
                  f"{wall:.1f} s with start-up")
        own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(f"(this driver's own peak RSS: {own:,.0f} MB)")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
