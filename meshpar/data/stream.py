"""``TokenStream``: several 1-D token arrays (memory-mapped shards) read as one, without a copy.

The loader needs ``len``, integer-array indexing (``tokens[starts[:, None] + arange(T + 1)]``)
and slices (the train / validation split); a prepared corpus is one shard per source file, so
the stream maps a global position to (shard, offset) with one ``searchsorted`` per index.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class TokenStream:
    """The concatenation of ``parts`` (1-D arrays of one dtype), restricted to ``[start, stop)``."""

    def __init__(self, parts: Sequence[np.ndarray], start: int = 0, stop: int | None = None):
        if not parts:
            raise ValueError("a token stream needs at least one part")
        dtypes = {np.dtype(p.dtype) for p in parts}
        if len(dtypes) != 1:
            raise ValueError(f"token stream parts have different dtypes: {sorted(map(str, dtypes))}")
        self.parts = list(parts)
        self.dtype = dtypes.pop()
        self._ends = np.cumsum([len(p) for p in self.parts], dtype=np.int64)  # part k holds [ends[k-1], ends[k])
        self.start = start
        self.stop = int(self._ends[-1]) if stop is None else stop

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step == 1:
                return TokenStream(self.parts, self.start + start, self.start + max(start, stop))
            return self[np.arange(start, stop, step)]
        if isinstance(idx, (int, np.integer)):
            return self[np.array([idx])][0]
        local = np.asarray(idx)
        if local.dtype.kind not in "iu":
            raise IndexError(f"token streams take integer arrays or slices, not {local.dtype}")
        if local.size and (local.min() < 0 or local.max() >= len(self)):
            raise IndexError(f"index out of range for a stream of {len(self)} tokens")
        where = local.astype(np.int64) + self.start
        part = np.searchsorted(self._ends, where, side="right")
        out = np.empty(local.shape, dtype=self.dtype)
        for k in np.unique(part):
            hit = part == k
            out[hit] = self.parts[k][where[hit] - (self._ends[k - 1] if k else 0)]
        return out

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        first = int(np.searchsorted(self._ends, self.start, side="right"))
        chunks, pos = [], self.start
        for k in range(first, len(self.parts)):
            if pos >= self.stop:
                break
            begin = int(self._ends[k - 1]) if k else 0
            end = min(self.stop, int(self._ends[k]))
            chunks.append(np.asarray(self.parts[k][pos - begin:end - begin]))
            pos = end
        out = np.concatenate(chunks) if chunks else np.empty(0, self.dtype)
        return out if dtype is None else out.astype(dtype)

    def __iter__(self):
        return iter(np.asarray(self))

    def tolist(self) -> list[int]:
        return np.asarray(self).tolist()

    def max(self) -> int:
        """The largest id, read part by part (memory-mapped parts are not loaded whole)."""
        return max((int(np.asarray(p).max()) for p in self._pieces() if len(p)), default=0)

    def _pieces(self):
        for k, p in enumerate(self.parts):
            begin = int(self._ends[k - 1]) if k else 0
            lo, hi = max(self.start, begin) - begin, min(self.stop, int(self._ends[k])) - begin
            if lo < hi:
                for i in range(lo, hi, 1 << 24):
                    yield p[i:min(hi, i + (1 << 24))]


def concat(parts: Sequence[np.ndarray]) -> np.ndarray | TokenStream:
    """One array as is (a memory map stays one), several as a :class:`TokenStream`."""
    nonempty = [p for p in parts if len(p)] or list(parts[:1])
    return nonempty[0] if len(nonempty) == 1 else TokenStream(nonempty)
