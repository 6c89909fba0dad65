"""Step one torch optimizer on one bucket's parameters at a time (``overlap="forward"``).

For each bucket a *view* of the user's optimizer is made once: an object of the
same class that shares the optimizer's ``state`` (momentum buffers, Adam moments,
step counts) and whose ``param_groups`` hold only that bucket's parameters, with
the hyperparameters of the group they come from. Stepping the view runs the
optimizer's own ``step`` code on that subset, so any per-parameter optimizer
(SGD, Adam, AdamW, RMSprop, Adagrad, LARS/LAMB-style per-tensor rules) gives
exactly what one whole step gives. Optimizers that couple parameters across
buckets (global gradient-norm clipping, LBFGS) cannot be split this way.

Hyperparameters (learning rate, ...) are copied from the user's optimizer at the
start of each backward, so an LR scheduler stepped after ``loss.backward()``
affects the next step, exactly as in ``backward(); step(); scheduler.step()``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from dtrain.errors import ConfigError

__all__ = ["BucketOptimizer", "check_optimizer"]


def check_optimizer(optimizer: Any, params: Sequence[torch.Tensor]) -> None:
    """Raise ConfigError unless ``optimizer`` is a torch optimizer over a subset of ``params``."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(
            "optimizer must be a torch.optim.Optimizer (optimizer_factory must return one), "
            f"got {type(optimizer).__name__}"
        )
    known = {id(p) for p in params}
    for g in optimizer.param_groups:
        for p in g["params"]:
            if id(p) not in known:
                raise ConfigError(
                    "the optimizer holds a parameter that is not a trainable parameter of the wrapped module "
                    f"(shape {tuple(p.shape)}); build it from the module's parameters "
                    "(optimizer_factory=lambda params: torch.optim.SGD(params, lr=...))"
                )


class BucketOptimizer:
    """Per-bucket stepping of one optimizer.

    Args:
        optimizer: the user's optimizer over (a subset of) the model's parameters.
        bucket_params: the parameters of each bucket.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, bucket_params: Sequence[Sequence[torch.Tensor]]) -> None:
        check_optimizer(optimizer, [p for ps in bucket_params for p in ps])
        self.optimizer = optimizer
        self._hyper: list[dict[str, Any]] = self._snapshot()
        self._views = [self._view(ps) for ps in bucket_params]

    def _snapshot(self) -> list[dict[str, Any]]:
        return [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]

    def _view(self, params: Sequence[torch.Tensor]) -> tuple[Any, list[int]]:
        opt = self.optimizer
        ids = {id(p) for p in params}
        view = object.__new__(type(opt))
        view.__dict__.update({k: v for k, v in opt.__dict__.items() if k != "step"})  # not a scheduler's patched step
        groups, where = [], []
        for gi, g in enumerate(opt.param_groups):
            sub = [p for p in g["params"] if id(p) in ids]
            if sub:
                groups.append({**self._hyper[gi], "params": sub})
                where.append(gi)
        view.param_groups = groups
        return view, where

    def snapshot(self) -> None:
        """Take the hyperparameters the next buckets are stepped with (start of backward)."""
        self._hyper = self._snapshot()

    def step(self, bucket_index: int) -> None:
        """Run the optimizer on bucket ``bucket_index``'s parameters."""
        view, where = self._views[bucket_index]
        if not where:
            return
        view.state = self.optimizer.state  # load_state_dict replaces the dict
        for g, gi in zip(view.param_groups, where):
            g.update(self._hyper[gi])
        type(self.optimizer).step(view)

    def committed(self) -> None:
        """A step's buckets will all be stepped: tell LR schedulers that ``optimizer.step`` ran."""
        self.optimizer._opt_called = True  # type: ignore[attr-defined]  # what torch's LRScheduler checks
