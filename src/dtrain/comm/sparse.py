"""Sparse collectives: allgather and allreduce of (index, value) pairs.

Written against :class:`~dtrain.comm.transport.Transport`, like every collective:
the same code runs over threads in unit tests and over torch.distributed.

Each rank holds ``k_r`` pairs ``(indices int, values)`` of a vector of ``n``
elements (indices unique per rank). A pair costs ``w = 4 + v`` bytes (int32
index, ``v`` bytes of value); a dense slice of ``c`` elements costs ``c * v``.
Whenever a piece is moved, it goes in whichever form is smaller: sparse when
``k * w < c * v`` (for fp32, density below 1/2), dense otherwise. That is the
switch to a dense representation of SparCML (Renggli, Ashkboos, Aghagolzadeh,
Alistarh & Hoefler, "SparCML: High-Performance Sparse Communication for Machine
Learning", SC 2019).

:func:`sparse_allreduce` first exchanges every rank's pair counts per chunk
(``P - 1`` messages of ``8 (P + 2)`` bytes), so that every rank computes the same
plan, then runs one of two algorithms:

``allgather`` (SparCML's small-data case)
    every rank sends its pairs to every other rank and each sums all ``P`` sets
    in rank order. Bytes rank ``r`` sends::

        B_ag(r) = (P - 1) * min(k_r * w, n * v)

``split`` (SparCML's split allgather; DSAR when chunks turn dense)
    the index space is cut into ``P`` chunks of ``c_j`` elements; phase 1 sends
    rank ``r``'s pairs of chunk ``j`` to its owner ``j`` (a sparse
    reduce-scatter), the owner sums them; phase 2 sends each owner's merged chunk
    (``m_j`` non-zeros) to every rank, dense if ``m_j * w >= c_j * v``::

        B_split(r) = sum_{j != r} min(k_rj * w, c_j * v)
                     + (P - 1) * (8 + min(m_r * w, c_r * v))

    ``m_r`` is known only after phase 1; the plan uses its upper bound
    ``min(sum_i k_ir, c_r)``.

The plan picks the algorithm whose busiest rank sends fewer bytes,
``argmin_alg max_r B_alg(r)`` (ties go to ``allgather``, which has one phase).
When every rank is denser than ``v / w``, ``split`` moves dense slices both ways,
which is exactly a (direct) reduce-scatter + allgather: ``2 (P-1)/P n v`` bytes,
the cost of a dense ring allreduce.

Sums are taken in rank order on one rank per element (the owner, or every rank
over identical inputs), so all ranks end with bitwise the same vector.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from dtrain.comm.transport import Transport, Work
from dtrain.errors import CommError

__all__ = [
    "INDEX_BYTES",
    "SparsePlan",
    "SparseAllreduceResult",
    "chunk_bounds",
    "plan_sparse_allreduce",
    "sparse_allgather",
    "sparse_allreduce",
]

INDEX_BYTES = 4
_TAG = 0x5C0000  # tags of this module: _TAG + phase
_TAG_COUNTS, _TAG_GATHER, _TAG_SCATTER, _TAG_HEADER, _TAG_MERGED = (_TAG + i for i in range(5))

_VALUE_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def chunk_bounds(n: int, parts: int) -> list[int]:
    """Boundaries of ``parts`` near-equal chunks of ``range(n)`` (the first ``n % parts`` get one more)."""
    q, rem = divmod(n, parts)
    return [i * q + min(i, rem) for i in range(parts + 1)]


@dataclass(frozen=True)
class SparsePlan:
    """The algorithm :func:`sparse_allreduce` runs and the costs it compared.

    Attributes:
        method: ``"allgather"`` or ``"split"``.
        costs: per algorithm, estimated bytes sent by the busiest rank (the module
            docstring gives the formulas); ``split``'s is an upper bound.
        per_rank: per algorithm, the estimate for each rank.
    """

    method: str
    costs: dict[str, int] = field(default_factory=dict)
    per_rank: dict[str, list[int]] = field(default_factory=dict)


class SparseAllreduceResult(NamedTuple):
    """What :func:`sparse_allreduce` returns.

    Attributes:
        tensor: the dense sum, ``n`` elements, values' dtype.
        plan: the plan every rank followed.
        merged_nnz: for ``split``, non-zeros of each merged chunk (how phase 2 sent
            it: dense where ``m_j * w >= c_j * v``); ``None`` for ``allgather``.
    """

    tensor: torch.Tensor
    plan: SparsePlan
    merged_nnz: list[int] | None


def _piece_bytes(k: int, c: int, v: int) -> int:
    return min(k * (INDEX_BYTES + v), c * v)


def _dense_piece(k: int, c: int, v: int) -> bool:
    return k * (INDEX_BYTES + v) >= c * v


def plan_sparse_allreduce(counts: Sequence[Sequence[int]], numel: int, value_bytes: int) -> SparsePlan:
    """Choose between ``allgather`` and ``split`` by the cost formulas of this module.

    Args:
        counts: ``counts[r][j]`` = pairs rank ``r`` holds in chunk ``j``
            (chunks from :func:`chunk_bounds`); ``P x P``.
        numel: vector length ``n``.
        value_bytes: bytes per value ``v``.

    Returns:
        the plan, with each algorithm's estimated bytes for its busiest rank.
    """
    p = len(counts)
    if any(len(row) != p for row in counts):
        raise ValueError(f"counts must be P x P, got rows of lengths {[len(r) for r in counts]}")
    bounds = chunk_bounds(numel, p)
    c = [bounds[j + 1] - bounds[j] for j in range(p)]
    v = value_bytes
    ag = [(p - 1) * _piece_bytes(sum(counts[r]), numel, v) for r in range(p)]
    split = []
    for r in range(p):
        phase1 = sum(_piece_bytes(counts[r][j], c[j], v) for j in range(p) if j != r)
        merged = min(sum(counts[i][r] for i in range(p)), c[r])
        split.append(phase1 + (p - 1) * (8 + _piece_bytes(merged, c[r], v)))
    costs = {"allgather": max(ag), "split": max(split)}
    method = "allgather" if costs["allgather"] <= costs["split"] else "split"
    return SparsePlan(method, costs, {"allgather": ag, "split": split})


# ----------------------------------------------------------------------------- helpers


def _check_pairs(indices: torch.Tensor, values: torch.Tensor, numel: int | None, rank: int, op: str) -> None:
    if not isinstance(indices, torch.Tensor) or not isinstance(values, torch.Tensor):
        raise CommError(rank, op, "indices and values must be torch.Tensors")
    if indices.dim() != 1 or values.dim() != 1 or indices.numel() != values.numel():
        raise CommError(
            rank,
            op,
            f"need 1-D indices and values of equal length, got {tuple(indices.shape)} and {tuple(values.shape)}",
        )
    if indices.dtype not in (torch.int32, torch.int64):
        raise CommError(rank, op, f"indices must be int32 or int64, got {indices.dtype}")
    if values.dtype not in _VALUE_DTYPES:
        raise CommError(rank, op, f"values must be one of {_VALUE_DTYPES}, got {values.dtype}")
    if numel is not None and indices.numel():
        lo, hi = int(indices.min()), int(indices.max())
        if lo < 0 or hi >= numel:
            raise CommError(rank, op, f"indices must lie in [0, {numel}), got range [{lo}, {hi}]")
    if numel is not None and numel > 2**31 - 1:
        raise CommError(rank, op, f"vectors over 2**31-1 elements are not supported (n={numel})")


def _code(dtype: torch.dtype) -> int:
    return _VALUE_DTYPES.index(dtype)


def _pack_pairs(idx: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
    return torch.cat([idx.to(torch.int32).contiguous().view(torch.uint8), vals.contiguous().view(torch.uint8)])


def _unpack_pairs(buf: torch.Tensor, k: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    cut = k * INDEX_BYTES
    idx = buf[:cut].view(torch.int32).to(torch.int64)
    raw = buf[cut:]
    if cut % torch.empty((), dtype=dtype).element_size():
        raw = raw.clone()  # realign before reinterpreting
    return idx, raw.view(dtype)


def _wait_all(works: list[Work]) -> None:
    for w in works:
        w.wait()


def _exchange_counts(t: Transport, row: list[int], op: str) -> list[list[int]]:
    """All-to-all of one int64 row per rank (direct sends); returns the rows by rank."""
    mine = torch.tensor(row, dtype=torch.int64)
    bufs = {src: torch.empty(len(row), dtype=torch.int64) for src in range(t.world_size) if src != t.rank}
    works = [t.irecv(b, src, _TAG_COUNTS) for src, b in bufs.items()]
    works += [t.isend(mine, dst, _TAG_COUNTS) for dst in range(t.world_size) if dst != t.rank]
    _wait_all(works)
    rows = [row if r == t.rank else bufs[r].tolist() for r in range(t.world_size)]
    for r, other in enumerate(rows):
        if other[:2] != row[:2]:
            raise CommError(
                t.rank,
                op,
                f"ranks disagree on the vector: rank {t.rank} has n={row[0]}, dtype {_VALUE_DTYPES[row[1]]}; "
                f"rank {r} has n={other[0]}, dtype {_VALUE_DTYPES[other[1]] if 0 <= other[1] < 4 else other[1]}",
                peer=r,
            )
    return rows


# ----------------------------------------------------------------------------- allgather


def _gather(
    t: Transport, idx: torch.Tensor, vals: torch.Tensor, numel: int | None, ks: list[int]
) -> list[tuple[torch.Tensor | None, torch.Tensor]]:
    """Send my pairs to everyone and receive theirs. With ``numel`` set, a rank whose
    pairs are denser than ``v / w`` sends its dense vector instead; such entries come
    back as ``(None, dense)``."""
    v = vals.element_size()
    dense_me = numel is not None and _dense_piece(ks[t.rank], numel, v)
    if dense_me:
        assert numel is not None
        out_msg = torch.zeros(numel, dtype=vals.dtype)
        out_msg[idx.to(torch.int64)] = vals
    else:
        out_msg = _pack_pairs(idx, vals)
    recv: dict[int, torch.Tensor] = {}
    works: list[Work] = []
    for src in range(t.world_size):
        if src == t.rank or ks[src] == 0:
            continue
        if numel is not None and _dense_piece(ks[src], numel, v):
            recv[src] = torch.empty(numel, dtype=vals.dtype)
        else:
            recv[src] = torch.empty(ks[src] * (INDEX_BYTES + v), dtype=torch.uint8)
        works.append(t.irecv(recv[src], src, _TAG_GATHER))
    if ks[t.rank]:
        works += [t.isend(out_msg, dst, _TAG_GATHER) for dst in range(t.world_size) if dst != t.rank]
    _wait_all(works)
    out: list[tuple[torch.Tensor | None, torch.Tensor]] = []
    for r in range(t.world_size):
        if r == t.rank:
            out.append((None, out_msg) if dense_me else (idx.to(torch.int64), vals))
        elif ks[r] == 0:
            out.append((torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=vals.dtype)))
        elif recv[r].dtype != torch.uint8:
            out.append((None, recv[r]))
        else:
            out.append(_unpack_pairs(recv[r], ks[r], vals.dtype))
    return out


def sparse_allgather(
    indices: torch.Tensor, values: torch.Tensor, transport: Transport
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every rank's ``(indices, values)``, by rank.

    1. allgather the counts ``k_r`` (``P - 1`` messages of 24 bytes per rank);
    2. every rank sends its pairs, packed as int32 indices then values, to every
       other rank: ``(P - 1) * k_r * (4 + v)`` bytes from rank ``r``.

    Args:
        indices: 1-D int32/int64 indices (any order).
        values: 1-D floating values, same length; same dtype on every rank.
        transport: the ranks.

    Returns:
        ``[(indices int64, values)]`` for ranks ``0..P-1`` (this rank's own as given).
    """
    t = transport
    _check_pairs(indices, values, None, t.rank, "sparse_allgather")
    if t.world_size == 1:
        return [(indices.to(torch.int64), values)]
    rows = _exchange_counts(t, [0, _code(values.dtype), indices.numel()], "sparse_allgather")
    got = _gather(t, indices, values, None, [row[2] for row in rows])
    return [(i if i is not None else torch.empty(0, dtype=torch.int64), v) for i, v in got]


