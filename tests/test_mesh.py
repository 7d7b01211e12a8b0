"""Mesh construction on real gloo ranks: names, rank placement (tp innermost) and the flat dp."""

import torch.distributed as dist

from meshpar.config.recipe import ParallelConfig
from meshpar.distributed import mesh as meshlib
from tests.distributed import run_distributed


def _coordinates(cfg: ParallelConfig) -> dict:
    m = meshlib.build(meshlib.resolve(cfg, dist.get_world_size()), "cpu")
    groups = {d: dist.get_process_group_ranks(m[d].get_group()) for d in (*meshlib.DIMS, "dp")}
    coords = {d: m[d].get_local_rank() for d in meshlib.DIMS}
    return {"coords": coords, "groups": groups, "dp_rank": m.dp_rank, "dp_size": m["dp"].size()}


def test_3d_layout_places_tp_innermost_and_pp_outermost():
    # pp 2 x dp_shard 2 x tp 2 on 8 ranks: the table in meshpar/distributed/mesh.py's docstring.
    out = run_distributed(_coordinates, 8, ParallelConfig(pp=2, dp_shard=-1, tp=2), timeout=180)
    for rank, r in enumerate(out):
        pp, dp, tp = rank // 4, (rank // 2) % 2, rank % 2
        assert r["coords"] == {"pp": pp, "dp_replicate": 0, "dp_shard": dp, "cp": 0, "tp": tp}
        assert r["groups"]["tp"] == [4 * pp + 2 * dp, 4 * pp + 2 * dp + 1]
        assert r["groups"]["dp_shard"] == [4 * pp + tp, 4 * pp + 2 + tp]
        assert r["groups"]["pp"] == [2 * dp + tp, 4 + 2 * dp + tp]
        assert r["groups"]["dp"] == r["groups"]["dp_shard"]
        assert r["groups"]["cp"] == r["groups"]["dp_replicate"] == [rank]
        assert (r["dp_rank"], r["dp_size"]) == (dp, 2)


def test_hybrid_dp_flattens_replicate_outer_shard_inner():
    out = run_distributed(_coordinates, 4, ParallelConfig(dp_replicate=2, dp_shard=2), timeout=120)
    for rank, r in enumerate(out):
        assert r["groups"]["dp"] == [0, 1, 2, 3]
        assert r["groups"]["dp_shard"] == [2 * (rank // 2), 2 * (rank // 2) + 1]
        assert r["groups"]["dp_replicate"] == [rank % 2, rank % 2 + 2]
        assert r["dp_rank"] == rank  # replicate-major: dp rank = replica * dp_shard + shard
