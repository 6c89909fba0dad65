"""The arguments of :class:`~dtrain.sharded.ShardedDataParallel`: the values ``shard``, ``overlap`` and
``algorithm`` take, shared with :class:`dtrain.DataParallel` (``DataParallel(shard=...)`` builds a sharded
engine; :mod:`dtrain.data_parallel.tunables` re-exports them), and :func:`check_arguments`."""

from __future__ import annotations

from typing import Any

from dtrain.comm.shard import SHARD_ALGORITHMS
from dtrain.errors import ConfigError

__all__ = ["OVERLAPS", "SHARDS", "SHARD_ALGORITHMS", "check_arguments"]

#: ``backward``: every gradient is averaged when ``loss.backward()`` returns (DDP).
#: ``forward``: priority scheduling; the optimizer steps per bucket and the next
#: forward waits layer by layer (ByteScheduler / P3).
OVERLAPS = ("backward", "forward")

#: ZeRO levels (Rajbhandari et al. 2020): ``none`` (plain data parallelism),
#: ``optimizer`` (stage 1: optimizer state sharded), ``gradients`` (stage 2: and the
#: gradients), ``parameters`` (stage 3: and the parameters, gathered per unit when used).
SHARDS = ("none", "optimizer", "gradients", "parameters")


def check_arguments(module: Any, *, shard: str, algorithm: str, overlap: str, timeout_s: Any) -> None:
    """:class:`~dtrain.sharded.ShardedDataParallel`'s arguments, checked before anything is built (ConfigError
    saying what to change)."""
    from torch import nn

    if not isinstance(module, nn.Module):
        raise ConfigError(f"ShardedDataParallel wraps a torch.nn.Module, got {type(module).__name__}")
    if shard not in SHARDS[1:]:
        raise ConfigError(
            f"shard {shard!r} is not a ZeRO level; choose one of {', '.join(SHARDS[1:])} (or use DataParallel for none)"
        )
    if algorithm not in SHARD_ALGORITHMS:
        raise ConfigError(f"algorithm {algorithm!r} has no sharded form; choose one of {', '.join(SHARD_ALGORITHMS)}")
    if overlap not in OVERLAPS:
        raise ConfigError(f"overlap {overlap!r}; choose one of {', '.join(OVERLAPS)}")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ConfigError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
