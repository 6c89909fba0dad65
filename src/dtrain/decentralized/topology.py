"""Communication topologies for gossip averaging: graphs and their doubly stochastic mixing matrices.

A :class:`Topology` is ``n`` nodes and a mixing matrix ``W`` (``n x n``, non-negative, every row
and every column summing to 1, its graph connected). One gossip round replaces node ``i``'s
vector by ``x_i <- sum_j W[i, j] x_j`` (:func:`mix_round`); because ``W`` is doubly stochastic
the round keeps the nodes' mean, and the distance to that mean shrinks at least by the factor
``|lambda_2|`` per round (for a symmetric ``W``), so ``spectral_gap = 1 - |lambda_2|`` says how
fast the nodes agree (Xiao & Boyd 2004, "Fast linear iterations for distributed averaging";
Boyd, Ghosh, Prabhakar & Shah 2006, "Randomized gossip algorithms", IEEE Trans. Inf. Theory).

:func:`topology` builds the usual ones:

==================  ============================================================  ==========
spec                graph                                                         needs
==================  ============================================================  ==========
``"ring"``          ``i -- i+1 (mod n)``                                          ``n >= 1``
``"torus"``         2-D torus ``a x b`` (``n = a*b``, the most square, a, b >= 2)  ``n >= 4``
                    with wrap-around; a prime ``n`` has no torus                   composite
``"exponential"``   ``i -- i +- 2^k (mod n)`` for ``2^k < n`` (undirected, so ``W``  ``n >= 1``
                    is symmetric; Lian et al. 2017 use the one-peer directed form)
``"random"``        a random connected graph of degree about ``d`` (``"random:d"``;  ``n >= 1``
                    default ``max(2, ceil(log2 n))``) from ``seed``: a random
                    Hamiltonian cycle plus random edges
``"complete"``      every pair                                                    ``n >= 1``
a matrix            ``W`` itself (nested list, tensor or array), validated          ``n x n``
edges               ``[(i, j), ...]`` undirected, Metropolis-Hastings weights       connected
==================  ============================================================  ==========

The graphs use Metropolis-Hastings weights ``W[i, j] = 1 / (1 + max(d_i, d_j))`` on an edge and
``W[i, i] = 1 - sum_j W[i, j]`` (Xiao & Boyd 2004; Boyd, Diaconis & Xiao 2004, "Fastest mixing
Markov chain on a graph"): symmetric and doubly stochastic for any graph; on a regular graph
(ring, torus, exponential, complete) they are the uniform ``1 / (degree + 1)``.

Decentralized SGD over such a ``W``: D-PSGD (Lian, Zhang, Zhang, Hsieh, Zhang & Liu 2017, "Can
Decentralized Algorithms Outperform Centralized Algorithms?", arXiv 1705.09056) mixes every step
with :func:`mix_round`; AD-PSGD (Lian, Zhang, Zhang & Liu 2018, "Asynchronous Decentralized
Parallel Stochastic Gradient Descent", arXiv 1710.06952) averages pairs across a bipartite split
(:func:`bipartition`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Union

import torch

from dtrain.comm.transport import Transport
from dtrain.errors import ConfigError

__all__ = [
    "Topology",
    "Bipartition",
    "TopologySpec",
    "topology",
    "bipartition",
    "mix_round",
    "metropolis_hastings",
    "TAG_MIX",
    "STOCHASTIC_TOL",
]

STOCHASTIC_TOL = 1e-6  # rows and columns must sum to 1 within this
TAG_MIX = 0x6A0000  # transport tag of a gossip round (distinct from the collectives' tags)
NAMES = ("ring", "torus", "exponential", "random", "complete")

Matrix = tuple[tuple[float, ...], ...]
TopologySpec = Union[str, "Topology", torch.Tensor, Sequence[Sequence[float]], Sequence[tuple[int, int]]]


@dataclass(frozen=True)
class Topology:
    """``n`` nodes and their mixing matrix ``W`` (validated at construction).

    Args:
        name: what built it (``"ring"``, ``"torus(2x4)"``, ``"matrix"``, ``"edges"``, ...).
        n: number of nodes (the world size of the workers that mix).
        matrix: ``W`` as ``n`` rows of ``n`` floats; ``W[i, j]`` is the weight node ``i`` gives
            to node ``j``'s vector. A tensor or nested list is accepted and stored as tuples.

    Raises:
        ConfigError: ``n < 1``; ``W`` not ``n x n``; a negative or non-finite entry; a row or
            column not summing to 1 within ``1e-6``; the graph of ``W`` not connected. The
            message names the offending value.
    """

    name: str
    n: int
    matrix: Matrix

    def __post_init__(self) -> None:
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ConfigError(f"topology {self.name!r}: n must be an integer >= 1, got n={self.n!r}")
        object.__setattr__(self, "matrix", _as_rows(self.matrix, self.n, self.name))
        _check_stochastic(self.matrix, self.name)
        _check_connected(self.matrix, self.name)

    # -- the matrix ---------------------------------------------------------------------
    def tensor(self) -> torch.Tensor:
        """``W`` as an ``n x n`` float64 tensor (a fresh copy)."""
        return torch.tensor(self.matrix, dtype=torch.float64)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.n:
            raise ConfigError(f"topology {self.name!r}: rank {rank} out of range 0..{self.n - 1}")

    def neighbours(self, rank: int) -> list[tuple[int, float]]:
        """The nodes ``j != rank`` whose vectors ``rank`` mixes in (``W[rank, j] > 0``), with weights."""
        self._check_rank(rank)
        return [(j, w) for j, w in enumerate(self.matrix[rank]) if j != rank and w > 0]

    def out_neighbours(self, rank: int) -> list[int]:
        """The nodes ``k != rank`` that mix ``rank``'s vector in (``W[k, rank] > 0``): whom it sends to.
        The same as :meth:`neighbours`' nodes for a symmetric ``W``."""
        self._check_rank(rank)
        return [k for k in range(self.n) if k != rank and self.matrix[k][rank] > 0]

    def self_weight(self, rank: int) -> float:
        """``W[rank, rank]``."""
        self._check_rank(rank)
        return self.matrix[rank][rank]

    @cached_property
    def degrees(self) -> tuple[int, ...]:
        """Per node, the number of nodes it sends to in a round (its out-degree)."""
        return tuple(len(self.out_neighbours(i)) for i in range(self.n))

    @property
    def degree(self) -> int:
        """The largest number of neighbours a node sends to per round (every node's, if regular)."""
        return max(self.degrees)

    @cached_property
    def symmetric(self) -> bool:
        return all(abs(self.matrix[i][j] - self.matrix[j][i]) <= 1e-12 for i in range(self.n) for j in range(i))

    @cached_property
    def lambda2(self) -> float:
        """``|lambda_2|``: the second-largest eigenvalue of ``W`` in absolute value (the largest is 1).

        For a non-symmetric ``W`` the second-largest *singular value* instead: it bounds the
        per-round contraction ``||W x - mean|| <= sigma_2 ||x - mean||`` as ``|lambda_2|`` does
        for a symmetric one (eigenvalues of a non-normal matrix do not bound a single round).
        """
        if self.n == 1:
            return 0.0
        w = self.tensor()
        vals = torch.linalg.eigvalsh(w).abs() if self.symmetric else torch.linalg.svdvals(w)
        return float(torch.sort(vals, descending=True).values[1])

    @property
    def spectral_gap(self) -> float:
        """``1 - |lambda_2|`` (see :attr:`lambda2`): 0 means the nodes never agree, 1 one round suffices."""
        return 1.0 - self.lambda2

    def describe(self) -> str:
        """Printable summary: name, n, degree, spectral gap, then ``W`` row by row."""
        lines = [
            f"topology {self.name}: n={self.n} degree={self.degree} "
            f"spectral_gap={self.spectral_gap:.4f} (|lambda_2|={self.lambda2:.4f})"
            f"{'' if self.symmetric else ' [non-symmetric W: sigma_2 used]'}",
            "W (row i: the weights node i gives to nodes 0..n-1):",
        ]
        width = len(str(self.n - 1))
        for i, row in enumerate(self.matrix):
            lines.append(f"  {i:>{width}}: " + " ".join(f"{w:.4f}" for w in row))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.describe()

    # -- explicit constructors -------------------------------------------------------------
    @classmethod
    def from_matrix(cls, matrix: Any, n: int | None = None, name: str = "matrix") -> Topology:
        """A user matrix (tensor, array or nested sequence), validated; ``n`` (if given) must match."""
        rows = _as_rows(matrix, n if n is not None else _len(matrix, name), name)
        return cls(name, len(rows), rows)

    @classmethod
    def from_edges(cls, edges: Sequence[Sequence[int]], n: int, name: str = "edges") -> Topology:
        """The undirected graph of ``edges`` on ``n`` nodes, with Metropolis-Hastings weights."""
        _check_n(n, name)
        nbrs: list[set[int]] = [set() for _ in range(n)]
        for e in edges:
            if len(e) != 2 or not all(_is_int(v) for v in e):
                raise ConfigError(f"topology {name!r}: an edge must be a pair of node ids, got {e!r}")
            i, j = int(e[0]), int(e[1])
            if not (0 <= i < n and 0 <= j < n):
                raise ConfigError(f"topology {name!r}: edge {(i, j)} names a node outside 0..{n - 1} (n={n})")
            if i == j:
                raise ConfigError(f"topology {name!r}: edge {(i, j)} is a self-loop; list edges between nodes")
            nbrs[i].add(j)
            nbrs[j].add(i)
        return cls(name, n, metropolis_hastings(nbrs))


