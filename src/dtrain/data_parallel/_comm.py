"""The two schedules of ``overlap="backward"``, and the CUDA stream ordering they need.

Each bucket is averaged by a :class:`dtrain.compress.reduce.BucketReducer` (an allreduce
algorithm, or a compressor's collective).

* :class:`NativeScheduler` -- ``algorithm="native"``: the backend's own allreduce,
  issued asynchronously from the backward hook (``async_op=True``), as DDP does;
  gloo/NCCL run it on their own threads.
* :class:`ThreadScheduler` -- every other algorithm: one communication thread,
  fed in bucket order, reduces while backward goes on. It owns its process group
  (two threads issuing collectives on one gloo group crash). The
  bucket that completes backward is reduced on the calling thread once the
  communication thread has drained, so a model that fits one bucket pays no
  thread hand-off at all.

Both keep the launch order identical on every rank (the engine launches buckets
strictly by index), which is what keeps the collectives of different ranks
matched.
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from dtrain import trace as _trace
from dtrain.comm.step_stats import StepStats
from dtrain.comm.waits import GRACE_S, wait_work, with_step
from dtrain.compress.reduce import BucketReducer
from dtrain.data_parallel._buckets import Bucket
from dtrain.errors import CommTimeoutError

__all__ = ["StreamSync", "NativeScheduler", "ThreadScheduler", "native_bytes"]

NATIVE_TID = 3  # the trace track of native allreduces (they run on the backend's own thread)


@functools.lru_cache(maxsize=4096)
def native_bytes(world: int, group_rank: int, numel: int, itemsize: int) -> int:
    """Bytes charged to a rank for a native allreduce: an unpipelined ring, about ``2(P-1)/P * n``."""
    if world <= 1:
        return 0
    from dtrain.comm.cost import native_traffic

    return int(native_traffic(world, numel, itemsize).bytes_sent[group_rank])


class StreamSync:
    """CUDA stream ordering between the compute stream and the communication thread; no-op on CPU.

    ``produced()`` records an event on the caller's current stream (gradients
    written); the communication thread runs under ``on_comm_stream(event)``, which
    makes its own stream wait for that event; ``finished()`` records completion on
    the communication stream; ``consume(event)`` makes the caller's stream wait.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.stream: Any = torch.cuda.Stream(device=device) if self.cuda else None

    def produced(self) -> Any:
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def on_comm_stream(self, event: Any) -> Any:
        if not self.cuda:
            return _NULL
        if event is not None:
            self.stream.wait_event(event)
        return torch.cuda.stream(self.stream)

    def finished(self) -> Any:
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(self.stream)
        return ev

    def consume(self, event: Any) -> None:
        if self.cuda and event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


_NULL = _Null()


class NativeScheduler:
    """``algorithm="native"``, ``overlap="backward"``: async backend allreduce per bucket.

    ``launch`` divides the bucket by the world size and issues
    ``dist.all_reduce(flat, async_op=True)``; ``wait_all`` waits every handle with
    the remaining time. A bucket counts as in flight from its launch until
    ``wait_all`` sees it complete (no completion callback: a Python callback on
    the backend's thread would hold up its next collective waiting for the GIL).
    The backend does not count bytes, so ``bytes_sent`` is what a ring sends,
    ``2(P-1)/P * n`` (:func:`native_bytes`).
    """

    def __init__(self, group: Any, world: int, rank: int, timeout_s: float) -> None:
        self.group = group
        self.world = world
        self.rank = rank
        self.group_rank = dist.get_rank(group) if world > 1 else 0
        self.timeout_s = timeout_s
        self._works: list[tuple[Bucket, Any, float]] = []

    def launch(self, b: Bucket, inline: bool, step: int) -> None:
        if self.world <= 1:
            return
        b.flat.div_(self.world)
        t0 = time.perf_counter()
        self._works.append((b, dist.all_reduce(b.flat, group=self.group, async_op=True), t0))

    def wait_all(self, step: int, stats: StepStats) -> None:
        works, self._works = self._works, []
        deadline = time.monotonic() + self.timeout_s
        for b, work, t0 in works:
            op = f"allreduce(native) of gradient bucket {b.index}"
            wait_work(work, deadline - time.monotonic(), self.rank, op, step)
            nbytes = native_bytes(self.world, self.group_rank, b.flat.numel(), b.flat.element_size())
            t1 = time.perf_counter()
            stats.add_comm(t0, t1, nbytes)
            tracer = _trace.current()
            if tracer is not None:  # launch to seen complete, on a track of its own (the backend's thread)
                tracer.add(f"allreduce(native) bucket {b.index}", t0, t1 - t0, NATIVE_TID, bytes=nbytes)

    def abort(self, error: BaseException) -> None:
        """Forget the step's handles (the backend completes them on its own)."""
        self._works = []

    def close(self) -> None:
        self._works = []