# ----------------------------------------------------------------------------- allreduce


def sparse_allreduce(
    indices: torch.Tensor,
    values: torch.Tensor,
    numel: int,
    transport: Transport,
    *,
    method: str = "auto",
) -> SparseAllreduceResult:
    """Sum sparse vectors of all ranks; every rank gets the dense sum.

    See the module docstring for the two algorithms and their cost formulas.

    Args:
        indices: 1-D int32/int64 indices in ``[0, numel)``, unique on this rank.
        values: 1-D floating values of the same length (same dtype on every rank).
        numel: length ``n`` of the vector (same on every rank).
        transport: the ranks.
        method: ``"auto"`` (by the cost formula), ``"allgather"`` or ``"split"``.

    Returns:
        the dense sum, the plan every rank followed, and the merged chunk sizes.

    Raises:
        CommError: bad input, ranks that disagree on ``numel`` or dtype, or a
            failed/timed-out transfer (naming the peer).
    """
    t = transport
    op = "sparse_allreduce"
    if method not in ("auto", "allgather", "split"):
        raise ValueError(f"method must be 'auto', 'allgather' or 'split', got {method!r}")
    _check_pairs(indices, values, numel, t.rank, op)
    idx = indices.to(torch.int64)
    p = t.world_size
    if p == 1:
        out = torch.zeros(numel, dtype=values.dtype)
        out.index_add_(0, idx, values)
        return SparseAllreduceResult(out, SparsePlan("allgather", {"allgather": 0, "split": 0}), None)

    bounds = chunk_bounds(numel, p)
    order = torch.argsort(idx)
    idx, vals = idx[order], values[order]
    cuts = torch.searchsorted(idx, torch.tensor(bounds, dtype=torch.int64)).tolist()
    mine = [cuts[j + 1] - cuts[j] for j in range(p)]
    rows = _exchange_counts(t, [numel, _code(values.dtype), *mine], op)
    counts = [row[2:] for row in rows]
    plan = plan_sparse_allreduce(counts, numel, values.element_size())
    if method != "auto":
        plan = SparsePlan(method, plan.costs, plan.per_rank)

    if plan.method == "allgather":
        out = torch.zeros(numel, dtype=values.dtype)
        for gi, gv in _gather(t, idx, vals, numel, [sum(c) for c in counts]):
            if gi is None:
                out.add_(gv)
            elif gi.numel():
                out.index_add_(0, gi, gv)
        return SparseAllreduceResult(out, plan, None)
    out, nnz = _split(t, idx, vals, numel, bounds, cuts, counts)
    return SparseAllreduceResult(out, plan, nnz)