@dataclass(frozen=True)
class Bipartition:
    """The active/passive split AD-PSGD pairs across (Lian et al. 2018, arXiv 1710.06952, Sec. 3).

    Attributes:
        active: per node, True when it starts pairwise averages (its ``step()`` sends), False when
            it answers them.
        partners: per node, the nodes of the other side it may average with.
        colouring: how the split was made: ``"graph"``, ``"parity"`` or ``"bfs"`` (see :func:`bipartition`).
    """

    active: tuple[bool, ...]
    partners: tuple[tuple[int, ...], ...]
    colouring: str


def _two_colouring(nbrs: list[set[int]]) -> list[int] | None:
    colour = [-1] * len(nbrs)
    for start in range(len(nbrs)):
        if colour[start] >= 0:
            continue
        colour[start] = 0
        stack = [start]
        while stack:
            i = stack.pop()
            for j in nbrs[i]:
                if colour[j] < 0:
                    colour[j] = 1 - colour[i]
                    stack.append(j)
                elif colour[j] == colour[i]:
                    return None
    return colour


def _bfs_depth_parity(nbrs: list[set[int]]) -> list[int]:
    depth = {0: 0}
    queue = [0]
    for i in queue:  # grows while iterating: breadth-first
        for j in sorted(nbrs[i]):
            if j not in depth:
                depth[j] = depth[i] + 1
                queue.append(j)
    return [depth[i] % 2 for i in range(len(nbrs))]


