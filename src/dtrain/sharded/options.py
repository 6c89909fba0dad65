"""The names of :mod:`dtrain.sharded.arguments` under this module's path, which older scripts import
(``check_options`` is :func:`~dtrain.sharded.arguments.check_arguments`)."""

from dtrain.sharded.arguments import OVERLAPS, SHARD_ALGORITHMS, SHARDS, check_arguments

check_options = check_arguments

__all__ = ["OVERLAPS", "SHARDS", "SHARD_ALGORITHMS", "check_options", "check_arguments"]
