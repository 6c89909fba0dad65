"""dtrain.Mesh: the DP x PP x TP layout without processes, its errors, and its groups over gloo.

Pure tests hold :class:`MeshLayout` to the Megatron-LM placement ``rank = (pp_i * dp + dp_i) * tp + tp_i``
for several shapes and check the text of ``describe()``. Spawned tests (one spawn per world
size: 4 processes for (dp, pp, tp) = (2, 1, 2), (1, 2, 2), (2, 2, 1); 8 for (2, 2, 2)) build
each mesh, all-reduce every rank's global rank over each dimension's group and compare with
the sum of ``mesh.ranks(dim)``; the groups of each dimension must partition the world and
agree with torch's DeviceMesh.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from _dist import run_distributed

import dtrain
from dtrain.errors import ConfigError
from dtrain.hybrid_parallel.mesh import DIMS, Mesh, MeshLayout

SHAPES = [(1, 1, 1), (2, 1, 1), (1, 3, 1), (1, 1, 4), (2, 1, 2), (1, 2, 2), (2, 2, 1), (2, 2, 2), (3, 2, 4)]


@pytest.mark.parametrize(("dp", "pp", "tp"), SHAPES)
def test_placement_formula(dp: int, pp: int, tp: int) -> None:
    lay = Mesh.layout(dp, pp, tp)
    assert lay.world_size == dp * pp * tp
    seen = []
    for p, d, t in itertools.product(range(pp), range(dp), range(tp)):
        r = (p * dp + d) * tp + t
        assert lay.rank_of(dp=d, pp=p, tp=t) == r
        assert lay.coords(r) == {"dp": d, "pp": p, "tp": t}
        seen.append(r)
    assert seen == list(range(dp * pp * tp))  # pp outermost, tp innermost: rank order
    assert lay.table() == [lay.coords(r) for r in range(lay.world_size)]


@pytest.mark.parametrize(("dp", "pp", "tp"), SHAPES)
def test_groups_partition_the_world(dp: int, pp: int, tp: int) -> None:
    lay = MeshLayout(dp=dp, pp=pp, tp=tp)
    for dim in DIMS:
        groups = lay.groups(dim)
        assert len(groups) == lay.world_size // lay.size(dim)
        assert sorted(r for g in groups for r in g) == list(range(lay.world_size))
        for r in range(lay.world_size):
            g = lay.ranks(dim, r)
            assert g in groups and r in g and len(g) == lay.size(dim)
            # members differ only in this dimension's coordinate, which runs 0..size-1
            assert [lay.coords(m)[dim] for m in g] == list(range(lay.size(dim)))
            others = [{k: v for k, v in lay.coords(m).items() if k != dim} for m in g]
            assert all(o == others[0] for o in others)
    assert lay.groups("tp") == [list(range(i, i + tp)) for i in range(0, lay.world_size, tp)]


def test_describe_text() -> None:
    text = Mesh.layout(dp=2, pp=2, tp=2).describe()
    lines = text.splitlines()
    assert lines[0] == "mesh dp 2 x pp 2 x tp 2 = 8 processes (tp innermost, pp outermost)"
    assert len(lines) == 9
    assert lines[6] == "rank 5: dp 0, pp 1, tp 1 | tp group [4, 5], dp group [5, 7], pp group [1, 5]"
    assert lines[1] == "rank 0: dp 0, pp 0, tp 0 | tp group [0, 1], dp group [0, 2], pp group [0, 4]"
    wide = MeshLayout(dp=3, pp=2, tp=2).describe(mark=10).splitlines()
    assert wide[1].startswith("rank  0: ") and wide[11].startswith("rank 10: dp 2, pp 1, tp 0 | tp group [10, 11]")
    assert wide[11].endswith(" <- this rank") and sum("this rank" in ln for ln in wide) == 1


def test_world_of_one_without_torch_distributed() -> None:
    assert not torch.distributed.is_initialized()
    m = dtrain.Mesh()
    assert m.world_size == 1 and m.rank == 0 and m.device_mesh is None
    assert all(m.size(d) == 1 and m.index(d) == 0 and m.ranks(d) == [0] and m.group(d) is None for d in DIMS)
    assert m.describe().splitlines()[1].endswith("<- this rank")
    assert repr(m).startswith("Mesh(dp=1, pp=1, tp=1, rank=0")
    with pytest.raises(ConfigError, match=r"^dp 2 x pp 1 x tp 1 = 2 processes, but the world has 1$"):
        dtrain.Mesh(dp=2)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dp": 0}, "mesh size dp must be a positive int, got 0"),
        ({"pp": -2}, "mesh size pp must be a positive int, got -2"),
        ({"tp": 1.5}, r"mesh size tp must be a positive int, got 1.5 \(float\)"),
        ({"tp": "2"}, r"mesh size tp must be a positive int, got '2' \(str\)"),
        ({"dp": True}, r"mesh size dp must be a positive int, got True \(bool\)"),
    ],
)
def test_bad_sizes(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        MeshLayout(**kwargs)
    with pytest.raises(ConfigError, match=message):
        dtrain.Mesh(**kwargs)


def test_bad_lookups() -> None:
    lay = MeshLayout(dp=2, pp=2, tp=2)
    with pytest.raises(ConfigError, match="rank 8 is outside the mesh's 8 processes"):
        lay.coords(8)
    with pytest.raises(ConfigError, match=r"pp coordinate 2 is outside \[0, 2\)"):
        lay.rank_of(pp=2)
    with pytest.raises(ConfigError, match="unknown mesh dimension 'ep'; one of dp, pp, tp"):
        lay.size("ep")
    with pytest.raises(ConfigError, match="unknown mesh dimension"):
        dtrain.Mesh().group("cp")
    with pytest.raises(ConfigError, match=r"^dp 2 x pp 2 x tp 2 = 8 processes, but the world has 4$"):
        lay.check_world(4)


# ---- spawned: real groups over gloo -----------------------------------------------------------


def _build_and_reduce(rank: int, world: int, shapes: list[tuple[int, int, int]]) -> list[dict[str, Any]]:
    import torch.distributed as dist

    out: list[dict[str, Any]] = []
    # a wrong shape fails on every rank before any collective (a hang would time the test out)
    try:
        Mesh(dp=world + 1)
        out.append({"mismatch": "no error"})
    except ConfigError as e:
        out.append({"mismatch": str(e)})
    for dp, pp, tp in shapes:
        m = Mesh(dp=dp, pp=pp, tp=tp)
        assert m.device_mesh is not None
        rec: dict[str, Any] = {
            "shape": (dp, pp, tp),
            "coords": {d: m.index(d) for d in DIMS},
            "mesh": m.device_mesh.mesh.tolist(),
            "repr": repr(m),
        }
        for dim in DIMS:
            group = m.group(dim)
            t = torch.tensor([float(rank)])
            dist.all_reduce(t, group=group)
            rec[dim] = {
                "sum": int(t.item()),
                "ranks": m.ranks(dim),
                "group_ranks": dist.get_process_group_ranks(group),
                "local_rank": m.device_mesh.get_local_rank(dim),
            }
        out.append(rec)
    return out


def _check_world(world: int, shapes: list[tuple[int, int, int]], results: list[list[dict[str, Any]]]) -> None:
    for rank, recs in enumerate(results):
        assert recs[0]["mismatch"] == f"dp {world + 1} x pp 1 x tp 1 = {world + 1} processes, but the world has {world}"
        for (dp, pp, tp), rec in zip(shapes, recs[1:]):
            lay = MeshLayout(dp=dp, pp=pp, tp=tp)
            assert rec["coords"] == lay.coords(rank)
            assert rec["mesh"] == torch.arange(world).reshape(pp, dp, tp).tolist()
            assert f"rank={rank}" in rec["repr"]
            for dim in DIMS:
                r = rec[dim]
                assert r["ranks"] == lay.ranks(dim, rank)
                assert r["sum"] == sum(r["ranks"]), (rank, (dp, pp, tp), dim, r)
                assert sorted(r["group_ranks"]) == r["ranks"]
                assert r["local_rank"] == rec["coords"][dim]
    for i, shape in enumerate(shapes, start=1):
        for dim in DIMS:
            groups = {tuple(results[rank][i][dim]["ranks"]) for rank in range(world)}
            assert sorted(r for g in groups for r in g) == list(range(world)), (shape, dim, groups)


@pytest.mark.procs
def test_world_4_groups_over_gloo() -> None:
    shapes = [(2, 1, 2), (1, 2, 2), (2, 2, 1)]
    _check_world(4, shapes, run_distributed(_build_and_reduce, 4, shapes, timeout=150))


@pytest.mark.procs
def test_world_8_groups_over_gloo() -> None:
    shapes = [(2, 2, 2)]
    _check_world(8, shapes, run_distributed(_build_and_reduce, 8, shapes, timeout=240))
