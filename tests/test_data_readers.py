"""meshpar.data.readers: every corpus format gives the documents written, in order; path specs expand
deterministically; each bad input is a RecipeError naming the file and the key; jsonl, Parquet and
Arrow are read streaming."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from meshpar.config.errors import RecipeError
from meshpar.data.readers import expand, kind_of, read_documents, read_tokens

DOCS = ["First document.", "Second,\nover two lines.", "ünïcödé ✓ {\"json\": 1}", "x", "The last one.\n"]


def _jsonl(docs, field="text") -> bytes:
    rows = [json.dumps({"id": i, field: d}) for i, d in enumerate(docs)]
    return ("\n".join(rows[:2]) + "\n\n   \n" + "\n".join(rows[2:]) + "\n\n").encode()  # blank lines skipped


def _table(docs, field="text") -> pa.Table:
    return pa.table({"id": list(range(len(docs))), field: docs})


def _write(tmp_path: Path, fmt: str, docs=DOCS, field="text") -> Path:
    """``docs`` as a ``fmt`` file (txt: a folder of one file per document), with '' entries in between."""
    with_empty = [docs[0], "", *docs[1:]]
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / f"corpus.{fmt}"
    if fmt == "txt":
        path = tmp_path / "txt"
        for i, d in enumerate(with_empty):
            (path / f"part{i // 3}").mkdir(parents=True, exist_ok=True)
            (path / f"part{i // 3}" / f"{i:02d}.txt").write_text(d, encoding="utf-8")
    elif fmt.startswith("jsonl"):
        raw = _jsonl(with_empty, field)
        path.write_bytes({"jsonl": raw, "jsonl.gz": gzip.compress(raw),
                          "jsonl.zst": zstandard.ZstdCompressor().compress(raw)}[fmt])
    elif fmt == "parquet":
        pq.write_table(_table([*with_empty, None], field), path, row_group_size=2)  # several row groups
    else:  # arrow-stream / arrow-file: record batches of 2 rows
        path = tmp_path / "data-00000-of-00001.arrow"
        table = _table([*with_empty, None], field)
        new = pa.ipc.new_stream if fmt == "arrow-stream" else pa.ipc.new_file
        with pa.OSFile(str(path), "wb") as sink, new(sink, table.schema) as writer:
            for batch in table.to_batches(max_chunksize=2):
                writer.write_batch(batch)
    return path


def _read(path: Path, field="text") -> list[str]:
    return [d for f in expand(str(path)) for d in read_documents(f, field)]


FORMATS = ["txt", "jsonl", "jsonl.gz", "jsonl.zst", "parquet", "arrow-stream", "arrow-file"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_gives_the_documents_in_order(tmp_path, fmt):
    assert _read(_write(tmp_path, fmt)) == DOCS


@pytest.mark.parametrize("fmt", ["jsonl.gz", "parquet", "arrow-stream"])
def test_custom_text_field(tmp_path, fmt):
    assert _read(_write(tmp_path, fmt, field="content"), "content") == DOCS


def test_hugging_face_arrow_is_the_stream_format(tmp_path):
    path = _write(tmp_path, "arrow-stream")
    assert path.read_bytes()[:4] == b"\xff\xff\xff\xff"  # as datasets' save_to_disk writes; the file format: ARROW1
    assert _write(tmp_path / "f", "arrow-file").read_bytes()[:6] == b"ARROW1"


def test_kind_of():
    assert [kind_of(Path(n)) for n in ["a.txt", "A.JSONL.GZ", "b.jsonl.zst", "c.jsonl", "d.Parquet", "e.arrow",
                                       "f.npy", "g.bin", "h.json", "i.gz", "j.txt.gz", "k"]] == \
        ["txt", "jsonl.gz", "jsonl.zst", "jsonl", "parquet", "arrow", "npy", "bin", None, None, None, None]


def _tree(root: Path, names: list[str]) -> None:
    for n in names:
        (root / n).parent.mkdir(parents=True, exist_ok=True)
        (root / n).write_text("doc " + n)


def test_expand_file_folder_and_globs(tmp_path, monkeypatch):
    _tree(tmp_path, ["c/b.jsonl", "c/a/z.txt", "c/A.txt", "c/a.parquet", "c/README.md", "c/.hidden.txt",
                     "c/.git/x.txt", "c/sub/.cache/y.jsonl", "c/sub/d.jsonl.gz"])
    c = tmp_path / "c"
    assert expand(str(c / "b.jsonl")) == [c / "b.jsonl"]
    rel = lambda files, root=c: [f.relative_to(root).as_posix() for f in files]
    # sorted by relative POSIX path (byte order: 'A' < 'a' . '.' < '/'); hidden files and folders, unknown suffixes
    # skipped
    assert rel(expand(str(c))) == ["A.txt", "a.parquet", "a/z.txt", "b.jsonl", "sub/d.jsonl.gz"]
    assert rel(expand(str(c / "*.txt"))) == ["A.txt"]
    assert rel(expand(str(c / "**" / "*.txt"))) == ["A.txt", "a/z.txt"]
    assert rel(expand(str(c / "**/*.jsonl*"))) == ["b.jsonl", "sub/d.jsonl.gz"]
    monkeypatch.setenv("HOME", str(tmp_path))
    assert rel(expand("~/c/*/z.txt")) == ["a/z.txt"]
    monkeypatch.chdir(tmp_path)
    assert expand("c/sub/*.gz") == [Path("c/sub/d.jsonl.gz")]


def _error(call) -> RecipeError:
    with pytest.raises(RecipeError) as info:
        call()
    return info.value


def _expand_errors(tmp_path: Path):
    _tree(tmp_path, ["mixed/a.txt", "mixed/b/ids.npy", "notes.md", "only.md/x.doc", "g/a.txt", "g/b.csv"])
    yield lambda: expand(str(tmp_path / "missing.txt")), "missing.txt", "data.path"
    yield lambda: expand(str(tmp_path / "only.md")), "only.md", "data.path"  # a folder with no corpus files
    yield lambda: expand(str(tmp_path / "nothing*.jsonl")), "nothing*.jsonl", "data.path"
    yield lambda: expand(str(tmp_path / "notes.md")), "notes.md", "data.path"
    yield lambda: expand(str(tmp_path / "g" / "*")), "b.csv", "data.path"
    yield lambda: expand(str(tmp_path / "mixed"), "data.val_path"), "ids.npy", "data.val_path"


def _read_errors(tmp_path: Path):
    def write(name: str, data: bytes) -> Path:
        (tmp_path / name).write_bytes(data)
        return tmp_path / name

    def read(path: Path, field="text"):
        return lambda: list(read_documents(path, field))

    yield read(write("bad.jsonl", b'{"text": "ok"}\n{"text": oops}\n')), "bad.jsonl:2", "data.path"
    yield read(write("list.jsonl", b'["text"]\n')), "list.jsonl:1", "data.path"
    yield read(write("field.jsonl", b'{"text": "a"}\n\n{"body": "b", "id": 3}\n')), "field.jsonl:3", "data.text_field"
    yield read(write("num.jsonl", b'{"text": 7}\n')), "num.jsonl:1", "data.text_field"
    yield read(write("latin1.txt", "caf\xe9".encode("latin-1"))), "latin1.txt", "data.path"
    yield read(write("latin1.jsonl", '{"text": "caf\xe9"}\n'.encode("latin-1"))), "latin1.jsonl:1", "data.path"
    yield read(write("trunc.jsonl.gz", gzip.compress(_jsonl(DOCS))[:-12])), "trunc.jsonl.gz", "data.path"
    yield read(_write(tmp_path / "p", "parquet"), "body"), "corpus.parquet", "data.text_field"
    yield read(_write(tmp_path / "p", "parquet"), "id"), "corpus.parquet", "data.text_field"  # an int64 column
    yield read(_write(tmp_path / "a", "arrow-file"), "body"), "data-00000-of-00001.arrow", "data.text_field"
    yield read(write("junk.parquet", b"not parquet at all")), "junk.parquet", "data.path"


def _token_errors(tmp_path: Path):
    for name, ids in [("int64.npy", np.arange(4)), ("float.npy", np.ones(4)), ("matrix.npy", np.zeros((2, 2), "u2")),
                      ("big_endian.npy", np.arange(4, dtype=">u2")), ("empty.npy", np.zeros(0, "u2"))]:
        np.save(tmp_path / name, ids)
        yield lambda name=name: read_tokens(tmp_path / name, "uint16"), name, "data.path"
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    yield lambda: read_tokens(tmp_path / "odd.bin", "uint16"), "odd.bin", "data.format"
    (tmp_path / "six.bin").write_bytes(bytes(6))
    yield lambda: read_tokens(tmp_path / "six.bin", "uint32"), "six.bin", "data.format"
    (tmp_path / "empty.bin").write_bytes(b"")
    yield lambda: read_tokens(tmp_path / "empty.bin", "uint16"), "empty.bin", "data.format"
    yield lambda: read_tokens(tmp_path / "six.bin", "text"), "six.bin", "data.format"


@pytest.mark.parametrize("cases", [_expand_errors, _read_errors, _token_errors])
def test_errors_name_the_file_and_the_key(tmp_path, cases):
    seen = 0
    for call, names, key in cases(tmp_path):
        e = _error(call)
        assert names in str(e) and e.key == key, (str(e), e.key)
        seen += 1
    assert seen >= 6


def test_error_messages_name_the_fix(tmp_path):
    (tmp_path / "f.jsonl").write_text('{"body": "b", "id": 3}\n')
    assert "the fields there are ['body', 'id']" in str(_error(lambda: list(read_documents(tmp_path / "f.jsonl"))))
    e = _error(lambda: list(read_documents(_write(tmp_path, "parquet"), "body")))
    assert "the columns there are ['id', 'text']" in str(e)
    (tmp_path / "t.txt").write_bytes(b"ok\xff")
    assert "offset 2" in str(e := _error(lambda: list(read_documents(tmp_path / "t.txt")))) and "uint16" in str(e)
    np.save(tmp_path / "i.npy", np.arange(3, dtype=np.int32))
    assert "astype(np.uint32)" in str(_error(lambda: read_tokens(tmp_path / "i.npy", "uint16")))
    _tree(tmp_path, ["m/a.txt", "m/b.bin"])
    assert "data.sources" in str(_error(lambda: expand(str(tmp_path / "m"))))


def test_read_tokens(tmp_path):
    for dtype in ("u1", "<u2", "<u4"):
        np.save(tmp_path / "ids.npy", (np.arange(300) % 256).astype(dtype))
        ids = read_tokens(tmp_path / "ids.npy", "uint32")  # the header gives the dtype, not fmt
        assert ids.dtype == np.dtype(dtype) and ids.ndim == 1 and not ids.flags.writeable
        assert list(ids[:3]) == [0, 1, 2] and isinstance(ids, np.memmap)
    np.arange(70000, dtype="<u4").tofile(tmp_path / "ids.bin")
    ids = read_tokens(tmp_path / "ids.bin", "uint32")
    assert ids.dtype == np.dtype("<u4") and int(ids[-1]) == 69999 and not ids.flags.writeable
    assert len(read_tokens(tmp_path / "ids.bin", "uint16")) == 140000  # raw files trust data.format


def _truncated(data: bytes) -> bytes:
    return data[: len(data) // 2]


def test_jsonl_is_read_streaming(tmp_path):
    # Truncated files: a reader that read (or decompressed) a file whole before its first document would fail
    # there; a streaming one gives the first documents, and the error only where the file ends.
    filler = b"x" * 1000
    raw = b"".join(b'{"text": "doc %d %s"}\n' % (i, filler) for i in range(50_000))  # 50 MB
    lines = raw.splitlines(keepends=True)
    zst = zstandard.ZstdCompressor(level=1).compressobj(size=len(raw))  # the size goes into the frame header
    cut = zst.compress(b"".join(lines[:25_000])) + zst.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK)  # cut at line end
    # .gz and .zst: the end of the stream is missing; .jsonl: the last line is cut in half, not JSON
    for name, data, error in [("big.jsonl.gz", _truncated(gzip.compress(raw, compresslevel=1)), "is the file complete"),
                              ("big.jsonl.zst", cut, "is the file complete"),
                              ("big.jsonl", _truncated(raw), r"big.jsonl:\d+ is not a JSON object")]:
        (tmp_path / name).write_bytes(data)
        docs = read_documents(tmp_path / name)
        assert next(docs) == f"doc 0 {filler.decode()}"
        assert next(docs) == f"doc 1 {filler.decode()}"
        with pytest.raises(RecipeError, match=error):
            list(docs)


def test_zstd_of_several_frames_or_no_size(tmp_path):
    c, raw = zstandard.ZstdCompressor(), _jsonl(DOCS)
    (tmp_path / "frames.jsonl.zst").write_bytes(c.compress(raw[:30]) + c.compress(raw[30:]))  # as `cat a.zst b.zst`
    assert list(read_documents(tmp_path / "frames.jsonl.zst")) == DOCS
    obj = c.compressobj()  # as `cat x.jsonl | zstd` writes: no content size in the header
    (tmp_path / "piped.jsonl.zst").write_bytes(obj.compress(raw) + obj.flush())
    assert list(read_documents(tmp_path / "piped.jsonl.zst")) == DOCS


def test_arrow_stream_is_read_streaming(tmp_path):
    path = _write(tmp_path, "arrow-stream", docs=[f"doc {i}" for i in range(10_000)])
    path.write_bytes(_truncated(path.read_bytes()))
    docs = read_documents(path)
    assert next(docs) == "doc 0"
    with pytest.raises(RecipeError, match="is the file complete"):
        list(docs)


def test_parquet_is_read_streaming(tmp_path):
    # One 50 MB row group, uncompressed: pyarrow's defaults hold the whole column chunk in its memory pool
    # (a deterministic count, unlike RSS) before the first batch; the reader holds about 1 MB of it.
    filler = "y" * 1000
    table = pa.table({"text": [f"doc {i} {filler}" for i in range(50_000)]})
    pq.write_table(table, tmp_path / "big.parquet", row_group_size=len(table), compression="none",
                   use_dictionary=False)
    del table
    before = pa.total_allocated_bytes()
    docs = read_documents(tmp_path / "big.parquet")
    assert next(docs) == f"doc 0 {filler}"
    assert pa.total_allocated_bytes() - before < 20e6
    docs.close()


@pytest.mark.parametrize("module, fmt", [("pyarrow", "parquet"), ("pyarrow", "arrow-file"),
                                         ("zstandard", "jsonl.zst")])
def test_missing_library_names_the_extra(tmp_path, monkeypatch, module, fmt):
    path = _write(tmp_path, fmt)
    monkeypatch.setitem(sys.modules, module, None)  # import fails: ImportError
    e = _error(lambda: list(read_documents(path)))
    assert "pip install 'meshpar[data]'" in str(e) and path.name in str(e) and e.key == "data.path"
