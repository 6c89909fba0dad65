"""Per-step figures of the data-parallel engines, ``step_stats()`` of :class:`dtrain.DataParallel` and
:class:`dtrain.ShardedDataParallel` (the metrics rows' columns)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from dtrain.comm.waits import add_blocked

__all__ = ["StepStats", "busy_time"]


def busy_time(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals: time something was in flight."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


@dataclass
class StepStats:
    """What one training step cost on this rank.

    Attributes:
        step: index of the synchronised step (0-based).
        compute_s: forward + backward wall time, less the time spent waiting.
        comm_s: time at least one bucket's allreduce was in flight (union of the
            per-bucket intervals, so overlapping buckets are not counted twice).
        wait_s: time forward or the end of backward blocked on communication.
        bytes_sent: bytes this rank sent for the step's buckets.
        buckets: buckets reduced.
    """

    step: int = -1
    compute_s: float = 0.0
    comm_s: float = 0.0
    wait_s: float = 0.0
    bytes_sent: int = 0
    buckets: int = 0
    _intervals: list[tuple[float, float]] = field(default_factory=list, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add_wait(self, seconds: float) -> None:
        """Count ``seconds`` this step blocked on communication (also on the process's blocked clock)."""
        self.wait_s += seconds
        add_blocked(seconds)

    def add_comm(self, start: float, end: float, nbytes: int) -> None:
        with self._lock:
            self._intervals.append((start, end))
            self.bytes_sent += int(nbytes)
            self.buckets += 1

    def close(self) -> StepStats:
        with self._lock:
            self.comm_s = busy_time(self._intervals)
        return self

    def as_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "compute_s": self.compute_s,
            "comm_s": self.comm_s,
            "wait_s": self.wait_s,
            "bytes_sent": self.bytes_sent,
            "buckets": self.buckets,
        }
