"""What each allreduce algorithm sends, and how long it takes in the alpha-beta-gamma model.

Two families of pure functions (no tensors, no processes):

* **Traffic** -- the exact number of messages and bytes every rank sends with
  dtrain's implementation (:mod:`dtrain.comm.allreduce`): the fold of a
  non-power-of-two world into a power-of-two core, the ring's pieces, empty
  messages skipped. Tests hold the counters of a real run against these.
* **Time** -- the alpha-beta-gamma model (Hockney 1994; Chan et al., "Collective
  communication: theory, practice, and experience", CCPE 2007; Thakur et al.,
  IJHPCA 2005): ``alpha`` seconds per message, ``beta`` seconds per byte sent,
  ``gamma`` seconds per byte reduced. For ``P`` ranks and ``n`` bytes
  (``log2 P`` exact for powers of two):

  ========================  ==========================================================
  ring                      2(P-1)·alpha + 2(P-1)/P·n·beta + (P-1)/P·n·gamma
  recursive doubling        log2 P·alpha + log2 P·n·beta + log2 P·n·gamma
  binomial tree             2·log2 P·alpha + 2·log2 P·n·beta + log2 P·n·gamma
  Rabenseifner              2·log2 P·alpha + 2(P-1)/P·n·beta + (P-1)/P·n·gamma
  lower bound               log2 P·alpha + 2(P-1)/P·n·beta + (P-1)/P·n·gamma
  ========================  ==========================================================

  For other ``P`` the functions model what the implementation does: the tree
  uses ``ceil(log2 P)`` rounds; recursive doubling and Rabenseifner run on the
  power-of-two core ``P' = 2**floor(log2 P)`` plus a fold and unfold of the full
  vector (``2·alpha + 2·n·beta + n·gamma``).

Example::

    from dtrain.comm import cost
    link = cost.LinkCost(alpha=5e-6, beta=1 / 10e9, gamma=1 / 20e9)
    cost.allreduce_time("ring", 8, 100 << 20, link)
    cost.traffic("rabenseifner", 6, 4000, itemsize=4).max_bytes
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from dtrain.comm.indexing import (
    Fold,
    RingPlan,
    binomial_children,
    binomial_parent,
    ceil_log2,
    doubling_rounds,
    halving_rounds,
    offsets,
)
from dtrain.errors import ConfigError

__all__ = [
    "ALGORITHMS",
    "RING_PIECE_BYTES",
    "RING_MAX_PIECES",
    "LinkCost",
    "Traffic",
    "traffic",
    "ring_traffic",
    "native_traffic",
    "tree_traffic",
    "recursive_doubling_traffic",
    "rabenseifner_traffic",
    "hierarchical_traffic",
    "allreduce_time",
    "ring_time",
    "recursive_doubling_time",
    "tree_time",
    "rabenseifner_time",
    "lower_bound_time",
    "hierarchical_time",
    "ceil_log2",
]

ALGORITHMS = ("native", "ring", "tree", "recursive_doubling", "rabenseifner", "hierarchical")
#: the ring's default piece size and cap on pieces per segment (see AllreduceOptions)
RING_PIECE_BYTES = 1 << 20
RING_MAX_PIECES = 2


# ----------------------------------------------------------------------------- traffic


@dataclass(frozen=True)
class Traffic:
    """Messages and bytes each rank sends in one allreduce.

    Attributes:
        messages: per rank, the number of point-to-point sends.
        bytes_sent: per rank, the payload bytes of those sends.
    """

    messages: tuple[int, ...]
    bytes_sent: tuple[int, ...]

    @property
    def max_messages(self) -> int:
        return max(self.messages, default=0)

    @property
    def max_bytes(self) -> int:
        return max(self.bytes_sent, default=0)

    @property
    def total_messages(self) -> int:
        return sum(self.messages)

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_sent)


def _check(world_size: int, numel: int, itemsize: int) -> None:
    if world_size < 1:
        raise ConfigError(f"world_size must be >= 1, got {world_size}")
    if numel < 0:
        raise ConfigError(f"element count must be >= 0, got {numel}")
    if itemsize < 1:
        raise ConfigError(f"itemsize must be >= 1 byte, got {itemsize}")


def _nothing_sent(world_size: int, numel: int, itemsize: int) -> bool:
    """Check the arguments; True when nothing is sent (an empty vector, or one rank)."""
    _check(world_size, numel, itemsize)
    return numel == 0 or world_size == 1


def _idle(world_size: int) -> Traffic:
    return Traffic((0,) * world_size, (0,) * world_size)


def _tally(world_size: int, sends: Callable[[int], Iterable[int]]) -> Traffic:
    """Traffic of every rank from ``sends(rank)``: the payload bytes of each message it sends, in
    order; an empty message is not sent (the implementation skips it), so it counts for nothing."""
    sizes = [[b for b in sends(r) if b > 0] for r in range(world_size)]
    return Traffic(tuple(len(s) for s in sizes), tuple(sum(s) for s in sizes))


def ring_traffic(
    world_size: int,
    numel: int,
    itemsize: int = 4,
    piece_bytes: int = RING_PIECE_BYTES,
    max_pieces: int = RING_MAX_PIECES,
) -> Traffic:
    """Sends of the pipelined ring: ``2(P-1)`` steps, each segment in ``k`` pieces.

    Rank ``r`` sends every segment but ``r+1`` during reduce-scatter and every one
    but ``r+2`` during allgather; each non-empty piece is one message. So each rank
    sends ``2(P-1)·k`` messages (fewer when segments are shorter than ``k``) and
    about ``2(P-1)/P·n`` bytes.

    Args:
        world_size: ranks ``P``.
        numel: elements in the vector.
        itemsize: bytes per element (default: 4).
        piece_bytes: the ring's piece size (default: 1 MiB, as the implementation).
        max_pieces: the cap on pieces per segment (default: 2, as the implementation).
    """
    if _nothing_sent(world_size, numel, itemsize):
        return _idle(world_size)
    plan = RingPlan.build(numel, world_size, max(1, piece_bytes // itemsize), max_pieces)

    def sends(r: int) -> Iterator[int]:
        for s in range(plan.steps()):
            seg = plan.send_segment(r, s)
            for j in range(plan.pieces):
                lo, hi = plan.piece(seg, j)
                yield (hi - lo) * itemsize

    return _tally(world_size, sends)


def native_traffic(world_size: int, numel: int, itemsize: int = 4) -> Traffic:
    """What ``native`` charges to the stats: an unpipelined ring (the backend does not report its own)."""
    return ring_traffic(world_size, numel, itemsize, piece_bytes=max(1, numel * itemsize), max_pieces=1)


def tree_traffic(world_size: int, numel: int, itemsize: int = 4) -> Traffic:
    """Binomial reduce + broadcast: a rank sends the whole vector once to its parent and once to each child."""
    if _nothing_sent(world_size, numel, itemsize):
        return _idle(world_size)
    n = numel * itemsize
    return _tally(world_size, lambda r: [n] * ((binomial_parent(r) >= 0) + len(binomial_children(r, world_size))))


def _folded_traffic(world_size: int, numel: int, itemsize: int, core: Callable[[Fold], Iterable[int]]) -> Traffic:
    """An algorithm on the power-of-two core: the fold's full-vector message (the folded rank sends
    its vector in, its partner sends the result back) plus, for a rank in the core, ``core(fold)``."""
    if _nothing_sent(world_size, numel, itemsize):
        return _idle(world_size)
    n = numel * itemsize

    def sends(r: int) -> Iterator[int]:
        fold = Fold.of(r, world_size)
        if fold.partner >= 0:
            yield n
        if fold.new_rank >= 0:
            yield from core(fold)

    return _tally(world_size, sends)


def recursive_doubling_traffic(world_size: int, numel: int, itemsize: int = 4) -> Traffic:
    """Butterfly on the power-of-two core (full vector each round) plus the fold of the extra ranks."""
    return _folded_traffic(world_size, numel, itemsize, lambda fold: [numel * itemsize] * (fold.core.bit_length() - 1))


def rabenseifner_traffic(world_size: int, numel: int, itemsize: int = 4) -> Traffic:
    """Recursive halving + doubling on the core (empty halves not sent) plus the full-vector fold."""

    def core(fold: Fold) -> Iterator[int]:
        blocks = offsets(numel, fold.core)
        for _, _, give in halving_rounds(fold.new_rank, fold.core):
            yield (blocks[give[1]] - blocks[give[0]]) * itemsize
        for _, mine, _ in doubling_rounds(fold.new_rank, fold.core):
            yield (blocks[mine[1]] - blocks[mine[0]]) * itemsize

    return _folded_traffic(world_size, numel, itemsize, core)


def _nodes(world_size: int, node_size: int | None, nodes: tuple[int, ...] | list[int] | None) -> list[int]:
    if nodes is not None:
        if len(nodes) != world_size:
            raise ConfigError(f"nodes gives {len(nodes)} node ids for {world_size} ranks; give one per rank")
        return list(nodes)
    if node_size is None or node_size < 1:
        raise ConfigError(f"hierarchical needs node_size >= 1 or nodes, got node_size={node_size}")
    return [r // node_size for r in range(world_size)]


def hierarchical_traffic(
    world_size: int,
    numel: int,
    itemsize: int = 4,
    *,
    node_size: int | None = None,
    nodes: tuple[int, ...] | list[int] | None = None,
    piece_bytes: int = RING_PIECE_BYTES,
    max_pieces: int = RING_MAX_PIECES,
) -> Traffic:
    """Tree reduce/broadcast inside each node plus a pipelined ring among the node leaders.

    Args:
        node_size: consecutive ranks per node (the last node may be smaller).
        nodes: node id of every rank instead of ``node_size``.
    """
    _check(world_size, numel, itemsize)
    ids = _nodes(world_size, node_size, nodes)
    if _nothing_sent(world_size, numel, itemsize):
        return _idle(world_size)
    msgs, sent = [0] * world_size, [0] * world_size

    def add(ranks: list[int], t: Traffic) -> None:  # t counts ranks[0], ranks[1], ... as 0, 1, ...
        for local, q in enumerate(ranks):
            msgs[q] += t.messages[local]
            sent[q] += t.bytes_sent[local]

    for i in set(ids):
        members = [q for q in range(world_size) if ids[q] == i]
        add(members, tree_traffic(len(members), numel, itemsize))
    leaders = sorted({min(q for q in range(world_size) if ids[q] == i) for i in set(ids)})
    add(leaders, ring_traffic(len(leaders), numel, itemsize, piece_bytes, max_pieces))
    return Traffic(tuple(msgs), tuple(sent))


def traffic(
    algorithm: str,
    world_size: int,
    nbytes: int,
    *,
    itemsize: int = 4,
    piece_bytes: int = RING_PIECE_BYTES,
    max_pieces: int = RING_MAX_PIECES,
    node_size: int | None = None,
    nodes: tuple[int, ...] | list[int] | None = None,
) -> Traffic:
    """Messages and bytes each rank sends when ``algorithm`` reduces ``nbytes`` over ``world_size`` ranks.

    Args:
        algorithm: a name in :data:`ALGORITHMS`.
        world_size: ranks ``P``.
        nbytes: size of the vector in bytes (a multiple of ``itemsize``).
        itemsize: bytes per element (default: 4, float32).
        piece_bytes, max_pieces: the ring's piece size and cap on pieces per
            segment (ring, hierarchical).
        node_size, nodes: hierarchical's placement (default: one node).

    Returns:
        A :class:`Traffic` with per-rank counts.
    """
    if nbytes % max(1, itemsize):
        raise ConfigError(f"nbytes={nbytes} is not a whole number of {itemsize}-byte elements")
    numel = nbytes // max(1, itemsize)
    plain = {
        "native": native_traffic,
        "tree": tree_traffic,
        "recursive_doubling": recursive_doubling_traffic,
        "rabenseifner": rabenseifner_traffic,
    }  # the algorithms with no option of their own
    if algorithm in plain:
        return plain[algorithm](world_size, numel, itemsize)
    if algorithm == "ring":
        return ring_traffic(world_size, numel, itemsize, piece_bytes, max_pieces)
    if algorithm == "hierarchical":
        if node_size is None and nodes is None:
            node_size = world_size
        return hierarchical_traffic(
            world_size,
            numel,
            itemsize,
            node_size=node_size,
            nodes=nodes,
            piece_bytes=piece_bytes,
            max_pieces=max_pieces,
        )
    raise ConfigError(f"unknown allreduce algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}")


# ----------------------------------------------------------------------------- time


@dataclass(frozen=True)
class LinkCost:
    """Alpha-beta-gamma parameters of one level of the network.

    Attributes:
        alpha: seconds per message (latency and per-message software overhead).
        beta: seconds per byte sent (1 / bandwidth).
        gamma: seconds per byte reduced (1 / local reduction rate) (default: 0).
    """

    alpha: float
    beta: float
    gamma: float = 0.0

    def __post_init__(self) -> None:
        for name in ("alpha", "beta", "gamma"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ConfigError(f"LinkCost.{name} must be a finite number >= 0 (seconds), got {v!r}")


def _p(world_size: int) -> None:
    if world_size < 1:
        raise ConfigError(f"world_size must be >= 1, got {world_size}")


def ring_time(world_size: int, nbytes: float, link: LinkCost, pieces: int = 1) -> float:
    """``2(P-1)·pieces·alpha + 2(P-1)/P·n·beta + (P-1)/P·n·gamma``.

    Args:
        pieces: messages per segment; 1 gives the textbook formula, the
            implementation's count is ``RingPlan`` pieces (alpha is charged per
            message, reductions are not assumed to overlap the transfers).
    """
    _p(world_size)
    P = world_size
    if P == 1:
        return 0.0
    return 2 * (P - 1) * pieces * link.alpha + 2 * (P - 1) / P * nbytes * link.beta + (P - 1) / P * nbytes * link.gamma


def _fold_time(world_size: int, nbytes: float, link: LinkCost) -> float:
    core = 1 << (world_size.bit_length() - 1)
    if core == world_size:
        return 0.0
    return 2 * link.alpha + 2 * nbytes * link.beta + nbytes * link.gamma


def recursive_doubling_time(world_size: int, nbytes: float, link: LinkCost) -> float:
    """``log2 P'·(alpha + n·beta + n·gamma)`` on the core ``P'`` plus the fold (0 for powers of two)."""
    _p(world_size)
    rounds = world_size.bit_length() - 1
    return rounds * (link.alpha + nbytes * link.beta + nbytes * link.gamma) + _fold_time(world_size, nbytes, link)


def tree_time(world_size: int, nbytes: float, link: LinkCost) -> float:
    """``2·ceil(log2 P)·(alpha + n·beta) + ceil(log2 P)·n·gamma`` (binomial reduce then broadcast)."""
    _p(world_size)
    rounds = ceil_log2(world_size)
    return 2 * rounds * (link.alpha + nbytes * link.beta) + rounds * nbytes * link.gamma


def rabenseifner_time(world_size: int, nbytes: float, link: LinkCost) -> float:
    """``2·log2 P'·alpha + 2(P'-1)/P'·n·beta + (P'-1)/P'·n·gamma`` on the core plus the fold."""
    _p(world_size)
    core = 1 << (world_size.bit_length() - 1)
    rounds = core.bit_length() - 1
    frac = (core - 1) / core
    core_t = 2 * rounds * link.alpha + 2 * frac * nbytes * link.beta + frac * nbytes * link.gamma
    return core_t + _fold_time(world_size, nbytes, link)