def _cross(nbrs: list[set[int]], colour: list[int]) -> list[list[int]]:
    return [sorted(j for j in nbrs[i] if colour[j] != colour[i]) for i in range(len(nbrs))]


def bipartition(topo: Topology) -> Bipartition:
    """Split ``topo``'s nodes into active and passive for asynchronous pairwise gossip.

    AD-PSGD needs a bipartite communication graph so that two actives never wait on each other
    (Lian et al. 2018, arXiv 1710.06952). In order of preference:

    1. ``"graph"``: the topology's graph is bipartite (a ring of even ``n``, a torus of even
       sides): its own 2-colouring, node 0 active, every edge kept;
    2. ``"parity"``: even ranks active, odd passive, keeping the graph's even--odd edges,
       when those still connect every node (a ring of odd ``n``, exponential, complete);
    3. ``"bfs"``: otherwise (e.g. some random graphs) the parity of the breadth-first depth
       from node 0, keeping the edges between depths of different parity; the BFS tree's
       edges are among them, so the kept graph is always connected.

    Every node keeps at least one partner and the kept graph is connected, so pairwise averages
    still bring every node to the mean.

    Raises:
        ConfigError: ``n < 2`` (no pair to average).
    """
    if topo.n < 2:
        raise ConfigError(f"asynchronous gossip needs at least 2 workers, topology {topo.name!r} has n={topo.n}")
    nbrs = _undirected(topo.matrix)
    colour = _two_colouring(nbrs)
    how = "graph"
    if colour is None:
        how, colour = "parity", [i % 2 for i in range(topo.n)]
        if _unreachable([set(p) for p in _cross(nbrs, colour)]):
            how, colour = "bfs", _bfs_depth_parity(nbrs)
    partners = _cross(nbrs, colour)
    return Bipartition(tuple(c == 0 for c in colour), tuple(tuple(p) for p in partners), how)


