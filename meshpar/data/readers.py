"""Readers for the file formats corpora come in: path specs -> files -> documents, or -> token ids.

Documents (one ``str`` each, empty ones skipped):

- ``.txt``: the whole file is one document (UTF-8);
- ``.jsonl`` / ``.jsonl.gz`` / ``.jsonl.zst``: one JSON object per non-blank line, the document is
  its ``data.text_field`` (default ``text``; null skipped);
- ``.parquet``: one document per row of the ``text_field`` column (null rows skipped);
- ``.arrow``: Arrow IPC, the stream format (what Hugging Face ``datasets`` saves as
  ``data-00000-of-0000N.arrow``) or the file format; same column rules as Parquet.

Token ids: ``.npy`` (1-D, uint8 / uint16 / uint32) or raw little-endian ids (``.bin``, any suffix
for :func:`read_tokens`) with ``data.format = uint16 / uint32``; both memory-mapped read-only.

Streaming: :func:`read_documents` holds one line (JSON Lines), one record batch and 1 MB of read
buffer (Parquet), or one memory-mapped record batch (Arrow) at a time, never the whole file, so the
first document of a file of any size comes back at once. A ``.txt`` file is one document, read
whole. Parquet, Arrow and ``.zst`` need the ``data`` extra (pyarrow, zstandard), imported only when
such a file is read.

[Note: why pyarrow] pyarrow's ``iter_batches`` reads Parquet faster, in less memory and with a
much cheaper import than ``datasets``' streaming or its Arrow cache; its defaults, though, keep
whole column chunks (a row group can be GBs) in memory, so the reader turns pre-buffering off and
reads through a 1 MB buffer. Figures: docs/performance.md#reading-parquet.
"""

from __future__ import annotations

import gzip
import importlib
import io
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from meshpar.config.errors import RecipeError

DOC_SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet", ".arrow")  # document files
TOKEN_SUFFIXES = (".npy", ".bin")  # pre-tokenized: .npy (header gives dtype), .bin = raw ids (format uint16/uint32)
_BY_LENGTH = sorted(DOC_SUFFIXES + TOKEN_SUFFIXES, key=len, reverse=True)  # .jsonl.gz before .jsonl
_BATCH_ROWS = 1024  # rows per Parquet / Arrow record batch read
_STRING_TYPES = ("string", "large_string", "string_view")


def kind_of(path: Path) -> str | None:
    """'txt' | 'jsonl' | 'jsonl.gz' | 'jsonl.zst' | 'parquet' | 'arrow' | 'npy' | 'bin' by the (compound) suffix,
    case-insensitive; None for anything else."""
    name = Path(path).name.lower()
    return next((s[1:] for s in _BY_LENGTH if name.endswith(s)), None)


def expand(spec: str, key: str = "data.path") -> list[Path]:
    """The files a path spec names, in a deterministic order: a file; a folder (recursive, every file whose kind_of
    is not None, sorted by relative POSIX path, hidden files/folders (leading '.') skipped); or a glob
    (``corpus/*.jsonl.gz``, ``**`` allowed, sorted the same way, hidden skipped). ``~`` expanded. RecipeError(..., key)
    naming the spec and the fix when nothing matches, when a file (or a glob's match) has an unknown suffix, or when a
    folder/glob mixes document files and token files."""
    where = f"{key} = {spec!r}"
    known = ", ".join(DOC_SUFFIXES + TOKEN_SUFFIXES)
    if not spec:
        raise RecipeError(f"{key} is empty: name a file, a folder or a glob of {known} files", key)
    path = Path(spec).expanduser()
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = _visible_files(path, (f for f in path.rglob("*") if kind_of(f) is not None))
        if not files:
            raise RecipeError(f"{where}: the folder holds no {known} files; add some, or point {key} elsewhere", key)
    elif any(c in spec for c in "*?["):
        root, pattern = _split_glob(path)
        files = _visible_files(root, root.glob(pattern))
        if not files:
            raise RecipeError(f"{where}: the glob matches no files; check the pattern (** spans folders: "
                              f"corpus/**/*.jsonl)", key)
    else:
        raise RecipeError(f"{where}: no such file, folder or glob", key)
    unknown = [f for f in files if kind_of(f) is None]
    if unknown:
        raise RecipeError(f"{where}: {unknown[0]} has an unknown suffix; corpora are {known} files (raw token ids: "
                          f"rename to .bin){'; narrow the glob' if len(files) > 1 else ''}", key)
    docs = [f for f in files if "." + kind_of(f) in DOC_SUFFIXES]
    if docs and len(docs) < len(files):
        ids = next(f for f in files if "." + kind_of(f) in TOKEN_SUFFIXES)
        raise RecipeError(f"{where} mixes documents ({docs[0]}) and token ids ({ids}); point {key} at one kind "
                          f"(for several sources, list them in data.sources)", key)
    return files


