"""``BatchLoader``: one data-parallel rank's microbatches of a token stream, in a seeded order
that depends only on the global sample count (see [Note: sample order])."""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from functools import cached_property

import numpy as np
import torch

from meshpar.config.recipe import RecipeError
from meshpar.data.packing import IGNORE, Conversations, Packed, Windows

# [Note: sample order]
# Window w is tokens[w*T : w*T + T + 1] (inputs its first T, targets its last T), for
# w < n_windows = (len(tokens) - 1) // T. Global sample g, counted over the whole run and
# all ranks, is window perm_e[g % n_windows] of epoch e = g // n_windows. Step s takes the
# samples [s*B, (s+1)*B) and dp rank r the contiguous slice [r*B/dp, (r+1)*B/dp) of them, in
# microbatches in order. So the data of a step does not depend on dp or micro_batch, and the
# position is samples_seen alone: a checkpoint resumes on any layout.
# perm_e is a 4-round Feistel network over the smallest even-bit domain 2^(2h) >= n_windows,
# made a permutation of range(n_windows) by cycle-walking (apply again until the value is
# < n_windows). Integer arithmetic only: the same order on every platform and library version,
# O(1) memory and random access, whatever the number of windows.

# [Note: mixtures]
# With several sources (data.sources) and weights w_i, the samples are cut into blocks of
# MIX_BLOCK; every block holds exactly n_i samples of source i (n_i: w_i * MIX_BLOCK rounded by
# largest remainder, so the shares are exact to 1 / MIX_BLOCK). Position p of block b is
# q = perm_b(p), a Feistel permutation of range(MIX_BLOCK) seeded apart from the window order;
# q falls in source i's range [c_i, c_i + n_i) of the cumulative counts, and the sample is source
# i's own sample b * n_i + (q - c_i). That is a bijection, so each source's samples are counted
# without gaps or repeats, and source i then walks its own windows as one source does, with
# seed train.seed + i. Everything is a function of the global sample index: the mixture is
# deterministic for a seed, independent of the layout, and resumes from samples_seen alone.
MIX_BLOCK = 4096

