"""A shard's training batches and where a run stands in them: :class:`ShardLoaders`.

A shard's samples in an epoch are ``DistributedSampler``'s (:class:`ShardOrder` gives the same order
without making a Python list of every index, which for a memory-mapped token file of millions of
windows would cost more memory than the batches): the epoch's permutation of the whole training set
(seeded by ``--seed`` plus the epoch), its first ``total_size`` indices, shard ``r`` taking positions
``r, r + W, r + 2W, ...``. Batch ``k`` of every shard together is positions ``k B`` to ``(k + 1) B - 1``
of the permutation for a global batch ``B``, whatever the number of shards ``W`` that divides it: the
same samples a step at 1, 2 or 3 workers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader, DistributedSampler

if TYPE_CHECKING:
    from dtrain.config.schema import RunConfig
    from dtrain.optim.large_batch import BatchPlan
    from dtrain.workloads.data import DatasetSplit

__all__ = ["ShardLoaders", "ShardOrder"]


@dataclass(frozen=True)
class ShardLoaders:
    """The training batches of each data shard, epoch by epoch, and the run's steps.

    Attributes:
        cfg: the run configuration (``--seed`` shuffles, ``--max-steps`` ends the run).
        data: the dataset.
        plan: every epoch's global batch (:attr:`dtrain.training.batch_control.BatchControl.plan`).
    """

    cfg: RunConfig
    data: DatasetSplit
    plan: BatchPlan

    def loader(self, shard: int, num_shards: int, epoch: int, start_batch: int = 0) -> DataLoader[Any]:
        """This shard's training batches for ``epoch`` (a DistributedSampler slice).

        The per-shard batch is ``batch_size // num_shards``, so the global batch is
        ``batch_size`` rounded down to a multiple of the shards (``RunConfig.global_batch``:
        64 over 3 workers trains on 63 samples a step). ``start_batch`` skips the
        epoch's first batches without reading them (a resumed run starts mid-epoch
        on exactly the batches the uninterrupted run saw next). Under ``--auto-every`` each batch is
        as large as the plan's latest decision when the step draws it, and ``start_batch`` counts batches
        of the sizes the plan's changes gave them.
        """
        sampler = ShardOrder(
            self.data.train, num_replicas=num_shards, rank=shard, shuffle=True, seed=self.cfg.seed, drop_last=True
        )
        sampler.set_epoch(epoch)
        if self.plan.within_epochs:  # --auto-every: each batch as large as the plan's latest decision
            order = sampler.indices()[self.plan.offset(epoch, start_batch, num_shards) :]
            sizes = _GrowingBatches(order, lambda: self.plan.current // num_shards)
            return DataLoader(self.data.train, batch_sampler=sizes)
        bs = self.plan.batch(epoch) // num_shards
        if start_batch:
            rest = _Indices(sampler.indices()[start_batch * bs :])
            return DataLoader(self.data.train, batch_size=bs, sampler=rest, drop_last=True)
        return DataLoader(self.data.train, batch_size=bs, sampler=sampler, drop_last=True)

    def steps_per_epoch(self, num_shards: int, epoch: int = 0) -> int:
        """Steps of ``epoch`` (its global batch: :attr:`plan`)."""
        return self.plan.steps_in(epoch, num_shards)

    def total_steps(self, num_shards: int) -> int:
        """Steps of the run: every epoch's, at most ``--max-steps`` (``auto``: as planned so far)."""
        n = self.plan.total(num_shards)
        return min(n, self.cfg.max_steps) if self.cfg.max_steps else n

    def locate(self, step: int, num_shards: int) -> tuple[int, int]:
        """``(epoch, batch)`` after ``step`` steps: where a resumed run starts."""
        return self.plan.locate(step, num_shards)


class ShardOrder(DistributedSampler[Any]):
    """``DistributedSampler``'s order (shuffled, ``drop_last``), kept as one tensor of indices: the same
    integers in the same order, without its list of every index of the set (4 bytes an index of the
    training set, against a Python list's 36)."""

    def indices(self) -> torch.Tensor:
        """This shard's indices of the epoch (:meth:`set_epoch`), in order."""
        if not (self.shuffle and self.drop_last):
            raise ValueError("ShardOrder is the shuffled, drop_last order; use DistributedSampler otherwise")
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        n = len(self.dataset)  # type: ignore[arg-type]
        # int32 where it holds every index: the same permutation from the same generator, half the bytes
        order = torch.randperm(n, generator=g, dtype=torch.int32 if n < 2**31 else torch.int64)
        return order[self.rank : self.total_size : self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        return iter(_Indices(self.indices()))


class _Indices:
    """A sampler over a tensor of indices: its integers, a block at a time."""

    def __init__(self, order: torch.Tensor) -> None:
        self.order = order

    def __len__(self) -> int:
        return len(self.order)

    def __iter__(self) -> Iterator[int]:
        for block in self.order.split(1 << 16):
            yield from block.tolist()


class _GrowingBatches:
    """A batch sampler over ``order`` whose batch size is read (``size()``) as each batch is drawn: the data
    loader draws a step's batch when the step starts, after the decision that sized it. An epoch ends where
    the next batch would not fit (``drop_last``)."""

    def __init__(self, order: torch.Tensor, size: Callable[[], int]) -> None:
        self.order, self.size = order, size

    def __iter__(self) -> Iterator[list[int]]:
        i = 0
        while True:
            bs = self.size()
            if bs < 1 or i + bs > len(self.order):
                return
            yield self.order[i : i + bs].tolist()
            i += bs
