"""Measurement: the benchmarks run as ``dtrain bench NAME`` and the calibration of a machine or cluster.

* :mod:`.allreduce`, :mod:`.p2p`, :mod:`.train` -- ``dtrain bench allreduce / p2p / train``: each has
  ``main(argv) -> int``; they launch local workers, discard warm-up runs, report medians, print the
  torch version and world size, and show the peer (the backend's own collective, DDP, ...) in the
  same table as a ratio;
* :mod:`.calibrate` -- ``dtrain bench calibrate`` and this machine's cached calibration (what each
  process measures is the private ``_probes``); :mod:`.load` -- the load a calibration is made under;
* :mod:`.harness` -- rotated rounds, medians and one JSON schema for the benchmarks in ``benchmarks/``;
* :mod:`.memory` -- a process's peak memory above a baseline.
"""

from __future__ import annotations

__all__: list[str] = []