def _split(
    t: Transport,
    idx: torch.Tensor,
    vals: torch.Tensor,
    numel: int,
    bounds: list[int],
    cuts: list[int],
    counts: list[list[int]],
) -> tuple[torch.Tensor, list[int]]:
    """SparCML's split allgather: phase 1 reduces each chunk on its owner, phase 2 gathers the merged chunks."""
    c = [bounds[j + 1] - bounds[j] for j in range(t.world_size)]
    acc = _reduce_to_owners(t, idx, vals, bounds, cuts, counts, c)
    return _gather_merged(t, acc, numel, bounds, c, vals.element_size())


def _reduce_to_owners(
    t: Transport,
    idx: torch.Tensor,
    vals: torch.Tensor,
    bounds: list[int],
    cuts: list[int],
    counts: list[list[int]],
    c: list[int],
) -> torch.Tensor:
    """Phase 1 of :func:`_split`: a sparse (or dense) reduce-scatter; returns this rank's summed chunk."""
    p, me = t.world_size, t.rank
    v = vals.element_size()
    dtype = vals.dtype
    lo = bounds[me]
    recv: dict[int, torch.Tensor] = {}
    sends: list[torch.Tensor] = []
    works: list[Work] = []
    for src in range(p):
        k = counts[src][me]
        if src == me or k == 0:
            continue
        shape = c[me] if _dense_piece(k, c[me], v) else k * (INDEX_BYTES + v)
        recv[src] = torch.empty(shape, dtype=dtype if _dense_piece(k, c[me], v) else torch.uint8)
        works.append(t.irecv(recv[src], src, _TAG_SCATTER))
    for dst in range(p):
        k = counts[me][dst]
        if dst == me or k == 0:
            continue
        pi = idx[cuts[dst] : cuts[dst + 1]]
        pv = vals[cuts[dst] : cuts[dst + 1]]
        if _dense_piece(k, c[dst], v):
            msg = torch.zeros(c[dst], dtype=dtype)
            msg[pi - bounds[dst]] = pv
        else:
            msg = _pack_pairs(pi - bounds[dst], pv)
        sends.append(msg)
        works.append(t.isend(msg, dst, _TAG_SCATTER))
    _wait_all(works)
    del sends

    acc = torch.zeros(c[me], dtype=dtype)
    for src in range(p):
        if counts[src][me] == 0:
            continue
        if src == me:
            acc.index_add_(0, idx[cuts[me] : cuts[me + 1]] - lo, vals[cuts[me] : cuts[me + 1]])
        elif recv[src].dtype != torch.uint8:
            acc.add_(recv[src])
        else:
            ri, rv = _unpack_pairs(recv[src], counts[src][me], dtype)
            acc.index_add_(0, ri, rv)
    return acc


