"""Power-of-two butterflies with a fold: recursive doubling and Rabenseifner's algorithm.

Both run on the largest power-of-two core of the world; the other ranks fold into
it first and get the result back after (MPICH's scheme: :class:`~dtrain.comm._schedule.Fold`).
"""

from __future__ import annotations

import torch

from dtrain.comm._kernel import TAG_FOLD, AllreduceOptions, algorithm
from dtrain.comm._reduce import BUFFERS, combine, post_recv, post_send
from dtrain.comm._schedule import Fold, doubling_rounds, halving_rounds, offsets
from dtrain.comm.transport import Transport

__all__ = ["recursive_doubling", "rabenseifner"]


def _fold_in(t: Transport, flat: torch.Tensor, op: str, fold: Fold) -> None:
    if fold.partner < 0:
        return
    if fold.new_rank < 0:
        post_send(t, flat, fold.partner, TAG_FOLD).wait()
    else:
        buf = BUFFERS.take(flat.numel(), flat.dtype, flat.device)
        post_recv(t, buf, fold.partner, TAG_FOLD).wait()
        combine(flat, buf, op)
        BUFFERS.give(buf)


def _fold_out(t: Transport, flat: torch.Tensor, fold: Fold) -> None:
    if fold.partner < 0:
        return
    if fold.new_rank < 0:
        post_recv(t, flat, fold.partner, TAG_FOLD + 1).wait()
    else:
        post_send(t, flat, fold.partner, TAG_FOLD + 1).wait()


def _exchange(
    t: Transport, send: torch.Tensor, recv: torch.Tensor, peer: int, tag: int
) -> None:
    """Send ``send`` to and receive ``recv`` from ``peer`` at once (either may be empty: skipped)."""
    rw = post_recv(t, recv, peer, tag) if recv.numel() else None
    sw = post_send(t, send, peer, tag) if send.numel() else None
    if rw is not None:
        rw.wait()
    if sw is not None:
        sw.wait()


@algorithm("recursive_doubling")
def recursive_doubling(t: Transport, flat: torch.Tensor, op: str, opts: AllreduceOptions) -> None:
    """Recursive doubling (butterfly): ``log2 P`` rounds of full-vector exchange.

    Steps: in round ``i`` rank ``r`` swaps its whole vector with ``r XOR 2**i`` and
    both reduce, so after ``log2 P`` rounds everyone holds the result. For ``P``
    not a power of two the first ``2·(P - 2**floor(log2 P))`` ranks fold pairwise
    into a power-of-two core first and get the result back after (MPICH's scheme).

    Cost (power of two): ``log2 P·(alpha + n·beta + n·gamma)``; the fold adds
    ``2·alpha + 2·n·beta + n·gamma`` (Thakur et al. 2005).
    """
    fold = Fold.of(t.rank, t.world_size)
    _fold_in(t, flat, op, fold)
    if fold.new_rank >= 0 and fold.core > 1:
        buf = BUFFERS.take(flat.numel(), flat.dtype, flat.device)
        d, rnd = 1, 0
        while d < fold.core:
            peer = fold.real(fold.new_rank ^ d)
            _exchange(t, flat, buf, peer, rnd)
            combine(flat, buf, op)
            d, rnd = d << 1, rnd + 1
        BUFFERS.give(buf)
    _fold_out(t, flat, fold)


@algorithm("rabenseifner")
def rabenseifner(t: Transport, flat: torch.Tensor, op: str, opts: AllreduceOptions) -> None:
    """Rabenseifner's allreduce: recursive-halving reduce-scatter, recursive-doubling allgather.

    Steps (``P`` a power of two, vector cut into ``P`` blocks):

    1. Reduce-scatter, ``log2 P`` rounds: with distance ``d = P/2, P/4, ..., 1``,
       swap half of the current window of blocks with ``r XOR d`` -- send the half
       the partner keeps, reduce the half you keep. Rank ``r`` ends with block ``r``.
    2. Allgather, ``log2 P`` rounds: ``d = 1, 2, ..., P/2``, swap the windows built
       so far with ``r XOR d``, receiving into place.

    Non-powers of two fold into the power-of-two core first (full vector), as in
    MPICH. Cost (power of two): ``2·log2 P·alpha + 2(P-1)/P·n·beta +
    (P-1)/P·n·gamma``; the fold adds ``2·alpha + 2·n·beta + n·gamma``
    (Rabenseifner, ICCS 2004; Thakur et al. 2005).
    """
    fold = Fold.of(t.rank, t.world_size)
    _fold_in(t, flat, op, fold)
    if fold.new_rank >= 0 and fold.core > 1:
        blocks = offsets(flat.numel(), fold.core)
        half = blocks[fold.core // 2]  # the first window kept is the largest
        buf = BUFFERS.take(max(half, flat.numel() - half), flat.dtype, flat.device)
        rnd = 0
        for peer_new, keep, give in halving_rounds(fold.new_rank, fold.core):
            klo, khi = blocks[keep[0]], blocks[keep[1]]
            glo, ghi = blocks[give[0]], blocks[give[1]]
            got = buf[: khi - klo]
            _exchange(t, flat[glo:ghi], got, fold.real(peer_new), rnd)
            combine(flat[klo:khi], got, op)
            rnd += 1
        BUFFERS.give(buf)
        for peer_new, mine, theirs in doubling_rounds(fold.new_rank, fold.core):
            mlo, mhi = blocks[mine[0]], blocks[mine[1]]
            tlo, thi = blocks[theirs[0]], blocks[theirs[1]]
            _exchange(t, flat[mlo:mhi], flat[tlo:thi], fold.real(peer_new), rnd)
            rnd += 1
    _fold_out(t, flat, fold)
