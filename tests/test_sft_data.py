"""Supervised fine-tuning data: greedy packing of whole conversations (meshpar/data/packing.py), the
loader's rows, IGNORE'd targets and global trained-target count for chat data (meshpar/data/loader.py),
and ``prepare`` with ``data.format = "chat"`` (meshpar/data/corpus.py, prepared.py, chat.py): the
trained tokens are exactly the assistant's turns, for meshpar's plain template, a template file and a
Hugging Face tokenizer folder (ids as transformers' ``apply_chat_template`` gives them).

Expected values come from references written here (a list-based packer, rows built by hand, templates
rendered with string formatting), not from the helpers under test."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from meshpar.config.errors import RecipeError
from meshpar.config.recipe import DataConfig
from meshpar.data import BatchLoader, prepare
from meshpar.data.loader import Step
from meshpar.data.packing import IGNORE, Conversations, Packed, pack
from meshpar.data.stream import TokenStream

SEP = 0  # the hand-built conversations' separator
T = 8  # seq_len: rows of T + 1 = 9 tokens
G = 8  # global batch
# conversation lengths (separator included): short ones, one exactly a row (9), longer ones cut (12, 10, 14)
LENGTHS = [4, 3, 9, 2, 6, 12, 5, 5, 2, 2, 2, 10, 7, 3, 8, 2, 14, 4, 4, 1, 6]


# ---- references ----

def reference_pack(lengths, width: int) -> tuple[list[list[int]], int]:
    """Greedy in-order packing: each row's item indices, and how many items are cut to ``width``."""
    rows: list[list[int]] = []
    row: list[int] = []
    used = 0
    for i, n in enumerate(lengths):
        if row and used + n > width:
            rows.append(row)
            row, used = [], 0
        row.append(i)
        used += min(n, width)
    if row:
        rows.append(row)
    return rows, sum(n > width for n in lengths)


def make_conversations(lengths, seed: int = 0, separator: int = SEP):
    """Conversations of random ids in [1, 1000) (each row distinct) and random trained flags, each
    ending with ``separator`` (untrained); also each conversation's own (ids, flags)."""
    rng = np.random.default_rng(seed)
    ids, flags = [], []
    for n in lengths:
        t = rng.integers(1, 1000, n)
        t[-1] = separator
        f = rng.random(n) < 0.6
        f[-1] = False
        ids.append(t)
        flags.append(f)
    conv = Conversations(np.concatenate(ids).astype(np.uint16), np.concatenate(flags).astype(np.uint8),
                         np.cumsum(lengths).astype(np.int64), separator)
    return conv, ids, flags


def expected_rows(ids, flags, width: int, separator: int = SEP) -> tuple[np.ndarray, np.ndarray]:
    """Rows by hand: the conversations of each reference row end to end, cut to ``width``, padded with
    the separator (never trained)."""
    rows, _ = reference_pack([len(t) for t in ids], width)
    out_ids = np.full((len(rows), width), separator, np.int64)
    out_trained = np.zeros((len(rows), width), bool)
    for r, members in enumerate(rows):
        row_ids = np.concatenate([ids[i] for i in members])[:width]
        row_trained = np.concatenate([flags[i] for i in members])[:width]
        out_ids[r, :len(row_ids)] = row_ids
        out_trained[r, :len(row_trained)] = row_trained
    return out_ids, out_trained


def trained_runs(tokens: np.ndarray, trained: np.ndarray) -> list[list[int]]:
    """The maximal runs of consecutive trained tokens."""
    runs: list[list[int]] = []
    previous = False
    for t, f in zip(tokens.tolist(), trained.tolist(), strict=True):
        if f and not previous:
            runs.append([])
        if f:
            runs[-1].append(t)
        previous = bool(f)
    return runs


