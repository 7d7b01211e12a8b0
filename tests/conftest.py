import os

import pytest

from tests import tiers
from tests.distributed import select_cases

# Tests run on 2 cores next to other ranks: one thread per process keeps timings sane.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> str:
    """One tokenizer/token cache for the whole session, shared by every test that trains."""
    path = tmp_path_factory.mktemp("meshpar-cache")
    os.environ["MESHPAR_CACHE"] = str(path)
    return str(path)


def pytest_configure(config: pytest.Config) -> None:
    tiers.install()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks the tiers (tests/tiers.py): `multirank` from what a test calls, `slow` for benchmarks."""
    for item in items:
        fn = getattr(item, "function", None)
        if fn is None:
            continue
        if item.get_closest_marker("multirank") is None:
            defs = item._fixtureinfo.name2fixturedefs if hasattr(item, "_fixtureinfo") else {}
            fixtures = [d[-1].func for d in defs.values() if d]
            if tiers.spawns(fn, fixtures):
                item.add_marker(pytest.mark.multirank)
        if item.path.name.startswith("test_bench_"):
            item.add_marker(pytest.mark.slow)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Each spawned CaseSet job runs only the cases the selected tests check (tests/distributed.py)."""
    select_cases(session.items)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    """[Note: the tier guard] in tests/tiers.py: a test of the inner loop may not start a process."""
    inner = not (item.get_closest_marker("multirank") or item.get_closest_marker("slow"))
    tiers.begin(item.nodeid if inner else None)
    try:
        result = yield
    finally:
        started = tiers.end()
    if started:
        pytest.fail(f"{item.nodeid} started processes but is in the inner loop ({'; '.join(started[:3])}): "
                    "mark it @pytest.mark.multirank if it spawns ranks (or let tests/tiers.py see the call), "
                    "@pytest.mark.slow if torch.compile builds kernels", pytrace=False)
    return result
