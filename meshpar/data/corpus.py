"""``prepare(cfg)``: the ``[data]`` section -> a :class:`Corpus` (train sources and val token streams).

A data source (``data.path``, or each of ``data.sources``) is one of:

- documents: the built-in corpus (empty path), or files ``readers.expand`` finds (text, JSON Lines,
  Parquet, Arrow). They are tokenized through the cache into a prepared folder
  ([Note: the token cache], [Note: the prepared format]), with ``bpe`` trained on the training
  sources' documents, ``byte``, or a Hugging Face tokenizer;
- a folder made by ``meshpar data prepare``: memory-mapped as is;
- token ids: ``.npy`` arrays, or raw files with ``data.format = uint16 / uint32``;
- conversations (``data.format = chat``): rows of JSON Lines / Parquet / Arrow files, or the built-in
  plays' dialogues, rendered with a chat template and tokenized into a chat folder whose sources
  are :class:`~meshpar.data.packing.Conversations` ([Note: packing conversations]).

Validation is ``data.val_path`` (tokenized with the training tokenizer), or else the last
``val_fraction`` of each source's stream.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tokenizers

from meshpar.config.errors import RecipeError
from meshpar.config.recipe import DataConfig, DataSource
from meshpar.data.cache import cached
from meshpar.data.packing import Conversations
from meshpar.data.prepared import (
    BUILTIN,
    Encoder,
    Prepared,
    conversations,
    documents,
    is_prepared,
    open_prepared,
    prepare_folder,
)
from meshpar.data.stream import TokenStream, concat
from meshpar.data.tokenizer import EOT, BPETokenizer, ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer
from meshpar.runtime.progress import Progress

CACHE_VERSION = 2  # bump when the cache layout or the tokenization changes (2: prepared folders, EOS after each doc)
Stream = np.ndarray | TokenStream | Conversations


@dataclass(frozen=True)
class Corpus:
    sources: tuple[Stream, ...]  # each training source's 1-D token ids (memory-mapped)
    weights: tuple[float, ...]  # each source's share of the samples, summing to 1
    val: Stream  # held-out tokens; empty when val_fraction = 0 and no val_path
    vocab_size: int  # the tokenizer's vocabulary; for token files, max id + 1
    tokenizer: Tokenizer | None  # None for token files
    name: str  # for logs, e.g. "shakespeare (bpe 2048)"
    eos_id: int | None = None  # the id ending every document (None: byte tokenizer, token files; chat: the separator)

    @property
    def train(self) -> Stream:
        """Every training source's tokens as one stream (the stream itself for one source)."""
        if len(self.sources) == 1:
            return self.sources[0]
        if isinstance(self.sources[0], Conversations):
            return Conversations.join(self.sources)
        return concat(list(self.sources))

    @property
    def chat(self) -> bool:
        return isinstance(self.sources[0], Conversations)


def tokenizer_choice(cfg: DataConfig, hf_weights: str = "") -> str:
    """``bpe``, ``byte`` or a Hugging Face tokenizer path: ``auto`` is checkpoint.hf_weights' own tokenizer."""
    if cfg.tokenizer != "auto":
        return cfg.tokenizer
    if not hf_weights:
        return "bpe"
    folder = Path(hf_weights).expanduser()
    if not (folder / "tokenizer.json").is_file():
        raise RecipeError(f"data.tokenizer = 'auto' takes the tokenizer of checkpoint.hf_weights = {hf_weights!r}, "
                          f"but that folder has no tokenizer.json; set data.tokenizer to the model's tokenizer (a "
                          f"tokenizer.json or a folder holding one), or to bpe / byte to train with a new one",
                          "data.tokenizer")
    return str(folder)