def each_conversation(conv: Conversations):
    """(ids, trained flags) of each conversation, from the stream and its ends."""
    tokens, trained = np.asarray(conv.tokens), np.asarray(conv.trained)
    assert conv.ends[-1] == len(tokens) == len(trained)
    starts = np.concatenate([[0], conv.ends[:-1]])
    return [(tokens[a:b], trained[a:b]) for a, b in zip(starts.tolist(), conv.ends.tolist(), strict=True)]


# ---- packing ----

def test_pack_hand_made_lengths():
    starts, used, cut = pack(np.array([3, 4, 2, 9, 1, 5]), 6)
    # rows: [3] | [4, 2] | [9 cut to 6] | [1, 5]; items start at offsets 0, 3, 7, 9, 18, 19
    assert starts.tolist() == [0, 3, 9, 18] and used.tolist() == [3, 6, 6, 6] and cut == 1
    starts, used, cut = pack(np.array([6, 6, 1, 7, 7, 2]), 6)  # exact fits, then cut ones back to back
    assert starts.tolist() == [0, 6, 12, 13, 20, 27] and used.tolist() == [6, 6, 1, 6, 6, 2] and cut == 2
    starts, used, cut = pack(np.array([], np.int64), 6)
    assert starts.tolist() == [] and used.tolist() == [] and cut == 0
    starts, used, cut = pack(np.array([20]), 6)
    assert starts.tolist() == [0] and used.tolist() == [6] and cut == 1


@pytest.mark.parametrize("width", [1, 2, 5, 9, 33])
@pytest.mark.parametrize("seed", range(4))
def test_pack_equals_the_reference(width, seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 2 * width + 3, int(rng.integers(1, 60)))
    starts, used, cut = pack(lengths, width)
    rows, want_cut = reference_pack(lengths.tolist(), width)
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    assert cut == want_cut and len(starts) == len(used) == len(rows)
    assert (used <= width).all() and (used >= 1).all()
    assert np.all(np.diff(starts) > 0)
    got = [[i for i, o in enumerate(offsets.tolist()) if s <= o < s + u] for s, u in zip(starts, used, strict=True)]
    assert got == rows
    assert sorted(i for row in got for i in row) == list(range(len(lengths)))  # every item in exactly one row
    for s, u, row in zip(starts.tolist(), used.tolist(), rows, strict=True):
        assert s == offsets[row[0]]  # a row starts where its first item does
        assert u == sum(min(int(lengths[i]), width) for i in row)


# ---- packed rows ----

@pytest.mark.parametrize("stream", ["array", "shards"])
def test_packed_rows_are_whole_conversations_padded_with_the_separator(stream):
    conv, ids, flags = make_conversations(LENGTHS)
    if stream == "shards":  # the same conversations over three shards (a TokenStream), as a prepared folder opens
        bounds = np.concatenate([[0], conv.ends])
        conv = Conversations.join([Conversations(conv.tokens[bounds[a]:bounds[b]], conv.trained[bounds[a]:bounds[b]],
                                                 conv.ends[a:b] - bounds[a], SEP)
                                   for a, b in ((0, 5), (5, 6), (6, len(LENGTHS)))])
        assert isinstance(conv.tokens, TokenStream) and isinstance(conv.trained, TokenStream)
    width = T + 1
    rows = Packed(conv, T)
    want_ids, want_trained = expected_rows(ids, flags, width)
    got_ids, got_trained = rows.read(np.arange(rows.n))
    assert rows.n == len(want_ids) and rows.cut == sum(n > width for n in LENGTHS) == 3
    assert got_ids.shape == got_trained.shape == (rows.n, width) and got_trained.dtype == bool
    assert np.array_equal(got_ids, want_ids) and np.array_equal(got_trained, want_trained)
    conv_starts = set(np.concatenate([[0], np.cumsum(LENGTHS)[:-1]]).tolist())
    assert set(rows.starts.tolist()) <= conv_starts  # no row begins inside a conversation
    content = []
    for r in range(rows.n):
        n = int(rows.lengths[r])
        pad = slice(n, width)
        assert (got_ids[r, pad] == SEP).all() and not got_trained[r, pad].any()  # padding: separator, untrained
        content.append(got_ids[r, :n])
    assert np.array_equal(np.concatenate(content), np.concatenate([t[:width] for t in ids]))
    some = np.array([3, 0, 3, rows.n - 1])
    ids_some, trained_some = rows.read(some)
    assert np.array_equal(ids_some, want_ids[some]) and np.array_equal(trained_some, want_trained[some])
    assert rows.trained_targets(some) == int(want_trained[some, 1:].sum())


