"""Topologies for gossip: mixing matrices against numpy, threaded mixing rounds, the bipartite
split of AD-PSGD, and every bad input as a ConfigError naming the bad value. Single process."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch

from dtrain.comm.transport import Transport, run_threads
from dtrain.decentralized.topology import Topology, bipartition, metropolis_hastings, mix_round, topology
from dtrain.errors import ConfigError

REGULAR = ("ring", "torus", "exponential")
SIZES = (4, 8, 16)


def _np(t: Topology) -> np.ndarray:
    return np.array(t.matrix, dtype=np.float64)


def _np_lambda2(w: np.ndarray) -> float:
    if np.allclose(w, w.T, atol=0):
        vals = np.sort(np.abs(np.linalg.eigvals(w)))[::-1]
    else:
        vals = np.sort(np.linalg.svd(w, compute_uv=False))[::-1]
    return float(vals[1])


def _data(n: int, dim: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, dim, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def _consensus(x: torch.Tensor) -> float:
    x = x.double()
    return math.sqrt(float(((x - x.mean(0)) ** 2).sum(1).mean()))


def _rounds(topo: Topology, x0: torch.Tensor, rounds: int) -> list[torch.Tensor]:
    """``rounds`` threaded mix rounds of the rows of ``x0``; the stacked state after each round."""
    n = topo.n

    def body(t: Transport) -> list[torch.Tensor]:
        mine = x0[t.rank].clone()
        out = []
        for _ in range(rounds):
            mix_round(t, mine, topo)
            out.append(mine.clone())
        return out

    per_rank = run_threads(n, body, timeout=20)
    return [torch.stack([per_rank[r][k] for r in range(n)]) for k in range(rounds)]


# ---------------------------------------------------------------------------- regular topologies


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("name", REGULAR)
def test_regular_doubly_stochastic_symmetric_and_gap(name: str, n: int) -> None:
    t = topology(name, n)
    w = _np(t)
    assert w.shape == (n, n)
    assert (w >= 0).all()
    np.testing.assert_allclose(w.sum(0), 1.0, atol=1e-12)
    np.testing.assert_allclose(w.sum(1), 1.0, atol=1e-12)
    np.testing.assert_array_equal(w, w.T)
    assert t.symmetric
    assert t.spectral_gap == pytest.approx(1.0 - _np_lambda2(w), abs=1e-9)
    assert 0.0 < t.spectral_gap <= 1.0
    # neighbours / self weight / degree read W
    for i in range(n):
        nb = t.neighbours(i)
        assert [j for j, _ in nb] == [j for j in range(n) if j != i and w[i, j] > 0]
        assert all(wj == w[i, j] for j, wj in nb)
        assert t.self_weight(i) == w[i, i]
        assert sorted(t.out_neighbours(i)) == [j for j, _ in nb]
    assert t.degree == max(len(t.neighbours(i)) for i in range(n))


def test_shapes_of_the_graphs() -> None:
    ring = topology("ring", 8)
    assert [j for j, _ in ring.neighbours(0)] == [1, 7] and ring.degree == 2
    assert ring.self_weight(3) == pytest.approx(1 / 3) and ring.neighbours(3) == [(2, 1 / 3), (4, 1 / 3)]
    tor = topology("torus", 16)
    assert tor.name == "torus(4x4)" and tor.degree == 4
    assert sorted(j for j, _ in tor.neighbours(5)) == [1, 4, 6, 9]
    assert sorted(j for j, _ in tor.neighbours(0)) == [1, 3, 4, 12]  # wrap-around
    assert topology("torus", 8).name == "torus(2x4)" and topology("torus", 8).degree == 3
    assert topology("torus", 6).name == "torus(2x3)"
    exp = topology("exponential", 16)
    assert sorted(j for j, _ in exp.neighbours(0)) == [1, 2, 4, 8, 12, 14, 15] and exp.degree == 7
    assert all(w == pytest.approx(1 / 8) for _, w in exp.neighbours(3))
    comp = topology("complete", 5)
    np.testing.assert_allclose(_np(comp), np.full((5, 5), 0.2))
    assert comp.spectral_gap == pytest.approx(1.0)
    # degenerate but valid worlds
    assert topology("ring", 1).matrix == ((1.0,),) and topology("ring", 1).spectral_gap == 1.0
    assert topology("ring", 2).matrix == ((0.5, 0.5), (0.5, 0.5))
    # the ring's gap in closed form: eigenvalues 1/3 + 2/3 cos(2 pi k / n)
    lam = max(abs(1 / 3 + 2 / 3 * math.cos(2 * math.pi * k / 8)) for k in range(1, 8))
    assert ring.lambda2 == pytest.approx(lam, abs=1e-12)


def test_describe() -> None:
    t = topology("ring", 4)
    text = t.describe()
    assert "ring" in text and "n=4" in text and "degree=2" in text and f"{t.spectral_gap:.4f}" in text
    assert "0: 0.3333 0.3333 0.0000 0.3333" in text and "3: 0.3333 0.0000 0.3333 0.3333" in text
    assert len(text.splitlines()) == 2 + 4
    assert str(t) == text


# ---------------------------------------------------------------------------- threaded mixing


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("name", REGULAR)
def test_mix_round_keeps_mean_and_contracts(name: str, n: int) -> None:
    t = topology(name, n)
    w = t.tensor()
    # float64: the contraction bound holds to 1e-9; the result is W x exactly (up to float order)
    x0 = _data(n, 37, torch.float64, seed=n)
    states = _rounds(t, x0, 6)
    prev, ref = x0, x0
    for x in states:
        ref = w @ ref
        assert float((x - ref).abs().max()) <= 1e-12
        assert float((x.mean(0) - x0.mean(0)).abs().max()) <= 1e-12
        assert _consensus(x) <= t.lambda2 * _consensus(prev) + 1e-9
        prev = x
    assert _consensus(prev) < _consensus(x0)
    # float32 (what models use): the mean is kept within 1e-6
    x32 = _data(n, 37, torch.float32, seed=100 + n)
    last = _rounds(t, x32, 6)[-1]
    assert float((last.double().mean(0) - x32.double().mean(0)).abs().max()) <= 1e-6


def test_mix_round_counts_bytes_and_checks_inputs() -> None:
    t = topology("ring", 4)

    def body(tr: Transport) -> int:
        x = torch.ones(10, dtype=torch.float32) * tr.rank
        mix_round(tr, x, t)
        return tr.stats.bytes_sent

    assert run_threads(4, body) == [2 * 10 * 4] * 4
    with pytest.raises(ConfigError, match="n=8"):
        run_threads(4, lambda tr: mix_round(tr, torch.zeros(3), topology("ring", 8)))
    with pytest.raises(ConfigError, match="contiguous"):
        run_threads(4, lambda tr: mix_round(tr, torch.zeros(3, 4).t(), t))


def test_non_symmetric_matrix_mixes_by_in_and_out_neighbours() -> None:
    n = 5
    perm = np.roll(np.eye(n), 1, axis=1)  # i -> i+1: a directed cycle
    w = 0.5 * np.eye(n) + 0.3 * perm + 0.2 * perm @ perm
    t = topology(w.tolist(), n)
    assert not t.symmetric
    assert t.lambda2 == pytest.approx(np.sort(np.linalg.svd(w, compute_uv=False))[-2], abs=1e-12)
    assert [j for j, _ in t.neighbours(0)] == [1, 2] and t.out_neighbours(0) == [3, 4]
    assert "sigma_2" in t.describe()
    x0 = _data(n, 9, torch.float64, seed=3)
    states = _rounds(t, x0, 4)
    ref = x0
    for x in states:
        ref = torch.tensor(w) @ ref
        assert float((x - ref).abs().max()) <= 1e-12
        assert float((x.mean(0) - x0.mean(0)).abs().max()) <= 1e-12


# ---------------------------------------------------------------------------- random / custom


@pytest.mark.parametrize("n", SIZES)
def test_random_graph(n: int) -> None:
    t = topology("random", n, seed=5)
    w = _np(t)
    np.testing.assert_allclose(w.sum(0), 1.0, atol=1e-12)
    np.testing.assert_allclose(w.sum(1), 1.0, atol=1e-12)
    np.testing.assert_array_equal(w, w.T)
    d = max(2, math.ceil(math.log2(n)))
    assert all(2 <= k <= d for k in t.degrees)
    assert t.spectral_gap == pytest.approx(1.0 - _np_lambda2(w), abs=1e-9) and t.spectral_gap > 0
    # Metropolis-Hastings weights on the edges
    deg = (w > 0).sum(1) - 1
    for i in range(n):
        for j, wj in t.neighbours(i):
            assert wj == pytest.approx(1 / (1 + max(deg[i], deg[j])))
    assert topology("random", n, seed=5).matrix == t.matrix
    assert any(topology("random", n, seed=s).matrix != t.matrix for s in range(6, 10))
    t3 = topology("random:3", n, seed=1)
    assert max(t3.degrees) == 3 and min(t3.degrees) >= 2


def test_custom_matrix_and_edges() -> None:
    w = [[0.5, 0.5, 0.0], [0.5, 0.25, 0.25], [0.0, 0.25, 0.75]]
    for spec in (w, torch.tensor(w), np.array(w)):
        t = topology(spec, 3)
        assert t.name == "matrix" and t.matrix == tuple(tuple(r) for r in w)
    assert topology(Topology.from_matrix(w), 3).matrix == tuple(tuple(r) for r in w)
    # a path 0-1-2-3 as edges: Metropolis-Hastings (degrees 1, 2, 2, 1)
    ref = [[2 / 3, 1 / 3, 0, 0], [1 / 3, 1 / 3, 1 / 3, 0], [0, 1 / 3, 1 / 3, 1 / 3], [0, 0, 1 / 3, 2 / 3]]
    for edges in ([(0, 1), (1, 2), (2, 3)], [[0, 1], [1, 2], [2, 3]], [(1, 0), (2, 1), (3, 2), (0, 1)]):
        t = topology(edges, 4)
        assert t.name == "edges"
        np.testing.assert_allclose(_np(t), ref, atol=1e-15)
    assert metropolis_hastings([{1}, {0}]) == ((0.5, 0.5), (0.5, 0.5))
    # a 2 x 2 list of ints is a matrix (the permutation), not edges; tuples are edges
    assert topology([[0, 1], [1, 0]], 2).matrix == ((0.0, 1.0), (1.0, 0.0))
    assert topology([(0, 1)], 2).matrix == ((0.5, 0.5), (0.5, 0.5))


# ---------------------------------------------------------------------------- bipartite split


def _check_split(t: Topology) -> None:
    b = bipartition(t)
    for i in range(t.n):
        assert b.partners[i], i
        for j in b.partners[i]:
            assert b.active[j] != b.active[i] and i in b.partners[j]
            assert t.matrix[i][j] > 0 or t.matrix[j][i] > 0
    seen, stack = {0}, [0]  # connected across the split
    while stack:
        for j in b.partners[stack.pop()]:
            if j not in seen:
                seen.add(j)
                stack.append(j)
    assert seen == set(range(t.n))


def test_bipartition() -> None:
    b = bipartition(topology("ring", 8))
    assert b.colouring == "graph" and b.active == (True, False) * 4 and b.partners[0] == (1, 7)
    b = bipartition(topology("torus", 16))
    assert b.colouring == "graph" and b.active[0] and not b.active[1] and not b.active[4] and b.active[5]
    assert bipartition(topology("ring", 5)).colouring == "parity"
    assert bipartition(topology("exponential", 8)).colouring == "parity"
    assert bipartition(topology("random", 8, seed=0)).colouring == "bfs"
    for spec in ("ring", "torus", "exponential", "random", "complete"):
        for n in SIZES:
            _check_split(topology(spec, n, seed=2))
    _check_split(topology("ring", 7))
    with pytest.raises(ConfigError, match="n=1"):
        bipartition(topology("ring", 1))


# ---------------------------------------------------------------------------- bad inputs


BAD: list[tuple[Any, int, str]] = [
    ([[0.5, 0.5], [0.5, 0.5]], 3, "2 rows"),  # wrong size for the world
    ([[0.5, 0.5, 0.0], [0.5, 0.5], [0.0, 0.0, 1.0]], 3, "row 1 has 2 entries"),  # not square
    ([[1.2, -0.2], [-0.2, 1.2]], 2, "W[0, 1] = -0.2"),  # negative
    ([[0.5, 0.4, 0.0], [0.5, 0.5, 0.0], [0.0, 0.0, 1.0]], 3, "row 0 sums to 0.9"),
    ([[0.5, 0.5, 0.0], [0.3, 0.7, 0.0], [0.0, 0.0, 1.0]], 3, "column 0 sums to 0.8"),
    ([[0.5, 0.5, 0.0], [0.5, 0.5, 0.0], [0.0, 0.0, 1.0]], 3, "nodes [2] are unreachable"),
    ([[float("nan"), 1.0], [1.0, 0.0]], 2, "W[0, 0] = nan"),
    ([(0, 1), (2, 3)], 4, "nodes [2, 3] are unreachable"),
    ([(0, 1), (1, 5)], 4, "edge (1, 5)"),
    ([(0, 1), (1, 1)], 4, "edge (1, 1) is a self-loop"),
    ([(0, 1), (1, 2, 3)], 4, "(1, 2, 3)"),
    ("torus", 7, "n=7"),
    ("torus", 2, "n=2"),
    ("torus", 1, "n=1"),
    ("ring", 0, "n=0"),
    ("exponential", -3, "n=-3"),
    ("hypercube", 4, "'hypercube'"),
    ("random:1", 8, "d=1"),
    ("random:8", 8, "d=8"),
    ("random:x", 8, "'random:x'"),
    ("ring:2", 8, "'ring:2'"),
    (topology("ring", 4), 8, "n=4"),
    (42, 4, "int"),
]


@pytest.mark.parametrize(("spec", "n", "needle"), BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_inputs_raise_config_error_naming_the_value(spec: Any, n: int, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        topology(spec, n)
    assert needle in str(info.value), str(info.value)


def test_bad_direct_construction() -> None:
    with pytest.raises(ConfigError, match="n=0"):
        Topology("mine", 0, ())
    with pytest.raises(ConfigError, match="row 1 sums to 1.1"):
        Topology("mine", 2, ((0.5, 0.5), (0.6, 0.5)))
    with pytest.raises(ConfigError, match="rank 4 out of range"):
        topology("ring", 4).neighbours(4)
    with pytest.raises(ConfigError, match="3 x 3"):
        Topology.from_matrix(torch.eye(2), 3)
