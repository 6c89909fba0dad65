"""Per-host compute slowdown for straggler studies on an emulated cluster.

``dtrain cluster up --slow 2:3`` makes host 2 three times slower at computing:
its workers get ``DTRAIN_SLOWDOWN=3`` from the launcher, and the training loop
calls :func:`straggle` after each step's compute, which sleeps ``(factor - 1)``
times the compute just measured. Sleeping (rather than burning CPU or cutting a
CPU quota) slows that worker by exactly the factor without stealing cycles
from the other emulated hosts, which share this machine's cores.
"""

from __future__ import annotations

import os
import time

from dtrain.errors import ConfigError

__all__ = ["slowdown_factor", "straggle"]


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


def straggle(compute_s: float) -> float:
    """Stretch a compute phase that took ``compute_s`` to ``factor * compute_s``.

    Returns:
        The extra seconds slept (0.0 when this worker is not slowed).
    """
    extra = (slowdown_factor() - 1.0) * max(0.0, compute_s)
    if extra > 0:
        time.sleep(extra)
    return extra
