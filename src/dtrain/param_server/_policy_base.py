"""The vocabulary of the consistency models (:mod:`dtrain.param_server.consistency`): the events' actions
(:class:`Apply`, :class:`Drop`, :class:`Release`) and :class:`Policy`, the base that keeps the clock table
and checks every event against the protocol. The policies themselves are :mod:`._policies`.
"""

from __future__ import annotations

import abc
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar

from dtrain.errors import ConfigError

__all__ = ["Arrival", "Apply", "Drop", "Release", "Action", "PolicyViolation", "Policy"]


# ---------------------------------------------------------------------- actions


@dataclass(frozen=True)
class Arrival:
    """One gradient as the server sees it.

    Attributes:
        worker: the worker's id (its rank).
        clock: the worker's clock after this push (1 for its first gradient).
        read: the parameter version the gradient was computed on.
    """

    worker: int
    clock: int
    read: int

    def __str__(self) -> str:
        return f"w{self.worker}c{self.clock}"


@dataclass(frozen=True)
class Apply:
    """Average ``arrivals`` and take one optimizer step, turning ``version`` into ``version + 1``.

    Attributes:
        arrivals: the gradients to average (in arrival order).
        version: the parameter version the update is applied to.
        lr_scale: multiply the learning rate by this for this update (staleness-aware LR).
    """

    arrivals: tuple[Arrival, ...]
    version: int
    lr_scale: float = 1.0

    @property
    def staleness(self) -> tuple[int, ...]:
        """Updates applied between each gradient's read and this update."""
        return tuple(self.version - a.read for a in self.arrivals)

    def __str__(self) -> str:
        s = f"apply[{','.join(map(str, self.arrivals))}]@{self.version}"
        return s if self.lr_scale == 1.0 else f"{s}x{self.lr_scale:.3g}"


@dataclass(frozen=True)
class Drop:
    """Discard ``arrival``: its step closed at an earlier version (backup workers)."""

    arrival: Arrival
    version: int

    def __str__(self) -> str:
        return f"drop {self.arrival}@{self.version}"


@dataclass(frozen=True)
class Release:
    """Send ``worker`` the parameters of ``version``; it may compute its next gradient.

    Attributes:
        worker: who is released.
        version: the parameter version it will read.
        clock_lag: its clock minus the slowest active worker's clock at this moment.
    """

    worker: int
    version: int
    clock_lag: int = 0

    def __str__(self) -> str:
        return f"release w{self.worker}@{self.version}" + (f" lag{self.clock_lag}" if self.clock_lag else "")


Action = Apply | Drop | Release


class PolicyViolation(ValueError):
    """An event that the protocol does not allow (the server rejects the message)."""


# ---------------------------------------------------------------------- base