# ---- the loader ----

def global_steps(stream, steps: int, dp_size: int, micro_batch: int,
                 **kw) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """Each step's (inputs, targets) over all ranks in rank order, and its Step.trained (checked equal on
    every rank and to the targets not IGNORE'd over all ranks)."""
    args = {"seq_len": T, "global_batch": G, "micro_batch": micro_batch, "dp_size": dp_size, "seed": 5, **kw}
    ranks = [BatchLoader(stream, dp_rank=r, **args) for r in range(dp_size)]
    out = []
    for _ in range(steps):
        parts = [rank.next_step() for rank in ranks]
        for part in parts:
            assert isinstance(part, Step) and len(part) == G // dp_size // micro_batch
            for x, y in part:
                assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (micro_batch, T)
        counted = sum(int((y != IGNORE).sum()) for part in parts for _, y in part)
        assert [part.trained for part in parts] == [counted] * dp_size
        inputs = torch.cat([x for part in parts for x, _ in part])
        targets = torch.cat([y for part in parts for _, y in part])
        out.append((inputs, targets, counted))
    return out


def check_rows(inputs: torch.Tensor, targets: torch.Tensor, trained: int, want_ids, want_trained) -> list[int]:
    """Each row is one of the expected rows; its targets are the next ids where trained, IGNORE elsewhere.
    Returns the rows' indices."""
    index = {tuple(r[:-1].tolist()): i for i, r in enumerate(want_ids)}
    assert len(index) == len(want_ids)  # rows are told apart by their inputs
    found = [index[tuple(x.tolist())] for x in inputs]
    want_targets = np.where(want_trained[found, 1:], want_ids[found, 1:], IGNORE)
    assert np.array_equal(targets.numpy(), want_targets)
    kept = targets[:, :-1] != IGNORE
    assert torch.equal(targets[:, :-1][kept], inputs[:, 1:][kept])  # targets are the inputs shifted by one
    assert trained == int(want_trained[found, 1:].sum()) == int((targets != IGNORE).sum())
    return found


def test_loader_masks_untrained_targets_and_counts_the_whole_global_batch():
    conv, ids, flags = make_conversations(LENGTHS)
    want_ids, want_trained = expected_rows(ids, flags, T + 1)
    n = len(want_ids)
    steps = 5  # 40 samples: three epochs of the rows
    runs = {dp: global_steps(conv, steps, dp, mb) for dp, mb in ((1, 4), (2, 2), (4, 1), (4, 2))}
    for dp, run in runs.items():
        for (x, y, trained), (x1, y1, trained1) in zip(run, runs[1], strict=True):
            assert torch.equal(x, x1) and torch.equal(y, y1) and trained == trained1, dp  # one global batch
    found = [i for x, y, trained in runs[1] for i in check_rows(x, y, trained, want_ids, want_trained)]
    assert sorted(found[:n]) == list(range(n)) and sorted(found[n:2 * n]) == list(range(n))  # each epoch: every row
    assert found[:n] != list(range(n))  # shuffled
    in_order = global_steps(conv, steps, 2, 2, shuffle=False)
    found = [i for x, y, trained in in_order for i in check_rows(x, y, trained, want_ids, want_trained)]
    assert found == [g % n for g in range(steps * G)]


