import os

import pytest

# Tests run on 2 cores next to other ranks: one thread per process keeps timings sane.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> str:
    """One tokenizer/token cache for the whole session, shared by every test that trains."""
    path = tmp_path_factory.mktemp("meshpar-cache")
    os.environ["MESHPAR_CACHE"] = str(path)
    return str(path)
