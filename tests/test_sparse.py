"""Sparse collectives: equal to the dense sum, bitwise equal across ranks, costs as the formula says."""

from __future__ import annotations

import pytest
import torch
from _dist import run_distributed

from dtrain.comm.sparse import (
    INDEX_BYTES,
    chunk_bounds,
    plan_sparse_allreduce,
    sparse_allgather,
    sparse_allreduce,
)
from dtrain.comm.transport import Transport, run_threads
from dtrain.errors import CommError

N = 2000


def _pairs(rank: int, n: int, density: float, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + rank)
    k = max(1, round(density * n))
    idx = torch.randperm(n, generator=g)[:k]
    return idx, torch.randn(k, generator=g).to(dtype)


def _dense(idx: torch.Tensor, vals: torch.Tensor, n: int) -> torch.Tensor:
    out = torch.zeros(n, dtype=vals.dtype)
    out[idx] = vals
    return out


def _counts_bytes(p: int) -> int:
    return (p - 1) * 8 * (p + 2)


def _expected_bytes(method: str, counts: list[list[int]], n: int, v: int, merged: list[int] | None) -> list[int]:
    """The module docstring's formula, with the true merged sizes for split, plus the counts exchange."""
    p = len(counts)
    w = INDEX_BYTES + v
    b = chunk_bounds(n, p)
    c = [b[j + 1] - b[j] for j in range(p)]
    if method == "allgather":
        return [(p - 1) * min(sum(counts[r]) * w, n * v) + _counts_bytes(p) for r in range(p)]
    assert merged is not None
    return [
        sum(min(counts[r][j] * w, c[j] * v) for j in range(p) if j != r)
        + (p - 1) * (8 + min(merged[r] * w, c[r] * v))
        + _counts_bytes(p)
        for r in range(p)
    ]


def _counts(data: list[tuple[torch.Tensor, torch.Tensor]], n: int) -> list[list[int]]:
    b = chunk_bounds(n, len(data))
    return [[int(((i >= b[j]) & (i < b[j + 1])).sum()) for j in range(len(data))] for i, _ in data]


@pytest.mark.parametrize("p", range(2, 8))
@pytest.mark.parametrize("density", [0.001, 0.01, 0.05, 0.1, 0.3, 0.5])
def test_sparse_allreduce_matches_dense_and_formula(p: int, density: float) -> None:
    data = [_pairs(r, N, density) for r in range(p)]
    ref = torch.stack([_dense(i, v, N).double() for i, v in data]).sum(0)
    counts = _counts(data, N)
    plan = plan_sparse_allreduce(counts, N, 4)
    assert plan.method == min(("allgather", "split"), key=lambda m: (plan.costs[m], m != "allgather"))

    for method in ("auto", "allgather", "split"):

        def fn(t: Transport) -> tuple[object, int]:
            i, v = data[t.rank]
            return sparse_allreduce(i, v, N, t, method=method), t.stats.bytes_sent

        out = run_threads(p, fn)
        first = out[0][0].tensor  # type: ignore[attr-defined]
        assert torch.allclose(first.double(), ref, rtol=1e-6, atol=1e-6)
        assert all(torch.equal(first, o[0].tensor) for o in out)  # type: ignore[attr-defined]
        res = out[0][0]
        ran = res.plan.method  # type: ignore[attr-defined]
        assert ran == (plan.method if method == "auto" else method)
        sent = [b for _, b in out]
        assert sent == _expected_bytes(ran, counts, N, 4, res.merged_nnz)  # type: ignore[attr-defined]
        if ran == "split":
            # the plan's split estimate is an upper bound of what it sends
            assert max(sent) - _counts_bytes(p) <= plan.costs["split"]
            bounds = chunk_bounds(N, p)
            expect = [int((ref[a:b] != 0).sum()) for a, b in zip(bounds, bounds[1:])]
            assert res.merged_nnz == expect  # type: ignore[attr-defined]


