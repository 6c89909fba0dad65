"""A communication stream: one thread, its own process group, jobs run in submission order.

The sharded engine has two: reduce-scatters of gradients (fed during backward) and
allgathers of parameters (fed before forwards and, for stage 3, backwards). Each
owns its process group, since two threads issuing collectives on one gloo group
crash; within a stream every rank submits the same jobs in the same
order, which is what keeps the ranks' collectives matched.
"""

from __future__ import annotations

import contextlib
import datetime
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from dtrain.comm.waits import GRACE_S, with_step
from dtrain.errors import CommTimeoutError

__all__ = ["Job", "Stream", "private_group"]


def private_group(ranks: list[int], timeout_s: float) -> Any:
    """A new process group over ``ranks`` (None for a world of one); every member creates it at the same point."""
    if len(ranks) <= 1:
        return None
    whole = len(ranks) == dist.get_world_size()
    return dist.new_group(
        ranks=ranks, timeout=datetime.timedelta(seconds=timeout_s), use_local_synchronization=not whole
    )


class Job:
    """A submitted job: ``wait()`` blocks until it ran and re-raises its error, naming rank, op and step."""

    __slots__ = ("op", "step", "done", "error", "t0", "t1", "nbytes", "_stream")

    def __init__(self, stream: Stream, op: str, step: int) -> None:
        self._stream = stream
        self.op, self.step = op, step
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.t0 = self.t1 = 0.0
        self.nbytes = 0

    def wait(self) -> None:
        s = self._stream
        if not self.done.wait(s.timeout_s + GRACE_S):
            raise CommTimeoutError(s.rank, self.op, f"not completed within {s.timeout_s:.0f}s", step=self.step)
        if self.error is not None:
            raise with_step(self.error, self.step)


class Stream:
    """Run ``fn(transport_group)`` jobs on one thread over a private group of ``ranks``.

    Args:
        ranks: global ranks of the data-parallel group (the group's members).
        timeout_s: limit of every wait.
        rank: this process's global rank (for error messages).
        name: thread name.
    """

    def __init__(self, ranks: list[int], timeout_s: float, rank: int, name: str) -> None:
        self.timeout_s, self.rank = timeout_s, rank
        self.world = len(ranks)
        self.group: Any = private_group(ranks, timeout_s)
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._broken: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._name = name

    def submit(self, op: str, step: int, fn: Callable[[], int]) -> Job:
        """Queue ``fn`` (returns the bytes it sent); jobs after a failed one fail with the same error."""
        job = Job(self, op, step)
        if self.world <= 1:
            self._run(job, fn)
            return job
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
            self._thread.start()
        self._q.put((job, fn))
        return job

    def _run(self, job: Job, fn: Callable[[], int]) -> None:
        try:
            if self._broken is not None:
                raise self._broken
            job.t0 = time.perf_counter()
            job.nbytes = fn()
            job.t1 = time.perf_counter()
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            self._broken = self._broken or e
            job.error = e
        finally:
            job.done.set()

    def _loop(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            self._run(*item)
            item = None  # the job's closure (a unit's gradient buffer) goes now, not when the next job comes

    def close(self) -> None:
        if self._thread is not None:
            self._q.put(None)
            self._thread.join(timeout=5)
            self._thread = None
        if self.group is not None:
            with contextlib.suppress(Exception):  # best effort at teardown: a peer may be gone
                dist.destroy_process_group(self.group)
            self.group = None