def lower_bound_time(world_size: int, nbytes: float, link: LinkCost) -> float:
    """``ceil(log2 P)·alpha + 2(P-1)/P·n·beta + (P-1)/P·n·gamma``: no allreduce does better in this model."""
    _p(world_size)
    P = world_size
    return ceil_log2(P) * link.alpha + 2 * (P - 1) / P * nbytes * link.beta + (P - 1) / P * nbytes * link.gamma


def hierarchical_time(
    world_size: int, nbytes: float, node_size: int, intra: LinkCost, inter: LinkCost, pieces: int = 1
) -> float:
    """Tree reduce inside nodes, ring across ``N = ceil(P/L)`` leaders, tree broadcast inside nodes.

    ``2·ceil(log2 L)·(alpha_in + n·beta_in) + ceil(log2 L)·n·gamma + ring_time(N, n, inter)``
    with ``L = min(node_size, P)`` ranks in the largest node; the reduction rate
    ``gamma`` is taken from ``intra`` inside the node and from ``inter`` in the ring.

    Args:
        node_size: ranks per node.
        intra: the links inside a node.
        inter: the links between nodes.
        pieces: messages per ring segment (see :func:`ring_time`).
    """
    _p(world_size)
    if node_size < 1:
        raise ConfigError(f"node_size must be >= 1, got {node_size}")
    L = min(node_size, world_size)
    nodes = -(-world_size // L)
    return tree_time(L, nbytes, intra) + ring_time(nodes, nbytes, inter, pieces)


def allreduce_time(
    algorithm: str,
    world_size: int,
    nbytes: float,
    link: LinkCost,
    *,
    inter: LinkCost | None = None,
    node_size: int | None = None,
    piece_bytes: int | None = None,
    max_pieces: int = RING_MAX_PIECES,
    itemsize: int = 4,
) -> float:
    """Predicted time of ``algorithm`` (or ``"lower_bound"``) for ``P`` ranks and ``nbytes``.

    Args:
        algorithm: a name in :data:`ALGORITHMS` or ``"lower_bound"``. ``native`` is
            modelled as an unpipelined ring (gloo's and NCCL's large-message choice).
        link: the network (for hierarchical: the links inside a node).
        inter: hierarchical only: links between nodes (default: ``link``).
        node_size: hierarchical only: ranks per node (default: all in one node).
        piece_bytes: the ring's piece size; when given, alpha is charged per piece
            as the implementation sends them (default: textbook, one message per step).
        max_pieces: the ring's cap on pieces per segment (default: 2, as the implementation).
        itemsize: bytes per element, to count pieces exactly (default: 4).
    """
    P = world_size
    _p(P)

    def pieces(ranks: int) -> int:
        if piece_bytes is None or ranks <= 1 or nbytes <= 0:
            return 1
        return RingPlan.build(int(nbytes) // itemsize, ranks, max(1, piece_bytes // itemsize), max_pieces).pieces

    plain = {
        "native": ring_time,
        "tree": tree_time,
        "recursive_doubling": recursive_doubling_time,
        "rabenseifner": rabenseifner_time,
        "lower_bound": lower_bound_time,
    }  # native: an unpipelined ring
    if algorithm in plain:
        return plain[algorithm](P, nbytes, link)
    if algorithm == "ring":
        return ring_time(P, nbytes, link, pieces(P))
    if algorithm == "hierarchical":
        L = node_size or P
        return hierarchical_time(P, nbytes, L, link, inter or link, pieces(-(-P // min(L, P))))
    raise ConfigError(
        f"unknown allreduce algorithm {algorithm!r}; choose one of {', '.join((*ALGORITHMS, 'lower_bound'))}"
    )