class Policy(abc.ABC):
    """State machine of one server's consistency model.

    Subclasses implement :meth:`_on_push` and may extend :meth:`_on_leave`. The
    base class keeps the clock table and checks every event against the
    protocol, raising :class:`PolicyViolation` (never changing state) for a push
    from a worker that is not active, that has not been released since its last
    push, or that claims a clock or a read version the server did not give it.

    Attributes:
        name: the registry name ("bsp", ...).
        tolerates_loss: whether training may go on without a lost worker.
        active: workers that have neither finished nor been lost.
        clock: pushes received per worker (the clock table).
        version: updates applied so far.
        waiting: workers that pushed (or asked to pull) and were not released yet.
        last_read: the version each worker was last released with.
    """

    name: ClassVar[str] = "abstract"
    tolerates_loss: ClassVar[bool] = True

    def __init__(self) -> None:
        self.active: set[int] = set()
        self.clock: dict[int, int] = {}
        self.version = 0
        self.waiting: set[int] = set()
        self.last_read: dict[int, int] = {}
        self.buffer: list[Arrival] = []
        self.workers: tuple[int, ...] = ()
        # how many active workers are at each clock, and the lowest clock any has: min_clock in O(1) amortized
        # (clocks only rise, one at a time, and leaving only removes), instead of a scan of every worker on every
        # release, which made a simulated run of 4,000 workers quadratic
        self._at: Counter[int] = Counter()
        self._low = 0

    # ------------------------------------------------------------------ set-up

    def start(self, workers: Iterable[int]) -> Policy:
        """Reset the state for a new run with these worker ids; returns ``self``."""
        ws = tuple(sorted(set(workers)))
        if not ws:
            raise ConfigError("a parameter server needs at least one worker")
        self.workers = ws
        self.active = set(ws)
        self.clock = {w: 0 for w in ws}
        self.version = 0
        self.waiting = set()
        self.last_read = {}
        self.buffer = []
        self._at, self._low = Counter({0: len(ws)}), 0
        self._check_workers(len(ws))
        return self

    def restore_clock(self, clock: dict[int, int], version: int) -> None:
        """The clock table and version of a checkpoint, for this run's workers (a resumed server)."""
        if set(clock) != set(self.clock):
            raise ValueError(f"the saved clock table has workers {sorted(clock)}, this run {sorted(self.clock)}")
        self.clock = {int(w): int(c) for w, c in clock.items()}
        self.version = int(version)
        self._at = Counter(self.clock[w] for w in self.active)
        self._low = min(self._at, default=0)

    def _check_workers(self, n: int) -> None:
        """Raise :class:`ConfigError` when the policy cannot run with ``n`` workers."""

    # ------------------------------------------------------------------ events

    def pull(self, worker: int) -> list[Action]:
        """A worker's first read. It is released at once with the current version."""
        self._check_active(worker, "pull")
        if worker in self.last_read or worker in self.waiting:
            raise PolicyViolation(f"worker {worker} asked for its first pull twice")
        self.waiting.add(worker)
        return [self._release(worker)]

    def push(self, worker: int, clock: int, read: int) -> list[Action]:
        """A gradient from ``worker`` with the worker's new ``clock``, computed on version ``read``."""
        self._check_active(worker, "push")
        if worker in self.waiting:
            raise PolicyViolation(f"worker {worker} pushed again before it was released")
        if worker not in self.last_read:
            raise PolicyViolation(f"worker {worker} pushed before its first pull")
        if clock != self.clock[worker] + 1:
            raise PolicyViolation(f"worker {worker} sent clock {clock}, expected {self.clock[worker] + 1}")
        if read != self.last_read[worker]:
            raise PolicyViolation(
                f"worker {worker} claims to have read version {read}, but was sent version {self.last_read[worker]}"
            )
        self._at[clock - 1] -= 1
        self._at[clock] += 1
        self.clock[worker] = clock
        self.waiting.add(worker)
        return self._on_push(Arrival(worker, clock, read))

    def leave(self, worker: int, *, lost: bool = False) -> list[Action]:
        """``worker`` finished (``lost=False``) or was lost; the others may now go on."""
        if worker not in self.active:
            raise PolicyViolation(f"worker {worker} left twice or was never part of the run")
        if not lost and worker in self.waiting:
            raise PolicyViolation(f"worker {worker} finished while waiting for a reply")
        self.active.discard(worker)
        self._at[self.clock[worker]] -= 1
        self.waiting.discard(worker)
        return self._on_leave(worker, lost)

    # ------------------------------------------------------------------ queries

    def min_clock(self) -> int | None:
        """The slowest active worker's clock (``None`` when no worker is active)."""
        if not self.active:
            return None
        while self._at[self._low] <= 0:  # the lowest clock only rises
            self._low += 1
        return self._low

    def may_proceed(self, worker: int) -> bool:
        """Whether a waiting ``worker`` would be released by the current state."""
        return worker not in self.waiting

    # ------------------------------------------------------------------ helpers

    @abc.abstractmethod
    def _on_push(self, a: Arrival) -> list[Action]: ...

    def _on_leave(self, worker: int, lost: bool) -> list[Action]:
        return []

    def _check_active(self, worker: int, what: str) -> None:
        if worker not in self.clock:
            raise PolicyViolation(f"{what} from unknown worker {worker} (workers: {list(self.workers)})")
        if worker not in self.active:
            raise PolicyViolation(f"{what} from worker {worker}, which has already left")

    def _release(self, worker: int) -> Release:
        m = self.min_clock()
        self.waiting.discard(worker)
        self.last_read[worker] = self.version
        return Release(worker, self.version, self.clock[worker] - m if m is not None else 0)

    def _apply(self, arrivals: Sequence[Arrival]) -> Apply:
        act = Apply(tuple(arrivals), self.version)
        self.version += 1
        return act

    def spec(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec()!r})"
