"""What LARS and LAMB share: the exclusion rule, the trust ratio, and the optimizer's frame (argument
checks on every param group, the closure, one ``_update`` per tensor with a gradient)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Any, overload

import torch
from torch import Tensor
from torch.optim.optimizer import Optimizer, ParamsT

__all__ = ["LayerwiseOptimizer", "Exclude", "default_exclude", "check_exclude", "is_excluded", "trust_ratio"]

# What ``exclude=`` (and a param group's ``"exclude"``) accepts: see :func:`is_excluded`.
Exclude = Callable[[Tensor], bool] | bool | None


def default_exclude(param: Tensor) -> bool:
    """The default rule: biases and norm weights, i.e. tensors with ``ndim <= 1``."""
    return param.ndim <= 1


def check_exclude(exclude: object) -> None:
    """Raise ``ValueError`` unless ``exclude`` is ``None``, a bool or a callable."""
    if exclude is None or isinstance(exclude, bool) or callable(exclude):
        return
    raise ValueError(
        f"exclude must be None (default: ndim <= 1), True (same), False (exclude nothing) "
        f"or a callable (param) -> bool, got {exclude!r}"
    )


def is_excluded(param: Tensor, exclude: Exclude) -> bool:
    """Whether ``param`` is left out of layer-wise adaptation and weight decay.

    ``None`` or ``True``: :func:`default_exclude` (``param.ndim <= 1``); ``False``:
    nothing is excluded; a callable: its answer, ``True`` meaning excluded.
    """
    if exclude is None or exclude is True:
        return default_exclude(param)
    if exclude is False:
        return False
    return bool(exclude(param))


def trust_ratio(numerator: Tensor, denominator: Tensor, w_norm: Tensor, u_norm: Tensor) -> Tensor:
    """``numerator / denominator``, or 1 where ``w_norm`` or ``u_norm`` is 0.

    ``w_norm`` is the parameter's norm and ``u_norm`` that of its update direction.
    Without the guard a zero tensor (a zero-initialized layer) would get ratio 0 and
    never move, and a zero update would divide by zero.
    """
    return torch.where((w_norm > 0) & (u_norm > 0), numerator / denominator, torch.ones_like(w_norm))


class LayerwiseOptimizer(Optimizer, ABC):
    """A torch optimizer that updates each parameter tensor on its own (a "layer"): subclasses give
    ``_check_group`` (ValueError naming a bad hyperparameter) and ``_update(p, grad, group)``."""

    def __init__(self, params: ParamsT, defaults: dict[str, Any]) -> None:
        self._check_group(defaults)
        super().__init__(params, defaults)

    @staticmethod
    @abstractmethod
    def _check_group(group: Mapping[str, Any]) -> None:
        """ValueError naming the first bad hyperparameter of ``group``."""

    @abstractmethod
    def _update(self, p: Tensor, grad: Tensor, group: Mapping[str, Any]) -> None:
        """Apply one step to ``p`` from ``grad`` with ``group``'s hyperparameters (under no_grad)."""

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group, checking its hyperparameters like the constructor's."""
        self._check_group({**self.defaults, **param_group})
        super().add_param_group(param_group)

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One step on every parameter that has a gradient.

        Args:
            closure: recomputes the loss (with gradients) and returns it (default: None).

        Returns:
            The closure's loss, or None without a closure.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, p.grad, group)
        return loss
