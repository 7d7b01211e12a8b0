"""Tokenizers: ``byte`` (UTF-8 bytes), ``bpe`` (a byte-level BPE trained on the data), a Hugging
Face ``tokenizer.json`` (``load_tokenizer``), and, for text, cutting it into pieces that tokenize
exactly like the whole (``split_text``).

All three have ``vocab_size``, ``encode``, ``encode_batch``, ``decode``, ``eos_id`` / ``bos_id``
(None where there is none: byte text keeps its literal separator) and ``hf_files()``: the
tokenizer.json + tokenizer_config.json a checkpoint keeps, so that ``meshpar convert --to hf``
gives the model its tokenizer (meshpar/checkpoint/checkpointer.py, meshpar/convert/files.py).
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from meshpar.config.errors import RecipeError

EOT = "<|endoftext|>"
EOS_CANDIDATES = (EOT, "</s>", "<|end_of_text|>", "<eos>")  # end-of-text tokens, where no config names one
CHUNK_CHARS = 1 << 16  # text is tokenized in chunks of about this many characters, in parallel


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255."""

    vocab_size = 256
    eos_id = bos_id = None  # documents are joined with the separator's 13 literal bytes (meshpar/data/corpus.py)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def hf_files(self) -> dict[str, bytes]:
        return {}  # no Hugging Face form

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class BPETokenizer:
    """Byte-level BPE (GPT-2 pre-tokenization, lossless) with ``<|endoftext|>`` as one special id."""

    def __init__(self, tok: tokenizers.Tokenizer):
        self.tok = tok
        self.vocab_size = tok.get_vocab_size()
        self.eot_id = self.eos_id = tok.token_to_id(EOT)
        self.bos_id = None

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

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """``[encode(t) for t in texts]``, long texts in chunks (split_text), all in one parallel batch."""
        pieces = [split_text(t) for t in texts]
        ids = iter(e.ids for e in self.tok.encode_batch([p for ps in pieces for p in ps]))
        return [list(itertools.chain.from_iterable(next(ids) for _ in ps)) for ps in pieces]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def hf_files(self) -> dict[str, bytes]:
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOT, "bos_token": None}
        return {"tokenizer.json": self.tok.to_str().encode(), "tokenizer_config.json": _json(config)}


class HFTokenizer:
    """A Hugging Face tokenizer (tokenizer.json through the ``tokenizers`` library); ``load_tokenizer`` makes one.

    ``encode`` gives exactly ``tokenizers``' ids for the text with ``add_special_tokens=False``:
    no BOS / EOS from the file's post-processor (``document_ids`` adds them, once per
    document), and no truncation or padding, which some tokenizer.json files switch on.
    Special tokens written in the text itself (a literal ``<|endoftext|>``) still become their ids.
    """

    def __init__(self, raw: bytes, tok: tokenizers.Tokenizer, config: dict[str, Any], eos_id: int,
                 bos_id: int | None, where: str):
        self.raw, self.tok, self.config = raw, tok, config
        tok.no_truncation()
        tok.no_padding()
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.eos_id, self.bos_id = eos_id, bos_id
        self.name = f"tokenizer.json of {where} (vocab {self.vocab_size})"

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(list(texts), add_special_tokens=False)]  # parallel in Rust

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def fingerprint(self) -> str:
        """sha256 of the tokenizer.json bytes and the eos / bos ids: what the token cache keys on."""
        return hashlib.sha256(self.raw + f"|eos={self.eos_id}|bos={self.bos_id}".encode()).hexdigest()

    def hf_files(self) -> dict[str, bytes]:
        """The file's bytes as read, and its tokenizer_config.json (kept whole: chat template, added tokens)
        with the eos / bos tokens used here filled in where it named none."""
        config = {"tokenizer_class": "PreTrainedTokenizerFast", **self.config}
        if _token(config.get("eos_token")) is None:  # found in special_tokens_map.json or by EOS_CANDIDATES
            config["eos_token"] = self.tok.id_to_token(self.eos_id)
        if "bos_token" not in config:
            config["bos_token"] = None if self.bos_id is None else self.tok.id_to_token(self.bos_id)
        return {"tokenizer.json": self.raw, "tokenizer_config.json": _json(config)}


