"""The multi-process harness itself: results in rank order, readable failures, hangs caught."""

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_distributed


def _sum_ranks() -> int:
    t = torch.tensor([dist.get_rank() + 1])
    dist.all_reduce(t)
    return dist.get_rank(), int(t)


def _rank1_raises() -> None:
    if dist.get_rank() == 1:
        raise ValueError("rank one is broken")
    dist.barrier()  # rank 0 waits for a peer that will never come


def _rank0_hangs() -> None:
    if dist.get_rank() == 0:
        import time
        time.sleep(60)


def test_results_in_rank_order():
    assert run_distributed(_sum_ranks, 3, timeout=60) == [(0, 6), (1, 6), (2, 6)]


def test_failure_names_rank_and_traceback():
    with pytest.raises(AssertionError, match=r"(?s)rank 1 raised:.*ValueError: rank one is broken"):
        run_distributed(_rank1_raises, 2, timeout=60)


def test_hang_is_killed_at_the_deadline():
    with pytest.raises(AssertionError, match=r"ranks \[0\] never reported"):
        run_distributed(_rank0_hangs, 2, timeout=8)
