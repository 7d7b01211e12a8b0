"""The multi-process harness itself: results in rank order, readable failures, hangs caught,
and a CaseSet spawns one job per world size however many cases and tests read it."""

import time

import pytest
import torch
import torch.distributed as dist

from tests.distributed import CaseSet, run_distributed, select_cases


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


def _rank1_aborts() -> None:
    if dist.get_rank() == 1:
        import os
        os.abort()  # what a gloo enforce ("collective mismatch") does: no Python exception, no report
    time.sleep(60)  # rank 0 blocks on something that never notices (a collective over another transport)


def test_results_in_rank_order():
    assert run_distributed(_sum_ranks, 3, timeout=60) == [(0, 6), (1, 6), (2, 6)]


def test_failure_names_rank_and_traceback():
    with pytest.raises(AssertionError, match=r"(?s)rank 1 raised:.*ValueError: rank one is broken"):
        run_distributed(_rank1_raises, 2, timeout=60)


def test_hang_is_killed_at_the_deadline():
    with pytest.raises(AssertionError, match=r"ranks \[0\] never reported"):
        run_distributed(_rank0_hangs, 2, timeout=8)


def test_dead_rank_fails_fast_not_at_the_deadline():
    """... and the error names where it died: the crashed rank's faulthandler stack (rank 0, killed
    here, wrote none)."""
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"ranks \[0, 1\] never reported \(exit codes \['-9 \(SIGKILL\)', "
                                             r"'-6 \(SIGABRT\)'\]") as err:  # 0 killed here, 5 s after 1 died
        run_distributed(_rank1_aborts, 2, timeout=120)
    assert time.monotonic() - start < 60  # seconds after the abort, not the 120 s deadline
    report = str(err.value)
    assert "--- rank 1 crashed (exit code -6 (SIGABRT)); faulthandler:" in report
    assert "Fatal Python error: Aborted" in report and "in _rank1_aborts" in report
    assert "rank 0 crashed" not in report


# --- CaseSet ----------------------------------------------------------------------------------------

def _setup(tmp) -> dict:
    return {"world": dist.get_world_size(), "tmp": tmp}


def _case_sum(ctx: dict) -> tuple[int, int]:
    assert ctx["tmp"].is_dir()  # the job's scratch folder, shared by its ranks
    return _sum_ranks()


def _case_rank1_fails(ctx: dict) -> None:
    if dist.get_rank() == 1:
        raise ValueError(f"rank one is broken at world {ctx['world']}")


CASES = CaseSet({"sum": (_case_sum, (1, 2)), "rank1_fails": (_case_rank1_fails, 2),
                 "after_a_failure": (_case_sum, 2)}, setup=_setup, timeout=120)
HANGS = CaseSet({"rank0_hangs": (_rank0_hangs, 2)}, timeout=8)


@pytest.mark.parametrize("world", CASES.worlds("sum"))
def test_case_returns_each_ranks_value(world):
    assert CASES.check("sum", world) == [(r, world * (world + 1) // 2) for r in range(world)]


def test_failing_case_reports_its_rank_and_traceback_and_the_next_case_runs():
    with pytest.raises(pytest.fail.Exception, match=r"(?s)rank1_fails at 2 ranks:\n--- rank 1:\nTraceback.*"
                                                    r"ValueError: rank one is broken at world 2") as e:
        CASES.check("rank1_fails", 2)
    assert "--- rank 0" not in str(e.value)
    assert CASES.check("after_a_failure", 2) == [(0, 3), (1, 3)]


def test_hung_case_fails_at_the_deadline():
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match=r"(?s)rank0_hangs at 2 ranks: the job failed.*"
                                                    r"ranks \[0\] never reported"):
        HANGS.check("rank0_hangs", 2)
    assert time.monotonic() - start < 40  # the 8 s deadline plus start-up, not the rank's 60 s sleep


def test_cases_at_two_world_sizes_spawn_two_jobs():
    for case, world in [(p.values[0], p.values[1]) for p in CASES.params()]:
        try:
            CASES.check(case, world)
        except pytest.fail.Exception:
            assert case == "rank1_fails"
    assert sorted(CASES.spawned) == [1, 2]
    with pytest.raises(ValueError, match="not registered at 4 ranks"):
        CASES.check("sum", 4)


SELECTED = CaseSet({"first": (_case_sum, 2), "second": (_case_sum, 2), "third": (_case_sum, 2)},
                   setup=_setup, timeout=120)


def test_a_job_runs_the_wanted_cases_and_an_unforeseen_one_runs_in_another():
    SELECTED.wanted = {"first"}  # as select_cases leaves it when the session's tests check only "first"
    assert SELECTED.check("first", 2) == [(0, 3), (1, 3)]
    assert SELECTED.spawned == [2]
    assert SELECTED.check("third", 2) == [(0, 3), (1, 3)]  # not foreseen: one more job, with "second"
    assert SELECTED.check("second", 2) == [(0, 3), (1, 3)]
    assert SELECTED.spawned == [2, 2]


class _Item:
    def __init__(self, function, **params) -> None:
        self.function = function
        self.callspec = type("CallSpec", (), {"params": params})()


def _checks_first():
    SELECTED.check("first", 2)


def _checks_its_parameter(case):
    SELECTED.check(case, 2)


def _checks_a_computed_name():
    for name in ("first", "second"):
        SELECTED.check(name, 2)


def test_select_cases_reads_the_names_the_tests_check():
    before = SELECTED.wanted
    try:
        select_cases([_Item(_checks_first), _Item(_checks_its_parameter, case="third")])
        assert SELECTED.wanted == {"first", "third"}
        select_cases([_Item(_checks_first), _Item(_checks_a_computed_name)])
        assert SELECTED.wanted is None  # every case: the name is not readable
    finally:
        SELECTED.wanted = before
