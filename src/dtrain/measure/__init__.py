"""Benchmarks: the commands ``dtrain bench allreduce / p2p / train`` and the benchmarks' instruments.

* :mod:`.allreduce`, :mod:`.p2p`, :mod:`.train` -- each has ``main(argv) -> int``; they launch local
  workers, discard warm-up runs, report medians, print the torch version and world size, and show
  the peer (the backend's own collective, DDP, ...) in the same table as a ratio;
* :mod:`.harness` -- rotated rounds, medians and one JSON schema for the benchmarks in ``benchmarks/``;
* :mod:`.memory` -- a process's peak memory above a baseline.

The calibration of a machine or cluster (``dtrain bench calibrate``), which the planner reads, is
:mod:`dtrain.planning.calibrate`.
"""

from __future__ import annotations

__all__: list[str] = []