def _visible_files(root: Path, found: Iterator[Path]) -> list[Path]:
    """The files of ``found`` with no hidden part ('.'-led) below ``root``, sorted by relative POSIX path."""
    rel = {f: f.relative_to(root) for f in found if f.is_file()}
    return sorted((f for f, r in rel.items() if not any(p.startswith(".") for p in r.parts)),
                  key=lambda f: rel[f].as_posix())


def _split_glob(path: Path) -> tuple[Path, str]:
    """``/a/b/*/c*.jsonl`` -> (``/a/b``, ``*/c*.jsonl``): the folder before the first wildcard, the rest."""
    parts = path.parts
    first = next(i for i, p in enumerate(parts) if any(c in p for c in "*?["))
    return Path(*parts[:first]) if first else Path("."), "/".join(parts[first:])


def read_documents(path: Path, text_field: str = "text", key: str = "data.path") -> Iterator[str]:
    """The non-empty documents of one file, streaming (never the whole file in memory for jsonl/parquet/arrow);
    see the module docstring for the formats. Errors (bad UTF-8 or JSON, a missing or non-string field or column,
    a missing optional library) are RecipeErrors naming the file; field problems have key data.text_field."""
    path = Path(path)
    kind = kind_of(path)
    if kind == "txt":
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as e:
            raise RecipeError(f"{key}: {path} is not UTF-8 text (bad byte at offset {e.start}); for a file of token "
                              f"ids set data.format = 'uint16' or 'uint32'", key) from None
        if text:
            yield text
    elif kind in ("jsonl", "jsonl.gz", "jsonl.zst"):
        yield from _jsonl(path, kind, text_field, key)
    elif kind in ("parquet", "arrow"):
        yield from _arrow_table(path, kind, text_field, key)
    else:
        raise RecipeError(f"{key}: {path} is not a document file ({', '.join(DOC_SUFFIXES)})", key)


def read_rows(path: Path, key: str = "data.path") -> Iterator[dict]:
    """Every row of a JSON Lines, Parquet or Arrow file as a dict (chat data: meshpar/data/chat.py),
    streaming as :func:`read_documents` does; errors as its."""
    path = Path(path)
    kind = kind_of(path)
    if kind in ("jsonl", "jsonl.gz", "jsonl.zst"):
        yield from (obj for _, obj in _jsonl_objects(path, kind, key))
    elif kind in ("parquet", "arrow"):
        for batch in _arrow_batches(path, kind, None, key):
            yield from batch.to_pylist()
    else:
        raise RecipeError(f"{key}: {path} holds no rows: conversations come in .jsonl, .jsonl.gz, .jsonl.zst, "
                          f".parquet or .arrow files", key)


def _jsonl(path: Path, kind: str, text_field: str, key: str) -> Iterator[str]:
    for lineno, obj in _jsonl_objects(path, kind, key):
        doc = obj.get(text_field)
        if text_field not in obj or (doc is not None and not isinstance(doc, str)):
            what = f"is a {type(doc).__name__}, not a string" if text_field in obj else "is missing"
            raise RecipeError(f"data.text_field = {text_field!r} {what} in {path}:{lineno} (the fields there "
                              f"are {sorted(obj)}); set data.text_field to the field that holds the text",
                              "data.text_field")
        if doc:  # null and '' skipped
            yield doc


def _jsonl_objects(path: Path, kind: str, key: str) -> Iterator[tuple[int, dict]]:
    """(line number, object) of each non-blank line."""
    # Lines stay bytes: json.loads decodes UTF-8 itself, and a decode error keeps its exact line number.
    corrupt: tuple[type[Exception], ...] = (OSError, EOFError)  # a truncated or corrupt .gz / .zst
    lineno, size, unzstd = 0, 0, None
    with open(path, "rb") as raw:
        try:
            if kind == "jsonl.gz":
                lines: io.BufferedIOBase = gzip.GzipFile(fileobj=raw)
            elif kind == "jsonl.zst":
                zstd = _optional("zstandard", path, key)
                corrupt = (*corrupt, zstd.ZstdError)
                size = zstd.get_frame_parameters(raw.read(18)).content_size  # 18: the longest frame header
                raw.seek(0)
                unzstd = zstd.ZstdDecompressor().stream_reader(raw, read_across_frames=True)
                lines = io.BufferedReader(unzstd)
            else:
                lines = raw
            for lineno, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                    if not isinstance(obj, dict):
                        raise ValueError(f"a JSON {type(obj).__name__}")
                except ValueError as e:  # also JSONDecodeError and UnicodeDecodeError
                    _check_zstd_end(lines, unzstd, size)
                    raise RecipeError(f"{key}: {path}:{lineno} is not a JSON object ({e}); JSON Lines files hold one "
                                      f"object per line", key) from None
                yield lineno, obj
            _check_zstd_end(lines, unzstd, size)
        except corrupt as e:
            raise RecipeError(f"{key}: {path} cannot be read as {kind} after line {lineno} ({e}); is the file "
                              f"complete?", key) from None


