"""Samples of a stream: fixed windows of pretraining text, or whole conversations packed into rows.

    rows = Windows(tokens, seq_len)        # pretraining: window w is tokens[w*T : w*T + T + 1]
    rows = Packed(conversations, seq_len)  # fine-tuning: whole conversations per row, padded
    ids, trained = rows.read(indices)      # [n, T + 1] ids, and [n, T + 1] trained flags (None: all)

The loader ([Note: sample order] in meshpar/data/loader.py) draws row indices; a row's inputs are
its first T ids and its targets its last T, -100 where a target is not trained.

[Note: packing conversations]
A chat corpus is a stream of conversations, each followed by the separator id (the document end
that document-causal attention splits on), with a trained flag per token (the assistant's tokens:
[Note: the assistant's tokens] in meshpar/data/chat.py). Rows hold T + 1 tokens. Conversations are
taken in stream order and laid end to end while the next one fits; then a new row starts, and the
rest of the row is padding: separators, never trained, each one a document of its own. So a row
never begins inside a conversation, and under document attention each conversation sees exactly
what it would see alone: its positions start at 0 and its mask ends at its separator. A
conversation longer than a row is cut to T + 1 tokens (its tail, and its separator, dropped) and
counted in ``Packed.cut``. Rows are a pure function of the conversation lengths and T, computed by
every rank alike in one pass over the lengths (docs/performance.md#packing-conversations).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from meshpar.data.stream import TokenStream, concat

IGNORE = -100  # a target the loss skips (torch.nn.functional.cross_entropy's ignore_index)


@dataclass(frozen=True)
class Conversations:
    """A chat corpus (or a slice of one): ``tokens`` and ``trained`` (uint8, one flag per token)
    of the same length, and ``ends``, each conversation's end offset (after its separator)."""

    tokens: np.ndarray | TokenStream
    trained: np.ndarray | TokenStream
    ends: np.ndarray  # int64, increasing, the last equal to len(tokens)
    separator: int

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def starts(self) -> np.ndarray:
        return np.concatenate([[0], self.ends[:-1]]).astype(np.int64)

    def split(self, fraction: float) -> tuple[Conversations, Conversations]:
        """(head, tail): the tail the last conversations holding about ``fraction`` of the tokens."""
        want = len(self) - int(len(self) * fraction)  # the head ends with the conversation holding token want - 1
        k = min(int(np.searchsorted(self.ends, want, side="left")) + 1, len(self.ends)) if want else 0
        cut = int(self.ends[k - 1]) if k else 0
        head = Conversations(self.tokens[:cut], self.trained[:cut], self.ends[:k], self.separator)
        tail = Conversations(self.tokens[cut:], self.trained[cut:], self.ends[k:] - cut, self.separator)
        return head, tail

    @classmethod
    def join(cls, parts: Sequence[Conversations]) -> Conversations:
        """Several corpora (shards) as one."""
        offsets = np.cumsum([0] + [len(p) for p in parts[:-1]])
        return cls(concat([p.tokens for p in parts]), concat([p.trained for p in parts]),
                   np.concatenate([p.ends + o for p, o in zip(parts, offsets, strict=True)]).astype(np.int64),
                   parts[0].separator)


class Windows:
    """Pretraining samples: window w is ``tokens[w*T : w*T + T + 1]`` ([Note: sample order])."""

    trained_rows = False

    def __init__(self, tokens, seq_len: int):
        self.tokens, self.seq_len = tokens, seq_len
        self.n = (len(tokens) - 1) // seq_len

    def read(self, rows: np.ndarray) -> tuple[np.ndarray, None]:
        starts = np.asarray(rows, dtype=np.int64) * self.seq_len
        return np.asarray(self.tokens[starts[:, None] + np.arange(self.seq_len + 1)], dtype=np.int64), None

    def trained_targets(self, rows: np.ndarray) -> int:
        return len(rows) * self.seq_len


class Packed:
    """Fine-tuning samples: whole conversations per row ([Note: packing conversations])."""

    trained_rows = True

    def __init__(self, conversations: Conversations, seq_len: int):
        self.conversations, self.seq_len = conversations, seq_len
        self.starts, self.lengths, self.cut = pack(np.diff(conversations.ends, prepend=0), seq_len + 1)
        self.n = len(self.starts)

    def read(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """ids[n, T + 1] (padding: the separator) and trained[n, T + 1] (bool) of ``rows``."""
        rows = np.asarray(rows, dtype=np.int64)
        width = self.seq_len + 1
        offsets = np.arange(width)
        inside = offsets < self.lengths[rows, None]
        where = np.where(inside, self.starts[rows, None] + offsets, 0)
        conv = self.conversations
        ids = np.where(inside, np.asarray(conv.tokens[where], dtype=np.int64), conv.separator)
        trained = inside & (np.asarray(conv.trained[where]) != 0)
        return ids, trained

    def trained_targets(self, rows: np.ndarray) -> int:
        """The trained targets of ``rows``: flags at positions 1..T (position 0 is no row's target)."""
        rows = np.asarray(rows, dtype=np.int64)
        offsets = np.arange(1, self.seq_len + 1)
        inside = offsets < self.lengths[rows, None]
        where = np.where(inside, self.starts[rows, None] + offsets, 0)
        return int((inside & (np.asarray(self.conversations.trained[where]) != 0)).sum())


def pack(lengths: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Greedy in-order packing of items of ``lengths`` into rows of ``width``: (each row's start
    offset, its used length, the number of items cut to ``width``)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    starts, used = [], []
    offset, row_start, row_len = 0, 0, 0
    for n in lengths.tolist():
        if row_len and row_len + n > width:  # the item does not fit: close the row
            starts.append(row_start)
            used.append(row_len)
            row_len = 0
        if not row_len:
            row_start = offset
        row_len += min(n, width) if not row_len else n
        offset += n
        if row_len >= width:  # a full row (an item as long as a row, or longer and cut)
            starts.append(row_start)
            used.append(width)
            row_len = 0
    if row_len:
        starts.append(row_start)
        used.append(row_len)
    return np.asarray(starts, np.int64), np.asarray(used, np.int64), int((lengths > width).sum())
