"""meshpar against the installed torch: every private name it relies on still exists, and the
heavy private modules stay out of ``import meshpar`` / ``import meshpar.fsdp``.

meshpar/distributed/_torch.py is the one module that touches PyTorch's underscore names; its ``REQUIRED``
maps each to the meshpar feature that needs it. After a torch upgrade, a failure here names
what moved and what breaks with it.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from meshpar.distributed import _torch

ROOT = Path(__file__).resolve().parents[1]


def _missing() -> list[str]:
    missing = []
    for name, feature in _torch.REQUIRED.items():
        if name in _torch.CUDA_ONLY and not torch.backends.cuda.is_built():
            continue
        try:
            _torch.resolve(name)
        except (ImportError, AttributeError) as e:
            missing.append(f"  {name}  ({type(e).__name__}: {e})\n      needed by: {feature}")
    return missing


def test_every_private_torch_name_meshpar_uses_exists():
    missing = _missing()
    assert not missing, (f"torch {torch.__version__} lacks {len(missing)} private name(s) meshpar relies on; "
                         f"update meshpar/distributed/_torch.py:\n" + "\n".join(missing))


def test_the_lookup_names_what_is_missing(monkeypatch):
    made_up = {"torch.distributed.tensor.placement_types._NoSuchShard": "a made-up feature"}
    monkeypatch.setattr(_torch, "REQUIRED", {**_torch.REQUIRED, **made_up})  # REQUIRED itself is read-only
    assert any("_NoSuchShard" in m and "a made-up feature" in m for m in _missing())


def test_the_wrappers_bind_to_what_required_names():
    """The names meshpar imports from _torch are the objects REQUIRED checks."""
    from torch.distributed.tensor.placement_types import _StridedShard
    from torch.utils import _pytree

    assert _torch.StridedShard is _StridedShard
    assert _torch.tree_leaves is _pytree.tree_leaves
    assert _torch.MemTracker is _torch.resolve("torch.distributed._tools.mem_tracker.MemTracker")
    assert _torch.RefType is _torch.resolve("torch.distributed._tools.mem_tracker._RefType")
    assert _torch.FakeStore is _torch.resolve("torch.testing._internal.distributed.fake_pg.FakeStore")
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        _torch.nothing  # noqa: B018


_PRIVATE_TORCH = re.compile(r"torch\..*\._[a-zA-Z]|\._local_tensor\b|\b_StridedShard\b|_pytree|\._batch_p2p\b|"
                            r"\._op_dispatcher\b|\._execution_engine\b|\._(flatten|unflatten|concatenate)\(|"
                            r"from torch\S* import .*\b_[a-zA-Z]")


def test_no_private_torch_name_outside_meshpar_torch():
    """grep: only meshpar/distributed/_torch.py names PyTorch's private API (subclass overrides, which cannot
    go through it, are listed in its REQUIRED)."""
    hits = []
    for path in sorted((ROOT / "meshpar").rglob("*.py")):
        if path == ROOT / "meshpar" / "distributed" / "_torch.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if _PRIVATE_TORCH.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not hits, "private torch names outside meshpar/distributed/_torch.py:\n" + "\n".join(hits)
    assert _PRIVATE_TORCH.search("from torch.distributed.checkpoint.filesystem import _StorageInfo")
    assert _PRIVATE_TORCH.search("from torch.distributed.tensor import DTensor, _Partial")
    assert not _PRIVATE_TORCH.search("from torch.distributed.tensor import DTensor, Shard")


def test_importing_meshpar_skips_the_heavy_private_modules():
    """Fresh interpreter: ``import meshpar`` and ``import meshpar.fsdp`` load neither the memory
    tracker, the fake process group, nor the meshpar modules built on them."""
    heavy = ["torch.distributed._tools.mem_tracker", "torch.testing._internal.distributed.fake_pg",
             "meshpar.profiling.memory", "meshpar.planner", "meshpar.planner.simulate", "meshpar.planner.dry_run"]
    code = ("import sys\nimport meshpar\nimport meshpar.fsdp\n"
            f"print(','.join(m for m in {heavy!r} if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    loaded = proc.stdout.strip()
    assert not loaded, f"import meshpar / meshpar.fsdp loaded {loaded}"


def test_a_dtensor_made_by_new_alone_is_the_one_the_constructor_makes():
    """``dtensor_like`` calls ``DTensor.__new__`` without ``__init__`` ([Note: DTensor without __init__]):
    after a torch upgrade that gives ``__init__`` work of its own, the two objects differ here."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        like = distribute_tensor(torch.ones(4, 2), init_device_mesh("cpu", (1,)), [Shard(0)])
        local = torch.arange(8.0).view(4, 2)
        made, built = _torch.dtensor_like(local, like), DTensor(local, like._spec, requires_grad=False)
        assert type(made) is type(built) is DTensor
        assert vars(made).keys() == vars(built).keys()
        assert made._spec is built._spec and made._local_tensor is built._local_tensor is local
        assert (made.requires_grad, made.shape, made.stride()) == (built.requires_grad, built.shape, built.stride())
        assert torch.equal((made * 2).full_tensor(), (built * 2).full_tensor())
    finally:
        dist.destroy_process_group()