def _gather_merged(
    t: Transport, acc: torch.Tensor, numel: int, bounds: list[int], c: list[int], v: int
) -> tuple[torch.Tensor, list[int]]:
    """Phase 2 of :func:`_split`: every owner sends its merged chunk ``acc``, sparse or dense, to every rank.

    Returns:
        the dense sum, and the non-zeros of each merged chunk.
    """
    p, me = t.world_size, t.rank
    dtype = acc.dtype
    nz = torch.nonzero(acc, as_tuple=True)[0]
    m = nz.numel()
    header = torch.tensor([m], dtype=torch.int64)
    msg2 = acc if _dense_piece(m, c[me], v) else _pack_pairs(nz, acc[nz])
    heads = {src: torch.empty(1, dtype=torch.int64) for src in range(p) if src != me}
    works = [t.irecv(h, src, _TAG_HEADER) for src, h in heads.items()]
    works += [t.isend(header, dst, _TAG_HEADER) for dst in range(p) if dst != me]
    _wait_all(works)
    nnz = [m if r == me else int(heads[r].item()) for r in range(p)]

    got: dict[int, torch.Tensor] = {}
    works = []
    for src in range(p):
        if src == me or nnz[src] == 0:
            continue
        dense = _dense_piece(nnz[src], c[src], v)
        got[src] = torch.empty(c[src] if dense else nnz[src] * (INDEX_BYTES + v), dtype=dtype if dense else torch.uint8)
        works.append(t.irecv(got[src], src, _TAG_MERGED))
    if m:
        works += [t.isend(msg2, dst, _TAG_MERGED) for dst in range(p) if dst != me]
    _wait_all(works)

    out = torch.zeros(numel, dtype=dtype)
    out[bounds[me] : bounds[me + 1]] = acc
    for src, buf in got.items():
        if buf.dtype != torch.uint8:
            out[bounds[src] : bounds[src + 1]] = buf
        else:
            ri, rv = _unpack_pairs(buf, nnz[src], dtype)
            out[ri + bounds[src]] = rv
    return out, nnz
