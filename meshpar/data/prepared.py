"""Prepared corpora: tokenize once, memory-map forever.

[Note: the prepared format]
A prepared folder (what ``meshpar data prepare`` writes, and what every token cache entry is):

    meta.json          written last: the folder is complete exactly when it exists
    plan.json          the inputs and the tokenizer, written first (a resumed run must match it)
    tokenizer.json     the tokenizer that made the ids (absent for the byte tokenizer)
    shards/00000.bin   the token ids of input file 0, every document followed by EOS (dtype in meta)
    shards/00000.idx   int64 end offset of each document in the shard (the index: documents)
    shards/00000.json  the shard's record: source, its size and mtime, documents, tokens; written
                       after the .bin and .idx are synced, so a shard with a record is complete
    shards/00000.mask  chat data only: one byte per token, 1 where the token is trained (the
                       assistant's); each document is a conversation followed by the separator id
                       ([Note: packing conversations] in meshpar/data/packing.py)

One shard per input file, in ``readers.expand``'s order: the unit of work over processes and of
resumption (a killed run redoes only the files that have no record). ``meta.json``'s ``groups``
name consecutive shard ranges: a training cache entry keeps one group per mixture source, a
folder from ``meshpar data prepare`` has one. Files are read streaming, a batch of documents at a
time, so memory stays bounded by the batch whatever the corpus size.
"""

from __future__ import annotations

import gzip
import json
import os
import resource
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from importlib import resources
from multiprocessing import current_process, get_context
from pathlib import Path

import numpy as np
import tokenizers

from meshpar.config.errors import RecipeError
from meshpar.data.packing import Conversations
from meshpar.data.stream import TokenStream, concat
from meshpar.data.tokenizer import EOT, split_text
from meshpar.runtime.atomic import fsync_dir, write_atomic

FORMAT = "meshpar-prepared"
VERSION = 1
BUILTIN = "<builtin:shakespeare>"  # the packaged corpus, as an input "file"
BATCH_CHARS = 1 << 22  # documents are tokenized in batches of about this many characters


@dataclass(frozen=True)
class Encoder:
    """What a worker process needs to tokenize: picklable, rebuilt in each process.

    ``kind``: ``byte`` (UTF-8 bytes, the separator text after each document), ``bpe`` (meshpar's
    byte-level BPE: long documents are cut with ``split_text`` for parallel encoding) or ``hf``.
    """

    kind: str
    json: str = ""  # tokenizer.json's text (bpe, hf)
    eos: int | None = None
    bos: int | None = None
    vocab_size: int = 256
    hf_fingerprint: str = ""  # HFTokenizer.fingerprint() of the tokenizer given (its file's bytes), for hf
    chat: str = ""  # chat data: the chat template's source (documents are conversations, rows of messages)
    special: tuple[tuple[str, str], ...] = ()  # the special tokens the template may name (bos_token, ...)
    separator: int | None = None  # chat data: the id after each conversation

    @property
    def dtype(self) -> str:
        return "<u2" if self.vocab_size <= 1 << 16 else "<u4"

    def fingerprint(self) -> str:
        import hashlib

        chat = [self.chat, list(self.special), self.separator] if self.chat else []
        return hashlib.sha256(json.dumps([self.kind, self.json, self.eos, self.bos, *chat]).encode()).hexdigest()[:24]


def builtin_text() -> str:
    raw = resources.files("meshpar").joinpath("corpus/shakespeare.txt.gz").read_bytes()
    return gzip.decompress(raw).decode("utf-8")


def documents(source: str, text_field: str) -> Iterator[str]:
    if source == BUILTIN:  # its 38 plays, each a document (two blank lines separate them)
        yield from (play for play in builtin_text().split("\n\n\n") if play.strip())
    else:
        from meshpar.data.readers import read_documents

        yield from read_documents(Path(source), text_field)


def conversations(source: str) -> Iterator[list[dict]]:
    """A chat source's conversations: the built-in plays' dialogues, or each row's messages."""
    from meshpar.data.chat import ChatTemplateError, dialogues, messages_of

    if source == BUILTIN:
        yield from dialogues(builtin_text())
        return
    from meshpar.data.readers import read_rows

    for i, row in enumerate(read_rows(Path(source))):
        try:
            yield messages_of(row)
        except ChatTemplateError as e:
            raise RecipeError(f"data.path: row {i} of {source}: {e}", "data.path") from None


