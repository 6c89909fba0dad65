"""Point-to-point transports that every collective algorithm is written against.

A :class:`Transport` is the small interface every collective is written against: ranks
``0..world_size-1``, non-blocking ``isend``/``irecv`` of contiguous tensors with a
tag, a timeout on every wait, and counters of messages and bytes sent. Two
implementations:

* :class:`TorchTransport` -- ``torch.distributed`` point-to-point on a process group
  (gloo on CPU, NCCL on GPU; CUDA tensors over gloo go through host memory). Used in
  production and in the spawned tests.
* :class:`ThreadTransport` -- ranks are threads of one process exchanging tensors
  through queues. Used by unit tests to run any algorithm for any world size in
  one process; :func:`run_threads` drives it.

Algorithms never touch ``torch.distributed`` directly, so the same code runs in
both.
"""

from __future__ import annotations

import abc
import datetime
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch

from dtrain import trace as _trace
from dtrain.errors import CommError, CommTimeoutError

__all__ = [
    "CommStats",
    "Work",
    "Transport",
    "TorchTransport",
    "ThreadTransport",
    "run_threads",
    "DEFAULT_TIMEOUT_S",
]

DEFAULT_TIMEOUT_S = 300.0

T = TypeVar("T")


@dataclass
class CommStats:
    """Counters of what a transport sent (receives are not counted twice)."""

    messages: int = 0
    bytes_sent: int = 0

    def reset(self) -> None:
        self.messages = 0
        self.bytes_sent = 0

    def snapshot(self) -> CommStats:
        return CommStats(self.messages, self.bytes_sent)

    def __sub__(self, other: CommStats) -> CommStats:
        return CommStats(self.messages - other.messages, self.bytes_sent - other.bytes_sent)


class Work(Protocol):
    """Handle of a pending send or receive."""

    def wait(self) -> None: ...


class _Done:
    def wait(self) -> None:
        return None