# ----------------------------------------------------------------------------- builders


def metropolis_hastings(nbrs: Sequence[set[int]]) -> Matrix:
    """Metropolis-Hastings weights of an undirected graph given as neighbour sets:
    ``W[i, j] = 1 / (1 + max(d_i, d_j))`` on an edge, ``W[i, i] = 1 - sum_{j != i} W[i, j]``."""
    n = len(nbrs)
    deg = [len(s) for s in nbrs]
    rows: list[tuple[float, ...]] = []
    for i in range(n):
        row = [0.0] * n
        for j in nbrs[i]:
            row[j] = 1.0 / (1 + max(deg[i], deg[j]))
        row[i] = 1.0 - math.fsum(row)
        rows.append(tuple(row))
    return tuple(rows)


def _ring(n: int) -> list[set[int]]:
    return [{(i - 1) % n, (i + 1) % n} - {i} for i in range(n)]


def _torus_shape(n: int) -> tuple[int, int]:
    a = max((d for d in range(1, math.isqrt(n) + 1) if n % d == 0), default=1)
    if n < 4 or a < 2:
        raise ConfigError(
            f"topology 'torus' needs n = a x b nodes with a, b >= 2; n={n} has no such "
            "factorisation (prime or < 4); use 'ring' or 'exponential', or 4, 6, 8, 9, ..."
        )
    return a, n // a


def _torus(n: int) -> list[set[int]]:
    a, b = _torus_shape(n)
    out: list[set[int]] = []
    for i in range(n):
        r, c = divmod(i, b)
        s = {((r + 1) % a) * b + c, ((r - 1) % a) * b + c, r * b + (c + 1) % b, r * b + (c - 1) % b}
        out.append(s - {i})
    return out


def _exponential(n: int) -> list[set[int]]:
    offsets = [1 << k for k in range(max(1, n).bit_length()) if (1 << k) < n]
    return [({(i + o) % n for o in offsets} | {(i - o) % n for o in offsets}) - {i} for i in range(n)]


def _random(n: int, degree: int | None, seed: int) -> list[set[int]]:
    d = degree if degree is not None else (n - 1 if n <= 2 else min(n - 1, max(2, math.ceil(math.log2(n)))))
    if n > 1 and not (min(2, n - 1) <= d <= n - 1):
        raise ConfigError(f"topology 'random:{d}': degree d={d} must be in {min(2, n - 1)}..{n - 1} for n={n}")
    rng = random.Random(seed)
    order = list(range(n))
    rng.shuffle(order)
    nbrs: list[set[int]] = [set() for _ in range(n)] if n < 2 else _ring_in_order(order)
    for i in order:  # top up to about d: random partners that are below d themselves
        while len(nbrs[i]) < d:
            cands = [j for j in range(n) if j != i and j not in nbrs[i] and len(nbrs[j]) < d]
            if not cands:
                break
            j = rng.choice(cands)
            nbrs[i].add(j)
            nbrs[j].add(i)
    return nbrs


def _ring_in_order(order: list[int]) -> list[set[int]]:
    n = len(order)
    nbrs: list[set[int]] = [set() for _ in range(n)]
    for k in range(n):
        i, j = order[k], order[(k + 1) % n]
        if i != j:
            nbrs[i].add(j)
            nbrs[j].add(i)
    return nbrs


