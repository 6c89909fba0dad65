"""Helpers the allreduce algorithms share: ops, input checks, buffers, sub-worlds.

* reduction ops (``sum``, ``avg``, ``max``, ``min``) applied in place, in the
  tensor's own dtype -- the same one-rounding-per-addition that gloo does;
* input validation with errors that say what to change;
* a small cache of receive buffers, so a ring does not fault in fresh pages on
  every call;
* :class:`SubTransport`, a view of some ranks of a transport as a world of their
  own (the hierarchical algorithm runs a tree inside each node and a ring across
  node leaders on it).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

from dtrain.comm.transport import CommStats, Transport, Work
from dtrain.errors import CommError, ConfigError

__all__ = [
    "OPS",
    "DTYPES",
    "check_op",
    "check_tensor",
    "combine",
    "average",
    "BufferCache",
    "BUFFERS",
    "size_class",
    "SubTransport",
    "post_send",
    "post_recv",
]

OPS = ("sum", "avg", "max", "min")
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64)


def check_op(op: str) -> str:
    if op not in OPS:
        raise ConfigError(f"unknown reduction op {op!r}; choose one of {', '.join(OPS)}")
    return op


def check_tensor(tensor: Any) -> torch.Tensor:
    """Return ``tensor`` flattened to a 1-D view, or raise a :class:`ConfigError` that says why not."""
    if not isinstance(tensor, torch.Tensor):
        raise ConfigError(f"allreduce needs a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type == "meta":
        raise ConfigError("allreduce got a tensor on the meta device, which holds no data; materialise it first")
    if tensor.is_sparse or tensor.layout != torch.strided:
        raise ConfigError(f"allreduce needs a dense (strided) tensor, got layout {tensor.layout}")
    if not tensor.is_contiguous():
        raise ConfigError(
            "allreduce works in place on a contiguous tensor; this one is a non-contiguous view "
            "(call .contiguous(), reduce that, and copy the result back)"
        )
    if tensor.dtype not in DTYPES:
        names = ", ".join(str(d).replace("torch.", "") for d in DTYPES)
        raise ConfigError(f"allreduce does not support dtype {tensor.dtype}; use one of {names}")
    return tensor.view(-1)


def combine(acc: torch.Tensor, other: torch.Tensor, op: str) -> None:
    """``acc = acc (op) other`` in place; ``op`` is ``sum``, ``max`` or ``min`` (``avg`` reduces as ``sum``)."""
    if op == "max":
        torch.maximum(acc, other, out=acc)
    elif op == "min":
        torch.minimum(acc, other, out=acc)
    else:
        acc.add_(other)


def average(flat: torch.Tensor, world_size: int) -> None:
    """Divide a sum by the world size in place.

    Floating dtypes divide exactly (one rounding). Integer dtypes use floor
    division (rounding toward minus infinity, like Python's ``//``), so
    ``avg`` of ``[-3, 0]`` over 2 ranks is ``-2``.
    """
    if world_size == 1:
        return
    if flat.is_floating_point():
        flat.div_(world_size)
    else:
        flat.copy_(torch.div(flat, world_size, rounding_mode="floor"))


def size_class(numel: int) -> int:
    """``numel`` rounded up to one of 8 sizes between consecutive powers of two (at most 1/8 more)."""
    if numel <= 16:
        return numel
    step = 1 << (numel.bit_length() - 4)  # an eighth of the power of two at or below numel
    return -(-numel // step) * step


class BufferCache:
    """Reusable scratch tensors, one free list per (dtype, device).

    ``take`` hands out a buffer of at least ``numel`` elements (the smallest free
    one that is big enough, else a new one of :func:`size_class` elements, so that
    a request a little larger than an earlier one, such as a bucket rebuilt in
    another order, fits the buffer that one left rather than adding a second);
    ``give`` returns it, and the cache keeps the largest few within a byte budget.
    Buffers that were in flight when an operation failed are simply not given back.
    """

    def __init__(self, max_bytes: int = 256 << 20, max_count: int = 4) -> None:
        self._lock = threading.Lock()
        self._free: dict[tuple[torch.dtype, str], list[torch.Tensor]] = {}
        self._max_bytes = max_bytes
        self._max_count = max_count

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (dtype, str(device))
        with self._lock:
            free = self._free.get(key, [])
            for i in range(len(free) - 1, -1, -1):  # the smallest that fits
                if free[i].numel() >= numel:
                    return free.pop(i)[:numel]
        return torch.empty(size_class(numel), dtype=dtype, device=device)[:numel]

    def give(self, buf: torch.Tensor) -> None:
        base = buf._base if buf._base is not None else buf
        key = (base.dtype, str(base.device))
        with self._lock:
            free = self._free.setdefault(key, [])
            free.append(base.view(-1))
            free.sort(key=lambda t: -t.numel())
            # keep the largest few, within the byte budget
            kept, total = [], 0
            for t in free[: self._max_count]:
                size = t.numel() * t.element_size()
                if total + size <= self._max_bytes:
                    kept.append(t)
                    total += size
            self._free[key] = kept


BUFFERS = BufferCache()


class SubTransport(Transport):
    """Ranks ``members`` of ``parent`` seen as a world ``0..len(members)-1``.

    Shares the parent's timeout and counters; adds ``tag_offset`` to every tag so
    the phases of one algorithm never match each other's messages.
    """

    def __init__(self, parent: Transport, members: Sequence[int], tag_offset: int) -> None:
        self.parent = parent
        self.members = list(members)
        self.rank = self.members.index(parent.rank)
        self.world_size = len(self.members)
        self.timeout = parent.timeout
        self.stats: CommStats = parent.stats
        self._tag_offset = tag_offset

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Work:
        return self.parent.isend(tensor, self.members[dst], tag + self._tag_offset)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Work:
        return self.parent.irecv(tensor, self.members[src], tag + self._tag_offset)

    def real_rank(self, rank: int) -> int:
        real = self.members[rank]
        parent = self.parent
        return parent.real_rank(real) if isinstance(parent, SubTransport) else real


def _real(t: Transport, peer: int) -> int:
    return t.real_rank(peer) if isinstance(t, SubTransport) else peer


def _as_comm_error(t: Transport, op: str, peer: int, e: RuntimeError) -> CommError:
    if isinstance(e, CommError):
        return e
    root = t.parent if isinstance(t, SubTransport) else t
    return CommError(root.rank, op, str(e).splitlines()[0][:300] if str(e) else type(e).__name__, peer=_real(t, peer))


def post_send(t: Transport, tensor: torch.Tensor, peer: int, tag: int) -> Work:
    """``t.isend`` whose backend errors become :class:`CommError` naming the peer."""
    try:
        return t.isend(tensor, peer, tag)
    except RuntimeError as e:
        raise _as_comm_error(t, "send", peer, e) from e


def post_recv(t: Transport, tensor: torch.Tensor, peer: int, tag: int) -> Work:
    """``t.irecv`` whose backend errors become :class:`CommError` naming the peer."""
    try:
        return t.irecv(tensor, peer, tag)
    except RuntimeError as e:
        raise _as_comm_error(t, "recv", peer, e) from e