def _check_tensor(t: torch.Tensor, rank: int, op: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise CommError(rank, op, f"expected a torch.Tensor, got {type(t).__name__}")
    if not t.is_contiguous():
        raise CommError(rank, op, "tensor is not contiguous; call .contiguous() first")


class Transport(abc.ABC):
    """Ranks that exchange tensors point to point.

    Attributes:
        rank: this endpoint's rank in ``0..world_size-1``.
        world_size: number of ranks.
        timeout: seconds any wait may block before :class:`CommTimeoutError`.
        stats: messages and bytes this endpoint has sent.
    """

    rank: int
    world_size: int
    timeout: float
    stats: CommStats

    @abc.abstractmethod
    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Work:
        """Start sending ``tensor`` to ``dst``; the tensor must not change until waited."""

    @abc.abstractmethod
    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Work:
        """Start receiving into ``tensor`` from ``src``."""

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        self.isend(tensor, dst, tag).wait()

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> None:
        self.irecv(tensor, src, tag).wait()

    def _count(self, tensor: torch.Tensor) -> None:
        self.stats.messages += 1
        self.stats.bytes_sent += tensor.numel() * tensor.element_size()


# ----------------------------------------------------------------------------- torch


_Traced = tuple[_trace.Tracer, str, float, int]  # (tracer, flow key, posted at, bytes) of a traced message


def _comm_error(e: RuntimeError, rank: int, op: str, peer: int | None) -> CommError:
    """torch.distributed's error (gloo raises on a timeout or a closed peer) as a :class:`CommError`."""
    msg = str(e)
    cls = CommTimeoutError if "timeout" in msg.lower() or "timed out" in msg.lower() else CommError
    return cls(rank, op, msg.splitlines()[0][:300], peer=peer)


class _TorchWork:
    def __init__(
        self,
        work: Any,
        transport: TorchTransport,
        op: str,
        peer: int,
        traced: _Traced | None = None,
        staged: tuple[torch.Tensor, torch.Tensor | None] | None = None,
    ) -> None:
        self._work = work
        self._t = transport
        self._op = op
        self._peer = peer
        self._traced = traced  # (tracer, flow key, posted at, bytes): recorded once complete
        # (host copy, device tensor to fill from it once received, or None for a send): CUDA over gloo
        self._staged = staged

    def wait(self) -> None:
        try:
            ok = self._work.wait(timeout=datetime.timedelta(seconds=self._t.timeout))
        except RuntimeError as e:  # gloo raises on timeout or a closed peer
            raise _comm_error(e, self._t.rank, self._op, self._peer) from e
        if ok is False:
            raise CommTimeoutError(
                self._t.rank, self._op, f"not completed within {self._t.timeout:.0f}s", peer=self._peer
            )
        if self._staged is not None:
            host, device = self._staged
            self._staged = None
            if device is not None:
                device.copy_(host)
        if self._traced is not None:
            tracer, key, start, nbytes = self._traced
            self._traced = None
            tracer.message(self._op, self._t.global_ranks[self._peer], key, start, nbytes)


class TorchTransport(Transport):
    """``torch.distributed`` point-to-point over a process group.

    gloo's point-to-point carries CPU tensors only. A CUDA tensor on a gloo group is
    staged through host memory (as Horovod's gloo path does for GPU tensors): a send
    copies it to the host first (on the caller's current stream, so after whatever
    wrote it), a receive lands in a host buffer that :meth:`Work.wait` copies into it.
    That is how several processes share one GPU, where NCCL refuses two ranks on a device.

    Args:
        group: the process group (default: the default group). Ranks of this
            transport are ranks *within* the group.
        timeout: seconds a wait may block (default: 300).
    """

    def __init__(self, group: Any = None, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise CommError(0, "TorchTransport", "torch.distributed is not initialized; call dtrain.init()")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.timeout = float(timeout)
        self.stats = CommStats()
        # the group object itself: its send/recv take group ranks and skip the per-call argument
        # handling of dist.isend/irecv (~10 us per message, measured on gloo; the ring sends many)
        pg = group if group is not None else dist.group.WORLD
        assert pg is not None  # torch.distributed is initialized (checked above)
        self._pg = pg
        # for the trace's message arrows: the group's name and its ranks' global ranks
        self.group_name = str(getattr(pg, "group_name", "0"))
        self.global_ranks = [dist.get_global_rank(pg, r) if group is not None else r for r in range(self.world_size)]
        self._host_only = str(dist.get_backend(pg)).lower() == "gloo"  # device tensors are staged on the host

    def _traced(self, tensor: torch.Tensor, src: int, dst: int, tag: int) -> _Traced | None:
        tracer = _trace.current()
        if tracer is None:
            return None
        g = self.global_ranks
        return (
            tracer,
            tracer.channel(self.group_name, g[src], g[dst], tag),
            time.perf_counter(),
            tensor.numel() * tensor.element_size(),
        )

    # posting a send or a receive raises too (gloo, when the peer's connection has closed): the same CommError
    # as a wait's, so that the caller names its stage and step either way

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Work:
        _check_tensor(tensor, self.rank, "isend")
        self._count(tensor)
        traced = self._traced(tensor, self.rank, dst, tag)
        try:
            if self._host_only and tensor.device.type != "cpu":
                host = tensor.cpu()  # kept alive by the work until the send completes
                return _TorchWork(self._pg.send([host], dst, tag), self, "send", dst, traced, staged=(host, None))
            w = self._pg.send([tensor], dst, tag)
        except RuntimeError as e:
            raise _comm_error(e, self.rank, "send", dst) from e
        return _TorchWork(w, self, "send", dst, traced)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Work:
        _check_tensor(tensor, self.rank, "irecv")
        traced = self._traced(tensor, src, self.rank, tag)
        try:
            if self._host_only and tensor.device.type != "cpu":
                host = torch.empty(tensor.shape, dtype=tensor.dtype)
                return _TorchWork(self._pg.recv([host], src, tag), self, "recv", src, traced, staged=(host, tensor))
            w = self._pg.recv([tensor], src, tag)
        except RuntimeError as e:
            raise _comm_error(e, self.rank, "recv", src) from e
        return _TorchWork(w, self, "recv", src, traced)


# ----------------------------------------------------------------------------- threads


class _Mailboxes:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._boxes: dict[tuple[int, int, int], queue.Queue[torch.Tensor]] = {}

    def box(self, src: int, dst: int, tag: int) -> queue.Queue[torch.Tensor]:
        with self._lock:
            key = (src, dst, tag)
            if key not in self._boxes:
                self._boxes[key] = queue.Queue()
            return self._boxes[key]


class _ThreadRecv:
    def __init__(self, t: ThreadTransport, tensor: torch.Tensor, src: int, tag: int) -> None:
        self._t, self._tensor, self._src, self._tag = t, tensor, src, tag

    def wait(self) -> None:
        box = self._t._boxes.box(self._src, self._t.rank, self._tag)
        try:
            data = box.get(timeout=self._t.timeout)
        except queue.Empty:
            raise CommTimeoutError(
                self._t.rank, "recv", f"nothing arrived within {self._t.timeout:.1f}s", peer=self._src
            ) from None
        if data.numel() != self._tensor.numel() or data.dtype != self._tensor.dtype:
            raise CommError(
                self._t.rank,
                "recv",
                f"size mismatch: got {data.numel()} x {data.dtype}, "
                f"expected {self._tensor.numel()} x {self._tensor.dtype}",
                peer=self._src,
            )
        self._tensor.copy_(data.view_as(self._tensor))


class ThreadTransport(Transport):
    """In-process transport: each rank is a thread; messages are copied through queues.

    Build a world with :meth:`create`. Sends never block (unbounded queues), which
    is what eager transports like gloo do for the sizes unit tests use.
    """

    def __init__(self, rank: int, world_size: int, boxes: _Mailboxes, timeout: float) -> None:
        self.rank = rank
        self.world_size = world_size
        self.timeout = float(timeout)
        self.stats = CommStats()
        self._boxes = boxes

    @classmethod
    def create(cls, world_size: int, timeout: float = 10.0) -> list[ThreadTransport]:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        boxes = _Mailboxes()
        return [cls(r, world_size, boxes, timeout) for r in range(world_size)]

    def _check_peer(self, peer: int, op: str) -> None:
        if not 0 <= peer < self.world_size or peer == self.rank:
            raise CommError(self.rank, op, f"invalid peer {peer} (world size {self.world_size})")

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Work:
        _check_tensor(tensor, self.rank, "isend")
        self._check_peer(dst, "isend")
        self._count(tensor)
        self._boxes.box(self.rank, dst, tag).put(tensor.detach().clone())
        return _Done()

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Work:
        _check_tensor(tensor, self.rank, "irecv")
        self._check_peer(src, "irecv")
        return _ThreadRecv(self, tensor, src, tag)


def run_threads(
    world_size: int,
    fn: Callable[[Transport], T],
    timeout: float = 10.0,
    transports: Sequence[ThreadTransport] | None = None,
) -> list[T]:
    """Run ``fn(transport)`` on ``world_size`` threads; return the results by rank.

    The first exception raised by any rank is re-raised here (after all threads end
    or time out), so a failing algorithm fails the test instead of hanging it.
    """
    ts = list(transports) if transports is not None else ThreadTransport.create(world_size, timeout)
    results: list[Any] = [None] * world_size
    errors: list[BaseException | None] = [None] * world_size

    def target(r: int) -> None:
        try:
            results[r] = fn(ts[r])
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            errors[r] = e

    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(world_size)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout * 3 + 5)
        if th.is_alive():
            raise CommTimeoutError(-1, "run_threads", "a rank thread did not finish")
    for e in errors:
        if e is not None:
            raise e
    return results