def prepare(cfg: DataConfig, hf_weights: str = "") -> Corpus:
    """Read, tokenize (through the cache) and split the data that ``cfg`` names."""
    specs = cfg.sources or (DataSource(cfg.path, 1.0),)
    key = "data.sources" if cfg.sources else "data.path"
    kinds = [_classify(s.path, cfg, key) for s in specs]
    val_kind = _classify(cfg.val_path, cfg, "data.val_path") if cfg.val_path else None
    choice = tokenizer_choice(cfg, hf_weights)
    if cfg.format == "chat" and choice == "byte":
        raise RecipeError("data.format = 'chat' with data.tokenizer = 'byte': byte ids have no separator to end each "
                          "conversation with; use bpe or a Hugging Face tokenizer", "data.tokenizer")
    streams: list[Stream | None] = [None] * len(specs)
    val: Stream | None = None
    made: list[Prepared] = []  # prepared folders (cache entries included): their tokenizers must agree
    doc_groups = [(str(i), files) for i, (kind, files) in enumerate(kinds) if kind == "docs"]
    val_docs = val_kind is not None and val_kind[0] == "docs"
    if doc_groups or val_docs:
        entry = _tokenized(cfg, choice, doc_groups, val_kind[1] if val_docs else None)
        made.append(entry)
        for name, _ in doc_groups:
            streams[int(name)] = entry.groups[name]
        if val_docs:
            val = entry.groups["val"]
    from meshpar.data.readers import read_tokens

    for i, (kind, what) in enumerate(kinds):
        if kind == "prepared":
            made.append(open_prepared(what, key))
            streams[i] = made[-1].tokens
        elif kind == "tokens":
            streams[i] = concat([read_tokens(f, cfg.format, key) for f in what])
    if val_kind is not None and val_kind[0] != "docs":
        val = (open_prepared(val_kind[1], "data.val_path").tokens if val_kind[0] == "prepared"
               else concat([read_tokens(f, cfg.format, "data.val_path") for f in val_kind[1]]))
    tokenizer, vocab_size, eos, tok_label = _tokenizer_of(made, choice, key)
    if cfg.format == "chat" and made and "chat" in made[0].meta:
        eos = made[0].meta["chat"]["separator"]  # the document end of [Note: packing conversations]
    id_files = [s for s, (kind, _) in zip(streams, kinds, strict=True) if kind == "tokens"]
    if id_files:  # ids of files nobody tokenized here: the vocabulary must hold the largest
        vocab_size = max(vocab_size, max(_max_id(s) for s in id_files) + 1)
    for i, s in enumerate(streams):
        if not len(s):
            raise RecipeError(f"{_where(specs, i, key)}: the source holds no tokens (no documents); point it at "
                              f"some data", key)
    for i, s in enumerate(streams):
        if (cfg.format == "chat") != isinstance(s, Conversations):
            raise RecipeError(f"{_where(specs, i, key)} was prepared " + (
                "as documents, not conversations; prepare it again with data.format = 'chat'" if cfg.format == "chat"
                else "from conversations (chat data); set data.format = 'chat'"), "data.format")
    if val is None and cfg.format == "chat":
        halves = [s.split(cfg.val_fraction) for s in streams]
        streams, val = [h for h, _ in halves], Conversations.join([t for _, t in halves])
    elif val is None:
        cut = [len(s) - int(len(s) * cfg.val_fraction) for s in streams]
        val = concat([s[c:] for s, c in zip(streams, cut, strict=True)])
        streams = [s[:c] for s, c in zip(streams, cut, strict=True)]
    total = sum(s.weight for s in specs)
    names = [_source_name(s.path) for s in specs]
    name = names[0] if len(specs) == 1 else "mixture of " + ", ".join(
        f"{n} {s.weight / total:.2g}" for n, s in zip(names, specs, strict=True))
    return Corpus(tuple(streams), tuple(s.weight / total for s in specs), val, vocab_size, tokenizer,
                  f"{name} ({tok_label})", eos)


def _where(specs, i: int, key: str) -> str:
    return f"{key}[{i}].path = {specs[i].path!r}" if key == "data.sources" else f"data.path = {specs[i].path!r}"


def _source_name(path: str) -> str:
    return Path(path).name or path if path else "shakespeare"


def _classify(path: str, cfg: DataConfig, key: str) -> tuple[str, object]:
    """("docs", [files]) / ("prepared", folder) / ("tokens", [files]) for one source's path."""
    if cfg.format == "chat":
        return _classify_chat(path, key)
    if not path:
        if cfg.format in ("uint16", "uint32"):
            raise RecipeError(f"data.format = {cfg.format!r} needs data.path: a file of token ids", "data.path")
        return "docs", [BUILTIN]
    from meshpar.data.readers import expand, kind_of

    folder = Path(path).expanduser()
    if is_prepared(folder):
        return "prepared", folder
    if cfg.format in ("uint16", "uint32") and folder.is_file() and kind_of(folder) in (None, "bin"):
        return "tokens", [folder]  # raw ids under any name, as ndarray.tofile wrote them
    files = expand(path, key)
    tokens = [f for f in files if kind_of(f) in ("npy", "bin")]
    if cfg.format in ("uint16", "uint32"):
        if len(tokens) < len(files):
            raise RecipeError(f"{key} = {path!r} holds documents ({files[0].name}, ...) but data.format = "
                              f"{cfg.format!r} reads raw token ids; set data.format = 'auto'", "data.format")
        return "tokens", files
    raw = [f for f in tokens if kind_of(f) == "bin"]
    if raw:
        raise RecipeError(f"{key} = {path!r}: {raw[0].name} holds raw token ids; set data.format = 'uint16' or "
                          f"'uint32' to read it", "data.format")
    return ("tokens" if tokens else "docs"), files


