"""Averaging a gradient bucket across ranks through a compressor.

:class:`BucketReducer` is how :class:`dtrain.DataParallel` and ``dtrain.hybrid`` average a flat
bucket: exactly by an allreduce algorithm, or with a compressor by :func:`compressed_allreduce`,
which picks the collective from what the compressor is:

=====================  =========================================================  =====================================
compressor             collective                                                 bytes per rank (n elements)
=====================  =========================================================  =====================================
summable (none, fp16)  allreduce of the payload (ring by default), decode, / P     ``2 (P-1)/P * payload``
PowerSGD               allreduce of Ps, orthogonalise, allreduce of Qs, vectors   ``2 (P-1)/P * 4 sum (rows+cols) r``
sparse (topk, ...)     :func:`dtrain.comm.sparse.sparse_allreduce` of the pairs    see that module
quantizers             compressed reduce-scatter + compressed allgather            ``2 (P-1)/P * payload``
=====================  =========================================================  =====================================

The quantizers' collective (as in 1-bit SGD's and 1-bit Adam's implementations):

1. cut the bucket into ``P`` chunks; compress chunk ``j`` (key ``KEY#j``) and send
   it to rank ``j``;
2. rank ``j`` decodes the ``P`` versions of its chunk and combines them (the
   mean; majority vote for ``SignSGD(majority_vote=True)``);
3. rank ``j`` compresses the result again (key ``KEY#j/agg``: with error feedback
   this is the "server" residual) and sends it to every rank; every rank, ``j``
   included, decodes it.

Gathering every rank's whole payload instead would cost ``(P-1) * payload`` per
rank, ``P/2`` times more: for 1-bit payloads on 4 ranks that is 1/16 of a dense
allreduce instead of 1/32. The second compression adds its own error; unbiased
quantizers stay unbiased, biased ones keep a residual for it.

Error feedback: a compressor wrapped in :class:`~dtrain.compress.ErrorFeedback`
keeps, per key, ``corrected - sent`` where ``sent`` is what this rank contributed
(for PowerSGD ``P P^T M``, as Vogels et al. do), so nothing a rank computed is lost.
With momentum, each rank compresses its own velocity; the owner's second
compression of a combined chunk feeds back its error but adds no momentum (the
chunk already carries every rank's).

Layout: given the bucket's ``shapes``, the quantizers scale each tensor on its own
(groups never cross a tensor boundary, also where a chunk of step 1 cuts a
tensor) and PowerSGD factors each weight matrix on its own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from dtrain.comm.allreduce import allreduce_over, get_transport
from dtrain.comm.sparse import chunk_bounds, sparse_allreduce
from dtrain.comm.transport import Transport, Work
from dtrain.compress.base import Compressor, pack_payload
from dtrain.compress.feedback import ErrorFeedback
from dtrain.compress.lowrank import PowerSGD, orthogonalize
from dtrain.errors import CommError

__all__ = ["compressed_allreduce", "BucketReducer"]

_TAG = 0x5D0000
_TAG_SIZE1, _TAG_DATA1, _TAG_SIZE2, _TAG_DATA2 = (_TAG + i for i in range(4))


def compressed_allreduce(
    flat: torch.Tensor,
    compressor: Compressor,
    key: str,
    transport: Transport,
    *,
    algorithm: str = "ring",
    shapes: Sequence[Sequence[int]] | None = None,
) -> None:
    """Average ``flat`` over the transport's ranks in place, communicating compressed.

    Every rank ends with bitwise the same tensor. See the module docstring for the
    collective each kind of compressor uses and its cost.

    Args:
        flat: a contiguous 1-D floating tensor (a gradient bucket), same length on
            every rank.
        compressor: from :func:`dtrain.compress.from_spec`; holds per-key state, so
            use one instance per rank and the same ``key`` for the same bucket.
        key: names the bucket (e.g. ``"bucket3"``).
        transport: the ranks; its ``stats`` count the bytes actually sent.
        algorithm: dense allreduce used for summable payloads, a name in
            :data:`dtrain.comm.allreduce.ALGORITHMS` (default: ring).
        shapes: shapes of the tensors packed back to back in ``flat`` (the
            bucket's layout). PowerSGD uses it to compress each weight matrix on
            its own and send vectors (biases) dense, as Vogels et al. do; without
            it the whole bucket is one square matrix, whose rank-r approximation
            is much poorer. The quantizers use it to scale every tensor by its own
            magnitudes; sparsifiers ignore it (default: None).

    Raises:
        CommError: bad input or a failed transfer (naming rank, operation, peer).
    """
    op = f"compressed_allreduce({compressor.name})"
    if not isinstance(flat, torch.Tensor) or flat.dim() != 1 or not flat.is_contiguous():
        raise CommError(transport.rank, op, "needs a contiguous 1-D tensor (a flat bucket)")
    if not flat.is_floating_point():
        raise CommError(transport.rank, op, f"needs a floating-point tensor, got {flat.dtype}")
    if flat.numel() == 0:
        return
    ef = compressor if isinstance(compressor, ErrorFeedback) else None
    inner = ef.inner if ef is not None else compressor
    layout = _layout(flat.numel(), shapes, transport.rank, op)
    with torch.no_grad():
        if transport.world_size == 1:
            if shapes is None:
                payload, ctx = compressor.compress(flat, key)
            else:
                payload, ctx = compressor.compress_layout(flat, key, layout)
            flat.copy_(compressor.decompress(payload, ctx))
        elif compressor.collective == "lowrank":
            assert isinstance(inner, PowerSGD)
            _powersgd(flat, inner, ef, key, transport, algorithm, layout)
        elif compressor.collective == "summable":
            _summable(flat, compressor, key, transport, algorithm)
        elif compressor.collective == "sparse":
            payload, _ = compressor.compress(flat, key)
            res = sparse_allreduce(payload[0], payload[1].to(flat.dtype), flat.numel(), transport)
            flat.copy_(res.tensor).div_(transport.world_size)
        else:
            _scatter_gather(flat, compressor, key, transport, layout if shapes is not None else None)


def _allreduce_sum(t: Transport, x: torch.Tensor, algorithm: str) -> None:
    from dtrain.comm.allreduce import allreduce_over

    allreduce_over(t, x, "sum", algorithm)


def _summable(flat: torch.Tensor, c: Compressor, key: str, t: Transport, algorithm: str) -> None:
    payload, ctx = c.compress(flat, key)
    for part in payload:
        _allreduce_sum(t, part, algorithm)
    flat.copy_(c.decompress(payload, ctx))
    flat.div_(t.world_size)


def _layout(n: int, shapes: Sequence[Sequence[int]] | None, rank: int, op: str) -> list[tuple[int, ...]]:
    if shapes is None:
        return [(n,)]
    out = [tuple(int(d) for d in s) for s in shapes]
    total = sum(math.prod(s) for s in out)
    if total != n:
        raise CommError(rank, op, f"shapes describe {total} elements but the bucket holds {n}")
    return out


def _powersgd(
    flat: torch.Tensor,
    ps: PowerSGD,
    ef: ErrorFeedback | None,
    key: str,
    t: Transport,
    algorithm: str,
    layout: list[tuple[int, ...]],
) -> None:
    """Vogels et al.'s Algorithm 1 over every matrix of the bucket at once.

    Tensors that gain nothing from factoring (vectors, tiny matrices) travel dense
    in the second round, beside the Qs. Two allreduces per bucket in all.
    """
    corrected = ef.corrected(ef.accumulate(flat, key), key) if ef is not None else flat.detach().clone()
    offsets = [0]
    for s in layout:
        offsets.append(offsets[-1] + math.prod(s))
    parts = [corrected[offsets[i] : offsets[i + 1]] for i in range(len(layout))]
    # with a layout only weight matrices (ndim >= 2) are factored; without one the bucket is
    mats = {
        i: ps.as_matrix(parts[i].view(layout[i]))
        for i in range(len(layout))
        if (len(layout[i]) >= 2 or len(layout) == 1) and ps.compressible(layout[i])
    }
    dense = [i for i in range(len(layout)) if i not in mats]

    def qkey(i: int) -> str:  # warm-start state per matrix
        return key if len(layout) == 1 else f"{key}/{i}"

    # round 1: P = M Q for every matrix, one allreduce, orthonormalise each
    ps_ = {i: m @ ps.warm_q(qkey(i), m.shape[1]) for i, m in mats.items()}
    if ps_:
        p_all = torch.cat([p.reshape(-1) for p in ps_.values()])
        _allreduce_sum(t, p_all, algorithm)
        o = 0
        for p in ps_.values():
            p.copy_(p_all[o : o + p.numel()].view_as(p))
            o += p.numel()
            orthogonalize(p)
    # round 2: Q = M^T P, plus the dense tensors, one allreduce
    qs = {i: mats[i].t() @ ps_[i] for i in mats}
    sent = torch.empty_like(corrected)
    for i in mats:
        n_i = offsets[i + 1] - offsets[i]
        sent[offsets[i] : offsets[i + 1]] = (ps_[i] @ qs[i].t()).reshape(-1)[:n_i]
    for i in dense:
        sent[offsets[i] : offsets[i + 1]] = parts[i]
    if ef is not None:
        ef.update(key, corrected, sent)
    q_all = torch.cat([q.reshape(-1) for q in qs.values()] + [parts[i].to(torch.float32) for i in dense])
    _allreduce_sum(t, q_all, algorithm)
    q_all.div_(t.world_size)
    o = 0
    for i, q in qs.items():
        q.copy_(q_all[o : o + q.numel()].view_as(q))
        o += q.numel()
        ps.remember_q(qkey(i), q)
        n_i = offsets[i + 1] - offsets[i]
        flat[offsets[i] : offsets[i + 1]] = (ps_[i] @ q.t()).reshape(-1)[:n_i]
    for i in dense:
        n_i = offsets[i + 1] - offsets[i]
        flat[offsets[i] : offsets[i + 1]] = q_all[o : o + n_i]
        o += n_i


def _post_sized(t: Transport, buf: torch.Tensor, dst: int, size_tag: int, data_tag: int) -> list[Work]:
    size = torch.tensor([buf.numel()], dtype=torch.int64)
    works = [t.isend(size, dst, size_tag)]
    if buf.numel():
        works.append(t.isend(buf, dst, data_tag))
    return works


def _recv_sized(t: Transport, srcs: list[int], size_tag: int, data_tag: int) -> dict[int, torch.Tensor]:
    sizes = {s: torch.empty(1, dtype=torch.int64) for s in srcs}
    for w in [t.irecv(b, s, size_tag) for s, b in sizes.items()]:
        w.wait()
    bufs = {s: torch.empty(int(sizes[s].item()), dtype=torch.uint8) for s in srcs}
    for w in [t.irecv(b, s, data_tag) for s, b in bufs.items() if b.numel()]:
        w.wait()
    return bufs


def _scatter_gather(
    flat: torch.Tensor, c: Compressor, key: str, t: Transport, layout: list[tuple[int, ...]] | None
) -> None:
    p, me = t.world_size, t.rank
    bounds = chunk_bounds(flat.numel(), p)
    chunks = [flat[bounds[j] : bounds[j + 1]] for j in range(p)]
    others = [r for r in range(p) if r != me]
    ef = c if isinstance(c, ErrorFeedback) else None

    def first(j: int) -> tuple[list[torch.Tensor], Any]:  # this rank's contribution to chunk j
        if layout is None:
            return c.compress(chunks[j], f"{key}#{j}")
        return c.compress_layout(chunks[j], f"{key}#{j}", layout, bounds[j])

    def again(avg: torch.Tensor) -> tuple[list[torch.Tensor], Any]:  # the owner's combined chunk
        k = f"{key}#{me}/agg"
        if ef is not None:
            return ef.recompress(avg, k, layout, bounds[me])
        if layout is None:
            return c.compress(avg, k)
        return c.compress_layout(avg, k, layout, bounds[me])

    # phase 1: compressed reduce-scatter
    sends: list[Work] = []
    own = flat.new_empty(0)
    for j in range(p):
        if chunks[j].numel() == 0:
            continue
        payload, ctx = first(j)
        if j == me:
            own = c.decompress(payload, ctx)
        else:
            sends += _post_sized(t, pack_payload(payload), j, _TAG_SIZE1, _TAG_DATA1)
    mine = chunks[me]
    if mine.numel():
        got = _recv_sized(t, others, _TAG_SIZE1, _TAG_DATA1)
        decoded = [own if r == me else c.from_wire(got[r], mine.shape, mine.dtype) for r in range(p)]
        avg = c.combine(decoded)
        payload, ctx = again(avg)
        reduced = c.decompress(payload, ctx)
        buf = pack_payload(payload)
        for dst in others:
            sends += _post_sized(t, buf, dst, _TAG_SIZE2, _TAG_DATA2)
    # phase 2: compressed allgather of the combined chunks (receive before waiting
    # on our own sends: a transport may complete a send only once it is received)
    srcs = [r for r in others if chunks[r].numel()]
    got2 = _recv_sized(t, srcs, _TAG_SIZE2, _TAG_DATA2)
    for w in sends:
        w.wait()
    for r in srcs:
        chunks[r].copy_(c.from_wire(got2[r], chunks[r].shape, chunks[r].dtype))
    if mine.numel():
        mine.copy_(reduced)


class BucketReducer:
    """Average a flat bucket over the ranks of ``group``, in place, on the calling thread.

    Without compression the bucket is divided by the world size and then summed
    by the algorithm (``dtrain.comm.allreduce_over`` on the group's cached
    transport, i.e. what ``dtrain.comm.allreduce(..., group=group)`` runs, without
    its per-call lookups); pre-division as DDP does.
    With a compressor, :func:`compressed_allreduce` averages it.
    ``__call__`` returns the bytes this rank sent, from the transport's counters.

    Args:
        algorithm: a :mod:`dtrain.comm.allreduce` algorithm name.
        group: the communication thread's own process group (None: world of one).
        world: ranks in the group.
        timeout_s: limit of every wait inside the collective.
        compressor: a :class:`~dtrain.compress.Compressor`, or None.
    """

    def __init__(
        self, algorithm: str, group: Any, world: int, timeout_s: float, compressor: Compressor | None = None
    ) -> None:
        self.algorithm = algorithm
        self.group = group
        self.world = world
        self.timeout_s = timeout_s
        self.compressor = compressor
        self._transport: Any = get_transport(group, timeout_s) if world > 1 else None

    def __call__(self, flat: torch.Tensor, key: str, shapes: Any = None) -> int:
        """Average ``flat`` (bucket ``key``, members of ``shapes``) in place; return the bytes sent."""
        if self.world <= 1:
            return 0
        before = self._transport.stats.bytes_sent
        if self.compressor is not None:
            # shapes: the bucket's layout, so PowerSGD factors each weight matrix on its own
            compressed_allreduce(flat, self.compressor, key, self._transport, algorithm=self.algorithm, shapes=shapes)
        else:
            flat.div_(self.world)
            allreduce_over(self._transport, flat, "sum", self.algorithm)
        return int(self._transport.stats.bytes_sent - before)
