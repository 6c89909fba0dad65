"""dtrain.comm.shard: ring reduce-scatter and allgather over threads against a plain reference, bytes against the
closed form, bad input; and over gloo processes against the backend's own reduce_scatter_tensor /
all_gather_into_tensor."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _dist import run_distributed

from dtrain.comm import ThreadTransport, run_threads
from dtrain.comm.shard import allgather_over, reduce_scatter_over, segment
from dtrain.errors import ConfigError


def _inputs(world: int, seg: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(world * 100 + seg)
    return [torch.randn(world * seg, generator=g).to(dtype) for _ in range(world)]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("op", ["sum", "avg", "max", "min"])
def test_reduce_scatter_leaves_each_rank_its_reduced_segment(world: int, op: str) -> None:
    xs = _inputs(world, 7)
    stacked = torch.stack(xs)
    want = {
        "sum": stacked.sum(0),
        "avg": stacked.sum(0) / world,
        "max": stacked.max(0).values,
        "min": stacked.min(0).values,
    }[op]
    ts = ThreadTransport.create(world)
    outs = run_threads(world, lambda t: reduce_scatter_over(t, xs[t.rank].clone(), op), transports=ts)
    for r, out in enumerate(outs):
        torch.testing.assert_close(segment(out, r, world), segment(want, r, world), rtol=1e-6, atol=1e-6)
    # each rank sends P-1 segments: (P-1)/P of the vector, the reduce-scatter half of a ring allreduce
    assert all(t.stats.bytes_sent == (world - 1) * 7 * 4 for t in ts)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("op", ["sum", "avg", "max"])
def test_reduce_scatter_into_out_gives_the_in_place_bits_and_takes_no_scratch(world: int, op: str) -> None:
    from dtrain.comm._reduce import BUFFERS

    xs = _inputs(world, 7)
    ts = ThreadTransport.create(world)
    inplace = run_threads(world, lambda t: reduce_scatter_over(t, xs[t.rank].clone(), op), transports=ts)
    BUFFERS._free.clear()  # what the in-place runs left: the cache starts empty
    outs = [torch.full((7,), float("nan")) for _ in range(world)]
    got = run_threads(world, lambda t: reduce_scatter_over(t, xs[t.rank].clone(), op, out=outs[t.rank]), transports=ts)
    for r in range(world):
        assert got[r] is outs[r]
        assert torch.equal(outs[r], segment(inplace[r], r, world))  # bit for bit: sum, max, min commute
    assert not any(BUFFERS._free.values())  # the receives landed in out: no scratch was taken


def test_reduce_scatter_refuses_an_out_of_the_wrong_size_or_storage() -> None:
    ts = ThreadTransport.create(2)
    with pytest.raises(ConfigError, match="one segment"):
        reduce_scatter_over(ts[0], torch.zeros(8), out=torch.zeros(3))
    x = torch.zeros(8)
    with pytest.raises(ConfigError, match="must not share"):
        reduce_scatter_over(ts[0], x, out=x[4:])


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_allgather_gives_every_rank_every_segment(world: int) -> None:
    xs = _inputs(world, 5)
    want = torch.cat([segment(xs[r], r, world) for r in range(world)])
    ts = ThreadTransport.create(world)
    outs = run_threads(world, lambda t: allgather_over(t, xs[t.rank].clone()), transports=ts)
    for out in outs:
        assert torch.equal(out, want)
    assert all(t.stats.bytes_sent == (world - 1) * 5 * 4 for t in ts)


def test_a_tensor_that_does_not_split_evenly_is_refused() -> None:
    ts = ThreadTransport.create(2)
    with pytest.raises(ConfigError, match="do not divide over 2 ranks"):
        reduce_scatter_over(ts[0], torch.zeros(5))
    with pytest.raises(ConfigError, match="pad it to a multiple of 2"):
        allgather_over(ts[0], torch.zeros(3))


def _against_native(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    from dtrain.comm.shard import allgather, reduce_scatter

    out: dict[str, Any] = {}
    x = _inputs(world, 1000)[rank]
    for alg in ("ring", "native"):
        a = x.clone()
        reduce_scatter(a, op="avg", algorithm=alg)
        b = torch.empty(1000)
        dist.reduce_scatter_tensor(b, x.clone())
        out[f"rs-{alg}"] = float((segment(a, rank, world) - b / world).abs().max())
        into = reduce_scatter(x.clone(), op="avg", algorithm=alg, out=torch.empty(1000))
        out[f"rs-out-{alg}"] = float((into - segment(a, rank, world)).abs().max())
        c = torch.zeros(world * 1000)
        segment(c, rank, world).copy_(x[:1000])
        allgather(c, algorithm=alg)
        d = torch.empty(world * 1000)
        dist.all_gather_into_tensor(d, x[:1000].clone())
        out[f"ag-{alg}"] = float((c - d).abs().max())
    return out


@pytest.mark.procs
def test_ring_and_native_match_the_backend_on_gloo() -> None:
    for res in run_distributed(_against_native, 3, timeout=60):
        assert res["ag-ring"] == 0.0 and res["ag-native"] == 0.0, res
        assert res["rs-ring"] < 1e-6 and res["rs-native"] < 1e-6, res
        assert res["rs-out-ring"] == 0.0 and res["rs-out-native"] == 0.0, res
