"""Reduce-scatter and allgather: the two halves of the ring allreduce, each a collective of its own.

Sharded data parallelism (ZeRO, Rajbhandari et al. 2020; FSDP) is built on them:
gradients are reduce-scattered so that rank ``r`` keeps the reduction of its own
segment, and updated parameter segments are allgathered back into whole tensors.

Layout: a flat tensor of ``P * s`` elements is ``P`` equal segments; segment ``r``
(elements ``[r*s, (r+1)*s)``) belongs to rank ``r``. Both collectives work in place
on the whole flat tensor:

* :func:`reduce_scatter_over` -- afterwards segment ``r`` of rank ``r`` holds the
  reduction of every rank's segment ``r``; the other segments hold partial sums
  (scratch: do not read them).
* :func:`allgather_over` -- afterwards every rank holds every rank's own segment.

Ring schedule (Patarasuk & Yuan, JPDC 2009; the two phases of
:func:`dtrain.comm.allreduce.ring`), ``P - 1`` steps each, rank ``r`` sending to
``r + 1`` and receiving from ``r - 1``:

* reduce-scatter step ``k``: send segment ``r-k-1`` (the partial sum it holds),
  receive segment ``r-k-2`` into scratch and add it in; the last segment received
  is ``r`` itself, now complete.
* allgather step ``k``: send segment ``r-k`` (complete), receive segment ``r-k-1``
  straight into place.

Cost per rank (alpha-beta-gamma): reduce-scatter ``(P-1)·alpha + (P-1)/P·n·beta +
(P-1)/P·n·gamma``; allgather ``(P-1)·alpha + (P-1)/P·n·beta``; together exactly one
ring allreduce. ``algorithm="native"`` runs the backend's own
``reduce_scatter_tensor`` / ``all_gather_into_tensor`` instead (gloo and NCCL have
both), with the same layout.
"""

from __future__ import annotations

from typing import Any

import torch

from dtrain import trace as _trace
from dtrain.comm._reduce import BUFFERS, average, check_op, check_tensor, combine, post_recv, post_send
from dtrain.comm.transport import Transport
from dtrain.errors import CommError, ConfigError

__all__ = ["SHARD_ALGORITHMS", "segment", "reduce_scatter_over", "allgather_over", "reduce_scatter", "allgather"]

#: how :func:`reduce_scatter` / :func:`allgather` run: dtrain's ring or the backend's own.
SHARD_ALGORITHMS = ("ring", "native")

_TAG_RS = 5 << 22
_TAG_AG = 6 << 22


