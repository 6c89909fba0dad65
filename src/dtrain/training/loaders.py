"""A shard's training batches and where a run stands in them: :class:`ShardLoaders`."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch.utils.data import DataLoader, DistributedSampler

if TYPE_CHECKING:
    from dtrain.config.schema import RunConfig
    from dtrain.optim.large_batch import BatchPlan
    from dtrain.workloads.data import DatasetSplit

__all__ = ["ShardLoaders"]


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
        sampler: DistributedSampler[Any] = DistributedSampler(
            self.data.train, num_replicas=num_shards, rank=shard, shuffle=True, seed=self.cfg.seed, drop_last=True
        )
        sampler.set_epoch(epoch)
        if self.plan.within_epochs:  # --auto-every: each batch as large as the plan's latest decision
            order = list(sampler)[self.plan.offset(epoch, start_batch, num_shards) :]
            sizes = _GrowingBatches(order, lambda: self.plan.current // num_shards)
            return DataLoader(self.data.train, batch_sampler=sizes)
        bs = self.plan.batch(epoch) // num_shards
        if start_batch:
            order = list(sampler)[start_batch * bs :]
            return DataLoader(self.data.train, batch_size=bs, sampler=order, drop_last=True)
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


class _GrowingBatches:
    """A batch sampler over ``order`` whose batch size is read (``size()``) as each batch is drawn: the data
    loader draws a step's batch when the step starts, after the decision that sized it. An epoch ends where
    the next batch would not fit (``drop_last``)."""

    def __init__(self, order: list[int], size: Callable[[], int]) -> None:
        self.order, self.size = order, size

    def __iter__(self) -> Iterator[list[int]]:
        i = 0
        while True:
            bs = self.size()
            if bs < 1 or i + bs > len(self.order):
                return
            yield self.order[i : i + bs]
            i += bs
