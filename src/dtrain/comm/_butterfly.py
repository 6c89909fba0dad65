"""Power-of-two butterflies with a fold: recursive doubling and Rabenseifner's algorithm.

Both run on the largest power-of-two core of the world; the other ranks fold into
it first and get the result back after (MPICH's scheme: :class:`~dtrain.comm.indexing.Fold`).
"""

from __future__ import annotations

import torch

from dtrain.comm._kernel import TAG_FOLD, AllreduceOptions, algorithm
from dtrain.comm._reduce import BUFFERS, combine, post_recv, post_send
from dtrain.comm.indexing import Fold, doubling_rounds, halving_rounds, offsets
from dtrain.comm.transport import Transport, Work

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
        n = flat.numel()
        bufs = BUFFERS.take(2 * n, flat.dtype, flat.device)  # round i receives into half i % 2
        peers = []
        d = 1
        while d < fold.core:
            peers.append(fold.real(fold.new_rank ^ d))
            d <<= 1

        # each round's receive is posted a round ahead: a message finds its buffer waiting (gloo
        # otherwise holds a send until the receiver posts: a rendezvous per round)
        def half(rnd: int) -> torch.Tensor:
            return bufs[(rnd % 2) * n : (rnd % 2 + 1) * n]

        recv: Work | None = post_recv(t, half(0), peers[0], 0)
        for rnd, peer in enumerate(peers):
            nxt = post_recv(t, half(rnd + 1), peers[rnd + 1], rnd + 1) if rnd + 1 < len(peers) else None
            send = post_send(t, flat, peer, rnd)
            assert recv is not None
            recv.wait()
            send.wait()
            combine(flat, half(rnd), op)
            recv = nxt
        BUFFERS.give(bufs)
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
        halving = halving_rounds(fold.new_rank, fold.core)
        doubling = doubling_rounds(fold.new_rank, fold.core)
        # every round's receive is posted up front (a message finds its buffer waiting; gloo otherwise
        # holds a send until the receiver posts): the reduce-scatter's into buffers end to end (n/2 +
        # n/4 + ... < n), the allgather's in place -- each lands in a window this rank gave away to
        # that same partner in the reduce-scatter, which the partner answers only after receiving it
        sizes = [blocks[keep[1]] - blocks[keep[0]] for _, keep, _ in halving]
        buf = BUFFERS.take(max(1, sum(sizes)), flat.dtype, flat.device)
        gots, recvs, off = [], [], 0
        for rnd, ((peer_new, _, _), size) in enumerate(zip(halving, sizes)):
            gots.append(buf[off : off + size])
            recvs.append(post_recv(t, gots[-1], fold.real(peer_new), rnd) if size else None)
            off += size
        for j, (peer_new, _, theirs) in enumerate(doubling):
            tlo, thi = blocks[theirs[0]], blocks[theirs[1]]
            recvs.append(post_recv(t, flat[tlo:thi], fold.real(peer_new), len(halving) + j) if thi > tlo else None)
        for rnd, (peer_new, keep, give) in enumerate(halving):
            glo, ghi = blocks[give[0]], blocks[give[1]]
            _finish_round(t, flat[glo:ghi], recvs[rnd], fold.real(peer_new), rnd)
            combine(flat[blocks[keep[0]] : blocks[keep[1]]], gots[rnd], op)
        BUFFERS.give(buf)
        for j, (peer_new, mine, _) in enumerate(doubling):
            mlo, mhi = blocks[mine[0]], blocks[mine[1]]
            _finish_round(t, flat[mlo:mhi], recvs[len(halving) + j], fold.real(peer_new), len(halving) + j)
    _fold_out(t, flat, fold)


def _finish_round(t: Transport, send: torch.Tensor, recv: Work | None, peer: int, tag: int) -> None:
    """Send ``send`` to ``peer`` and wait for it and for the round's receive posted before."""
    sw = post_send(t, send, peer, tag) if send.numel() else None
    if recv is not None:
        recv.wait()
    if sw is not None:
        sw.wait()