def load_tokenizer(spec: str, key: str = "data.tokenizer") -> HFTokenizer:
    """The tokenizer ``spec`` names: a tokenizer.json file, or a folder holding tokenizer.json
    (with tokenizer_config.json / special_tokens_map.json beside it, as Hugging Face model folders
    have). EOS: the config's ``eos_token``, else the first of EOS_CANDIDATES in the vocabulary.
    BOS: tokenizer_config.json's ``bos_token``, unless it says ``add_bos_token = false``.
    Anything unusable is a RecipeError on ``key`` naming the fix."""
    where = f"{key} = {spec!r}"
    path = Path(spec).expanduser()
    if not path.exists():
        raise RecipeError(f"{where}: no such file or folder; give a tokenizer.json or a Hugging Face model folder "
                          f"holding one (or 'bpe' / 'byte')", key)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        others = [n for n in ("tokenizer.model", "vocab.json", "merges.txt", "tokenizer_config.json")
                  if (path / n).exists()]
        held = f"it holds {', '.join(others)}, but " if others else ""
        raise RecipeError(f"{where}: the folder has no tokenizer.json ({held}meshpar reads only the fast-tokenizer "
                          f"format); write one with transformers: AutoTokenizer.from_pretrained(folder)"
                          f".save_pretrained(folder)", key)
    raw = file.read_bytes()
    try:
        tok = tokenizers.Tokenizer.from_str(raw.decode("utf-8"))
    except Exception as e:  # noqa: BLE001 - tokenizers raises plain Exception for a bad file
        reason = (str(e).splitlines() or [type(e).__name__])[0]
        raise RecipeError(f"{where}: {file} is not a tokenizer.json the tokenizers library can read ({reason}); "
                          f"download it again, or write it with transformers' save_pretrained", key) from None
    config, specials = (_read_json(file.parent / n, where, key) for n in ("tokenizer_config.json",
                                                                          "special_tokens_map.json"))

    def token_id(name: str, what: str) -> int:
        i = tok.token_to_id(name)
        if i is None:
            raise RecipeError(f"{where}: {what} {name!r} is not in the vocabulary of {file}; fix {what} in "
                              f"tokenizer_config.json", key)
        return i

    eos = _token(config.get("eos_token")) or _token(specials.get("eos_token"))
    if eos is not None:
        eos_id = token_id(eos, "eos_token")
    else:
        found = [i for i in map(tok.token_to_id, EOS_CANDIDATES) if i is not None]
        if not found:
            raise RecipeError(f"{where}: no end-of-text token: no tokenizer_config.json beside {file} names an "
                              f"eos_token and the vocabulary has none of {', '.join(EOS_CANDIDATES)}; add "
                              f"\"eos_token\" to a tokenizer_config.json beside it", key)
        eos_id = found[0]
    bos = _token(config.get("bos_token"))
    bos_id = token_id(bos, "bos_token") if bos is not None and config.get("add_bos_token") is not False else None
    return HFTokenizer(raw, tok, config, eos_id, bos_id, str(path))


def document_ids(tok, docs: Sequence[str]) -> list[list[int]]:
    """Each document as the training stream holds it: ``[bos?] + encode(doc) + [eos]`` (every
    document ends with EOS). ``tok`` needs an ``eos_id``: byte text is joined with the separator text."""
    if tok.eos_id is None:
        raise ValueError(f"{type(tok).__name__} has no end-of-text id; its documents are joined with {EOT!r} as text")
    head = [] if tok.bos_id is None else [tok.bos_id]
    return [head + ids + [tok.eos_id] for ids in tok.encode_batch(docs)]


def _token(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or ``{"content": ...}`` (an AddedToken)."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _read_json(path: Path, where: str, key: str) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise RecipeError(f"{where}: {path} is not readable JSON ({e}); fix or remove it", key) from None
    return value if isinstance(value, dict) else {}


def _json(value: dict[str, Any]) -> bytes:
    return (json.dumps(value, indent=2, ensure_ascii=False) + "\n").encode()


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
