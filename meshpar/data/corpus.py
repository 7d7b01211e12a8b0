"""``prepare(cfg)``: the ``[data]`` section -> a :class:`Corpus` (train and val token streams)."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import socket
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np
import tokenizers

from meshpar.checkpoint.atomic import write_atomic
from meshpar.data.cache import cached
from meshpar.data.tokenizer import EOT, BPETokenizer, ByteTokenizer, Tokenizer
from meshpar.recipe import DataConfig, RecipeError

CACHE_VERSION = 1  # bump when the cache layout or the tokenization changes


@dataclass(frozen=True)
class Corpus:
    train: np.ndarray  # 1-D token ids (uint16 / uint32, usually a read-only np.memmap)
    val: np.ndarray  # the last val_fraction of the stream; empty when val_fraction = 0
    vocab_size: int  # the tokenizer's vocabulary; for token files, max id + 1
    tokenizer: Tokenizer | None  # None for token files
    name: str  # for logs, e.g. "shakespeare (bpe 2048)"


def prepare(cfg: DataConfig) -> Corpus:
    """Read, tokenize (through the cache) and split the data that ``cfg`` names."""
    if cfg.format == "text":
        name, tokens, tokenizer = _text_tokens(cfg)
        vocab_size = tokenizer.vocab_size
    elif cfg.format in ("uint16", "uint32"):
        tokens = _token_file(cfg)
        name, tokenizer = f"{Path(cfg.path).name} ({cfg.format} tokens)", None
        vocab_size = _max_id(tokens) + 1
    else:
        raise RecipeError(f"data.format = {cfg.format!r}: must be 'text', 'uint16' or 'uint32'", "data.format")
    split = len(tokens) - int(len(tokens) * cfg.val_fraction)
    return Corpus(tokens[:split], tokens[split:], vocab_size, tokenizer, name)


def _text_tokens(cfg: DataConfig) -> tuple[str, np.ndarray, Tokenizer]:
    if cfg.tokenizer not in ("bpe", "byte"):
        raise RecipeError(f"data.tokenizer = {cfg.tokenizer!r}: must be 'bpe' or 'byte'", "data.tokenizer")
    name, docs = _read_docs(cfg)
    text = EOT.join(docs)
    settings = {"version": CACHE_VERSION, "tokenizer": cfg.tokenizer, "eot": EOT,
                "vocab_size": cfg.vocab_size if cfg.tokenizer == "bpe" else 256}
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    digest.update(text.encode("utf-8"))
    label = f"bpe{cfg.vocab_size}" if cfg.tokenizer == "bpe" else "byte"
    root = Path(cfg.cache_dir or os.environ.get("MESHPAR_CACHE") or Path.home() / ".cache" / "meshpar").expanduser()
    entry = cached(root, f"{label}-{digest.hexdigest()[:24]}", lambda tmp: _build_entry(tmp, docs, text, cfg, name))
    meta = json.loads((entry / "meta.json").read_text())
    tokens = np.memmap(entry / "tokens.bin", dtype=meta["dtype"], mode="r", shape=(meta["n_tokens"],))
    if cfg.tokenizer == "bpe":
        tokenizer: Tokenizer = BPETokenizer(tokenizers.Tokenizer.from_file(str(entry / "tokenizer.json")))
        return f"{name} (bpe {tokenizer.vocab_size})", tokens, tokenizer
    return f"{name} (byte)", tokens, ByteTokenizer()


def _read_docs(cfg: DataConfig) -> tuple[str, list[str]]:
    """The text documents ``data.path`` names, in order, checked to be non-empty UTF-8."""
    if not cfg.path:
        raw = resources.files("meshpar").joinpath("corpus/shakespeare.txt.gz").read_bytes()
        return "shakespeare", [gzip.decompress(raw).decode("utf-8")]
    path = Path(cfg.path).expanduser()
    if path.is_dir():
        files = sorted(path.rglob("*.txt"), key=lambda p: p.relative_to(path).as_posix())
        if not files:
            raise RecipeError(f"data.path = {cfg.path!r}: the folder holds no .txt files; add some, or point "
                              f"data.path at one file", "data.path")
    elif path.is_file():
        files = [path]
    else:
        raise RecipeError(f"data.path = {cfg.path!r}: no such file or folder", "data.path")
    docs = []
    for f in files:
        try:
            docs.append(f.read_bytes().decode("utf-8"))
        except UnicodeDecodeError as e:
            raise RecipeError(f"data.path = {cfg.path!r}: {f} is not UTF-8 text (bad byte at offset {e.start}); "
                              f"for a file of token ids set data.format = 'uint16' or 'uint32'", "data.path") from None
    if not any(docs):
        raise RecipeError(f"data.path = {cfg.path!r}: the text is empty; point data.path at some text", "data.path")
    return path.name, docs


def _build_entry(tmp: Path, docs: list[str], text: str, cfg: DataConfig, name: str) -> None:
    """Tokenize into the folder ``tmp``; meta.json is written last."""
    start = time.perf_counter()
    if cfg.tokenizer == "bpe":
        tok = BPETokenizer.train(docs, cfg.vocab_size)
        trained = time.perf_counter()
        ids = tok.encode_stream(text)
        write_atomic(tmp / "tokenizer.json", tok.tok.to_str().encode())
        vocab_size = tok.vocab_size
    else:
        trained = start
        ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
        vocab_size = 256
    dtype = "<u2" if vocab_size <= 1 << 16 else "<u4"
    write_atomic(tmp / "tokens.bin", ids.astype(dtype).tobytes())
    meta = {"version": CACHE_VERSION, "source": name, "tokenizer": cfg.tokenizer, "vocab_size": vocab_size,
            "dtype": dtype, "n_tokens": len(ids), "n_docs": len(docs), "text_bytes": len(text.encode("utf-8")),
            "train_seconds": round(trained - start, 3), "tokenize_seconds": round(time.perf_counter() - trained, 3),
            "built_by": {"host": socket.gethostname(), "pid": os.getpid(),  # and the torchrun rank, if any
                         **{k.lower(): int(os.environ[k]) for k in ("RANK", "LOCAL_RANK") if k in os.environ}}}
    write_atomic(tmp / "meta.json", json.dumps(meta, indent=1).encode())


def _token_file(cfg: DataConfig) -> np.ndarray:
    where = f"data.path = {cfg.path!r}"
    path = Path(cfg.path).expanduser()
    if not cfg.path:
        raise RecipeError(f"data.format = {cfg.format!r} needs data.path: a file of token ids", "data.path")
    if path.is_dir() or path.suffix == ".txt":
        raise RecipeError(f"{where} is text but data.format = {cfg.format!r} reads raw token ids; set "
                          f"data.format = 'text'", "data.format")
    if not path.is_file():
        raise RecipeError(f"{where}: no such file", "data.path")
    if path.suffix == ".npy":
        raise RecipeError(f"{where}: a .npy file has a header; write the raw ids with ndarray.tofile()", "data.path")
    itemsize = np.dtype(cfg.format).itemsize
    size = path.stat().st_size
    if size == 0 or size % itemsize:
        raise RecipeError(f"{where}: {size} bytes is not a whole, non-zero number of {cfg.format} ids "
                          f"({itemsize} bytes each); check data.format", "data.format")
    return np.memmap(path, dtype=f"<u{itemsize}", mode="r")


def _max_id(tokens: np.ndarray, block: int = 1 << 24) -> int:
    """The largest id, reading the (memory-mapped) stream in blocks."""
    return max(int(tokens[i:i + block].max()) for i in range(0, len(tokens), block))
