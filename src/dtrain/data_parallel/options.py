"""The names of :mod:`dtrain.data_parallel.tunables` under this module's path, which older scripts import."""

from dtrain.data_parallel.tunables import ALGORITHMS, OVERLAPS, SHARD_ALGORITHMS, SHARDS, DataParallelConfig

__all__ = ["ALGORITHMS", "OVERLAPS", "SHARDS", "SHARD_ALGORITHMS", "DataParallelConfig"]
