"""Straggler emulation in a run's processes: ``--straggler RANK:FACTOR`` and an emulated slow host
(``DTRAIN_SLOWDOWN``), as a :class:`dtrain.cluster.slowdown.Straggler` that stretches a step's compute."""

from __future__ import annotations

from dtrain.cluster.slowdown import Straggler, slowdown_factor
from dtrain.job.config import parse_straggler

__all__ = ["straggler_factor", "straggler"]


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