def _check_zstd_end(lines: io.BufferedIOBase, unzstd, size: int) -> None:
    """zstandard's reader ends a cut stream silently (often inside the last line): at the end of ``lines``, compare
    the bytes read with the first frame's header (``size`` is 2**64 - 1 where the header does not say)."""
    if unzstd is not None and size < 1 << 63 and not lines.peek(1) and unzstd.tell() < size:
        raise EOFError(f"{unzstd.tell()} bytes of the {size} that its first frame's header promises")


def _arrow_table(path: Path, kind: str, text_field: str, key: str) -> Iterator[str]:
    for batch in _arrow_batches(path, kind, text_field, key):
        yield from filter(None, batch.column(text_field).to_pylist())  # nulls and '' skipped


def _arrow_batches(path: Path, kind: str, column: str | None, key: str) -> Iterator:
    """The record batches of a Parquet or Arrow file: of ``column`` alone (checked to be text), or whole."""
    pa = _optional("pyarrow", path, key)
    try:
        if kind == "parquet":
            import pyarrow.parquet as pq

            # [Note: why pyarrow]: the defaults hold whole column chunks (a row group can be GBs) in memory
            source = pq.ParquetFile(path, pre_buffer=False, buffer_size=1 << 20)
            schema = source.schema_arrow
            batches = source.iter_batches(batch_size=_BATCH_ROWS, columns=None if column is None else [column])
        else:
            source = pa.memory_map(str(path))
            if source.read(6) == b"ARROW1":  # the file (random-access) format's magic; the stream format has none
                reader = pa.ipc.open_file(source)
                batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
            else:
                source.seek(0)
                reader = pa.ipc.open_stream(source)
                batches = iter(reader)
            schema = reader.schema
        with source:
            if column is not None:
                _check_column(schema, path, column)
            yield from batches
    except pa.ArrowException as e:
        raise RecipeError(f"{key}: {path} cannot be read as {kind} ({e}); is the file complete?", key) from None


def _check_column(schema, path: Path, text_field: str) -> None:
    if text_field not in schema.names:
        raise RecipeError(f"data.text_field = {text_field!r}: {path} has no such column (the columns there are "
                          f"{schema.names}); set data.text_field to the one that holds the text", "data.text_field")
    kind = str(schema.field(text_field).type)
    if kind not in _STRING_TYPES:
        raise RecipeError(f"data.text_field = {text_field!r}: column {text_field!r} of {path} is {kind}, not "
                          f"string; set data.text_field to the column that holds the text", "data.text_field")


def _optional(module: str, path: Path, key: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        raise RecipeError(f"{key}: reading {path} needs {module}, which is not installed: "
                          f"pip install 'meshpar[data]'", key) from None


def read_tokens(path: Path, fmt: str, key: str = "data.path") -> np.ndarray:
    """A pre-tokenized file as a read-only 1-D memory map: ``.npy`` (its header gives the dtype: uint8, uint16 or
    uint32; ``fmt`` is not used) or raw little-endian ids of ``fmt`` 'uint16' / 'uint32' (any other suffix)."""
    path = Path(path)
    where = f"{key}: {path}"
    if kind_of(path) == "npy":
        try:
            ids = np.load(path, mmap_mode="r", allow_pickle=False)
        except ValueError as e:
            raise RecipeError(f"{where} is not a readable .npy array ({e})", key) from None
        if ids.ndim != 1 or ids.dtype.kind != "u" or ids.dtype.itemsize > 4 or ids.dtype.byteorder == ">":
            raise RecipeError(f"{where} is a {ids.ndim}-D {ids.dtype} array; token ids are a 1-D uint8/16/32 array: "
                              f"np.save(path, ids.reshape(-1).astype(np.uint32))", key)
        if not len(ids):
            raise RecipeError(f"{where} holds no token ids", key)
        return ids
    if fmt not in ("uint16", "uint32"):
        raise RecipeError(f"{where} holds raw token ids: set data.format = 'uint16' or 'uint32' (not {fmt!r})",
                          "data.format")
    itemsize = np.dtype(fmt).itemsize
    size = path.stat().st_size
    if size == 0 or size % itemsize:
        raise RecipeError(f"{where}: {size} bytes is not a whole, non-zero number of {fmt} ids "
                          f"({itemsize} bytes each); check data.format", "data.format")
    return np.memmap(path, dtype=f"<u{itemsize}", mode="r")