def test_loader_mixture_of_conversations_counts_the_whole_global_batch():
    a, ids_a, flags_a = make_conversations(LENGTHS, seed=1)
    b, ids_b, flags_b = make_conversations([3, 9, 2, 5, 11, 4, 4, 6, 2, 7], seed=2)
    want_ids = np.concatenate([expected_rows(ids_a, flags_a, T + 1)[0], expected_rows(ids_b, flags_b, T + 1)[0]])
    want_trained = np.concatenate([expected_rows(ids_a, flags_a, T + 1)[1], expected_rows(ids_b, flags_b, T + 1)[1]])
    runs = {dp: global_steps([a, b], 4, dp, 1, weights=[0.7, 0.3]) for dp in (1, 2, 4)}
    for dp in (2, 4):
        for (x, y, trained), (x1, y1, trained1) in zip(runs[dp], runs[1], strict=True):
            assert torch.equal(x, x1) and torch.equal(y, y1) and trained == trained1
    for x, y, trained in runs[1]:
        check_rows(x, y, trained, want_ids, want_trained)


def test_loader_state_round_trip_resumes_the_same_batches():
    conv, _, _ = make_conversations(LENGTHS)
    first = BatchLoader(conv, seq_len=T, global_batch=G, micro_batch=2, dp_rank=0, dp_size=1, seed=7)
    for _ in range(3):
        first.next_step()
    state = first.state_dict()
    assert state["samples_seen"] == 3 * G
    want = [first.next_step() for _ in range(3)]
    for dp, mb in ((1, 2), (2, 1), (4, 2)):
        ranks = [BatchLoader(conv, seq_len=T, global_batch=G, micro_batch=mb, dp_rank=r, dp_size=dp, seed=7)
                 for r in range(dp)]
        for rank in ranks:
            rank.load_state_dict(dict(state))
        for step in want:
            parts = [rank.next_step() for rank in ranks]
            assert all(p.trained == step.trained for p in parts)
            for k in (0, 1):
                assert torch.equal(torch.cat([mb_[k] for p in parts for mb_ in p]), torch.cat([s[k] for s in step]))
    other, _, _ = make_conversations(LENGTHS, seed=9)  # the same lengths, other ids: another corpus
    stranger = BatchLoader(other, seq_len=T, global_batch=G, micro_batch=2, dp_rank=0, dp_size=1, seed=7)
    with pytest.raises(RecipeError, match="fingerprint"):
        stranger.load_state_dict(dict(state))
    shorter = BatchLoader(conv, seq_len=T - 1, global_batch=G, micro_batch=2, dp_rank=0, dp_size=1, seed=7)
    with pytest.raises(RecipeError, match="seq_len"):
        shorter.load_state_dict(dict(state))


# ---- prepare: chat files to conversations ----

ROWS = [
    {"messages": [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "What is two plus two?"},
                  {"role": "assistant", "content": "Four."},
                  {"role": "user", "content": "And three plus three?"},
                  {"role": "assistant", "content": "Six, of course."}]},
    {"prompt": "Name a colour.", "completion": "Blue, like the sea."},
    {"messages": [{"role": "user", "content": "Is anyone there?"}]},  # nothing to train: skipped
    {"messages": [{"role": "user", "content": "Café or thé?"},
                  {"role": "assistant", "content": "Thé — naïvely, with lemon."}]},
    {"prompt": "Say hi.", "completion": "Hi there, friend!"},
]


def messages(row: dict) -> list[dict]:
    return row["messages"] if "messages" in row else [{"role": "user", "content": row["prompt"]},
                                                     {"role": "assistant", "content": row["completion"]}]


def trained_conversations(rows) -> list[list[dict]]:
    return [messages(r) for r in rows if any(m["role"] == "assistant" for m in messages(r))]


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def chat_config(tmp_path: Path, path: Path, **kw) -> DataConfig:
    args = {"path": str(path), "format": "chat", "tokenizer": "bpe", "vocab_size": 300, "val_fraction": 0.0,
            "cache_dir": str(tmp_path / "cache"), **kw}
    return DataConfig(**args)


def cache_entries(tmp_path: Path) -> list[Path]:
    return sorted(p for p in (tmp_path / "cache").iterdir() if p.is_dir())


