"""The parity machinery itself (tests/parity.py): the kernel path reaches spawned ranks, and
``must_fail`` tells a comparison that bites from one that does not."""

import os

import pytest
import torch

from tests.distributed import run_distributed
from tests.parity import default_dtype, must_fail


def _capability() -> str:
    return torch.backends.cpu.get_cpu_capability()


@pytest.mark.parity
def test_spawned_ranks_use_the_parents_kernel_path():
    """.ci/run reruns parity under ATEN_CPU_CAPABILITY=default (and avx2): spawned ranks read it
    from the environment they inherit, so they run the same kernels as this process."""
    asked = os.environ.get("ATEN_CPU_CAPABILITY")
    if asked:
        assert _capability() == asked.upper(), f"ATEN_CPU_CAPABILITY={asked} did not take: {_capability()}"
    assert run_distributed(_capability, 2, init_process_group=False, timeout=60) == [_capability()] * 2


def test_must_fail_and_default_dtype():
    assert "differ" in must_fail(lambda: (_ for _ in ()).throw(AssertionError("differ")), "a bug")
    with pytest.raises(AssertionError, match="passed with a planted bug"):
        must_fail(lambda: None, "a bug")
    before = torch.get_default_dtype()
    with default_dtype():
        assert torch.ones(1).dtype == torch.float64
    assert torch.get_default_dtype() == before
