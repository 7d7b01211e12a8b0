"""Data: text or token files -> one cached token stream -> each data-parallel rank's microbatches.

``prepare(cfg)`` turns the ``[data]`` section into a :class:`Corpus`: a 1-D token stream split
into train (the head) and val (the last ``val_fraction``), plus the tokenizer that made it.
Text is the built-in Shakespeare (38 plays, 5 MB), a .txt file, or a folder of .txt files
(recursive, sorted by relative path, joined with ``<|endoftext|>``); it is tokenized with
``byte`` (UTF-8 bytes, vocab 256; the separator stays 13 literal bytes) or ``bpe`` (a byte-level
BPE trained here, with ``<|endoftext|>`` as one special id). A file of raw token ids
(``format = uint16 / uint32``, little-endian, as ``ndarray.tofile`` writes them) is memory-mapped
as is. Text is read into memory whole: pre-tokenize corpora of many GB into a token file.

``BatchLoader`` walks a token stream in non-overlapping windows of ``seq_len + 1`` tokens in a
seeded order that depends only on the global sample count, so its state is one integer and
moves freely between data-parallel layouts (see [Note: sample order]).

[Note: the token cache]
Tokenized text lives in ``<cache>/<tokenizer>-<hash>/`` (tokens.bin, tokenizer.json, meta.json),
where the hash covers the text and the tokenizer settings and <cache> is ``data.cache_dir``,
``$MESHPAR_CACHE`` or ``~/.cache/meshpar``. An entry is built in a temporary folder and published
with one ``os.replace``, so it is complete or absent. Builders serialize on ``<key>.lock``
(fcntl.flock): when every rank of a host calls prepare() at once, one trains and tokenizes while
the others wait, then all read the same entry (meta.json's ``built_by``: host, pid, torchrun rank).
Measured on 2 shared CPU cores, built-in corpus, bpe 2048: cold 1.9-3.7 s (BPE training
0.6-1.2 s, tokenizing 1.2-2.6 s in parallel chunks), warm 0.03 s; 0.367 tokens per byte (1.83 M
tokens from 4.99 MB). BPE training is deterministic (the same tokenizer.json with 1 or 2
threads), so hosts with separate caches agree on the tokens.

[Note: a cache per node or one for all]
Under torchrun every rank runs prepare() (in preflight, before any process group), so who
builds is decided by the lock, not by a rank number: the first process to take it, once per
cache folder. A node-local cache (``$MESHPAR_CACHE`` on local disk) is built once on each node
by one of its own ranks; a shared one (``~/.cache/meshpar`` on an NFS home) once for the job,
where flock spans hosts (NFS, GPFS, Lustre mounted with ``flock``). Where it does not (Lustre's
``localflock``; ``noflock``, whose flock fails), each host builds in its own temporary folder
``.<key>.tmp@<host>.*``, removes only its own host's dead ones, and drops its copy if another
host published the entry first (the same bytes: BPE training is deterministic).
"""

from __future__ import annotations

import fcntl
import gzip
import hashlib
import itertools
import json
import os
import shutil
import socket
import tempfile
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from importlib import resources
from pathlib import Path
from typing import Protocol

import numpy as np
import tokenizers
import torch
from tokenizers import decoders, models, pre_tokenizers, trainers

from meshpar.checkpoint.atomic import fsync_dir, write_atomic
from meshpar.recipe import DataConfig, RecipeError

EOT = "<|endoftext|>"
CACHE_VERSION = 1  # bump when the cache layout or the tokenization changes
CHUNK_CHARS = 1 << 16  # text is tokenized in chunks of about this many characters, in parallel


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class BPETokenizer:
    """Byte-level BPE (GPT-2 pre-tokenization, lossless) with ``<|endoftext|>`` as one special id."""

    def __init__(self, tok: tokenizers.Tokenizer):
        self.tok = tok
        self.vocab_size = tok.get_vocab_size()
        self.eot_id = tok.token_to_id(EOT)

    @classmethod
    def train(cls, docs: Sequence[str], vocab_size: int) -> BPETokenizer:
        tok = tokenizers.Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        # Documents one by one: the trainer would otherwise learn merges inside the separator text.
        tok.train_from_iterator((c for doc in docs for c in split_text(doc)), trainer=trainer)
        return cls(tok)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def encode_stream(self, text: str) -> np.ndarray:
        """``encode(text)`` as an array, computed over CPU cores on chunks (identical, see split_text)."""
        encodings = self.tok.encode_batch(split_text(text))
        return np.fromiter(itertools.chain.from_iterable(e.ids for e in encodings), dtype=np.uint32)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)


