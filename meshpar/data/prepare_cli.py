"""``meshpar data prepare SOURCES --tokenizer T --out DIR``: tokenize a corpus once into a prepared
folder ([Note: the prepared format]) that ``data.path = DIR`` trains from, memory-mapped.

Streaming (a batch of documents in memory per process), one process per input file up to the
cores (``--workers``), a progress bar over the files, and resumable: run the same command again
after an interruption and only the files without a finished shard are tokenized.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from meshpar.config.errors import RecipeError

HELP = ("Tokenize SOURCES (files, folders or globs of .txt, .jsonl, .jsonl.gz, .jsonl.zst, .parquet, .arrow; "
        "'builtin' for the packaged Shakespeare) once into DIR: memory-mapped token shards and an index, trained "
        "from with data.path = DIR. Resumable: the same command again finishes an interrupted run.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("sources", nargs="+", help="input files, folders or globs (quote globs); 'builtin' for the "
                        "built-in corpus")
    parser.add_argument("--tokenizer", required=True, help="a Hugging Face tokenizer (tokenizer.json or a folder "
                        "holding one, e.g. a model folder), or byte")
    parser.add_argument("--out", required=True, type=Path, help="output folder (created; an interrupted one resumes)")
    parser.add_argument("--text-field", default="text", help="the document's field in .jsonl objects and its "
                        "column in Parquet / Arrow (default: text)")
    parser.add_argument("--chat", action="store_true", help="the sources are conversations (rows of 'messages', or "
                        "'prompt' and 'completion'): render them with the tokenizer's chat template and keep which "
                        "tokens are the assistant's; train with data.format = 'chat'")
    parser.add_argument("--chat-template", default="", help="with --chat: a Jinja chat template file instead of the "
                        "tokenizer folder's own")
    parser.add_argument("--workers", type=int, default=0, help="processes, one input file each (default: one per "
                        "CPU core, at most one per file)")
    parser.add_argument("--progress", choices=("auto", "on", "off"), default="auto",
                        help="progress bar on stderr (auto: when stderr is a terminal)")


def run(args: argparse.Namespace) -> int:
    """The command; prints one line per problem (exit 2) or the figures of the preparation (exit 0)."""
    # the readers and tokenizers (numpy, torch) load here: `meshpar --help` stays quick
    from meshpar.data.corpus import _encoder
    from meshpar.data.prepared import BUILTIN, is_prepared, prepare_folder
    from meshpar.data.readers import expand, kind_of
    from meshpar.runtime.progress import Progress

    try:
        if args.tokenizer == "bpe":
            raise RecipeError("--tokenizer bpe: a BPE trained on the corpus is what training on raw text does "
                              "itself (data.tokenizer = 'bpe'); to prepare once, give a Hugging Face tokenizer "
                              "(a tokenizer.json or a folder holding one) or byte", "--tokenizer")
        if args.workers < 0:
            raise RecipeError(f"--workers {args.workers}: must be >= 0 (0: one per core)", "--workers")
        files: list[str] = []
        for spec in args.sources:
            if spec == "builtin":
                files.append(BUILTIN)
                continue
            found = expand(spec, "SOURCES")
            tokens = [f for f in found if kind_of(f) in ("npy", "bin")]
            if tokens:
                raise RecipeError(f"SOURCES: {tokens[0]} holds token ids, which need no preparing: train from it "
                                  f"with data.path (data.format = 'uint16' / 'uint32' for raw ids)", "SOURCES")
            files += [str(f) for f in found]
        if is_prepared(args.out):
            print(f"meshpar: {args.out} is already prepared (meta.json); remove it to prepare again")
            return 0
        if args.chat and args.tokenizer == "byte":
            raise RecipeError("--chat with --tokenizer byte: byte ids have no separator to end each conversation "
                              "with; give a Hugging Face tokenizer folder with a chat template", "--tokenizer")
        enc, tok = _encoder(args.tokenizer, chat_template=args.chat_template if args.chat else None)
        progress = Progress(len(files), {"on": True, "off": False}.get(args.progress, sys.stderr.isatty()),
                            unit="file")
        try:
            rep = prepare_folder(args.out, [("all", files)], args.text_field, enc, workers=args.workers,
                                 progress=progress)
        finally:
            progress.close()
    except RecipeError as e:
        print(f"meshpar: error: {e}", file=sys.stderr)
        return 2
    per_core = rep.tokens / max(rep.seconds, 1e-9) / rep.workers if rep.workers > 1 else None
    print(f"meshpar: prepared {args.out}: {rep.documents:,} documents, {rep.tokens:,} tokens from {len(files)} "
          f"file(s) in {rep.seconds:.1f} s ({rep.tokens / max(rep.seconds, 1e-9):,.0f} tokens/s"
          + (f", {per_core:,.0f} per worker process" if per_core else "")
          + f"; {rep.workers} worker(s)"
          + (f", {rep.reused} file(s) kept from an interrupted run" if rep.reused else "")
          + f"); peak RSS {rep.peak_rss_mb:,.0f} MB; tokenizer {getattr(tok, 'name', args.tokenizer)}")
    print(f"meshpar: train from it with --data.path={args.out}" + (" --data.format=chat" if args.chat else ""))
    return 0
