"""Emulated stragglers: one worker's own work takes ``FACTOR`` times longer than it normally does.

Two ways to ask for it, one emulation (:class:`Straggler`) in the training loop of
every strategy (``dtrain run``'s data parallel loop and the parameter-server
runner):

* ``dtrain run --straggler RANK:FACTOR`` slows one rank;
* ``dtrain cluster up --slow 2:3`` makes emulated host 2 three times slower: the
  launcher gives its workers ``DTRAIN_SLOWDOWN=3`` (:func:`slowdown_factor`).

Both apply (the factors multiply). What ``FACTOR`` means: this worker's own work
in a step takes ``FACTOR`` times as long as it normally takes in this run, as on
a machine ``FACTOR`` times slower attached to the same network. Its own work is
everything from the end of the previous step's exchange to the end of backward:
bookkeeping, loading the batch, forward, backward (the parameter server's
``compute_s``), less the time it spent blocked on communication in between
(data parallelism's wait for the buckets its backward overlapped, a pipeline
stage's receives, tensor parallelism's collectives: what the engines count with
:func:`dtrain.comm.waits.add_blocked`). Communication is not slowed. Counting the
waits would feed the others' slowness back into this worker's reference: with
several slowed workers, each waits for the others' sleep, counts the wait as its
own work and sleeps ``FACTOR`` times longer the next steps, and the steps grow
without bound.
The worker sleeps after its backward pass rather than burning CPU or cutting a
CPU quota, so it slows down by the factor without stealing cycles from the other
processes, which share this machine's cores.

"Normally" is a reference measured in the run itself (the median own work of the
worker's last 50 steps), not each step's own work: on a machine with fewer
cores than processes a step's compute depends on who else computes at that
moment, so sleeping ``(FACTOR - 1) x`` each step's own work would make the
slowdown vary with the other processes' schedule instead of being the factor.

How much a straggler slows a synchronous job then depends on how much of a step
is the workers' own work: with a share ``f`` of a plain step, a ``FACTOR``
straggler makes every BSP step ``1 + (FACTOR - 1) f`` plain steps long.
"""

from __future__ import annotations

import os
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from dtrain.config.schema import parse_straggler
from dtrain.errors import ConfigError

__all__ = ["slowdown_factor", "Straggler", "straggler_factor", "straggler"]


def slowdown_factor() -> float:
    """This worker's compute slowdown (1.0 = none), from ``DTRAIN_SLOWDOWN``."""
    raw = os.environ.get("DTRAIN_SLOWDOWN", "1")
    try:
        f = float(raw)
    except ValueError:
        raise ConfigError(f"DTRAIN_SLOWDOWN must be a number >= 1, got {raw!r}") from None
    if not f >= 1.0:
        raise ConfigError(f"DTRAIN_SLOWDOWN must be >= 1, got {raw!r}")
    return f


@dataclass
class Straggler:
    """Stretch each step's own work to ``factor`` times this worker's usual own work.

    Steps, called once per training step after backward with the seconds of own
    work (see the module's docstring) just measured (:meth:`stretch`):

    1. record the step's own work ``c`` in a window of the last ``window`` steps;
    2. the reference ``r`` is the median of the window -- the median, so a first
       step that pays for lazy initialisation or a moment of contention does not
       set it, and a window, so it follows a shared machine's load over a long run;
    3. sleep ``factor x r - c`` (never less than 0): own work plus sleep take
       ``factor`` times the reference whatever this step's own work was. The first
       step sleeps ``(factor - 1) c``: it is its own reference.

    Cost: a median of at most ``window`` numbers and one ``sleep`` per step;
    nothing when ``factor`` is 1.

    Args:
        factor: the slowdown (>= 1; 1 is no slowdown).
        window: steps the reference is the median of (default: 50).
        sleep: the sleeping function (tests pass a fake clock's).
    """

    factor: float = 1.0
    window: int = 50
    sleep: Callable[[float], None] = field(default=time.sleep, repr=False)
    _seen: deque[float] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.factor >= 1.0:
            raise ConfigError(
                f"a straggler's factor must be >= 1 (a slowdown), got {self.factor}; use e.g. 4 for 4x slower"
            )
        if self.window < 1:
            raise ConfigError(f"the straggler's window must be >= 1 step, got {self.window}")
        self._seen = deque(maxlen=self.window)

    @property
    def active(self) -> bool:
        """Whether this worker is slowed at all."""
        return self.factor > 1.0

    @property
    def reference_s(self) -> float | None:
        """The current reference own work in seconds (None before the first step)."""
        return statistics.median(self._seen) if self._seen else None

    def stretch(self, own_s: float) -> float:
        """Sleep so that this step's own work (``own_s`` seconds) lasts ``factor x`` the reference.

        Returns:
            The seconds slept (0.0 when not slowed).
        """
        if not self.active:
            return 0.0
        own_s = max(0.0, own_s)
        self._seen.append(own_s)
        extra = max(0.0, self.factor * statistics.median(self._seen) - own_s)
        if extra > 0:
            self.sleep(extra)
        return extra


def straggler_factor(spec: str, rank: int) -> float:
    """The slowdown factor ``spec`` (``--straggler RANK:FACTOR``, or empty) gives ``rank``."""
    if not spec:
        return 1.0
    r, f = parse_straggler(spec)
    return f if r == rank else 1.0


def straggler(spec: str, rank: int) -> Straggler:
    """``rank``'s compute slowdown: :func:`straggler_factor` times the emulated host's ``DTRAIN_SLOWDOWN``;
    call its ``stretch(compute_s)`` after backward."""
    return Straggler(straggler_factor(spec, rank) * slowdown_factor())