def _named(spec: str, n: int, seed: int) -> Topology:
    base, _, arg = spec.strip().lower().partition(":")
    if base not in NAMES or (arg and base != "random"):
        raise ConfigError(
            f"unknown topology {spec!r}: use one of {', '.join(NAMES)} ('random:D' for degree D), "
            "a mixing matrix or a list of edges"
        )
    if base == "complete":
        return Topology("complete", n, tuple(tuple(1.0 / n for _ in range(n)) for _ in range(n)))
    if base == "torus":
        a, b = _torus_shape(n)
        return Topology(f"torus({a}x{b})", n, metropolis_hastings(_torus(n)))
    if base == "random":
        try:
            degree = int(arg) if arg else None
        except ValueError:
            raise ConfigError(f"topology {spec!r}: the degree after 'random:' must be an integer") from None
        return Topology(
            f"random(seed={seed})" if not arg else f"random:{degree}(seed={seed})",
            n,
            metropolis_hastings(_random(n, degree, seed)),
        )
    return Topology(base, n, metropolis_hastings(_ring(n) if base == "ring" else _exponential(n)))


def topology(spec: TopologySpec, n: int, *, seed: int = 0) -> Topology:
    """Build (and validate) the topology ``spec`` for a world of ``n`` workers.

    Args:
        spec: a name (see the module docstring: ``"ring"``, ``"torus"``, ``"exponential"``,
            ``"random"`` / ``"random:D"``, ``"complete"``), a :class:`Topology` (its ``n`` must be
            ``n``), a mixing matrix (tensor, array or ``n`` lists of ``n`` numbers), or a list of
            undirected edges (tuples ``(i, j)``, or pairs of ints when the list is not an ``n x n``
            matrix), which get Metropolis-Hastings weights.
        n: the number of workers.
        seed: the random graph's seed (every worker must pass the same).

    Raises:
        ConfigError: naming the bad value (unknown name, ``n`` too small or not a torus, a matrix
            of the wrong size, negative, not doubly stochastic or not connected, a bad edge).
    """
    _check_n(n, spec if isinstance(spec, str) else "topology")
    if isinstance(spec, Topology):
        if spec.n != n:
            raise ConfigError(f"topology {spec.name!r} has n={spec.n} nodes but the world has {n} workers")
        return spec
    if isinstance(spec, str):
        return _named(spec, n, seed)
    if isinstance(spec, torch.Tensor) or hasattr(spec, "shape"):
        return Topology.from_matrix(spec, n)
    if isinstance(spec, Sequence) and _looks_like_edges(spec, n):
        return Topology.from_edges(spec, n)  # type: ignore[arg-type]
    return Topology.from_matrix(spec, n)


# ----------------------------------------------------------------------------- validation


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_n(n: Any, what: object) -> None:
    if not _is_int(n) or n < 1:
        raise ConfigError(f"topology {what!r}: the number of workers must be an integer >= 1, got n={n!r}")


def _len(matrix: Any, name: str) -> int:
    try:
        return len(matrix)
    except TypeError:
        raise ConfigError(f"topology {name!r}: expected an n x n matrix, got {type(matrix).__name__}") from None


def _looks_like_edges(spec: Sequence[Any], n: int) -> bool:
    """Tuples, or pairs of ints that are not an ``n x n`` matrix (a 2 x 2 int list is a matrix)."""
    items = list(spec)
    if all(isinstance(e, tuple) for e in items):
        return True
    pairs = all(isinstance(e, Sequence) and len(e) == 2 and all(_is_int(v) for v in e) for e in items)
    return pairs and not (len(items) == n == 2)


def _as_rows(matrix: Any, n: int, name: str) -> Matrix:
    """``matrix`` as ``n`` tuples of ``n`` floats, or ConfigError naming the wrong size."""
    if isinstance(matrix, torch.Tensor) or hasattr(matrix, "tolist"):
        matrix = matrix.tolist()
    if not isinstance(matrix, Sequence) or isinstance(matrix, str):
        raise ConfigError(f"topology {name!r}: expected an n x n matrix, got {type(matrix).__name__}")
    if len(matrix) != n:
        raise ConfigError(
            f"topology {name!r}: the mixing matrix must be {n} x {n} for a world of n={n} workers, "
            f"got {len(matrix)} rows"
        )
    rows: list[tuple[float, ...]] = []
    for i, row in enumerate(matrix):
        if not isinstance(row, Sequence) or isinstance(row, str) or len(row) != n:
            got = len(row) if isinstance(row, Sequence) else type(row).__name__
            raise ConfigError(
                f"topology {name!r}: the mixing matrix must be {n} x {n} (not square): row {i} has {got} entries"
            )
        try:
            rows.append(tuple(float(v) for v in row))
        except (TypeError, ValueError):
            raise ConfigError(f"topology {name!r}: row {i} of the mixing matrix is not numbers: {row!r}") from None
    return tuple(rows)