def _classify_chat(path: str, key: str) -> tuple[str, object]:
    """A chat source: the built-in dialogues (empty path), a prepared chat folder, or files of rows."""
    if not path:
        return "docs", [BUILTIN]
    from meshpar.data.readers import expand, kind_of

    folder = Path(path).expanduser()
    if is_prepared(folder):
        return "prepared", folder
    files = expand(path, key)
    other = [f for f in files if kind_of(f) not in ("jsonl", "jsonl.gz", "jsonl.zst", "parquet", "arrow")]
    if other:
        raise RecipeError(f"{key} = {path!r}: {other[0].name} holds no rows; data.format = 'chat' reads conversations "
                          f"from .jsonl, .parquet or .arrow files (each row 'messages', or 'prompt' and 'completion')",
                          "data.format")
    return "docs", files


def _encoder(choice: str, docs=None, vocab_size: int = 0, chat_template: str | None = None
             ) -> tuple[Encoder, Tokenizer]:
    """The encoder (and tokenizer) of ``choice``; ``chat_template`` not None for chat data: a template file, or ""
    for the tokenizer's own (meshpar's plain one for bpe). ``docs``: bpe's training text."""
    if chat_template is not None:
        return _chat_encoder(choice, docs, vocab_size, chat_template)
    if choice == "byte":
        return Encoder("byte"), ByteTokenizer()
    if choice == "bpe":
        tok = BPETokenizer.train(docs, vocab_size)
        return Encoder("bpe", tok.tok.to_str(), tok.eot_id, None, tok.vocab_size), tok
    hf = load_tokenizer(choice)
    return Encoder("hf", hf.tok.to_str(), hf.eos_id, hf.bos_id, hf.vocab_size, hf.fingerprint()), hf


def chat_template_of(choice: str, chat_template: str):
    """The ChatTemplate chat data is rendered with ([Note: rendering a chat template])."""
    from meshpar.data.chat import PLAIN_TEMPLATE, ChatTemplate, ChatTemplateError

    try:
        if chat_template:
            file = Path(chat_template).expanduser()
            if not file.is_file():
                raise RecipeError(f"data.chat_template = {chat_template!r}: no such file; give a Jinja chat "
                                  f"template file, or leave it empty for the tokenizer's own", "data.chat_template")
            if choice == "bpe":
                return ChatTemplate(file.read_text(), where=str(file))
            folder = Path(choice).expanduser()  # the tokenizer folder's special tokens, as transformers passes them
            return ChatTemplate.from_folder(folder if folder.is_dir() else folder.parent, file)
        if choice == "bpe":
            return ChatTemplate(PLAIN_TEMPLATE, where="meshpar's plain chat template")
        folder = Path(choice).expanduser()
        return ChatTemplate.from_folder(folder if folder.is_dir() else folder.parent)
    except ChatTemplateError as e:
        raise RecipeError(f"data.chat_template: {e}", "data.chat_template") from None


def _chat_encoder(choice: str, conversations, vocab_size: int, chat_template: str) -> tuple[Encoder, Tokenizer]:
    from meshpar.data.chat import choose_separator

    template = chat_template_of(choice, chat_template)
    if choice == "bpe":
        tok: Tokenizer = BPETokenizer.train((template.render(c) for c in conversations), vocab_size)
        base = Encoder("bpe", tok.tok.to_str(), tok.eot_id, None, tok.vocab_size)
        separator = tok.eot_id
    else:
        tok = load_tokenizer(choice)
        base = Encoder("hf", tok.tok.to_str(), tok.eos_id, tok.bos_id, tok.vocab_size, tok.fingerprint())
        separator = choose_separator(tok.tok, template, tok.eos_id)
        if separator is None:
            raise RecipeError(f"data.tokenizer = {choice!r}: every special token of the tokenizer appears in its "
                              f"chat template's conversations, so none can end a packed conversation; add a pad "
                              f"token to its tokenizer_config.json", "data.tokenizer")
    return dataclasses.replace(base, chat=template.source, special=tuple(sorted(template.special.items())),
                               separator=separator), tok