def _batches(source: str, text_field: str, chat: bool = False) -> Iterator[list]:
    batch, chars = [], 0
    for doc in conversations(source) if chat else documents(source, text_field):
        batch.append(doc)
        chars += len(doc) if not chat else sum(len(str(m.get("content", ""))) for m in doc)
        if chars >= BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


class _Tokenize:
    """Documents -> one id array per document, ``[bos] + ids + [eos]`` (byte: text + separator)."""

    def __init__(self, enc: Encoder):
        self.enc = enc
        self.tok = tokenizers.Tokenizer.from_str(enc.json) if enc.json else None
        if self.tok is not None:  # some tokenizer.json files switch these on; ids must be the whole document's
            self.tok.no_truncation()
            self.tok.no_padding()
        self.sep = np.frombuffer(EOT.encode(), np.uint8)

    def __call__(self, docs: list) -> list[np.ndarray]:
        if self.enc.chat:
            raise TypeError("chat data is tokenized by _TokenizeChat")
        if self.tok is None:
            return [np.concatenate([np.frombuffer(d.encode("utf-8"), np.uint8), self.sep]) for d in docs]
        pieces, owner = [], []
        for i, d in enumerate(docs):  # only our BPE's pre-tokenizer guarantees split_text's cuts are exact
            parts = split_text(d) if self.enc.kind == "bpe" else [d]
            pieces += parts
            owner += [i] * len(parts)
        encoded = self.tok.encode_batch(pieces, add_special_tokens=False)
        ids: list[list[int]] = [[] if self.enc.bos is None else [self.enc.bos] for _ in docs]
        for i, e in zip(owner, encoded, strict=True):
            ids[i] += e.ids
        return [np.asarray(d + [self.enc.eos], dtype=np.int64) for d in ids]


class _TokenizeChat:
    """Conversations -> (ids + [separator], trained flags + [0]) each; conversations that hold the
    separator or train no token are left out and counted ([Note: packing conversations])."""

    def __init__(self, enc: Encoder):
        from meshpar.data.chat import ChatTemplate

        self.enc, self.template = enc, ChatTemplate(enc.chat, dict(enc.special))
        self.tok = tokenizers.Tokenizer.from_str(enc.json)
        self.tok.no_truncation()
        self.tok.no_padding()
        self.skipped = {"separator": 0, "untrained": 0}

    def __call__(self, batch: list[list[dict]]) -> tuple[list[np.ndarray], list[np.ndarray]]:
        from meshpar.data.chat import ChatTemplateError, encode_conversations

        try:
            encoded = encode_conversations(self.tok, self.template, batch)
        except ChatTemplateError as e:
            raise RecipeError(f"data.path: {e}", "data.path") from None
        ids, flags = [], []
        for tokens, trained in encoded:
            if self.enc.separator in tokens:
                self.skipped["separator"] += 1
            elif not any(trained):
                self.skipped["untrained"] += 1
            else:
                ids.append(np.asarray(tokens + [self.enc.separator], np.int64))
                flags.append(np.asarray(trained + [False], np.uint8))
        return ids, flags


def _identity(source: str) -> dict:
    if source == BUILTIN:
        return {"source": "shakespeare (built in)"}
    st = os.stat(source)
    return {"source": source, "bytes": st.st_size, "mtime_ns": st.st_mtime_ns}


