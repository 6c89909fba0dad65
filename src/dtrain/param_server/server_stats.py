"""What a parameter server measured: :class:`ServerStats` (updates, gradients per worker, staleness and
clock lag, bytes, busy and wall time, lost workers) and :func:`hist_summary` of its histograms."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ServerStats", "hist_summary"]


@dataclass
class ServerStats:
    """What one server measured.

    Attributes:
        rank: the server's rank.
        updates: optimizer steps taken.
        received: gradients received (applied or dropped).
        applied / dropped: gradients per worker rank that went into an update / were dropped.
        staleness: histogram of applied gradients' staleness (updates between read and apply).
        clock_lag: histogram of applied gradients' clock lag (clocks ahead of the slowest worker).
        bytes_in / bytes_out: header and payload bytes received / sent.
        busy_s: time spent handling messages (decode, apply, encode, send).
        wall_s: time from the start of :meth:`ShardServer.serve` to its end.
        lost: worker rank -> why it was dropped.
    """

    rank: int = 0
    updates: int = 0
    received: int = 0
    applied: Counter[int] = field(default_factory=Counter)
    dropped: Counter[int] = field(default_factory=Counter)
    staleness: Counter[int] = field(default_factory=Counter)
    clock_lag: Counter[int] = field(default_factory=Counter)
    bytes_in: int = 0
    bytes_out: int = 0
    busy_s: float = 0.0
    wall_s: float = 0.0
    lost: dict[int, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "updates": self.updates,
            "received": self.received,
            "applied": {str(k): v for k, v in sorted(self.applied.items())},
            "dropped": {str(k): v for k, v in sorted(self.dropped.items())},
            "staleness": hist_summary(self.staleness),
            "clock_lag": hist_summary(self.clock_lag),
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "busy_s": round(self.busy_s, 6),
            "wall_s": round(self.wall_s, 6),
            "lost": {str(k): v for k, v in sorted(self.lost.items())},
        }


def hist_summary(h: Counter[int]) -> dict[str, Any]:
    """``{max, mean, hist}`` of an integer histogram (``hist`` keys are strings for JSON)."""
    n = sum(h.values())
    return {
        "max": max(h) if h else 0,
        "mean": (sum(k * v for k, v in h.items()) / n) if n else 0.0,
        "hist": {str(k): h[k] for k in sorted(h)},
    }
