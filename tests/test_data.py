"""Data pipeline: sources, tokenizers, the token cache, and the layout-independent sample order."""

from __future__ import annotations

import gzip
import hashlib
import json
import multiprocessing as mp
import shutil
import time
from importlib import resources
from pathlib import Path

import numpy as np
import pytest
import torch

from meshpar.config.recipe import DataConfig, RecipeError
from meshpar.data import EOT, BatchLoader, BPETokenizer, permute, prepare, split_text

WORDS = ("the", "king", "queen", "crown", "sword", "night", "day", "love", "death", "fair", "foul", "lord", "lady",
         "speak", "hence", "ay", "no")


def synthetic_text(n_words: int, seed: int = 0) -> str:
    """Play-like lines: indentation, blank lines, trailing spaces, punctuation (what trips chunking)."""
    rng = np.random.default_rng(seed)
    lines = []
    for k in range(n_words // 8):
        words = " ".join(WORDS[j] for j in rng.integers(0, len(WORDS), 8))
        lines.append(["KING:", "  " + words + ",", words + ". ", "", words + "!\n"][k % 5])
    return "\n".join(lines) + "\n"


def config(tmp_path: Path, **kw) -> DataConfig:
    return DataConfig(**{"cache_dir": str(tmp_path / "cache"), **kw})


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def loader(tokens, **kw) -> BatchLoader:
    args = {"seq_len": 8, "global_batch": 8, "micro_batch": 2, "dp_rank": 0, "dp_size": 1, "seed": 0, **kw}
    return BatchLoader(tokens, **args)


def global_steps(tokens, steps: int, dp_size: int, micro_batch: int, **kw) -> list[torch.Tensor]:
    """Each step's inputs over all ranks, concatenated in rank then microbatch order: [global_batch, T]."""
    ranks = [loader(tokens, dp_rank=r, dp_size=dp_size, micro_batch=micro_batch, **kw) for r in range(dp_size)]
    return [torch.cat([x for rank in ranks for x, _ in rank.next_step()]) for _ in range(steps)]


# ---- sources, tokenizers and the cache ----

def test_builtin_corpus_bpe_and_cache(tmp_path):
    cfg = config(tmp_path)  # data.path = "" is Shakespeare; bpe 2048 by default
    start = time.perf_counter()
    corpus = prepare(cfg)
    cold = time.perf_counter() - start
    raw = resources.files("meshpar").joinpath("corpus/shakespeare.txt.gz").read_bytes()
    plays = gzip.decompress(raw).decode().split("\n\n\n")
    text = "".join(p + EOT for p in plays)  # each play a document, each document ends with EOS
    n = len(corpus.train) + len(corpus.val)
    assert corpus.vocab_size == 2048 and corpus.name == "shakespeare (bpe 2048)" and len(plays) == 38
    assert (np.asarray(corpus.train) == corpus.eos_id).sum() + (np.asarray(corpus.val) == corpus.eos_id).sum() == 38
    assert corpus.train.dtype == np.uint16 and isinstance(corpus.train, np.memmap)
    assert len(corpus.val) == int(n * cfg.val_fraction)
    assert 0.3 < n / len(text.encode()) < 0.45  # around the measured ratio: docs/performance.md#the-token-cache
    assert int(max(corpus.train.max(), corpus.val.max())) < 2048
    tok = corpus.tokenizer
    sample = text[100_000:120_000]
    assert tok.decode(tok.encode(sample)) == sample
    assert tok.decode(corpus.train[:500]) == text[:len(tok.decode(corpus.train[:500]))]
    assert tok.decode(corpus.val[-500:]) == text[-len(tok.decode(corpus.val[-500:])):]

    start = time.perf_counter()
    again = prepare(cfg)
    warm = time.perf_counter() - start
    assert warm < 0.5, f"cache hit took {warm:.2f} s (cold {cold:.2f} s)"
    assert np.array_equal(again.train, corpus.train) and np.array_equal(again.val, corpus.val)
    assert len(list((tmp_path / "cache").iterdir())) == 2  # one entry and its lock file


def test_byte_tokenizer_split_and_env_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHPAR_CACHE", str(tmp_path / "env-cache"))
    text = "Now is the winter of our discontent — made glorious summer.\n" * 50
    path = write(tmp_path / "richard.txt", text)
    corpus = prepare(DataConfig(path=str(path), tokenizer="byte", val_fraction=0.1))
    stream = np.concatenate([corpus.train, corpus.val])
    text += EOT  # the byte tokenizer ends each document with the separator text
    assert stream.tolist() == list(text.encode()) and corpus.vocab_size == 256
    assert len(corpus.val) == int(len(stream) * 0.1) and corpus.name == "richard.txt (byte)"
    assert corpus.tokenizer.decode(corpus.val) == text.encode()[len(corpus.train):].decode()
    none = prepare(DataConfig(path=str(path), tokenizer="byte", val_fraction=0.0))
    assert len(none.val) == 0 and len(none.train) == len(stream)
    assert len(list((tmp_path / "env-cache").glob("byte-*/meta.json"))) == 1  # the split is not in the key


def test_cache_key_follows_the_text_and_a_dead_builder_is_cleaned_up(tmp_path):
    path = write(tmp_path / "t.txt", "to be or not to be\n")
    cfg = config(tmp_path, path=str(path), tokenizer="byte", val_fraction=0.0)
    prepare(cfg)
    (entry,) = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    shutil.rmtree(entry)
    (tmp_path / "cache" / f".{entry.name}.tmp_dead").mkdir()  # as a builder killed mid-way leaves it
    prepare(cfg)
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [entry.name, entry.name + ".lock"]
    write(path, "that is the question\n")
    assert bytes(prepare(cfg).train.tolist()) == f"that is the question\n{EOT}".encode()
    assert len([p for p in (tmp_path / "cache").iterdir() if p.is_dir()]) == 2


def test_folder_of_text_files(tmp_path):
    docs = {"b/one.txt": "second doc\n", "a.txt": "first doc\n", "c.txt": "third\n", "notes.md": "skipped"}
    for name, text in docs.items():
        write(tmp_path / "data" / name, text)
    joined = "".join(d + EOT for d in ["first doc\n", "second doc\n", "third\n"])  # sorted by relative path
    byte = prepare(config(tmp_path, path=str(tmp_path / "data"), tokenizer="byte", val_fraction=0.0))
    assert bytes(byte.train.tolist()) == joined.encode()
    bpe = prepare(config(tmp_path, path=str(tmp_path / "data"), vocab_size=300, val_fraction=0.0))
    assert bpe.tokenizer.decode(bpe.train) == joined
    assert (np.asarray(bpe.train) == bpe.tokenizer.eot_id).sum() == 3 and bpe.eos_id == bpe.tokenizer.eot_id


def test_chunked_tokenization_equals_whole_and_training_is_deterministic():
    docs = [synthetic_text(4000, seed=1), synthetic_text(4000, seed=2)]
    tok = BPETokenizer.train(docs, 400)
    assert tok.tok.to_str() == BPETokenizer.train(docs, 400).tok.to_str()
    assert not any("endoftext" in t for t in tok.tok.get_vocab() if t != EOT)  # no merges learnt from separators
    text = EOT.join(docs)
    for size in (37, 200, 5000):
        parts = split_text(text, size)
        assert "".join(parts) == text and len(parts) > 1
        assert [i for p in parts for i in tok.encode(p)] == tok.encode(text)
    assert tok.encode_stream(text).tolist() == tok.encode(text)
    assert tok.decode(tok.encode(text)) == text


def test_token_files_are_memory_mapped(tmp_path):
    rng = np.random.default_rng(0)
    for fmt, high in (("uint16", 50_000), ("uint32", 100_000)):
        ids = rng.integers(0, high, 1000).astype(fmt)
        ids.tofile(tmp_path / f"ids.{fmt}")
        corpus = prepare(config(tmp_path, path=str(tmp_path / f"ids.{fmt}"), format=fmt, val_fraction=0.2))
        assert isinstance(corpus.train, np.memmap) and corpus.tokenizer is None
        assert corpus.vocab_size == int(ids.max()) + 1 and len(corpus.val) == 200
        assert np.array_equal(np.concatenate([corpus.train, corpus.val]), ids)
        (x, y), = loader(corpus.train, global_batch=2, micro_batch=2, shuffle=False).next_step()
        assert x.tolist() == [ids[0:8].tolist(), ids[8:16].tolist()] and y[0].tolist() == ids[1:9].tolist()


def _concurrent_worker(cfg: DataConfig, barrier, results) -> None:
    barrier.wait()  # every process calls prepare() at once, as the ranks of one host do
    corpus = prepare(cfg)
    entry = next(p for p in Path(cfg.cache_dir).iterdir() if p.is_dir() and not p.name.startswith("."))
    built_by = json.loads((entry / "meta.json").read_text())["built_by"]["pid"]
    digest = hashlib.sha256(np.asarray(corpus.train).tobytes() + np.asarray(corpus.val).tobytes()).hexdigest()
    tokenizer = hashlib.sha256(corpus.tokenizer.tok.to_str().encode()).hexdigest()
    results.put((digest, corpus.vocab_size, tokenizer, built_by == mp.current_process().pid))  # small: no join stall


def test_concurrent_prepare_builds_once(tmp_path):
    path = write(tmp_path / "big.txt", synthetic_text(100_000))
    cfg = config(tmp_path, path=str(path), vocab_size=512)
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(3), ctx.Queue()
    procs = [ctx.Process(target=_concurrent_worker, args=(cfg, barrier, results)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    out = [results.get(timeout=10) for _ in procs]
    assert len({o[:3] for o in out}) == 1  # identical tokens, vocab and tokenizer everywhere
    assert sum(o[3] for o in out) == 1  # exactly one process built the entry
    names = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert len(names) == 2 and names[1] == names[0] + ".lock"  # no temporary folders left


@pytest.mark.parametrize("case, fields, key", [
    ("missing", {"path": "nope.txt"}, "data.path"),
    ("empty folder", {"path": "{d}/empty"}, "data.path"),
    ("text as uint16", {"path": "{d}/t.txt", "format": "uint16"}, "data.format"),
    ("folder as uint32", {"path": "{d}", "format": "uint32"}, "mixes documents"),
    ("size not a multiple", {"path": "{d}/odd.bin", "format": "uint32"}, "data.format"),
    ("empty token file", {"path": "{d}/empty.bin", "format": "uint16"}, "data.path"),
    ("token format without path", {"format": "uint16"}, "data.path"),
    ("npy of floats", {"path": "{d}/floats.npy"}, "floats.npy"),
    ("empty text", {"path": "{d}/blank.txt"}, "data.path"),
    ("binary as text", {"path": "{d}/odd.bin"}, "data.format = 'uint16'"),
    ("unwritable cache", {"path": "{d}/t.txt", "cache_dir": "{d}/t.txt/cache"}, "data.cache_dir"),
])
def test_data_errors_name_the_key(tmp_path, case, fields, key):
    (tmp_path / "empty").mkdir()
    write(tmp_path / "t.txt", "some text\n")
    write(tmp_path / "blank.txt", "")
    (tmp_path / "odd.bin").write_bytes(b"\xff\xfe\x00\x01\x02\x03")
    (tmp_path / "empty.bin").write_bytes(b"")
    np.save(tmp_path / "floats.npy", np.arange(10, dtype=np.float32))
    fields = {k: v.format(d=tmp_path) for k, v in fields.items()}
    with pytest.raises(RecipeError, match=key.replace("(", r"\(")) as err:
        prepare(config(tmp_path, **fields))
    assert err.value.key in ("data.path", "data.format", "data.cache_dir")  # where the CLI says the value came from


def test_loader_errors_name_the_key():
    tokens = np.arange(100, dtype=np.uint16)
    with pytest.raises(RecipeError, match=r"train\.global_batch = 10 .*train\.micro_batch \(4\).*\(2\).*"
                                          r"global_batch = 8 or 16.*micro_batch = 1 or 5"):
        loader(tokens, global_batch=10, micro_batch=4, dp_size=2)
    with pytest.raises(RecipeError) as err:
        loader(tokens, global_batch=3, micro_batch=2)
    assert err.value.key == "train.global_batch"
    with pytest.raises(RecipeError, match=r"train\.seq_len = 100.*too small"):
        loader(tokens, seq_len=100)
    with pytest.raises(RecipeError, match=r"train\.seq_len = 8.*too small"):
        loader(np.zeros(0, dtype=np.uint16))


# ---- the sample order ----

def test_layout_does_not_change_the_data():
    tokens = np.arange(300, dtype=np.uint32)  # 37 windows of 8: five steps of 8 wrap into the next epoch
    reference = global_steps(tokens, 5, dp_size=1, micro_batch=8)
    for dp_size, micro_batch in [(1, 1), (1, 4), (2, 1), (2, 4), (4, 1), (4, 2)]:
        got = global_steps(tokens, 5, dp_size=dp_size, micro_batch=micro_batch)
        assert all(torch.equal(a, b) for a, b in zip(got, reference, strict=True)), (dp_size, micro_batch)


def test_targets_are_inputs_shifted_from_the_stream():
    tokens = np.random.default_rng(0).integers(0, 60_000, 500).astype(np.uint16)
    positions = np.arange(500, dtype=np.uint32)
    batch = loader(tokens, micro_batch=4, seed=3).next_step()
    where = loader(positions, micro_batch=4, seed=3).next_step()  # the same order over token positions
    for (x, y), (px, _) in zip(batch, where, strict=True):
        assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (4, 8)
        assert torch.equal(px[:, 0] % 8, torch.zeros(4, dtype=torch.int64))  # windows start at multiples of T
        assert torch.equal(x, torch.from_numpy(tokens[px.numpy()].astype(np.int64)))
        assert torch.equal(y, torch.from_numpy(tokens[px.numpy() + 1].astype(np.int64)))


def test_epochs_cover_every_window_once_in_new_orders():
    tokens = np.arange(145, dtype=np.uint32)  # 18 windows of 8; global batch 6: 3 steps per epoch
    steps = global_steps(tokens, 9, dp_size=2, micro_batch=3, global_batch=6, seed=7)
    epochs = [torch.cat(steps[i:i + 3])[:, 0].numpy() // 8 for i in range(0, 9, 3)]
    for order in epochs:
        assert sorted(order.tolist()) == list(range(18))
    assert len({tuple(o) for o in epochs}) == 3 and epochs[0].tolist() != list(range(18))
    in_order = global_steps(tokens, 4, dp_size=1, micro_batch=2, global_batch=6, shuffle=False)
    assert (torch.cat(in_order)[:, 0] // 8).tolist() == list(range(18)) + list(range(6))  # identity, wraps
    for n in (1, 2, 3, 1000, 4097):
        assert sorted(permute(np.arange(n), n, seed=1, epoch=2).tolist()) == list(range(n))
    assert not np.array_equal(permute(np.arange(1000), 1000, 0, 0), permute(np.arange(1000), 1000, 1, 0))


def test_state_dict_round_trip():
    tokens = np.arange(1000, dtype=np.uint32)
    a = loader(tokens, seed=5)
    for _ in range(3):
        a.next_step()
    state = json.loads(json.dumps(a.state_dict()))
    b = loader(tokens, seed=5)
    b.load_state_dict(state)
    assert b.samples_seen == a.samples_seen == 24
    for _ in range(3):
        for (x, y), (u, v) in zip(a.next_step(), b.next_step(), strict=True):
            assert torch.equal(x, u) and torch.equal(y, v)


def test_state_reshards_to_another_dp_degree():
    tokens = np.arange(400, dtype=np.uint32)
    reference = global_steps(tokens, 6, dp_size=1, micro_batch=8)
    dp2 = [loader(tokens, dp_rank=r, dp_size=2, micro_batch=2) for r in range(2)]
    for _ in range(3):
        for rank in dp2:
            rank.next_step()
    state = dp2[0].state_dict()
    dp4 = [loader(tokens, dp_rank=r, dp_size=4, micro_batch=1) for r in range(4)]
    for rank in dp4:
        rank.load_state_dict(state)
    for step in range(3, 6):
        assert torch.equal(torch.cat([x for rank in dp4 for x, _ in rank.next_step()]), reference[step])


def test_load_state_dict_rejects_another_run():
    tokens = np.arange(1000, dtype=np.uint32)
    state = loader(tokens, seed=1).state_dict()
    with pytest.raises(RecipeError, match=r"seed = 1 there but 2.*train\.seed.*checkpoint\.exclude"):
        loader(tokens, seed=2).load_state_dict(state)
    with pytest.raises(RecipeError, match=r"seq_len.*train\.seq_len"):
        loader(tokens, seed=1, seq_len=16).load_state_dict(state)
    with pytest.raises(RecipeError, match="fingerprint"):
        loader(tokens[::-1].copy(), seed=1).load_state_dict(state)


def test_val_path_is_tokenized_with_the_training_tokenizer(tmp_path):
    train_text = synthetic_text(3000, seed=1)
    write(tmp_path / "train.txt", train_text)
    val_docs = [synthetic_text(200, seed=2), "a short held-out line\n"]
    write(tmp_path / "val.jsonl", "".join(json.dumps({"text": d}) + "\n" for d in val_docs))
    cfg = config(tmp_path, path=str(tmp_path / "train.txt"), val_path=str(tmp_path / "val.jsonl"), vocab_size=300)
    corpus = prepare(cfg)
    tok = corpus.tokenizer
    assert tok.tok.to_str() == BPETokenizer.train([train_text], 300).tok.to_str()  # trained on train only
    assert np.asarray(corpus.train).tolist() == tok.encode(train_text) + [tok.eot_id]  # no tail held out
    assert np.asarray(corpus.val).tolist() == [i for d in val_docs for i in tok.encode(d) + [tok.eot_id]]
    ids = np.arange(50, dtype=np.uint16)
    np.save(tmp_path / "val.npy", ids)
    tokens_val = prepare(config(tmp_path, path=str(tmp_path / "train.txt"), val_path=str(tmp_path / "val.npy"),
                                vocab_size=300))
    assert np.asarray(tokens_val.val).tolist() == ids.tolist() and len(tokens_val.train) == len(corpus.train)
    with pytest.raises(RecipeError, match="data.val_path") as err:
        prepare(config(tmp_path, path=str(tmp_path / "train.txt"), val_path=str(tmp_path / "nope.jsonl")))
    assert err.value.key == "data.val_path"