def _tokenized(cfg: DataConfig, choice: str, groups: list[tuple[str, list]], val_files: list | None) -> Prepared:
    """The cache entry holding ``groups`` (and a ``val`` group) tokenized: [Note: the token cache]."""
    inputs = [[str(f) for f in files] for _, files in groups]
    settings = {"version": CACHE_VERSION, "text_field": cfg.text_field, "groups": inputs,
                "val": [str(f) for f in val_files or []]}
    chat = cfg.format == "chat"
    if chat:
        settings.update(chat=chat_template_of(choice, cfg.chat_template).source)
    if choice == "bpe":
        settings.update(tokenizer="bpe", vocab_size=cfg.vocab_size, eot=EOT)
        label = f"bpe{cfg.vocab_size}" + ("-chat" if chat else "")
    elif choice == "byte":
        settings.update(tokenizer="byte")
        label = "byte"
    else:
        enc, _ = _encoder(choice, chat_template=cfg.chat_template if chat else None)
        settings.update(tokenizer=enc.fingerprint())
        label = "hf"
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    for f in (f for files in [*inputs, settings["val"]] for f in files):
        _hash_input(digest, f)
    root = Path(cfg.cache_dir or os.environ.get("MESHPAR_CACHE") or Path.home() / ".cache" / "meshpar").expanduser()

    def build(tmp: Path) -> None:
        named = [(name, [str(f) for f in files]) for name, files in groups]
        named += [("val", [str(f) for f in val_files])] if val_files else []
        n_files = sum(len(fs) for _, fs in named)
        print(f"meshpar: data: tokenizing {n_files} file(s) with {choice} into the cache {root} (once; "
              f"`meshpar data prepare` does it ahead of time)", file=sys.stderr, flush=True)
        if chat:
            train_docs = (c for _, files in groups for f in files for c in conversations(str(f)))
        else:
            train_docs = (d for _, files in groups for f in files for d in documents(str(f), cfg.text_field))
        enc, _ = _encoder(choice, train_docs, cfg.vocab_size, chat_template=cfg.chat_template if chat else None)
        progress = Progress(n_files, sys.stderr.isatty(), unit="file")
        try:
            report = prepare_folder(tmp, named, cfg.text_field, enc, progress=progress)
        finally:
            progress.close()
        print(f"meshpar: data: {report.tokens:,} tokens from {report.documents:,} documents in {report.seconds:.1f} s",
              file=sys.stderr, flush=True)

    entry = cached(root, f"{label}-{digest.hexdigest()[:24]}", build)
    return open_prepared(entry)


def _hash_input(digest, source: str) -> None:
    """An input's identity in the cache key: the packaged corpus by its bytes, files by path, size and mtime
    (a changed file gets a new entry; hashing every byte of a large corpus at each launch would cost minutes)."""
    if source == BUILTIN:
        digest.update(b"builtin:shakespeare:v1")
        return
    st = os.stat(source)
    digest.update(f"{os.path.abspath(source)}:{st.st_size}:{st.st_mtime_ns}".encode())


def _tokenizer_of(made: list[Prepared], choice: str, key: str) -> tuple[Tokenizer | None, int, int | None, str]:
    """The one tokenizer of every tokenized source: (tokenizer, vocab size, EOS id, label for logs)."""
    if not made:  # token files only
        return None, 0, None, "token ids"
    encoders = {p.meta["encoder"] for p in made}
    if len(encoders) > 1:
        raise RecipeError(f"{key}: the sources were tokenized with different tokenizers ("
                          + ", ".join(f"{p.path}: {p.meta['tokenizer']}" for p in made)
                          + "); prepare them with one tokenizer", key)
    meta, path = made[0].meta, made[0].path
    if meta["tokenizer"] == "byte":
        tok: Tokenizer = ByteTokenizer()
        label = "byte"
    elif meta["tokenizer"] == "bpe":
        tok = BPETokenizer(tokenizers.Tokenizer.from_file(str(path / "tokenizer.json")))
        label = f"bpe {tok.vocab_size}"
    elif (given := load_tokenizer(choice) if choice not in ("bpe", "byte", "auto") else None) is not None \
            and given.fingerprint() == meta.get("hf_fingerprint"):
        tok = given  # as given: its tokenizer_config.json (chat template, class) goes into checkpoints
        label = f"tokenizer {Path(choice).name}, vocab {meta['vocab_size']}"
    else:
        raw = (path / "tokenizer.json").read_bytes()
        where = choice if choice not in ("bpe", "byte", "auto") else str(path)
        tok = HFTokenizer(raw, tokenizers.Tokenizer.from_str(raw.decode()), {}, meta["eos_id"], meta["bos_id"], where)
        label = f"tokenizer {Path(where).name}, vocab {meta['vocab_size']}"
    return tok, meta["vocab_size"], meta["eos_id"], label


def _max_id(tokens: Stream, block: int = 1 << 24) -> int:
    """The largest id, reading the (memory-mapped) stream in blocks."""
    if isinstance(tokens, TokenStream):
        return tokens.max()
    return max((int(tokens[i:i + block].max()) for i in range(0, len(tokens), block)), default=0)


