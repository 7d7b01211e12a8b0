"""The all-gather's attention on flex_attention (meshpar/parallel/context_parallel/flex.py), in one
process: every rank's queries of cp 2 and 4, balanced and contiguous, causal and by document,
with grouped-query heads, against one masked attention over the whole sequence, in float64.
Forward only: flex has no CPU backward (the CUDA tests in tests/test_cuda.py run backward).
Eager flex on CPU evaluates ``mask_mod`` at every (query, key) pair, so the block mask's tile lists
(what the CUDA kernel skips and where it applies no mask) are checked on their own: equal, tile for
tile, to the tiles of the dense mask that hold some and that hold only attended pairs.

Tolerance: both sides are exact softmax attention in float64 over at most 1024 keys; they differ
only in summation order, ~1e-15 relative, so 1e-12 leaves room and any masking error (at least one
key's weight, ~1e-3 here) fails.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask

from meshpar.models.attention import document_ids
from meshpar.parallel.context_parallel import flex
from meshpar.parallel.context_parallel.layout import sequence_indices

B, H, HKV, T, D = 2, 4, 2, 1024, 16
TOL = 1e-12


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():  # eager flex warns that it is a reference implementation
        warnings.simplefilter("ignore")
        yield


def _inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, n, T, D, generator=gen, dtype=torch.float64) for n in (H, HKV, HKV))
    tokens = torch.ones(B, T, dtype=torch.long)
    tokens[0, [40, 300, 511, 700]] = 0  # documents ending inside tiles, one at a tile's and chunk's end
    tokens[1, [127, 128]] = 0  # a one-token document on a tile boundary
    return q, k, v, document_ids(tokens, eos=0)[0]


def _reference(q, k, v, positions, doc):
    return F.scaled_dot_product_attention(q[:, :, positions], k, v, attn_mask=_allowed(positions, doc).unsqueeze(1),
                                          enable_gqa=True)


@pytest.mark.parametrize("documents", [False, True], ids=["causal", "documents"])
@pytest.mark.parametrize("balanced", [True, False], ids=["balanced", "contiguous"])
@pytest.mark.parametrize("cp", [2, 4])
def test_every_rank_equals_masked_attention(cp, balanced, documents):
    q, k, v, doc = _inputs()
    doc = doc if documents else None
    for rank in range(cp):
        positions = sequence_indices(T, cp, rank, balanced=balanced)
        mask = flex.block_mask(positions, T, doc)
        got = flex.attend(q[:, :, positions], k, v, mask)
        want = _reference(q, k, v, positions, doc)
        assert (got - want).abs().max().item() <= TOL * want.abs().max().item(), rank
        some, every = _dense_tiles(positions, doc)
        assert _tiles(mask, full=True) == every and _tiles(mask, full=False) == some - every, rank


def _allowed(positions, doc):
    allowed = positions.unsqueeze(1) >= torch.arange(T).unsqueeze(0)  # [n, T]
    if doc is None:
        return allowed.expand(B, -1, -1)
    return allowed & (doc[:, positions].unsqueeze(2) == doc.unsqueeze(1))


def _dense_tiles(positions, doc) -> tuple[set, set]:
    """(tiles with some attended pair, tiles with only attended pairs) of the dense mask, as (b, q tile,
    key tile); without documents every row's are row 0's (the block mask has one row then)."""
    allowed = _allowed(positions, doc)[:1 if doc is None else B]
    tiles = allowed.unflatten(1, (-1, flex.BLOCK)).unflatten(3, (-1, flex.BLOCK))  # [b, nq, BLOCK, nk, BLOCK]
    some, every = tiles.any(4).any(2), tiles.all(4).all(2)
    return ({tuple(x) for x in some.nonzero().tolist()}, {tuple(x) for x in every.nonzero().tolist()})


def _tiles(mask: BlockMask, full: bool) -> set[tuple[int, int, int]]:
    count, idx = (mask.full_kv_num_blocks, mask.full_kv_indices) if full else (mask.kv_num_blocks, mask.kv_indices)
    return {(b, i, int(j)) for b in range(count.shape[0]) for i in range(count.shape[2])
            for j in idx[b, 0, i, :count[b, 0, i]]}


def test_tiles_skip_what_no_query_sees_and_fill_what_every_query_sees():
    """cp 4, rank 1, balanced: chunks 1 and 6 of 8 (128 queries each, one tile); chunk 1 sees key tiles
    0-1, the diagonal one partial; chunk 6 sees tiles 0-6. With documents a tile is full only inside
    one document, and a key tile with none of the query tile's documents is skipped."""
    positions = sequence_indices(T, 4, 1)
    causal = flex.block_mask(positions, T)
    assert _tiles(causal, full=True) == {(0, 0, 0)} | {(0, 1, j) for j in range(6)}
    assert _tiles(causal, full=False) == {(0, 0, 1), (0, 1, 6)}
    _, _, _, doc = _inputs()
    by_doc = flex.block_mask(positions, T, doc)
    # row 1: documents [0, 127], [128], [129, ...]: query tile 0 (positions 128-255) is not one document
    assert (1, 0, 0) not in _tiles(by_doc, True) | _tiles(by_doc, False)  # keys 0-127: another document
    assert (1, 1, 2) in _tiles(by_doc, True)  # positions 768-895 over keys 256-383: one document
    assert (0, 1, 0) not in _tiles(by_doc, True) | _tiles(by_doc, False)  # row 0: documents end at 511 and 700


def test_refuses_partial_tiles():
    with pytest.raises(ValueError, match="whole tiles of 128"):
        flex.block_mask(sequence_indices(T // 2 + 64, 2, 0), T // 2 + 64)
    assert not flex.takes(64, 1024) and flex.takes(128, 1024)
