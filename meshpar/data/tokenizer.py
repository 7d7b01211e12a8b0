"""Tokenizers: ``byte`` (UTF-8 bytes), ``bpe`` (a byte-level BPE trained on the data) and, for
text, cutting it into pieces that tokenize exactly like the whole (``split_text``)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

EOT = "<|endoftext|>"
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
