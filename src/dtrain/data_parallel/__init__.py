"""Synchronous data parallelism: :class:`DataParallel` (DDP's API, dtrain's allreduce algorithms).

Gradients are fused into buckets, each bucket's allreduce starts as soon as
backward has filled it, and ``overlap="forward"`` adds priority scheduling with a
per-bucket optimizer step (ByteScheduler / P3). See :mod:`dtrain.data_parallel.engine`.
"""

from __future__ import annotations

from dtrain.data_parallel.engine import DataParallel, UnusedParametersError
from dtrain.data_parallel.tunables import ALGORITHMS, OVERLAPS, DataParallelConfig

__all__ = ["DataParallel", "DataParallelConfig", "UnusedParametersError", "ALGORITHMS", "OVERLAPS"]
