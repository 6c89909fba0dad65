"""The tunables of :class:`~dtrain.data_parallel.DataParallel` (:class:`DataParallelConfig`) and the values
they take, validated before anything starts."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from dtrain.comm.allreduce import ALGORITHMS as _ALLREDUCE
from dtrain.errors import ConfigError
from dtrain.sharded.arguments import OVERLAPS, SHARD_ALGORITHMS, SHARDS

__all__ = ["ALGORITHMS", "OVERLAPS", "SHARDS", "SHARD_ALGORITHMS", "DataParallelConfig"]

#: allreduce algorithms a bucket can be reduced with: the names of :mod:`dtrain.comm.allreduce`.
ALGORITHMS = tuple(_ALLREDUCE)


@dataclass(frozen=True)
class DataParallelConfig:
    """Tunables of the data-parallel engine.

    Attributes:
        algorithm: how each bucket is allreduced, one of :data:`ALGORITHMS`
            (default: "ring"). ``native`` is the backend's own allreduce issued
            asynchronously from the backward hooks, as DDP does; the others run on
            one communication thread (:mod:`dtrain.comm.allreduce`).
        bucket_mb: gradients are fused into buckets of about this many MiB
            (default: 25, DDP's ``bucket_cap_mb``). 0 gives one bucket per tensor.
        first_bucket_mb: cap of the first bucket, so that communication starts
            early in backward (default: 1, as DDP; never above ``bucket_mb``).
        overlap: "backward" or "forward", see :data:`OVERLAPS` (default: "backward").
        find_unused_parameters: parameters that get no gradient in a step are
            treated as zero gradients instead of raising (default: False).
        broadcast_buffers: copy rank 0's buffers (e.g. BatchNorm statistics) to
            every rank before each forward, as DDP does (default: True).
        timeout_s: seconds any wait may block before CommTimeoutError (default: 300).
    """

    algorithm: str = "ring"
    bucket_mb: float = 25.0
    first_bucket_mb: float = 1.0
    overlap: str = "backward"
    find_unused_parameters: bool = False
    broadcast_buffers: bool = True
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ConfigError(
                f"unknown algorithm {self.algorithm!r} for DataParallel; choose one of {', '.join(ALGORITHMS)}"
            )
        if self.overlap not in OVERLAPS:
            raise ConfigError(
                f"unknown overlap {self.overlap!r}; use 'backward' (grads averaged when backward returns, "
                "like DDP) or 'forward' (per-bucket optimizer step, the next forward waits layer by layer)"
            )
        for name in ("bucket_mb", "first_bucket_mb"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ConfigError(
                    f"{name} must be a number of MiB >= 0 (e.g. 25; 0 = one bucket per tensor), got {v!r}"
                )
        for name in ("find_unused_parameters", "broadcast_buffers"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")
        t = self.timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            raise ConfigError(f"timeout_s must be a positive number of seconds (e.g. 300), got {t!r}")

    @property
    def cap_bytes(self) -> int:
        return max(1, int(self.bucket_mb * 1024 * 1024))

    @property
    def first_cap_bytes(self) -> int:
        return max(1, int(min(self.first_bucket_mb, self.bucket_mb) * 1024 * 1024))

    def describe(self) -> str:
        """One line of every option that must agree across ranks (checked at wrap time)."""
        d = asdict(self)
        d.pop("timeout_s")
        return ", ".join(f"{k}={v!r}" for k, v in d.items())