def test_plan_picks_cheaper_and_switches_dense() -> None:
    p, n = 4, 4000
    # very sparse: allgather is cheaper (one phase, no merged resend)
    sparse = plan_sparse_allreduce([[5] * p for _ in range(p)], n, 4)
    assert sparse.method == "allgather" and sparse.costs["allgather"] < sparse.costs["split"]
    # dense: split with dense pieces costs a dense reduce-scatter + allgather
    dense = plan_sparse_allreduce([[n // p] * p for _ in range(p)], n, 4)
    assert dense.method == "split"
    assert dense.costs["split"] == 2 * (p - 1) * (n // p) * 4 + (p - 1) * 8
    assert dense.costs["allgather"] == (p - 1) * n * 4
    # fp32 pieces go dense exactly from density 1/2 (k * 8 >= c * 4)
    c = n // p
    below = plan_sparse_allreduce([[c // 2 - 1, 0, 0, 0]] + [[0] * p] * 3, n, 4)
    assert below.per_rank["split"][0] == 0 + (p - 1) * (8 + (c // 2 - 1) * 8)


def test_dense_switch_sends_dense_bytes() -> None:
    p, n = 4, 1000
    data = [(torch.arange(n), torch.randn(n)) for _ in range(p)]

    def fn(t: Transport) -> tuple[object, int]:
        i, v = data[t.rank]
        return sparse_allreduce(i, v, n, t), t.stats.bytes_sent

    out = run_threads(p, fn)
    ring_bytes = 2 * (p - 1) * (n // p) * 4
    assert out[0][0].plan.method == "split"  # type: ignore[attr-defined]
    assert all(b == ring_bytes + (p - 1) * 8 + _counts_bytes(p) for _, b in out)


def test_sparse_allgather_returns_every_ranks_pairs() -> None:
    p = 5
    data = [_pairs(r, 300, 0.02 * (r + 1)) for r in range(p)]
    data[2] = (torch.empty(0, dtype=torch.int64), torch.empty(0))  # a rank with nothing
    out = run_threads(p, lambda t: (sparse_allgather(*data[t.rank], t), t.stats.bytes_sent))
    for got, _sent in out:
        assert len(got) == p
        for (gi, gv), (i, v) in zip(got, data):
            assert torch.equal(gi, i.to(torch.int64)) and torch.equal(gv, v)
    assert [s for _, s in out] == [(p - 1) * (24 + data[r][0].numel() * 8) for r in range(p)]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_other_value_dtypes(dtype: torch.dtype) -> None:
    p, n = 3, 501
    data = [_pairs(r, n, 0.05, dtype) for r in range(p)]
    ref = sum(_dense(i, v, n).double() for i, v in data)
    for method in ("allgather", "split"):
        out = run_threads(p, lambda t: sparse_allreduce(*data[t.rank], n, t, method=method))
        assert out[0].tensor.dtype == dtype
        tol = 1e-2 if dtype != torch.float64 else 1e-12
        assert torch.allclose(out[0].tensor.double(), ref, atol=tol, rtol=tol)


def test_more_ranks_than_elements() -> None:
    p, n = 6, 4
    data = [(torch.tensor([r % n]), torch.tensor([float(r)])) for r in range(p)]
    ref = sum(_dense(i, v, n) for i, v in data)
    for method in ("allgather", "split"):
        out = run_threads(p, lambda t: sparse_allreduce(*data[t.rank], n, t, method=method))
        assert all(torch.equal(o.tensor, ref) for o in out)


def test_bad_input_is_a_clear_error() -> None:
    with pytest.raises(CommError, match=r"indices must lie in \[0, 10\)"):
        run_threads(2, lambda t: sparse_allreduce(torch.tensor([3, 10]), torch.ones(2), 10, t))
    with pytest.raises(CommError, match="equal length"):
        run_threads(2, lambda t: sparse_allreduce(torch.tensor([3]), torch.ones(2), 10, t))
    with pytest.raises(CommError, match="ranks disagree"):
        run_threads(2, lambda t: sparse_allreduce(torch.tensor([1]), torch.ones(1), 10 + t.rank, t))
    with pytest.raises(ValueError, match="method"):
        run_threads(2, lambda t: sparse_allreduce(torch.tensor([1]), torch.ones(1), 10, t, method="ring"))


# ----------------------------------------------------------------------------- real processes


def _gloo_sparse(rank: int, world_size: int, cases: list[tuple[float, str]]) -> list[tuple[bool, bool, int, str]]:
    from dtrain.comm.transport import TorchTransport

    t = TorchTransport(timeout=30)
    results = []
    for density, method in cases:
        data = [_pairs(r, N, density) for r in range(world_size)]
        ref = torch.stack([_dense(i, v, N).double() for i, v in data]).sum(0)
        before = t.stats.bytes_sent
        res = sparse_allreduce(*data[rank], N, t, method=method)
        ok = bool(torch.allclose(res.tensor.double(), ref, rtol=1e-6, atol=1e-6))
        sent = t.stats.bytes_sent - before
        expected = _expected_bytes(res.plan.method, _counts(data, N), N, 4, res.merged_nnz)[rank]
        results.append((ok, sent == expected, int(res.tensor.sum().mul(1e4).round().item()), res.plan.method))
    gathered = sparse_allgather(*data[rank], t)
    results.append((all(torch.equal(gi, i) for (gi, _), (i, _) in zip(gathered, data)), True, 0, "allgather"))
    return results


@pytest.mark.procs
@pytest.mark.parametrize("world_size", [3, 4])
def test_sparse_allreduce_over_gloo(world_size: int) -> None:
    cases = [(0.001, "auto"), (0.05, "auto"), (0.5, "auto"), (0.05, "split"), (0.3, "allgather")]
    out = run_distributed(_gloo_sparse, world_size, cases, timeout=120)
    for per_rank in out:
        assert all(ok and bytes_ok for ok, bytes_ok, _, _ in per_rank), per_rank
    assert all(r == out[0] for r in out)  # same sums and same plan on every rank
    assert out[0][2][3] == "split" and out[0][0][3] == "allgather"
