"""The learning rate of a run's steps: the schedule (``--lr-schedule``) and, composed with it, the
large-batch rules (:mod:`dtrain.optim.large_batch`: scaling with the batch, warmup).

* :func:`lr_factor` -- the schedule's factor at a step;
* :func:`schedule_updates` -- the schedule applied by hooks to an optimizer the loop does not step
  (the parameter server's);
* :class:`LearningRate` -- a run's rate at each step (schedule x scaling x warmup), what
  :class:`dtrain.training.context.TrainContext` sets on the optimizer.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from dtrain.optim.large_batch import scaling_factor, warmup_factor

if TYPE_CHECKING:
    from dtrain.config.schema import RunConfig
    from dtrain.training.batch_control import BatchControl

__all__ = ["lr_factor", "schedule_updates", "LearningRate"]


def lr_factor(schedule: str, step: int, total: int) -> float:
    """The learning rate of optimizer step ``step`` (from 0) of ``total``, as a fraction of ``--lr``.

    ``constant``: 1. ``cosine``: ``0.5 * (1 + cos(pi * step / total))``, 1 at the
    first step and falling to ``0.5 * (1 + cos(pi * (total - 1) / total))`` at the
    last (Loshchilov & Hutter, "SGDR: Stochastic Gradient Descent with Warm
    Restarts", ICLR 2017, one cycle without restarts; torch's
    ``CosineAnnealingLR`` with ``eta_min=0`` stepped per optimizer step). Steps at
    or past ``total`` get 0.

    Raises:
        ValueError: unknown schedule or ``total < 1``.
    """
    if total < 1:
        raise ValueError(f"lr schedule needs total >= 1 steps, got {total}")
    if schedule == "constant":
        return 1.0
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * min(step, total) / total))
    raise ValueError(f"lr schedule {schedule!r} is not known; choose constant or cosine")


def schedule_updates(
    optimizer: torch.optim.Optimizer, schedule: str, total: int, factor: Callable[[int], float] | None = None
) -> None:
    """Scale every update of ``optimizer`` by :func:`lr_factor` of its own step count.

    For optimizers stepped where the loop cannot set the rate (the parameter
    server's): a pre-step hook multiplies each group's current ``lr`` (whatever
    set it: the policy's lr scale, staleness-aware scaling) by the factor and a
    post-step hook puts it back, so the schedule composes with them.
    """
    count = [0]

    def before(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        f = factor(count[0]) if factor is not None else lr_factor(schedule, count[0], total)
        for g in opt.param_groups:
            g["unscheduled_lr"] = g["lr"]
            g["lr"] = g["lr"] * f

    def after(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for g in opt.param_groups:
            g["lr"] = g.pop("unscheduled_lr")
        count[0] += 1

    optimizer.register_step_pre_hook(before)
    optimizer.register_step_post_hook(after)


@dataclass(frozen=True)
class LearningRate:
    """A run's learning rate at each optimizer step.

    Attributes:
        cfg: the run configuration (``--lr-schedule``, ``--lr-scaling``, ``--base-batch``, the warmup).
        batches: the run's global batches (the batch in force at a step, the first epoch's steps).
    """

    cfg: RunConfig
    batches: BatchControl

    def multiplier(self, step: int, total: int, batch: int | None = None) -> float:
        """The factor on ``--lr`` at optimizer step ``step`` of ``total``: batch scaling (``batch``: the
        global batch in force, default that of ``step``'s epoch) x warmup x schedule."""
        c, plan = self.cfg, self.batches.plan
        if batch is None:
            batch = plan.batch_at(step, self.batches.shards)
        k = scaling_factor(c.lr_scaling, batch, c.base_batch or plan.batches[0])
        return k * warmup_factor(step, self.warmup_steps, k) * lr_factor(c.lr_schedule, step, total)

    @property
    def warmup_steps(self) -> int:
        """``--warmup-steps``, or ``--warmup-epochs`` in steps of the first epoch."""
        c, plan = self.cfg, self.batches.plan
        if c.warmup_epochs:
            return max(1, round(c.warmup_epochs * plan.steps_at(plan.batches[0], self.batches.shards)))
        return c.warmup_steps

    @property
    def changes(self) -> bool:
        """Whether the rate changes during the run (a schedule, scaling or warmup)."""
        c = self.cfg
        return c.lr_schedule != "constant" or c.lr_scaling != "none" or bool(c.warmup_steps or c.warmup_epochs)

    def apply(self, optimizer: torch.optim.Optimizer, step: int, total: int) -> None:
        """Set each group's ``lr`` for ``step`` of ``total``: its initial rate times :meth:`multiplier`
        (nothing to do for a constant rate)."""
        if not self.changes:
            return
        f = self.multiplier(step, total)
        for g in optimizer.param_groups:
            g.setdefault("initial_lr", g["lr"])
            g["lr"] = g["initial_lr"] * f