def segment(flat: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s segment of a flat tensor of ``world`` equal segments (a view)."""
    s = flat.numel() // world
    return flat[rank * s : (rank + 1) * s]


def _check(tensor: Any, world: int, what: str) -> torch.Tensor:
    flat = check_tensor(tensor)
    if flat.numel() % world:
        raise ConfigError(
            f"{what} needs a flat tensor of world_size equal segments: {flat.numel()} elements do not divide "
            f"over {world} ranks (pad it to a multiple of {world})"
        )
    return flat


def _relabel(e: CommError, label: str) -> CommError:
    if e.op.startswith(label):
        return e
    new = type(e)(e.rank, f"{label} {e.op}", e.cause, peer=e.peer, step=e.step)
    new.__cause__ = e
    return new


def _check_out(out: torch.Tensor | None, flat: torch.Tensor, world: int) -> None:
    if out is None:
        return
    s = flat.numel() // world
    if out.numel() != s or out.dtype != flat.dtype or out.device != flat.device or not out.is_contiguous():
        raise ConfigError(
            f"reduce_scatter's out must be a contiguous {flat.dtype} tensor of one segment ({s} elements) on "
            f"{flat.device}; got {out.numel()} elements of {out.dtype} on {out.device}"
        )
    if out.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr():
        raise ConfigError("reduce_scatter's out must not share the input's storage")


def reduce_scatter_over(
    t: Transport, tensor: torch.Tensor, op: str = "sum", out: torch.Tensor | None = None
) -> torch.Tensor:
    """Reduce-scatter ``tensor`` over a transport: rank ``r``'s segment ``r`` ends reduced (in place, or in ``out``).

    Args:
        t: the ranks (threads in a test, a process group in production).
        tensor: contiguous, ``world_size * s`` elements, same shape and dtype on every rank.
        op: ``sum``, ``avg``, ``max`` or ``min`` (default: sum).
        out: optional, ``s`` contiguous elements of another storage: the reduced segment lands there (and
            the receives use it as their scratch, so none is taken), ``tensor``'s own segment is left as
            scratch. The same values, bit for bit, as in place.

    Returns:
        ``out`` if given, else ``tensor``; only its own segment (:func:`segment`) is meaningful afterwards.
    """
    check_op(op)
    P, r = t.world_size, t.rank
    flat = _check(tensor, P, "reduce_scatter")
    _check_out(out, flat, P)
    if P == 1 or flat.numel() == 0:
        if out is not None:
            out.copy_(flat)
        return tensor if out is None else out
    right, left = (r + 1) % P, (r - 1) % P
    s = flat.numel() // P
    scratch = BUFFERS.take(s, flat.dtype, flat.device) if out is None else out
    red = "sum" if op == "avg" else op
    try:
        with torch.no_grad(), _trace.span("reduce_scatter(ring)", bytes=flat.numel() * flat.element_size()):
            for k in range(P - 1):
                rv = post_recv(t, scratch, left, _TAG_RS + k)
                sd = post_send(t, segment(flat, (r - k - 1) % P, P), right, _TAG_RS + k)
                rv.wait()
                if out is not None and k == P - 2:  # the last partial sum received: ours, completed in out
                    combine(out, segment(flat, r, P), red)  # sum, max and min commute: the same bits
                else:
                    combine(segment(flat, (r - k - 2) % P, P), scratch, red)
                sd.wait()
            if op == "avg":
                average(segment(flat, r, P) if out is None else out, P)
    except CommError as e:
        raise _relabel(e, "reduce_scatter(ring)") from e
    if out is not None:
        return out
    BUFFERS.give(scratch)
    return tensor


def allgather_over(t: Transport, tensor: torch.Tensor) -> torch.Tensor:
    """Allgather in place over a transport: every rank ends with every rank's own segment.

    Args:
        t: the ranks.
        tensor: contiguous, ``world_size * s`` elements; rank ``r`` contributes segment ``r``.

    Returns:
        ``tensor``, whole on every rank.
    """
    P, r = t.world_size, t.rank
    flat = _check(tensor, P, "allgather")
    if P == 1 or flat.numel() == 0:
        return tensor
    right, left = (r + 1) % P, (r - 1) % P
    try:
        with torch.no_grad(), _trace.span("allgather(ring)", bytes=flat.numel() * flat.element_size()):
            for k in range(P - 1):
                rv = post_recv(t, segment(flat, (r - k - 1) % P, P), left, _TAG_AG + k)
                sd = post_send(t, segment(flat, (r - k) % P, P), right, _TAG_AG + k)
                rv.wait()
                sd.wait()
    except CommError as e:
        raise _relabel(e, "allgather(ring)") from e
    return tensor


def _native(group: Any, timeout: float | None, what: str, fn: Any) -> None:
    """Run a backend collective with a timeout; a failure becomes a CommError naming this rank."""
    import datetime

    import torch.distributed as dist

    rank = dist.get_rank()
    try:
        with _trace.span(what):
            work = fn()
            ok = work.wait(datetime.timedelta(seconds=timeout)) if timeout is not None else work.wait()
        if ok is False:
            raise CommError(rank, what, f"timed out after {timeout} s")
    except RuntimeError as e:
        raise CommError(rank, what, str(e).splitlines()[0][:300] if str(e) else type(e).__name__) from e


def reduce_scatter(
    tensor: torch.Tensor,
    op: str = "sum",
    group: Any = None,
    algorithm: str = "ring",
    timeout: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce-scatter ``tensor`` over ``group``, in place or into ``out``; see :func:`reduce_scatter_over`.

    Args:
        tensor: contiguous, ``world_size * s`` elements.
        op: ``sum``, ``avg``, ``max`` or ``min`` (default: sum).
        group: the process group (default: the default group).
        algorithm: ``ring`` (dtrain's, bytes counted) or ``native`` (default: ring).
        timeout: seconds any wait may block (default: the transport's, 300).
        out: optional, one segment's ``s`` elements of another storage: where the reduced segment goes.

    Returns:
        ``out`` if given, else ``tensor``.
    """
    import torch.distributed as dist

    if algorithm not in SHARD_ALGORITHMS:
        raise ConfigError(f"reduce_scatter algorithm {algorithm!r}; choose one of {', '.join(SHARD_ALGORITHMS)}")
    check_op(op)
    if not dist.is_initialized():
        if out is not None:
            out.copy_(check_tensor(tensor))
        return tensor if out is None else out
    P = dist.get_world_size(group)
    flat = _check(tensor, P, "reduce_scatter")
    _check_out(out, flat, P)
    if algorithm == "ring":
        from dtrain.comm.allreduce import get_transport

        return reduce_scatter_over(get_transport(group, timeout), flat, op, out=out)
    mine = segment(flat, dist.get_rank(group), P)
    dst = torch.empty_like(mine) if out is None else out
    red = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    _native(
        group,
        timeout,
        "reduce_scatter(native)",
        lambda: dist.reduce_scatter_tensor(dst, flat, op=red[op], group=group, async_op=True),
    )
    if out is None:
        mine.copy_(dst)
    if op == "avg":
        average(dst if out is not None else mine, P)
    return tensor if out is None else out


def allgather(
    tensor: torch.Tensor, group: Any = None, algorithm: str = "ring", timeout: float | None = None
) -> torch.Tensor:
    """Allgather in place over ``group``: rank ``r``'s segment ``r`` to every rank (see :func:`allgather_over`).

    Args:
        tensor: contiguous, ``world_size * s`` elements.
        group: the process group (default: the default group).
        algorithm: ``ring`` (dtrain's, bytes counted) or ``native`` (default: ring).
        timeout: seconds any wait may block (default: the transport's, 300).
    """
    import torch.distributed as dist

    if algorithm not in SHARD_ALGORITHMS:
        raise ConfigError(f"allgather algorithm {algorithm!r}; choose one of {', '.join(SHARD_ALGORITHMS)}")
    if not dist.is_initialized():
        return tensor
    P = dist.get_world_size(group)
    flat = _check(tensor, P, "allgather")
    if algorithm == "ring":
        from dtrain.comm.allreduce import get_transport

        return allgather_over(get_transport(group, timeout), flat)
    mine = segment(flat, dist.get_rank(group), P).clone()
    _native(
        group, timeout, "allgather(native)", lambda: dist.all_gather_into_tensor(flat, mine, group=group, async_op=True)
    )
    return tensor