def _check_stochastic(rows: Matrix, name: str) -> None:
    n = len(rows)
    for i, row in enumerate(rows):
        for j, w in enumerate(row):
            if not math.isfinite(w) or w < 0:
                raise ConfigError(
                    f"topology {name!r}: W[{i}, {j}] = {w} is negative or not finite; mixing weights must be >= 0"
                )
    for i, row in enumerate(rows):
        s = math.fsum(row)
        if abs(s - 1.0) > STOCHASTIC_TOL:
            raise ConfigError(
                f"topology {name!r}: W is not doubly stochastic: row {i} sums to {s:.9g} "
                f"(every row and column must sum to 1 within {STOCHASTIC_TOL:g})"
            )
    for j in range(n):
        s = math.fsum(rows[i][j] for i in range(n))
        if abs(s - 1.0) > STOCHASTIC_TOL:
            raise ConfigError(
                f"topology {name!r}: W is not doubly stochastic: column {j} sums to {s:.9g} "
                f"(every row and column must sum to 1 within {STOCHASTIC_TOL:g})"
            )


def _undirected(rows: Matrix) -> list[set[int]]:
    n = len(rows)
    return [{j for j in range(n) if j != i and (rows[i][j] > 0 or rows[j][i] > 0)} for i in range(n)]


def _unreachable(nbrs: Sequence[set[int]]) -> list[int]:
    seen = {0}
    stack = [0]
    while stack:
        for j in nbrs[stack.pop()]:
            if j not in seen:
                seen.add(j)
                stack.append(j)
    return [i for i in range(len(nbrs)) if i not in seen]


def _check_connected(rows: Matrix, name: str) -> None:
    # a doubly stochastic W's weakly connected parts are strongly connected (Birkhoff: a sum of
    # permutations), so the undirected graph decides
    missing = _unreachable(_undirected(rows))
    if missing:
        raise ConfigError(
            f"topology {name!r}: the graph of W is not connected: nodes {missing} are unreachable "
            "from node 0 (their vectors would never mix with the others)"
        )


# ----------------------------------------------------------------------------- one round


def mix_round(transport: Transport, tensor: torch.Tensor, topo: Topology, *, tag: int = TAG_MIX) -> torch.Tensor:
    """One synchronous gossip round over ``transport``: ``tensor <- sum_j W[rank, j] x_j`` (in place).

    Every rank calls it with its own ``tensor`` (same size and dtype everywhere). Receives from
    :meth:`Topology.neighbours` are posted before the sends to :meth:`Topology.out_neighbours`;
    the weighted sum is taken in float64 in rank order and rounded once into ``tensor``'s
    dtype. Bytes sent by this rank: ``len(out_neighbours) * tensor.nbytes``.

    Raises:
        ConfigError: the transport's world size is not ``topo.n``, or ``tensor`` is not contiguous.
        CommError / CommTimeoutError: from the transport (naming rank, operation and peer).
    """
    if transport.world_size != topo.n:
        raise ConfigError(
            f"topology {topo.name!r} has n={topo.n} nodes but the transport has {transport.world_size} ranks"
        )
    if not tensor.is_contiguous():
        raise ConfigError("mix_round needs a contiguous tensor (call .contiguous() or flatten first)")
    me = transport.rank
    srcs = topo.neighbours(me)
    bufs = {j: torch.empty_like(tensor) for j, _ in srcs}
    works = [transport.irecv(bufs[j], j, tag) for j, _ in srcs]
    works += [transport.isend(tensor, k, tag) for k in topo.out_neighbours(me)]
    for w in works:
        w.wait()
    acc = tensor.double() * topo.self_weight(me)
    for j, wj in srcs:
        acc.add_(bufs[j].double(), alpha=wj)
    with torch.no_grad():
        tensor.copy_(acc)
    return tensor
