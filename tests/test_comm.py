"""meshpar.distributed.comm's gloo reduce-scatter: rows exchanged with all-to-all, summed locally in rank
order, with this rank's own row never buffered or sent; bytes counted as a ring would move."""

import functools

import pytest
import torch
import torch.distributed as dist

from meshpar.distributed import comm, comm_record
from tests.distributed import CaseSet

PER_RANK, COLS = 10, (3, 4)  # the last 3 columns zeroed, as padding is


def _rows(world: int, per_rank: int) -> torch.Tensor:
    """Every rank's input, ``[world (sender), world (row), per_rank]``, from one seed."""
    g = torch.Generator().manual_seed(11)
    return torch.randn(world, world, per_rank, generator=g)


def _reduce_scatter_case(per_rank: int, cols: tuple[int, ...]) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    mine = _rows(world, per_rank)[rank]  # [world, per_rank]: row i bound for rank i
    buffer = comm.ReduceScatterInput(per_rank, group, dtype=torch.float32, device=torch.device("cpu"))
    offset = 0
    for k in cols:  # filled column block by column block, as a unit's parameters are
        buffer.copy_rows(offset, mine[:, offset:offset + k])
        offset += k
    buffer.zero_rows(offset, per_rank - offset)
    with comm_record.count() as c:
        work = comm.reduce_scatter_rows(buffer, group, dim="dp_shard", async_op=True)
    work.wait()
    return dict(output=buffer.output, send_rows=None if buffer.send is None else buffer.send.shape[0],
                exchange=buffer.exchange, calls=dict(c.calls), bytes=dict(c.bytes))


def _send_shape() -> tuple[int, int]:
    buffer = comm.ReduceScatterInput(5, dist.group.WORLD, dtype=torch.float32, device=torch.device("cpu"))
    return tuple(buffer.send.shape)


JOBS = CaseSet({"reduce_scatter": (functools.partial(_reduce_scatter_case, PER_RANK, COLS), (2, 3)),
                "send_shape": (_send_shape, 3)}, timeout=60)


@pytest.mark.parametrize("world", JOBS.worlds("reduce_scatter"))
def test_reduce_scatter_rows_sums_in_rank_order(world):
    per_rank, cols = PER_RANK, COLS
    results = JOBS.check("reduce_scatter", world)
    inputs = _rows(world, per_rank)
    inputs[:, :, sum(cols):] = 0
    for rank, r in enumerate(results):
        assert r["exchange"] is True
        assert r["send_rows"] is None  # the sent rows are freed once delivered
        expected = inputs[0, rank].clone()
        for sender in range(1, world):  # rank order, the order a sum over the stacked rows takes
            expected += inputs[sender, rank]
        assert torch.equal(r["output"], expected), (rank, r["output"] - expected)
        assert torch.equal(r["output"], inputs[:, rank].sum(dim=0))
        assert r["calls"] == {("reduce_scatter", "dp_shard"): 1}
        assert r["bytes"] == {("reduce_scatter", "dp_shard"): world * per_rank * 4 * (world - 1) / world}


def test_reduce_scatter_buffers_hold_n_minus_1_rows():
    """Only peers' rows are buffered for sending (the own row goes straight into the output)."""
    assert JOBS.check("send_shape", 3) == [(2, 5)] * 3