def check_corpus(corpus, conversations: list[list[dict]], render, closing: str) -> None:
    """Each conversation renders as ``render`` writes it, ends with the untrained separator, holds it
    nowhere else, and trains exactly each assistant message's content followed by ``closing``."""
    assert corpus.chat and isinstance(corpus.sources[0], Conversations)
    conv = corpus.sources[0]
    sep = corpus.eos_id
    assert conv.separator == sep and sep is not None
    got = each_conversation(conv)
    assert len(got) == len(conversations)
    decode = corpus.tokenizer.decode
    for (ids, trained), msgs in zip(got, conversations, strict=True):
        assert ids[-1] == sep and not trained[-1] and sep not in ids[:-1].tolist()
        assert decode(ids[:-1]) == render(msgs)
        runs = [decode(run) for run in trained_runs(ids, trained != 0)]
        assert runs == [m["content"] + closing for m in msgs if m["role"] == "assistant"], runs


def plain(msgs) -> str:
    """meshpar's PLAIN_TEMPLATE, rendered by hand."""
    return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in msgs)


def test_prepare_chat_jsonl_trains_the_assistant_turns(tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", ROWS)
    corpus = prepare(chat_config(tmp_path, path))
    check_corpus(corpus, trained_conversations(ROWS), plain, "\n")
    conv = corpus.sources[0]
    assert corpus.vocab_size == 300 and int(np.asarray(conv.tokens).max()) < 300
    assert corpus.eos_id == corpus.tokenizer.eot_id and len(corpus.val) == 0
    (entry,) = cache_entries(tmp_path)
    meta = json.loads((entry / "meta.json").read_text())
    assert meta["chat"]["skipped"] == {"separator": 0, "untrained": 1}
    assert meta["chat"]["separator"] == corpus.eos_id and meta["documents"] == 4
    assert meta["chat"]["trained"] == int(np.asarray(conv.trained).sum())

    split = prepare(chat_config(tmp_path, path, val_fraction=0.3))  # the same cache entry, split by conversations
    assert cache_entries(tmp_path) == [entry]
    head, tail = split.sources[0], split.val
    assert isinstance(tail, Conversations) and len(head.ends) + len(tail.ends) == 4 and len(tail.ends) >= 1
    assert np.array_equal(np.concatenate([np.asarray(head.tokens), np.asarray(tail.tokens)]), np.asarray(conv.tokens))
    assert np.array_equal(np.concatenate([head.ends, tail.ends + head.ends[-1]]), conv.ends)
    n, lengths = len(conv), np.diff(conv.ends, prepend=0)
    assert len(tail) <= int(n * 0.3) < len(tail) + lengths[len(head.ends) - 1]  # the tail: about 30 %, whole
    check_corpus(split, trained_conversations(ROWS)[:len(head.ends)], plain, "\n")


def test_a_conversation_holding_the_separator_is_skipped(tmp_path):
    rows = [*ROWS[:2], {"prompt": "Print <|endoftext|> please.", "completion": "No."}]
    corpus = prepare(chat_config(tmp_path, write_jsonl(tmp_path / "chat.jsonl", rows)))
    check_corpus(corpus, trained_conversations(rows[:2]), plain, "\n")
    (entry,) = cache_entries(tmp_path)
    assert json.loads((entry / "meta.json").read_text())["chat"]["skipped"] == {"separator": 1, "untrained": 0}


def test_parquet_and_arrow_rows_give_the_same_tokens_as_jsonl(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [r for r in ROWS if "messages" in r]  # one schema: every row has messages
    want = prepare(chat_config(tmp_path, write_jsonl(tmp_path / "chat.jsonl", rows))).sources[0]
    table = pa.Table.from_pylist(rows)
    pq.write_table(table, tmp_path / "chat.parquet")
    with pa.OSFile(str(tmp_path / "chat.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    for name in ("chat.parquet", "chat.arrow"):
        got = prepare(chat_config(tmp_path, tmp_path / name)).sources[0]
        assert np.array_equal(np.asarray(got.tokens), np.asarray(want.tokens)), name
        assert np.array_equal(np.asarray(got.trained), np.asarray(want.trained)) and np.array_equal(got.ends, want.ends)


def test_parquet_mixing_messages_rows_and_prompt_completion_rows(tmp_path):
    """A Parquet table has every column in every row: a prompt / completion row reads back with
    ``messages: None`` (and a messages row with ``prompt: None``), and is still a prompt / completion row."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    want = prepare(chat_config(tmp_path, write_jsonl(tmp_path / "chat.jsonl", ROWS))).sources[0]
    columns = {k: [r.get(k) for r in ROWS] for k in ("messages", "prompt", "completion")}
    pq.write_table(pa.table(columns), tmp_path / "chat.parquet")
    assert pq.read_table(tmp_path / "chat.parquet").to_pylist()[1]["messages"] is None
    got = prepare(chat_config(tmp_path, tmp_path / "chat.parquet")).sources[0]
    assert np.array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    assert np.array_equal(np.asarray(got.trained), np.asarray(want.trained)) and np.array_equal(got.ends, want.ends)


def test_chat_errors(tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", ROWS)
    with pytest.raises(RecipeError, match="data.tokenizer") as e:
        prepare(chat_config(tmp_path, path, tokenizer="byte"))
    assert e.value.key == "data.tokenizer"
    text = tmp_path / "notes.txt"
    text.write_text("just text\n")
    with pytest.raises(RecipeError, match="notes.txt holds no rows") as e:
        prepare(chat_config(tmp_path, text))
    assert e.value.key == "data.format"
    bad = write_jsonl(tmp_path / "bad.jsonl", [ROWS[1], {"text": "no conversation here"}])
    with pytest.raises(RecipeError, match=r"row 1 of .*bad\.jsonl.*'messages', or 'prompt' and 'completion'") as e:
        prepare(chat_config(tmp_path, bad))
    assert e.value.key == "data.path"
    missing = tmp_path / "nowhere" / "template.jinja"
    with pytest.raises(RecipeError, match="no such file") as e:
        prepare(chat_config(tmp_path, path, chat_template=str(missing)))
    assert e.value.key == "data.chat_template" and str(missing) in str(e.value)
    assert not [p for p in (tmp_path / "cache").glob("*") if p.is_dir()]  # nothing half-built was left


TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}]\n{{ m['content'] }} [end]\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant]\n{% endif %}")


def test_a_chat_template_file(tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", ROWS)
    template = tmp_path / "template.jinja"
    template.write_text(TEMPLATE)
    corpus = prepare(chat_config(tmp_path, path, chat_template=str(template)))

    def render(msgs):
        return "".join(f"[{m['role']}]\n{m['content']} [end]\n" for m in msgs)

    check_corpus(corpus, trained_conversations(ROWS), render, " [end]\n")
    prepare(chat_config(tmp_path, path))  # the plain template: another cache entry
    assert len(cache_entries(tmp_path)) == 2


# ---- a Hugging Face tokenizer folder ----

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def chatml(msgs) -> str:
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in msgs)


def hf_folder(tmp_path: Path, specials: tuple[str, ...], pad: str | None) -> Path:
    """A tokenizer folder as a chat model's: tokenizer.json (a small byte-level BPE) and a
    tokenizer_config.json whose ChatML template ends each turn with the EOS, ``<|im_end|>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = [chatml(messages(r)) for r in ROWS] * 3 + ["the quick brown fox jumps over the lazy dog " * 4]
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=list(specials), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(text, trainer)
    folder = tmp_path / "tok"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "chat_template": CHATML,
              **({"pad_token": pad} if pad else {})}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_hf_tokenizer_folder_separator_is_the_pad_not_the_eos(tmp_path):
    # <|endoftext|> (id 0) is never written either: the pad is preferred to it
    folder = hf_folder(tmp_path, ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"), pad="<|pad|>")
    path = write_jsonl(tmp_path / "chat.jsonl", ROWS)
    corpus = prepare(chat_config(tmp_path, path, tokenizer=str(folder)))
    tok = corpus.tokenizer.tok
    eos, pad = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|pad|>")
    assert corpus.tokenizer.eos_id == eos and corpus.eos_id == pad == 3 and pad != eos
    conversations = trained_conversations(ROWS)
    check_corpus(corpus, conversations, chatml, "<|im_end|>\n")  # each assistant turn trains its <|im_end|>
    for (ids, trained), msgs in zip(each_conversation(corpus.sources[0]), conversations, strict=True):
        ends_of_turns = [bool(trained[i]) for i, t in enumerate(ids.tolist()) if t == eos]  # the eos, inside
        assert ends_of_turns == [m["role"] == "assistant" for m in msgs]  # trained where it closes a reply
    (entry,) = cache_entries(tmp_path)
    meta = json.loads((entry / "meta.json").read_text())
    assert meta["tokenizer"] == "hf" and meta["chat"]["separator"] == pad and meta["eos_id"] == eos

    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    for (ids, _), msgs in zip(each_conversation(corpus.sources[0]), conversations, strict=True):
        want = theirs.apply_chat_template(msgs, tokenize=True, return_dict=True)["input_ids"]
        assert ids[:-1].tolist() == list(want)


def test_hf_tokenizer_folder_without_a_pad_token(tmp_path):
    """No pad token: the separator is the one special token the template never writes."""
    folder = hf_folder(tmp_path, ("<|im_start|>", "<|im_end|>", "<|endoftext|>"), pad=None)
    path = write_jsonl(tmp_path / "chat.jsonl", ROWS)
    corpus = prepare(chat_config(tmp_path, path, tokenizer=str(folder)))
    assert corpus.eos_id == corpus.tokenizer.tok.token_to_id("<|endoftext|>") == 2
    check_corpus(corpus, trained_conversations(ROWS), chatml, "<|im_end|>\n")


def test_hf_tokenizer_folder_whose_template_writes_every_special_token(tmp_path):
    folder = hf_folder(tmp_path, ("<|im_start|>", "<|im_end|>"), pad=None)
    path = write_jsonl(tmp_path / "chat.jsonl", ROWS)
    with pytest.raises(RecipeError, match="add a pad token") as e:
        prepare(chat_config(tmp_path, path, tokenizer=str(folder)))
    assert e.value.key == "data.tokenizer"


EOS_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}:\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
                "{% if add_generation_prompt %}assistant:\n{% endif %}")


def test_a_chat_template_file_with_a_tokenizer_folder_names_its_special_tokens(tmp_path):
    """data.chat_template with a tokenizer folder: the template sees the folder's special tokens
    (``eos_token``, ``pad_token``), as transformers' ``apply_chat_template(chat_template=...)`` renders it."""
    folder = hf_folder(tmp_path, ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"), pad="<|pad|>")
    template = tmp_path / "template.jinja"
    template.write_text(EOS_TEMPLATE)
    corpus = prepare(chat_config(tmp_path, write_jsonl(tmp_path / "chat.jsonl", ROWS), tokenizer=str(folder),
                                 chat_template=str(template)))

    def render(msgs):
        return "".join(f"{m['role']}:\n{m['content']}<|im_end|>\n" for m in msgs)

    conversations = trained_conversations(ROWS)
    check_corpus(corpus, conversations, render, "<|im_end|>\n")
    assert corpus.eos_id == corpus.tokenizer.tok.token_to_id("<|pad|>")  # the folder's pad token
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    for (ids, _), msgs in zip(each_conversation(corpus.sources[0]), conversations, strict=True):
        want = theirs.apply_chat_template(msgs, chat_template=EOS_TEMPLATE, tokenize=True, return_dict=True)
        assert ids[:-1].tolist() == list(want["input_ids"])