def split_text(text: str, size: int = CHUNK_CHARS) -> list[str]:
    """Cut ``text`` into pieces of about ``size`` characters that tokenize exactly like the whole.

    Cuts fall only after a newline that has a non-space character on both sides. The GPT-2
    pre-tokenizer makes such a newline a piece of its own and starts a new piece after it, and
    BPE merges never cross pieces, so the tokens of the parts concatenate to those of the whole.
    (CRLF text has no such newline: it stays one piece, tokenized correctly but on one core.)
    """
    parts, start = [], 0
    while len(text) - start > size:
        cut = text.find("\n", start + size)
        while cut != -1 and (cut + 1 == len(text) or text[cut + 1].isspace() or text[cut - 1].isspace()):
            cut = text.find("\n", cut + 1)
        if cut == -1:
            break
        parts.append(text[start:cut + 1])
        start = cut + 1
    return parts + [text[start:]]


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
    entry = _cached(root, f"{label}-{digest.hexdigest()[:24]}", lambda tmp: _build_entry(tmp, docs, text, cfg, name))
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


def _cached(root: Path, key: str, build) -> Path:
    """The complete cache entry ``root/key``, built by ``build(tmp_folder)`` in exactly one process
    per host that shares the lock ([Note: a cache per node or one for all])."""
    entry = root / key
    if (entry / "meta.json").exists():
        return entry
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock = open(root / f"{key}.lock", "a")  # noqa: SIM115 - the with block below closes it
    except OSError as e:
        raise RecipeError(f"data.cache_dir = {str(root)!r}: cannot write there ({e.strerror}); set data.cache_dir "
                          f"or $MESHPAR_CACHE to a writable folder", "data.cache_dir") from None
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
            locked = True
        except OSError:  # a file system without flock (Lustre's noflock): build unlocked, publish safely
            locked = False
        if not (entry / "meta.json").exists():  # a process we waited for may have built it
            mine = f".{key}.tmp@{socket.gethostname()}."
            if locked:  # dead builders' folders: of this host only, whose builders shared our lock
                for stale in root.glob(f".{key}.tmp*"):
                    if "@" not in stale.name or stale.name.startswith(mine):
                        shutil.rmtree(stale, ignore_errors=True)
            tmp = Path(tempfile.mkdtemp(prefix=mine, dir=root))
            try:
                build(tmp)
                _publish(tmp, entry)
                fsync_dir(root)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return entry


def _publish(tmp: Path, entry: Path) -> None:
    """Rename the built folder to ``entry``, unless a builder on a host outside our lock did first."""
    try:
        os.replace(tmp, entry)
    except OSError:  # renaming onto a non-empty folder fails: theirs stays, ours is removed
        if not (entry / "meta.json").exists():
            raise


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


# [Note: sample order]
# Window w is tokens[w*T : w*T + T + 1] (inputs its first T, targets its last T), for
# w < n_windows = (len(tokens) - 1) // T. Global sample g, counted over the whole run and
# all ranks, is window perm_e[g % n_windows] of epoch e = g // n_windows. Step s takes the
# samples [s*B, (s+1)*B) and dp rank r the contiguous slice [r*B/dp, (r+1)*B/dp) of them, in
# microbatches in order. So the data of a step does not depend on dp or micro_batch, and the
# position is samples_seen alone: a checkpoint resumes on any layout.
# perm_e is a 4-round Feistel network over the smallest even-bit domain 2^(2h) >= n_windows,
# made a permutation of range(n_windows) by cycle-walking (apply again until the value is
# < n_windows). Integer arithmetic only: the same order on every platform and library version,
# O(1) memory and random access, whatever the number of windows.

