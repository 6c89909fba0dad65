"""How a global batch splits over the data-parallel shards (the rule of DDP and Horovod).

Every shard takes ``batch // shards`` samples a step, so the effective global batch is
that times ``shards``: ``--batch-size 64`` over 3 workers trains on 63 samples a step
(21 per worker). The run, its data loaders, its summary and the planner all use this one
rule; a batch smaller than the shards leaves a shard nothing and is refused by the config.
"""

from __future__ import annotations

__all__ = ["batch_note", "split_batch"]


def split_batch(batch: int, shards: int) -> tuple[int, int]:
    """The per-shard batch and the effective global batch.

    Args:
        batch: the requested global batch (``--batch-size``).
        shards: slices the batch is split into (data-parallel workers).

    Returns:
        ``(batch // shards, batch // shards * shards)``.
    """
    per = batch // shards
    return per, per * shards


def batch_note(batch: int, shards: int) -> str:
    """The line a run prints when the effective global batch differs from ``batch`` ("" when equal)."""
    per, effective = split_batch(batch, shards)
    if effective == batch:
        return ""
    return (
        f"global batch {effective} ({per} per worker x {shards}; "
        f"--batch-size {batch} does not divide over {shards} workers)"
    )
