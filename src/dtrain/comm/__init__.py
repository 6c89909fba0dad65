"""Collectives written against a small point-to-point :class:`Transport`.

``dtrain.comm.allreduce(tensor, op, algorithm, group)`` reduces a tensor in place
with one of :data:`ALGORITHMS` (native, ring, tree, recursive_doubling,
rabenseifner, hierarchical); :mod:`dtrain.comm.cost` gives each algorithm's
messages, bytes and alpha-beta-gamma time. The transports let the same algorithm
run over threads in a unit test and over torch.distributed in production.
"""

from __future__ import annotations

from dtrain.comm.allreduce import (
    ALGORITHMS,
    OPS,
    AllreduceOptions,
    allreduce,
    allreduce_over,
    get_transport,
)
from dtrain.comm.transport import CommStats, ThreadTransport, TorchTransport, Transport, run_threads

__all__ = [
    "ALGORITHMS",
    "OPS",
    "AllreduceOptions",
    "allreduce",
    "allreduce_over",
    "get_transport",
    "Transport",
    "TorchTransport",
    "ThreadTransport",
    "CommStats",
    "run_threads",
]