def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a bijective 64-bit hash (uint64 array arithmetic wraps)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def permute(i: np.ndarray, n: int, seed: int, epoch: int) -> np.ndarray:
    """``perm[i]`` for the pseudo-random permutation of range(n) that (seed, epoch) picks."""
    half = np.uint64(max(1, ((n - 1).bit_length() + 1) // 2))
    mask = np.uint64((1 << int(half)) - 1)
    base = _mix(_mix(np.array([seed], dtype=np.uint64)) ^ np.uint64(epoch))
    keys = _mix(base + np.arange(1, 5, dtype=np.uint64))  # one key per round

    def feistel(x: np.ndarray) -> np.ndarray:
        left, right = x >> half, x & mask
        for k in keys:
            left, right = right, left ^ (_mix(right ^ k) & mask)
        return (left << half) | right

    y = feistel(np.asarray(i, dtype=np.uint64))
    while (out := y >= np.uint64(n)).any():
        y[out] = feistel(y[out])
    return y.astype(np.int64)


class BatchLoader:
    """One data-parallel rank's microbatches of a token stream, resumable on any layout."""

    def __init__(self, tokens: np.ndarray, *, seq_len: int, global_batch: int, micro_batch: int,
                 dp_rank: int, dp_size: int, seed: int, shuffle: bool = True):
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is outside [0, dp_size = {dp_size})")
        if global_batch % (micro_batch * dp_size):
            raise RecipeError(_batch_error(global_batch, micro_batch, dp_size), "train.global_batch")
        self.n_windows = (len(tokens) - 1) // seq_len
        if self.n_windows < 1:
            raise RecipeError(f"train.seq_len = {seq_len}: the data is too small ({len(tokens)} tokens) for one "
                              f"sample of seq_len + 1 tokens; use a shorter train.seq_len or more data (for "
                              f"validation: a larger data.val_fraction)", "train.seq_len")
        self.tokens, self.seq_len, self.seed, self.shuffle = tokens, seq_len, seed, shuffle
        self.global_batch, self.micro_batch, self.dp_rank, self.dp_size = global_batch, micro_batch, dp_rank, dp_size
        self._samples_seen = 0

    @property
    def samples_seen(self) -> int:
        """Samples consumed by all ranks together; the loader's whole position."""
        return self._samples_seen

    def windows(self, samples: np.ndarray) -> np.ndarray:
        """Global sample indices -> window indices (see [Note: sample order])."""
        epoch, i = np.divmod(np.asarray(samples, dtype=np.int64), self.n_windows)
        if not self.shuffle:
            return i
        for e in np.unique(epoch):
            i[epoch == e] = permute(i[epoch == e], self.n_windows, self.seed, int(e))
        return i

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's microbatches for one optimizer step: (inputs, targets) int64 [micro_batch, seq_len]."""
        per_rank = self.global_batch // self.dp_size
        first = self._samples_seen + self.dp_rank * per_rank
        starts = self.windows(np.arange(first, first + per_rank)) * self.seq_len
        # rows[per_rank, T + 1] = tokens[start : start + T + 1] for each sample
        rows = torch.from_numpy(np.asarray(self.tokens[starts[:, None] + np.arange(self.seq_len + 1)], np.int64))
        self._samples_seen += self.global_batch
        mb = self.micro_batch
        return [(rows[j:j + mb, :-1].contiguous(), rows[j:j + mb, 1:].contiguous()) for j in range(0, per_rank, mb)]

    @cached_property
    def _fingerprint(self) -> str:
        """CRC of up to 4096 evenly spaced tokens: tells a changed token stream of the same length."""
        sample = np.asarray(self.tokens[::max(1, len(self.tokens) // 4096)][:4096], dtype="<u4")
        return f"{zlib.crc32(sample.tobytes()):08x}"

    def state_dict(self) -> dict:
        return {"version": 1, "samples_seen": self._samples_seen, "seed": self.seed, "seq_len": self.seq_len,
                "shuffle": self.shuffle, "n_windows": self.n_windows, "n_tokens": len(self.tokens),
                "fingerprint": self._fingerprint, "global_batch": self.global_batch}

    def load_state_dict(self, state: dict) -> None:
        """Resume at ``state['samples_seen']``; any dp_size, micro_batch or global_batch may differ."""
        fixes = {"version": "a checkpoint from this meshpar version", "seed": "the same train.seed",
                 "seq_len": "the same train.seq_len", "shuffle": "the same shuffle setting",
                 "n_windows": "the same data", "n_tokens": "the same data and data.val_fraction",
                 "fingerprint": "the same data and tokenizer"}
        mine = self.state_dict()
        for key, fix in fixes.items():
            if state.get(key) != mine[key]:
                raise RecipeError(f"data loader checkpoint: {key} = {state.get(key)!r} there but {mine[key]!r} in "
                                  f"this run; resume with {fix}, or set checkpoint.exclude = [\"data\"] to start "
                                  f"the data order afresh", {"seed": "train.seed", "seq_len": "train.seq_len"}.get(key))
        self._samples_seen = int(state["samples_seen"])


def _batch_error(global_batch: int, micro_batch: int, dp_size: int) -> str:
    unit = micro_batch * dp_size
    sizes = [v for v in (global_batch // unit * unit, (global_batch // unit + 1) * unit) if v]
    fix = f"use train.global_batch = {' or '.join(map(str, sizes))}"
    if global_batch % dp_size == 0:
        per_rank = global_batch // dp_size
        near = sorted(sorted((d for d in range(1, per_rank + 1) if per_rank % d == 0),
                             key=lambda d: abs(d - micro_batch))[:3])
        fix += f", or train.micro_batch = {' or '.join(map(str, near))}"
    return (f"train.global_batch = {global_batch} is not a multiple of train.micro_batch ({micro_batch}) x the "
            f"data-parallel degree ({dp_size}) = {unit}, so it cannot split into equal microbatches per rank; {fix}")