def prepare_file(index: int, source: str, text_field: str, enc: Encoder, out: Path,
                 report: Callable[[int, int], None] | None = None) -> dict:
    """Tokenize one input file into shard ``index`` of the folder ``out``; returns its record."""
    shard = out / "shards" / f"{index:05d}"
    chat = bool(enc.chat)
    tokenize, dtype = (_TokenizeChat if chat else _Tokenize)(enc), np.dtype(enc.dtype)
    n_docs = n_tokens = n_trained = 0
    names = ["bin", "idx"] + (["mask"] if chat else [])
    files = {name: open(f"{shard}.{name}.tmp", "wb") for name in names}  # noqa: SIM115 - closed below
    try:
        for batch in _batches(source, text_field, chat):
            arrays = tokenize(batch)
            if chat:
                arrays, flags = arrays
                if not arrays:
                    continue
                files["mask"].write(np.concatenate(flags).tobytes())
                n_trained += int(sum(int(f.sum()) for f in flags))
            lengths = np.fromiter((len(a) for a in arrays), np.int64, len(arrays))
            files["bin"].write(np.concatenate(arrays).astype(dtype).tobytes())
            files["idx"].write((n_tokens + np.cumsum(lengths)).astype("<i8").tobytes())
            n_docs, n_tokens = n_docs + len(arrays), n_tokens + int(lengths.sum())
            if report is not None:
                report(len(arrays), int(lengths.sum()))
        for f in files.values():
            f.flush()
            os.fsync(f.fileno())
    finally:
        for f in files.values():
            f.close()
    for name in names:
        os.replace(f"{shard}.{name}.tmp", f"{shard}.{name}")
    record = {**_identity(source), "shard": index, "documents": n_docs, "tokens": n_tokens}
    if chat:
        record.update(trained=n_trained, skipped=tokenize.skipped)
    write_atomic(Path(f"{shard}.json"), json.dumps(record).encode())
    return record


def _worker_init() -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one file per process: cores are used across files


def _pool_file(args: tuple) -> dict:
    return prepare_file(*args)


@dataclass
class Report:
    documents: int
    tokens: int
    seconds: float
    workers: int
    reused: int  # shards kept from an interrupted run
    peak_rss_mb: float  # the largest of this process and its workers


def prepare_folder(out: Path, groups: Sequence[tuple[str, Sequence[str]]], text_field: str, enc: Encoder, *,
                   workers: int = 0, progress=None, extra_meta: dict | None = None) -> Report:
    """Tokenize ``groups`` (name, input files) into the prepared folder ``out``, resuming a partial one.

    ``progress`` (a runtime.progress.Progress over the input files, or None) advances a file at a time;
    ``workers`` 0 means one per CPU core, capped by the number of files.
    """
    start = time.perf_counter()
    files = [f for _, fs in groups for f in fs]
    plan = {"format": FORMAT, "version": VERSION, "encoder": enc.fingerprint(), "text_field": text_field,
            "groups": [[name, list(fs)] for name, fs in groups], "inputs": [_identity(f) for f in files]}
    (out / "shards").mkdir(parents=True, exist_ok=True)
    old = _read_json(out / "plan.json")
    if old is not None and old != plan:
        raise RecipeError(f"{out} holds a preparation of other inputs or another tokenizer (its plan.json "
                          f"differs); choose another output folder or remove it", "out")
    write_atomic(out / "plan.json", json.dumps(plan, indent=1).encode())
    if enc.json:
        write_atomic(out / "tokenizer.json", enc.json.encode())
    records: dict[int, dict] = {}
    for i, f in enumerate(files):  # shards done by an interrupted run, of the same input file
        rec = _read_json(out / "shards" / f"{i:05d}.json")
        if rec is not None and {k: rec.get(k) for k in _identity(f)} == _identity(f):
            records[i] = rec
    reused = len(records)
    todo = [i for i in range(len(files)) if i not in records]
    workers = max(1, min(workers or os.cpu_count() or 1, len(todo)))
    if current_process().daemon:  # a daemonic process (a multiprocessing worker) may not start children
        workers = 1
    counts = [0, 0]

    def report(docs: int, tokens: int) -> None:
        counts[0] += docs
        counts[1] += tokens
        if progress is not None:
            progress.postfix(tokens=counts[1])

    if progress is not None:
        progress.update(reused)
    if workers == 1:
        for i in todo:  # in this process: tokenizers' batch encoding uses every core
            records[i] = prepare_file(i, files[i], text_field, enc, out, report)
            if progress is not None:
                progress.update(progress.done + 1)
    else:
        with ProcessPoolExecutor(workers, mp_context=get_context("fork"), initializer=_worker_init) as pool:
            futures = [pool.submit(_pool_file, (i, files[i], text_field, enc, out)) for i in todo]
            for fut in as_completed(futures):
                rec = fut.result()
                records[rec["shard"]] = rec
                report(rec["documents"], rec["tokens"])
                if progress is not None:
                    progress.update(progress.done + 1)
    shards = [records[i] for i in range(len(files))]
    n_docs, n_tokens = sum(r["documents"] for r in shards), sum(r["tokens"] for r in shards)
    bounds, at = [], 0
    for name, fs in groups:
        bounds.append({"name": name, "shards": [at, at + len(fs)],
                       "tokens": sum(r["tokens"] for r in shards[at:at + len(fs)])})
        at += len(fs)
    seconds = time.perf_counter() - start
    meta = {"format": FORMAT, "version": VERSION, "dtype": enc.dtype, "vocab_size": enc.vocab_size,
            "eos_id": enc.eos, "bos_id": enc.bos, "tokenizer": enc.kind, "encoder": enc.fingerprint(),
            "hf_fingerprint": enc.hf_fingerprint,
            "documents": n_docs, "tokens": n_tokens, "groups": bounds, "shards": shards,
            **({"chat": {"separator": enc.separator, "trained": sum(r["trained"] for r in shards),
                         "skipped": {k: sum(r["skipped"][k] for r in shards) for k in ("separator", "untrained")}}}
               if enc.chat else {}),
            "seconds": round(seconds, 3), "built_by": _built_by(), **(extra_meta or {})}
    write_atomic(out / "meta.json", json.dumps(meta, indent=1).encode())
    fsync_dir(out)
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return Report(n_docs, n_tokens, seconds, workers, reused, max(own, children) / 1024)


