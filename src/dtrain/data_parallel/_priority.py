"""``overlap="forward"``: priority scheduling of buckets, optimizer step per bucket.

The idea (Peng et al., "A Generic Communication Scheduler for Distributed DNN
Training Acceleration" (ByteScheduler), SOSP 2019; Jayarajan et al., "Priority-based
Parameter Propagation for Distributed DNN Training" (P3), MLSys 2019): backward
produces the gradients of the *last* layers first, but the next forward needs the
*first* layers first. So communicate in priority order -- the bucket nearest the
input first -- apply the optimizer to each bucket as soon as it is averaged, and
let the next forward start as soon as its first layer's parameters are updated
(the engine's forward pre-hooks wait layer by layer).

Ranks must run their collectives in the same order, but which buckets are ready
when differs from rank to rank. So, like Horovod's coordinator, the
communication thread *agrees* before each bucket:

1. Wait until this rank has a ready bucket it has not offered yet (or all of its
   remaining buckets are ready, or the previous agreement left work).
2. Offer the set of ready, unreduced buckets: a bitmap, ``all_reduce(MIN)``. The
   result -- buckets ready on every rank -- is the same on every rank.
3. Reduce the agreed bucket of highest priority (nearest the input), run the
   per-bucket optimizer step, zero its gradients, mark it done; go to 1.

Cost: one extra small allreduce (latency ``alpha``) per bucket; a step needs at
least as many agreements as buckets. Forward waits only for the buckets of the
layer it is about to run.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from dtrain.comm.step_stats import StepStats
from dtrain.comm.waits import GRACE_S, wait_work, with_step
from dtrain.compress.reduce import BucketReducer
from dtrain.data_parallel._buckets import Bucket
from dtrain.data_parallel._comm import StreamSync
from dtrain.errors import CommTimeoutError, DTrainError

__all__ = ["PriorityScheduler"]


class PriorityScheduler:
    """The communication thread of ``overlap="forward"``.

    Args:
        reducer: averages one bucket in place.
        apply: the per-bucket optimizer step (runs on the thread, after the reduce).
        agree_group: a gloo group used only by this thread for the agreements
            (None in a world of one).
        rank: this process's global rank (for errors).
        timeout_s: limit of every wait.
        streams: the :class:`StreamSync` of a bucket's device.
        finished: called with a step's stats when its last bucket is done.
    """

    def __init__(
        self,
        reducer: BucketReducer,
        apply: Callable[[Bucket], None],
        agree_group: Any,
        rank: int,
        timeout_s: float,
        streams: Callable[[Bucket], StreamSync],
        finished: Callable[[StepStats], None],
    ) -> None:
        self.reducer = reducer
        self.apply = apply
        self.group = agree_group
        self.rank = rank
        self.timeout_s = timeout_s
        self._streams = streams
        self._finished = finished
        self._cond = threading.Condition()
        self._buckets: list[Bucket] = []
        self._ready: list[bool] = []
        self._events: list[Any] = []  # CUDA "gradients written" events
        self._done: list[threading.Event] = []
        self._done_cuda: list[Any] = []
        self._stats: StepStats | None = None
        self._step = 0
        self._error: BaseException | None = None
        self._stop = False
        self._thread: threading.Thread | None = None

    # ----------------------------------------------------------------- engine side

    def set_buckets(self, buckets: list[Bucket]) -> None:
        """Install a (new) layout; only while nothing is in flight."""
        with self._cond:
            self._buckets = buckets
            self._ready = [False] * len(buckets)
            self._events = [None] * len(buckets)
            self._done = [threading.Event() for _ in buckets]
            for ev in self._done:
                ev.set()
            self._done_cuda = [None] * len(buckets)

    def begin_step(self, step: int, stats: StepStats) -> None:
        """Stats of the step whose buckets are about to be marked ready."""
        self._step, self._stats = step, stats

    def mark_ready(self, b: Bucket) -> None:
        """Bucket ``b`` holds this rank's gradients; reduce and step it when its turn comes."""
        self.raise_if_failed()
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="dtrain-dp-priority", daemon=True)
            self._thread.start()
        i = b.index
        self._done[i].clear()
        event = self._streams(b).produced()
        with self._cond:
            self._events[i] = event
            self._ready[i] = True
            self._cond.notify()

    def wait(self, index: int, what: str) -> float:
        """Block until bucket ``index`` is reduced and stepped; return the seconds waited."""
        done = self._done[index]
        waited = 0.0
        if not done.is_set():
            t0 = time.perf_counter()
            if not done.wait(self.timeout_s + GRACE_S):
                b = self._buckets[index]
                raise CommTimeoutError(
                    self.rank,
                    f"{what} waiting for gradient bucket {index} ({self.reducer.algorithm}, members {b.members})",
                    f"not reduced within {self.timeout_s:.0f}s",
                    step=self._step,
                )
            waited = time.perf_counter() - t0
        self.raise_if_failed()
        b = self._buckets[index]
        self._streams(b).consume(self._done_cuda[index])
        return waited

    def wait_all(self, what: str) -> float:
        return sum(self.wait(i, what) for i in range(len(self._buckets)))

    def busy(self) -> bool:
        return not all(ev.is_set() for ev in self._done)

    def raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def abort(self, error: BaseException) -> None:
        """The step cannot complete (its backward failed): stop, and raise ``error`` from every later wait.

        Some of the step's buckets may already have been stepped, so the
        parameters are no longer consistent; the engine is unusable afterwards.
        """
        if self._error is None:
            self._error = error
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        for ev in self._done:
            ev.set()

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    # ----------------------------------------------------------------- thread side

    def _offer(self, unreduced: set[int]) -> frozenset[int]:
        return frozenset(i for i in unreduced if self._ready[i])

    def _news(self, unreduced: set[int], last: frozenset[int] | None) -> bool:
        """Stopped, or a ready set other than the last agreed one (and not empty), or every bucket ready."""
        if self._stop:
            return True
        offer = self._offer(unreduced)
        return offer not in (last, frozenset()) or offer == unreduced

    def _agree(self, offer: frozenset[int], n: int) -> list[int]:
        if self.group is None:
            agreed = offer
        else:
            bits = torch.zeros(n, dtype=torch.int32)
            if offer:
                bits[list(offer)] = 1
            work = dist.all_reduce(bits, op=dist.ReduceOp.MIN, group=self.group, async_op=True)
            wait_work(work, self.timeout_s, self.rank, "DataParallel(overlap='forward') bucket agreement", self._step)
            agreed = frozenset(int(i) for i in bits.nonzero().flatten().tolist())
        return sorted(agreed, key=lambda i: self._buckets[i].priority)

    def _run_step(self) -> None:
        buckets = self._buckets
        n = len(buckets)
        stats = self._stats if self._stats is not None else StepStats()
        unreduced = set(range(n))
        known: list[int] = []
        last: frozenset[int] | None = None
        while unreduced:
            with self._cond:
                if not known:
                    ok = self._cond.wait_for(functools.partial(self._news, unreduced, last), timeout=self.timeout_s)
                    if self._stop:
                        return
                    if not ok:
                        raise CommTimeoutError(
                            self.rank,
                            "DataParallel(overlap='forward') waiting for this rank's gradient buckets",
                            f"backward produced no new bucket within {self.timeout_s:.0f}s "
                            f"({len(unreduced)} of {n} buckets outstanding)",
                            step=self._step,
                        )
                last = self._offer(unreduced)
            known = self._agree(last, n)
            if not known:
                continue
            i = known.pop(0)
            unreduced.discard(i)
            b = buckets[i]
            sync = self._streams(b)
            with sync.on_comm_stream(self._events[i]):
                t0 = time.perf_counter()
                nbytes = self.reducer(b.flat, b.key, b.shapes)
                t1 = time.perf_counter()
                self.apply(b)
                self._done_cuda[i] = sync.finished()
            stats.add_comm(t0, t1, nbytes)
            with self._cond:
                self._ready[i] = False
            if not unreduced:  # publish before the last bucket's event: a wait_all() that returns sees the step
                self._finished(stats.close())
            self._done[i].set()
        if n == 0:
            self._finished(stats.close())

    def _loop(self) -> None:
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: self._stop or any(self._ready))
                    if self._stop:
                        return
                self._run_step()
        except BaseException as e:  # noqa: BLE001 - surfaced in the training thread
            err = with_step(e, self._step)
            if not isinstance(err, DTrainError):
                err = DTrainError(
                    f"rank {self.rank}: DataParallel communication thread failed at step {self._step}: {e!r}"
                )
                err.__cause__ = e
            self._error = err
            for ev in self._done:
                ev.set()
