"""Option names of :class:`~dtrain.sharded.ShardedDataParallel`, shared with :class:`dtrain.DataParallel`
(``DataParallel(shard=...)`` builds a sharded engine; :mod:`dtrain.data_parallel.options` re-exports them)."""

from __future__ import annotations

from dtrain.comm.shard import SHARD_ALGORITHMS

__all__ = ["OVERLAPS", "SHARDS", "SHARD_ALGORITHMS"]

#: ``backward``: every gradient is averaged when ``loss.backward()`` returns (DDP).
#: ``forward``: priority scheduling; the optimizer steps per bucket and the next
#: forward waits layer by layer (ByteScheduler / P3).
OVERLAPS = ("backward", "forward")

#: ZeRO levels (Rajbhandari et al. 2020): ``none`` (plain data parallelism),
#: ``optimizer`` (stage 1: optimizer state sharded), ``gradients`` (stage 2: and the
#: gradients), ``parameters`` (stage 3: and the parameters, gathered per unit when used).
SHARDS = ("none", "optimizer", "gradients", "parameters")
