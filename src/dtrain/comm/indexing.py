"""Index arithmetic shared by the allreduce algorithms and their cost formulas.

Everything here is pure integer arithmetic on (world size, rank, element count):
how a vector is cut into segments and pieces, which rank a non-power-of-two world
folds into which, and who a rank's parent and children are in a binomial tree.
:mod:`dtrain.comm.allreduce` moves tensors along these plans and
:mod:`dtrain.comm.cost` counts the same plans' messages, so the two cannot drift; the
parameter server sums in the tree allreduce's order by the same binomial tree.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "offsets",
    "RingPlan",
    "Fold",
    "binomial_parent",
    "binomial_children",
    "halving_rounds",
    "doubling_rounds",
    "ceil_log2",
]


def offsets(n: int, parts: int) -> list[int]:
    """Boundaries of ``parts`` near-equal slices of ``n`` items (the first ``n % parts`` get one more)."""
    q, rem = divmod(n, parts)
    return [i * q + min(i, rem) for i in range(parts + 1)]


def ceil_log2(p: int) -> int:
    """Smallest ``k`` with ``2**k >= p`` (0 for ``p <= 1``)."""
    return max(0, (p - 1).bit_length())


@dataclass(frozen=True)
class RingPlan:
    """How the ring cuts ``n`` elements: ``P`` segments, each in ``pieces`` pieces.

    ``pieces`` is the number of ``piece_elems``-sized pieces the longest segment
    needs, capped at ``max_pieces``. Every segment is split into the same number
    of pieces, so a piece index means the same thing on every rank; pieces of an
    empty or short segment may be empty and are then not sent at all.
    """

    n: int
    world_size: int
    pieces: int
    seg: tuple[int, ...]

    @classmethod
    def build(cls, n: int, world_size: int, piece_elems: int, max_pieces: int | None = None) -> RingPlan:
        seg = offsets(n, world_size)
        longest = -(-n // world_size)
        pieces = max(1, -(-longest // max(1, piece_elems)))
        if max_pieces is not None:
            pieces = max(1, min(pieces, max_pieces))
        return cls(n, world_size, pieces, tuple(seg))

    def piece(self, seg: int, j: int) -> tuple[int, int]:
        """Element range ``[lo, hi)`` of piece ``j`` of segment ``seg``."""
        lo, hi = self.seg[seg], self.seg[seg + 1]
        cut = offsets(hi - lo, self.pieces)
        return lo + cut[j], lo + cut[j + 1]

    def max_piece(self) -> int:
        return -(-(self.seg[1] - self.seg[0]) // self.pieces)

    def send_segment(self, rank: int, step: int) -> int:
        """Segment ``rank`` sends at ``step`` (0..2P-3); it receives ``send_segment(rank, step + 1)``."""
        return (rank - step) % self.world_size

    def steps(self) -> int:
        return 2 * (self.world_size - 1)


@dataclass(frozen=True)
class Fold:
    """Where ``rank`` sits when a world of ``P`` ranks is folded to a power of two.

    As in MPICH (Thakur, Rabenseifner & Gropp 2005): with ``core`` the largest power
    of two <= ``P`` and ``extra = P - core``, the first ``2*extra`` ranks pair up;
    each even one hands its vector to the odd one above it and waits, the odd one
    joins the core. Ranks from ``2*extra`` on join the core directly.

    Attributes:
        core: ranks in the power-of-two core.
        extra: ranks folded away.
        new_rank: this rank's index in the core, or -1 when it was folded away.
        partner: the rank it exchanges with during the fold (-1 if none).
    """

    core: int
    extra: int
    new_rank: int
    partner: int

    @classmethod
    def of(cls, rank: int, world_size: int) -> Fold:
        core = 1 << (world_size.bit_length() - 1)
        extra = world_size - core
        if rank < 2 * extra:
            if rank % 2 == 0:
                return cls(core, extra, -1, rank + 1)
            return cls(core, extra, rank // 2, rank - 1)
        return cls(core, extra, rank - extra, -1)

    def real(self, new_rank: int) -> int:
        """The real rank of core member ``new_rank``."""
        return 2 * new_rank + 1 if new_rank < self.extra else new_rank + self.extra


def binomial_parent(rank: int) -> int:
    """Parent of ``rank`` in the binomial tree rooted at 0 (-1 for the root)."""
    return -1 if rank == 0 else rank - (rank & -rank)


def binomial_children(rank: int, world_size: int) -> list[int]:
    """Children of ``rank`` in the binomial tree rooted at 0, farthest (largest subtree) first."""
    top = (rank & -rank) if rank else 1 << ceil_log2(world_size)
    out = []
    mask = top >> 1
    while mask:
        if rank + mask < world_size:
            out.append(rank + mask)
        mask >>= 1
    return out


def halving_rounds(new_rank: int, core: int) -> list[tuple[int, tuple[int, int], tuple[int, int]]]:
    """Recursive-halving rounds of a core member: ``(partner, keep, give)`` block ranges.

    The vector is cut into ``core`` blocks; each round halves the window of blocks a
    rank is responsible for, keeping the half its bit selects. After ``log2 core``
    rounds member ``i`` holds block ``i``.
    """
    rounds = []
    lo, hi = 0, core
    d = core >> 1
    while d:
        mid = (lo + hi) // 2
        if new_rank & d:
            keep, give = (mid, hi), (lo, mid)
        else:
            keep, give = (lo, mid), (mid, hi)
        rounds.append((new_rank ^ d, keep, give))
        lo, hi = keep
        d >>= 1
    return rounds


def doubling_rounds(new_rank: int, core: int) -> list[tuple[int, tuple[int, int], tuple[int, int]]]:
    """Recursive-doubling allgather rounds: ``(partner, mine, theirs)`` block ranges."""
    rounds = []
    d = 1
    while d < core:
        partner = new_rank ^ d
        mine_lo = new_rank & ~(d - 1)
        theirs_lo = partner & ~(d - 1)
        rounds.append((partner, (mine_lo, mine_lo + d), (theirs_lo, theirs_lo + d)))
        d <<= 1
    return rounds