def _built_by() -> dict:
    """Who built it: host, pid and the torchrun rank, if any (the cache's builder, [Note: the token cache])."""
    return {"host": socket.gethostname(), "pid": os.getpid(),
            **{k.lower(): int(os.environ[k]) for k in ("RANK", "LOCAL_RANK") if k in os.environ}}


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def is_prepared(path: Path) -> bool:
    meta = _read_json(path / "meta.json") if path.is_dir() else None
    return meta is not None and meta.get("format") == FORMAT


@dataclass(frozen=True)
class Prepared:
    """A complete prepared folder, opened: each group's token stream and what made it."""

    path: Path
    meta: dict
    groups: dict[str, np.ndarray | TokenStream | Conversations]  # Conversations for chat data

    @property
    def tokens(self) -> np.ndarray | TokenStream:
        """Every group's tokens, in order (chat data: its Conversations)."""
        groups = list(self.groups.values())
        if isinstance(groups[0], Conversations):
            return Conversations.join(groups) if len(groups) > 1 else groups[0]
        return concat(groups) if len(groups) > 1 else groups[0]


def open_prepared(path: Path, key: str = "data.path") -> Prepared:
    meta = _read_json(path / "meta.json")
    if meta is None or meta.get("format") != FORMAT:
        raise RecipeError(f"{key} = {str(path)!r}: not a complete prepared folder (no meta.json: was "
                          f"`meshpar data prepare` interrupted? run it again to finish)", key)
    if meta.get("version") != VERSION:
        raise RecipeError(f"{key} = {str(path)!r}: prepared by another meshpar version (format {meta.get('version')},"
                          f" this one reads {VERSION}); prepare it again", key)
    shards = [np.memmap(path / "shards" / f"{r['shard']:05d}.bin", dtype=meta["dtype"], mode="r", shape=(r["tokens"],))
              if r["tokens"] else np.empty(0, meta["dtype"]) for r in meta["shards"]]
    if "chat" in meta:
        parts = [_conversations(path, r, shard, meta["chat"]["separator"]) for r, shard in zip(meta["shards"], shards,
                                                                                                strict=True)]
        groups = {g["name"]: Conversations.join(parts[g["shards"][0]:g["shards"][1]]) for g in meta["groups"]}
        return Prepared(path, meta, groups)
    groups = {g["name"]: concat(shards[g["shards"][0]:g["shards"][1]] or [np.empty(0, meta["dtype"])])
              for g in meta["groups"]}
    return Prepared(path, meta, groups)


def _conversations(path: Path, record: dict, tokens: np.ndarray, separator: int) -> Conversations:
    """A chat shard: its tokens, trained flags and conversation ends."""
    name = path / "shards" / f"{record['shard']:05d}"
    if not record["tokens"]:
        return Conversations(tokens, np.empty(0, np.uint8), np.empty(0, np.int64), separator)
    trained = np.memmap(f"{name}.mask", dtype=np.uint8, mode="r", shape=(record["tokens"],))
    ends = np.fromfile(f"{name}.idx", dtype="<i8").astype(np.int64)
    return Conversations(tokens, trained, ends, separator)
