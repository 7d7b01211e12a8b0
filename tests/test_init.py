"""Layout-independent initialization (meshpar.models.init): one process and every DTensor layout agree bit
for bit, a rank computes only the blocks its shard overlaps, and sharded models start equal to
the single-process model. The multi-rank cases share a few spawned jobs (start-up dominates)."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from torch import nn

import meshpar.models.init as minit
from tests.distributed import CaseSet, run_distributed
from tests.helpers import FAMILIES, build_model

SMALL_BLOCK = 64  # elements: 5-row blocks for 11 columns, so block edges fall inside shards


def _shards(world: int):
    """(mesh, placements) cases for ``world`` ranks: 1-D over all ranks, 1-D over 2 ranks (a
    sub-mesh of 2 x 2) and 2-D, with uneven and empty shards for the shapes the tests use.
    Shard(-1) is the last dim: tensor-parallel row-wise on a matrix, dim 0 on a vector."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    flat = init_device_mesh("cpu", (world,))
    cases = [(flat, (Shard(0),)), (flat, (Shard(-1),)), (flat, (Replicate(),))]
    if world == 4:
        grid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        cases += [(grid["dp"], (Shard(0),)), (grid["tp"], (Shard(-1),)),
                  (grid, (Replicate(), Shard(0))), (grid, (Shard(0), Shard(-1))), (grid, (Shard(0), Shard(0))),
                  (grid, (_StridedShard(0, split_factor=2), Shard(0)))]  # FSDP over a column-wise tp shard
    return cases


def _empty_dtensor(shape, mesh, placements, dtype=torch.float32):
    """A DTensor whose local shard is uninitialized memory, shaped as DTensor places it (NaN-filled)."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard

    placements = tuple(Shard(p.dim % len(shape)) if isinstance(p, Shard) and not isinstance(p, _StridedShard)
                       else p for p in placements)
    local_shape, _ = compute_local_shape_and_global_offset(shape, mesh, placements)
    local = torch.full(local_shape, float("nan"), dtype=dtype)
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape),
                              stride=torch.empty(shape).stride())


def _init_cases():
    return [
        ("normal", lambda t: minit.normal_(t, 0.5, 2.0, key="w", seed=11)),
        ("trunc_normal", lambda t: minit.trunc_normal_(t, 0.0, 1.0, -1.5, 2.0, key="w", seed=11)),
        ("uniform", lambda t: minit.uniform_(t, -0.25, 0.75, key="w", seed=11)),
    ]


def _sharded_equals_plain() -> list[str]:
    """On every rank: each layout's full_tensor() after init equals the plain tensor's init. Returns failures."""
    world = torch.distributed.get_world_size()
    failures, default = [], minit.BLOCK_NUMEL
    normal = _init_cases()[0]
    cases = [((37, 11), fill, SMALL_BLOCK) for fill in _init_cases()] + [((37, 11), normal, default)]
    cases += [(shape, normal, SMALL_BLOCK) for shape in [(3, 5), (37,), (4, 3, 6)]]
    for shape, (name, fill), block in cases:
        minit.BLOCK_NUMEL = block
        try:
            ref = fill(torch.empty(shape))
            for mesh, placements in _shards(world):
                param = nn.Parameter(_empty_dtensor(shape, mesh, placements))  # written in place through it
                assert fill(param) is param
                if not torch.equal(param.full_tensor(), ref):
                    failures.append(f"{name} {shape} {placements} on {mesh.shape} (block {block})")
            dt = _empty_dtensor(shape, *_shards(world)[0], dtype=torch.bfloat16)
            if not torch.equal(fill(dt).full_tensor(), ref.bfloat16()):  # bf16 gets the float32 values rounded
                failures.append(f"{name} {shape} bf16")
        finally:
            minit.BLOCK_NUMEL = default
    # norms and biases keep nn.init's ones_ / zeros_: DTensor's fill_ handles uneven and empty shards
    for mesh, placements in _shards(world):
        dt = _empty_dtensor((3,), mesh, placements)
        for fill, value in ((nn.init.ones_, 1.0), (nn.init.zeros_, 0.0)):
            if not torch.equal(fill(dt).full_tensor(), torch.full((3,), value)):
                failures.append(f"{fill.__name__} {placements} on {mesh.shape}")
    return failures


@pytest.mark.parametrize("world", [2, 4])
def test_every_layout_equals_the_plain_tensor(world):
    results = JOBS.check("layouts", world)
    assert results == [[]] * world, results[0]


def test_same_key_and_seed_repeat_and_others_differ():
    def normal(key="layers.0.w", seed=5, shape=(64, 32)):
        return minit.normal_(torch.empty(shape), key=key, seed=seed)
    assert torch.equal(normal(), normal())
    assert not torch.equal(normal(), normal(key="layers.1.w"))
    assert not torch.equal(normal(), normal(seed=6))
    param = nn.Parameter(torch.zeros(64, 32))
    minit.normal_(param, key="layers.0.w", seed=5)  # in place, on a leaf that requires grad
    assert torch.equal(param.detach(), normal()) and param.requires_grad
    scalar = minit.uniform_(torch.empty(()), key="s", seed=5)
    assert scalar.shape == () and 0 <= scalar.item() < 1
    meta = torch.empty(8, 8, device="meta")
    assert minit.normal_(meta, key="m", seed=1) is meta  # nothing to fill on meta


def test_statistics():
    x = minit.normal_(torch.empty(1000, 1000), mean=1.0, std=0.5, key="n", seed=0)
    assert x.mean().item() == pytest.approx(1.0, abs=2e-3)
    assert x.std().item() == pytest.approx(0.5, rel=5e-3)
    std, a, b = 0.02, -0.04, 0.06
    t = minit.trunc_normal_(torch.empty(1000, 1000), std=std, a=a, b=b, key="t", seed=0)
    assert a <= t.min().item() and t.max().item() <= b
    assert t.min().item() < a + 1e-4 and t.max().item() > b - 1e-4  # the whole interval is used
    ref = nn.init.trunc_normal_(torch.empty(1000, 1000), std=std, a=a, b=b)
    assert t.mean().item() == pytest.approx(ref.mean().item(), abs=1e-4)
    assert t.std().item() == pytest.approx(ref.std().item(), rel=5e-3)
    u = minit.uniform_(torch.empty(1000, 1000), -1.0, 3.0, key="u", seed=0)
    assert u.min().item() >= -1.0 and u.max().item() < 3.0 and u.mean().item() == pytest.approx(1.0, abs=5e-3)
    with pytest.raises(ValueError, match="a < b"):
        minit.trunc_normal_(torch.empty(3), std=1.0, a=1.0, b=-1.0, key="t", seed=0)


def _huge_shard_blocks() -> list[tuple[int, tuple[int, ...]]]:
    """Rank 7 of 1000 (a fake process group: no peers) initializes its shard of a 4-billion-element
    weight; returns the blocks it generated."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=7, world_size=1000)
    try:
        mesh = init_device_mesh("cpu", (1000,))
        shape = (1_000_003, 4096)  # chunks of 1001 rows: rank 7 holds rows [7007, 8008)
        local = torch.full((1001, 4096), float("nan"))
        dt = DTensor.from_local(local, mesh, (Shard(0),), run_check=False, shape=shape, stride=(4096, 1))
        calls, generate = [], minit._generate_block

        def counting(seed, key, block, block_shape, sample):
            calls.append((block, block_shape))
            return generate(seed, key, block, block_shape, sample)
        minit._generate_block = counting
        minit.trunc_normal_(dt, std=0.02, a=-0.06, b=0.06, key="tok_embeddings.weight", seed=3)
        assert not local.isnan().any() and local.abs().max() <= 0.06
        return calls
    finally:
        dist.destroy_process_group()