def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a bijective 64-bit hash (uint64 array arithmetic wraps)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def permute(i: np.ndarray, n: int, seed: int, epoch: int) -> np.ndarray:
    """``perm[i]`` for the pseudo-random permutation of range(n) that (seed, epoch) picks."""
    half = np.uint64(max(1, ((n - 1).bit_length() + 1) // 2))
    mask = np.uint64((1 << int(half)) - 1)
    base = _mix(_mix(np.array([seed], dtype=np.uint64)) ^ np.uint64(epoch))
    keys = _mix(base + np.arange(1, 5, dtype=np.uint64))  # one key per round

    def feistel(x: np.ndarray) -> np.ndarray:
        left, right = x >> half, x & mask
        for k in keys:
            left, right = right, left ^ (_mix(right ^ k) & mask)
        return (left << half) | right

    y = feistel(np.asarray(i, dtype=np.uint64))
    while (out := y >= np.uint64(n)).any():
        y[out] = feistel(y[out])
    return y.astype(np.int64)


def mix_counts(weights: Sequence[float], block: int = MIX_BLOCK) -> list[int]:
    """Samples of each source per block of ``block`` ([Note: mixtures]): largest remainder, each >= 1."""
    total = sum(weights)
    exact = [w / total * block for w in weights]
    counts = [int(x) for x in exact]
    for i in sorted(range(len(exact)), key=lambda i: counts[i] - exact[i])[:block - sum(counts)]:
        counts[i] += 1
    if min(counts) < 1:
        small = min(range(len(weights)), key=lambda i: weights[i])
        raise RecipeError(f"data.sources[{small}].weight = {weights[small]:g} is below 1/{block} of the total "
                          f"({total:g}): that source would get no samples; raise its weight or drop it",
                          "data.sources")
    return counts


class Step(list):
    """One step's microbatches on this rank, and ``trained``: the targets not IGNORE'd in the whole
    global batch (every rank's), or None when every target is trained (pretraining windows)."""

    trained: int | None = None


class BatchLoader:
    """One data-parallel rank's microbatches of a token stream (or a weighted mixture of several:
    ``tokens`` a sequence of streams and ``weights`` theirs), resumable on any layout. A stream of
    :class:`Conversations` gives packed rows ([Note: packing conversations]) whose untrained
    targets are IGNORE."""

    def __init__(self, tokens, *, seq_len: int, global_batch: int, micro_batch: int,
                 dp_rank: int, dp_size: int, seed: int, shuffle: bool = True,
                 weights: Sequence[float] | None = None):
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is outside [0, dp_size = {dp_size})")
        if global_batch % (micro_batch * dp_size):
            raise RecipeError(_batch_error(global_batch, micro_batch, dp_size), "train.global_batch")
        self.streams = list(tokens) if weights is not None else [tokens]
        for i, stream in enumerate(self.streams):
            if (len(stream) - 1) // seq_len < 1:
                which = f" (source {i} of the mixture)" if len(self.streams) > 1 else ""
                raise RecipeError(f"train.seq_len = {seq_len}: the data{which} is too small ({len(stream)} tokens) "
                                  f"for one sample of seq_len + 1 tokens; use a shorter train.seq_len or more data "
                                  f"(for validation: a larger data.val_fraction)", "train.seq_len")
        self.rows = [Packed(x, seq_len) if isinstance(x, Conversations) else Windows(x, seq_len) for x in self.streams]
        self.windows_per_source = [r.n for r in self.rows]
        self.weights = [float(w) for w in weights] if weights is not None else [1.0]
        self.counts = mix_counts(self.weights) if len(self.streams) > 1 else [MIX_BLOCK]
        self.tokens, self.n_windows = self.streams[0], self.windows_per_source[0]
        self.seq_len, self.seed, self.shuffle = seq_len, seed, shuffle
        self.global_batch, self.micro_batch, self.dp_rank, self.dp_size = global_batch, micro_batch, dp_rank, dp_size
        self._samples_seen = 0

    @property
    def samples_seen(self) -> int:
        """Samples consumed by all ranks together; the loader's whole position."""
        return self._samples_seen

    def windows(self, samples: np.ndarray, source: int = 0, seed: int | None = None) -> np.ndarray:
        """A source's own sample indices -> its window indices (see [Note: sample order])."""
        n = self.windows_per_source[source]
        epoch, i = np.divmod(np.asarray(samples, dtype=np.int64), n)
        if not self.shuffle:
            return i
        for e in np.unique(epoch):
            i[epoch == e] = permute(i[epoch == e], n, self.seed + source if seed is None else seed, int(e))
        return i

    def sources_of(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Global sample indices -> (source, that source's own sample index): [Note: mixtures]."""
        samples = np.asarray(samples, dtype=np.int64)
        if len(self.streams) == 1:
            return np.zeros_like(samples), samples
        block, pos = np.divmod(samples, MIX_BLOCK)
        q = np.empty_like(pos)
        for b in np.unique(block):
            q[block == b] = permute(pos[block == b], MIX_BLOCK, self.seed ^ 0x6D6978, int(b))  # "mix"
        first = np.cumsum([0, *self.counts[:-1]])
        source = np.searchsorted(first, q, side="right") - 1
        return source, block * np.asarray(self.counts)[source] + q - first[source]

    def next_step(self) -> Step:
        """This rank's microbatches for one optimizer step: (inputs, targets) int64 [micro_batch, seq_len]."""
        per_rank = self.global_batch // self.dp_size
        first = self._samples_seen + self.dp_rank * per_rank
        step = Step()
        rows = np.empty((per_rank, self.seq_len + 1), np.int64)
        trained = np.ones((per_rank, self.seq_len + 1), bool)
        for i, hit, picked in self._by_source(np.arange(first, first + per_rank)):
            rows[hit], flags = self.rows[i].read(picked)
            if flags is not None:
                trained[hit] = flags
        targets = rows[:, 1:].copy()
        if any(r.trained_rows for r in self.rows):
            targets[~trained[:, 1:]] = IGNORE
            # the whole global batch's count, from every rank's rows (flags only): no collective needed
            everyone = np.arange(self._samples_seen, self._samples_seen + self.global_batch)
            step.trained = sum(self.rows[i].trained_targets(picked) for i, _, picked in self._by_source(everyone))
        inputs, targets = torch.from_numpy(rows[:, :-1].copy()), torch.from_numpy(targets)
        self._samples_seen += self.global_batch
        mb = self.micro_batch
        step.extend((inputs[j:j + mb], targets[j:j + mb]) for j in range(0, per_rank, mb))
        return step

    def _by_source(self, samples: np.ndarray):
        """(source, the samples' mask, their row indices in that source) for each source drawn from."""
        source, own = self.sources_of(samples)
        for i in np.unique(source):
            hit = source == i
            yield int(i), hit, self.windows(own[hit], int(i))

    @cached_property
    def _fingerprint(self) -> str:
        """CRC of up to 4096 evenly spaced tokens of each source: tells a changed stream of the same length."""
        crcs = []
        for x in self.streams:
            x = x.tokens if isinstance(x, Conversations) else x
            sample = np.asarray(x[::max(1, len(x) // 4096)][:4096], dtype="<u4")
            crcs.append(f"{zlib.crc32(sample.tobytes()):08x}")
        return ",".join(crcs)

    def state_dict(self) -> dict:
        state = {"version": 1, "samples_seen": self._samples_seen, "seed": self.seed, "seq_len": self.seq_len,
                 "shuffle": self.shuffle, "n_windows": self.n_windows, "n_tokens": len(self.tokens),
                 "fingerprint": self._fingerprint, "global_batch": self.global_batch}
        if len(self.streams) > 1:  # a mixture: every source, and the weights (one source keeps version 1's keys)
            state.update(n_windows=",".join(map(str, self.windows_per_source)),
                         n_tokens=",".join(str(len(x)) for x in self.streams),
                         weights=",".join(map(str, self.counts)))
        return state

    def load_state_dict(self, state: dict) -> None:
        """Resume at ``state['samples_seen']``; any dp_size, micro_batch or global_batch may differ."""
        fixes = {"version": "a checkpoint from this meshpar version", "seed": "the same train.seed",
                 "seq_len": "the same train.seq_len", "shuffle": "the same shuffle setting",
                 "n_windows": "the same data", "n_tokens": "the same data and data.val_fraction",
                 "fingerprint": "the same data and tokenizer", "weights": "the same data.sources weights"}
        mine = self.state_dict()
        for key, fix in fixes.items():
            if state.get(key) != mine.get(key):
                raise RecipeError(f"data loader checkpoint: {key} = {state.get(key)!r} there but {mine.get(key)!r} in "
                                  f"this run; resume with {fix}, or set checkpoint.exclude = [\"data\"] to start "
                                  f"the data order afresh", {"seed": "train.seed", "seq_len": "train.seq_len"}.get(key))
        self._samples_seen = int(state["samples_seen"])


def _batch_error(global_batch: int, micro_batch: int, dp_size: int) -> str:
    unit = micro_batch * dp_size
    sizes = [v for v in (global_batch // unit * unit, (global_batch // unit + 1) * unit) if v]
    fix = f"use train.global_batch = {' or '.join(map(str, sizes))}"
    if global_batch % dp_size == 0:
        per_rank = global_batch // dp_size
        near = sorted(sorted((d for d in range(1, per_rank + 1) if per_rank % d == 0),
                             key=lambda d: abs(d - micro_batch))[:3])
        fix += f", or train.micro_batch = {' or '.join(map(str, near))}"
    return (f"train.global_batch = {global_batch} is not a multiple of train.micro_batch ({micro_batch}) x the "
            f"data-parallel degree ({dp_size}) = {unit}, so it cannot split into equal microbatches per rank; {fix}")
