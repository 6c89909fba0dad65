"""Sharded data parallelism (ZeRO stages 1-3) on dtrain's reduce-scatter and allgather."""

from __future__ import annotations

from dtrain.sharded.engine import ShardedDataParallel

__all__ = ["ShardedDataParallel"]