class ThreadScheduler:
    """Any algorithm but native, ``overlap="backward"``: one communication thread, FIFO.

    ``launch(bucket, inline=False)`` queues the bucket; the thread reduces queued
    buckets in order. ``launch(bucket, inline=True)`` -- used for the bucket(s)
    completed by the last gradient of backward and for any launched from the
    end-of-backward callback -- keeps the bucket for ``wait_all``, which first
    waits the queued ones and then reduces the kept ones on the calling thread
    (the thread is idle then, so the group is never used by two threads at once).
    """

    def __init__(
        self, reducer: BucketReducer, rank: int, timeout_s: float, streams: Callable[[Bucket], StreamSync]
    ) -> None:
        self.reducer = reducer
        self.rank = rank
        self.timeout_s = timeout_s
        self._streams = streams
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._queued: list[tuple[Bucket, threading.Event, list[Any]]] = []  # launched, in order
        self._inline: list[Bucket] = []
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="dtrain-dp-comm", daemon=True)
        self._thread.start()

    def _op(self, b: Bucket) -> str:
        return f"allreduce({self.reducer.algorithm}) of gradient bucket {b.index}"

    def _reduce(self, b: Bucket, event: Any) -> tuple[float, float, int, Any]:
        sync = self._streams(b)
        with sync.on_comm_stream(event), _trace.span(f"bucket {b.index}", numel=b.flat.numel()):
            t0 = time.perf_counter()
            nbytes = self.reducer(b.flat, b.key, b.shapes)
            return t0, time.perf_counter(), nbytes, sync.finished()

    def _loop(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            b, done, out, event = item
            try:
                if self._error is None:
                    out.extend(self._reduce(b, event))
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                self._error = e
            finally:
                done.set()

    def launch(self, b: Bucket, inline: bool, step: int) -> None:
        if inline or self._inline:
            self._inline.append(b)
            return
        if self._thread is None:
            self._start()
        done = threading.Event()
        out: list[Any] = []  # [t0, t1, bytes, CUDA event] once reduced
        self._queued.append((b, done, out))
        self._q.put((b, done, out, self._streams(b).produced()))

    def wait_all(self, step: int, stats: StepStats) -> None:
        queued, self._queued = self._queued, []
        inline, self._inline = self._inline, []
        deadline = time.monotonic() + self.timeout_s + GRACE_S
        for b, done, out in queued:
            if not done.wait(max(0.0, deadline - time.monotonic())):
                raise CommTimeoutError(self.rank, self._op(b), f"not completed within {self.timeout_s:.0f}s", step=step)
            if self._error is not None:
                raise with_step(self._error, step)
            t0, t1, nbytes, finished = out
            self._streams(b).consume(finished)
            stats.add_comm(t0, t1, nbytes)
        for b in inline:
            try:
                t0, t1, nbytes, finished = self._reduce(b, self._streams(b).produced())
            except BaseException as e:
                raise with_step(e, step) from None
            self._streams(b).consume(finished)
            stats.add_comm(t0, t1, nbytes)

    def abort(self, error: BaseException) -> None:
        """Forget the step: buckets kept for the calling thread are dropped, queued ones finish unseen."""
        self._queued, self._inline = [], []

    def close(self) -> None:
        if self._thread is not None:
            self._q.put(None)
            self._thread.join(timeout=5)
            self._thread = None