def test_a_rank_generates_only_the_blocks_of_its_shard():
    calls = run_distributed(_huge_shard_blocks, 1, timeout=60, init_process_group=False)[0]
    block_rows = minit.BLOCK_NUMEL // 4096  # 256
    assert [b for b, _ in calls] == list(range(7007 // block_rows, 8007 // block_rows + 1))  # blocks 27..31
    assert len(calls) <= math.ceil(1001 / block_rows) + 1
    assert all(shape == (block_rows, 4096) for _, shape in calls)  # ~4 MiB each, never the whole weight


# --- models --------------------------------------------------------------------------------

def _sharded_model_equals_plain(families: list[str]) -> list[str]:
    """Every parameter replaced by an uninitialized Shard(0) (then Shard(-1)) DTensor over all ranks;
    init_weights() must gather to the single-process model. Returns failures."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    failures = []
    for family in families:
        reference = dict(build_model(family, seed=4).named_parameters(remove_duplicate=False))
        for dim in (0, -1):
            cls, sizes = FAMILIES[family]
            with torch.device("meta"):
                model = cls(sizes["debug"])
            model.to_empty(device="cpu")
            for module in model.modules():
                for name, param in list(module.named_parameters(recurse=False)):
                    dt = _empty_dtensor(tuple(param.shape), mesh, (Shard(dim),))
                    module.register_parameter(name, nn.Parameter(dt))
            torch.manual_seed(4)
            model.init_weights()
            for name, param in model.named_parameters(remove_duplicate=False):
                if not torch.equal(param.full_tensor(), reference[name]):
                    failures.append(f"{family} Shard({dim}) {name}")
    return failures


# the multi-rank cases above and below: one 2-rank and one 4-rank job
JOBS = CaseSet({"layouts": (_sharded_equals_plain, (2, 4)),
                "models": (functools.partial(_sharded_model_equals_plain, ["llama", "qwen3", "gpt2"]), 2)},
               timeout=180)


def test_sharded_models_start_equal_to_one_process():
    assert JOBS.check("models", 2) == [[], []]


def test_wrapped_blocks_draw_what_plain_blocks_draw():
    """Activation-checkpoint and torch.compile wrappers add a component to parameter names; the
    keys drop it, so a wrapped model starts equal to the plain one."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    cls, sizes = FAMILIES["llama"]
    model = cls(sizes["debug"])
    model.layers["0"] = checkpoint_wrapper(model.layers["0"])
    assert "layers.0._checkpoint_wrapped_module.attention.wq.weight" in dict(model.named_parameters())
    assert minit.canonical_name("layers.1._orig_mod.attention.wq.weight") == "layers.1.attention.wq.weight"
    torch.manual_seed(2)
    model.init_weights()
    plain = build_model("llama", seed=2)
    pairs = zip(model.named_parameters(), plain.named_parameters(), strict=True)
    for (name, param), (plain_name, plain_param) in pairs:
        assert minit.canonical_name(name) == plain_name and torch.equal(param, plain_param), name
