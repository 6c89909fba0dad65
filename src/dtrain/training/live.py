"""The progress bar's slowest rank, while the run trains.

Every rank that runs the training loop keeps the mean of its own work per step
(:func:`dtrain.rundir.attribution.own_s`: a step's time less its exchange) over its last rows
and, every :data:`EVERY` steps, posts it in the job's key-value store (torch.distributed's
default store, the rendezvous's; one ``set`` per rank, no collective, so ranks that share
no group -- a parameter server's workers -- take part alike). The evaluating rank reads
the others' posts and shows the slowest as ``slowest=r3 2.1x``: that rank's own work
over the median of the others'. Ranks that never post (servers) are left out.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping
from typing import Any

from dtrain.rundir.attribution import own_s

__all__ = ["LiveRanks", "EVERY"]

EVERY = 10  # steps between posts
KEY = "dtrain/live/rank{}"


class LiveRanks:
    """One rank's side of the live comparison (a no-op in a one-process run).

    Args:
        rank: this process's global rank.
        world: processes in the job.
        store: the job's store (default: torch.distributed's default store when it is initialized).
    """

    def __init__(self, rank: int, world: int, store: Any = None) -> None:
        self.rank = rank
        self.world = world
        self._own: deque[float] = deque(maxlen=EVERY)
        self._seen: set[int] = set()  # ranks whose key exists (store.get would block on a missing one)
        if store is None and world > 1:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                from torch.distributed import distributed_c10d

                store = distributed_c10d._get_default_store()
        self.store = store

    def observe(self, row: Mapping[str, Any]) -> None:
        """One of this rank's metrics rows."""
        if row.get("rank", self.rank) == self.rank and row.get("step_s") is not None:
            self._own.append(own_s(row))

    def post(self) -> None:
        """Publish this rank's recent mean own work per step."""
        if self.store is not None and self._own:
            self.store.set(KEY.format(self.rank), repr(sum(self._own) / len(self._own)))

    def read(self) -> dict[int, float]:
        """The posted means of every rank that has posted: rank -> seconds of own work per step."""
        if self.store is None:
            return {}
        out: dict[int, float] = {}
        for r in range(self.world):
            key = KEY.format(r)
            if r not in self._seen and not self.store.check([key]):
                continue
            self._seen.add(r)
            out[r] = float(bytes(self.store.get(key)))
        return out

    def slowest(self) -> str | None:
        """``"r3 2.1x"``: the rank with the most own work per step and its ratio to the median of the
        others'; None with fewer than two posts."""
        means = self.read()
        if len(means) < 2:
            return None
        r = max(means, key=lambda k: means[k])
        others = statistics.median(v for k, v in means.items() if k != r)
        return f"r{r} {means[r] / others:.1f}x" if others > 0 else f"r{r}"
