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

Modules: ``tokenizer`` (byte, bpe), ``corpus`` (``prepare``: files -> cached token stream),
``cache`` ([Note: the token cache]), ``loader`` (``BatchLoader``, [Note: sample order]).

Its names load on first use (PEP 562), as ``meshpar``'s: ``meshpar data prepare --help`` imports
``meshpar.data.prepare_cli`` and with it this package, without torch or the tokenizers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from meshpar.data.cache import cached
    from meshpar.data.corpus import Corpus, prepare
    from meshpar.data.loader import BatchLoader, permute
    from meshpar.data.tokenizer import EOT, BPETokenizer, ByteTokenizer, Tokenizer, split_text

__all__ = ["EOT", "BPETokenizer", "BatchLoader", "ByteTokenizer", "Corpus", "Tokenizer", "cached", "permute",
           "prepare", "split_text"]
_HOME = {"cached": "cache", "Corpus": "corpus", "prepare": "corpus", "BatchLoader": "loader", "permute": "loader",
         **dict.fromkeys(("EOT", "BPETokenizer", "ByteTokenizer", "Tokenizer", "split_text"), "tokenizer")}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'meshpar.data' has no attribute '{name}'")
    value = getattr(importlib.import_module(f"meshpar.data.{_HOME[name]}"), name)
    globals()[name] = value
    return value
