"""Token streams over shards and weighted mixtures of sources: [Note: mixtures]."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from meshpar.config.recipe import RecipeError
from meshpar.data import BatchLoader
from meshpar.data.loader import MIX_BLOCK, mix_counts
from meshpar.data.stream import TokenStream, concat


def test_token_stream_reads_shards_as_one():
    rng = np.random.default_rng(0)
    parts = [rng.integers(0, 1000, n).astype(np.uint16) for n in (7, 1, 30, 12)]
    whole = np.concatenate(parts)
    stream = TokenStream(parts)
    assert len(stream) == len(whole) and stream.dtype == np.uint16
    idx = rng.integers(0, len(whole), (5, 9))
    assert np.array_equal(stream[idx], whole[idx])
    assert np.array_equal(np.asarray(stream), whole)
    for lo, hi in ((0, 50), (3, 41), (8, 9), (20, 20)):
        view = stream[lo:hi]
        assert np.array_equal(np.asarray(view), whole[lo:hi]) and len(view) == hi - lo
        if hi > lo:
            assert np.array_equal(view[np.arange(hi - lo)], whole[lo:hi])
    assert np.array_equal(stream[::7], whole[::7]) and stream.max() == whole.max()
    with pytest.raises(IndexError):
        stream[np.array([len(whole)])]
    assert concat([parts[0]]) is parts[0] and isinstance(concat(parts), TokenStream)


def test_one_source_in_shards_gives_the_same_batches_as_one_array():
    tokens = np.arange(5000, dtype=np.uint32) * 7 % 2039
    pieces = np.split(tokens, [100, 1700, 1701, 4000])
    a = BatchLoader(tokens, seq_len=16, global_batch=8, micro_batch=4, dp_rank=0, dp_size=1, seed=3)
    b = BatchLoader(TokenStream(pieces), seq_len=16, global_batch=8, micro_batch=4, dp_rank=0, dp_size=1, seed=3)
    for _ in range(40):
        for (xa, ya), (xb, yb) in zip(a.next_step(), b.next_step(), strict=True):
            assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert a.state_dict() == b.state_dict()


def test_mix_counts_are_exact_shares():
    assert mix_counts([1.0]) == [MIX_BLOCK]
    assert mix_counts([3, 1]) == [3072, 1024]
    counts = mix_counts([0.5, 0.3, 0.2])
    assert sum(counts) == MIX_BLOCK and [round(c / MIX_BLOCK, 3) for c in counts] == [0.5, 0.3, 0.2]
    with pytest.raises(RecipeError, match=r"data\.sources\[1\]\.weight = 1e-05 .*raise its weight") as err:
        mix_counts([1.0, 1e-5])
    assert err.value.key == "data.sources"


def _sources(seq_len: int) -> list[np.ndarray]:
    """Three sources whose windows are told apart by their first token: source * 10_000 + window."""
    out = []
    for s, n_windows in enumerate((50, 7, 300)):
        ids = np.zeros(n_windows * seq_len + 1, np.uint32)
        ids[:-1:seq_len] = s * 10_000 + np.arange(n_windows)
        out.append(ids)
    return out


def _mixture(dp_size: int, dp_rank: int, micro_batch: int, **kw) -> BatchLoader:
    return BatchLoader(_sources(8), seq_len=8, global_batch=64, micro_batch=micro_batch, dp_rank=dp_rank,
                       dp_size=dp_size, seed=11, weights=[0.5, 0.2, 0.3], **kw)


def _global(loaders: list[BatchLoader], steps: int) -> np.ndarray:
    """First token of every sample of ``steps`` steps, ranks in order: [steps, global_batch]."""
    return np.array([[int(x[i, 0]) for ld in loaders for x, _ in ld.next_step() for i in range(len(x))]
                     for _ in range(steps)])


def test_mixture_shares_order_and_layout_independence():
    one = _global([_mixture(1, 0, 4)], 128)  # 8192 samples: two whole blocks
    source, window = np.divmod(one.ravel(), 10_000)
    shares = np.bincount(source, minlength=3) / source.size
    assert shares.tolist() == [c / MIX_BLOCK for c in mix_counts([0.5, 0.2, 0.3])]  # exact per whole block
    for s, n_windows in enumerate((50, 7, 300)):  # a source's samples 0..K-1 (all, over whole blocks): whole
        seen = np.bincount(window[source == s], minlength=n_windows)  # epochs and one partial, no window twice
        assert seen.max() - seen.min() <= 1 and len(seen) == n_windows
    assert len(set(map(tuple, np.split(source[:MIX_BLOCK], 64)))) > 1  # interleaved, not in runs
    for dp, mb in ((2, 2), (4, 4)):
        assert np.array_equal(_global([_mixture(dp, r, mb) for r in range(dp)], 128), one), (dp, mb)
    other_seed = BatchLoader(_sources(8), seq_len=8, global_batch=64, micro_batch=4, dp_rank=0, dp_size=1, seed=12,
                             weights=[0.5, 0.2, 0.3])
    assert not np.array_equal(_global([other_seed], 8), one[:8])


def test_mixture_resumes_exactly_on_another_layout():
    full = _global([_mixture(1, 0, 4)], 30)
    first = _mixture(2, 0, 2)
    _global([first, _mixture(2, 1, 2)], 0)
    head = _global([first, second := _mixture(2, 1, 2)], 11)
    state = first.state_dict()
    assert state == second.state_dict() and state["weights"] == ",".join(map(str, mix_counts([0.5, 0.2, 0.3])))
    resumed = [_mixture(4, r, 2) for r in range(4)]
    for ld in resumed:
        ld.load_state_dict(state)
    assert np.array_equal(np.concatenate([head, _global(resumed, 19)]), full)
    changed = BatchLoader(_sources(8), seq_len=8, global_batch=64, micro_batch=4, dp_rank=0, dp_size=1, seed=11,
                          weights=[0.2, 0.5, 0.3])
    with pytest.raises(RecipeError, match="weights"):
        changed.load_state_dict(state)
    single = BatchLoader(_sources(8)[0], seq_len=8, global_batch=16, micro_batch=4, dp_rank=0, dp_size=1, seed=11)
    with pytest.raises(RecipeError, match="n_windows"):
        single.load_state_dict(state)
