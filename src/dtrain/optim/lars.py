"""LARS: layer-wise adaptive rate scaling for SGD with momentum.

You, Gitman & Ginsburg, "Large Batch Training of Convolutional Networks",
arXiv:1708.03888 (2017), Algorithm 1. For each parameter tensor ``w`` (a
"layer") with gradient ``g``, at every step:

1. local learning rate ``local_lr = eta * ||w|| / (||g|| + weight_decay * ||w|| + eps)``,
   with ``eta`` the trust coefficient; ``local_lr = 1`` when ``||w|| = 0`` or ``||g|| = 0``;
2. ``v = momentum * v + lr * local_lr * (g + weight_decay * w)``  (``v`` starts at 0);
3. ``w = w - v``.

Cost: one momentum buffer per parameter and two norms per parameter per step.

The exclusion rule and the trust ratio are :mod:`dtrain.optim._layerwise`'s, shared with LAMB.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor
from torch.optim.optimizer import ParamsT

from dtrain.optim._layerwise import Exclude, LayerwiseOptimizer, check_exclude, is_excluded, trust_ratio

__all__ = ["LARS"]


def _check_group(group: Mapping[str, Any]) -> None:
    lr, momentum, wd = group["lr"], group["momentum"], group["weight_decay"]
    eta, eps = group["trust_coefficient"], group["eps"]
    if not 0.0 <= lr:
        raise ValueError(f"lr must be >= 0, got {lr}")
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"momentum must be in [0, 1), got {momentum}")
    if not 0.0 <= wd:
        raise ValueError(f"weight_decay must be >= 0, got {wd}")
    if not 0.0 < eta:
        raise ValueError(f"trust_coefficient must be > 0 (the paper's eta, e.g. 0.001), got {eta}")
    if not 0.0 <= eps:
        raise ValueError(f"eps must be >= 0, got {eps}")
    check_exclude(group["exclude"])


class LARS(LayerwiseOptimizer):
    """SGD with momentum and a per-tensor ("layer-wise") learning rate (LARS).

    Implements Algorithm 1 of You, Gitman & Ginsburg, "Large Batch Training of
    Convolutional Networks", arXiv:1708.03888, with the paper's momentum form
    (``lr`` inside the velocity)::

        local_lr = trust_coefficient * ||w|| / (||g|| + weight_decay * ||w|| + eps)
        v = momentum * v + lr * local_lr * (g + weight_decay * w)
        w = w - v

    Additions to the paper: ``eps`` in the denominator, and ``local_lr = 1`` when
    ``||w||`` or ``||g||`` is 0 (the formula would give 0 for a zero tensor, which
    then never moves). Excluded parameters (see ``exclude``) get ``local_lr = 1``
    and no weight decay: plain SGD with momentum, ``v = momentum * v + lr * g``.

    Differences from timm's ``Lars`` (1.0.31):

    * timm keeps ``buf = momentum * buf + local_lr * (g + wd * w)`` and steps
      ``w -= lr * buf``. With a constant ``lr`` (and dampening 0, no Nesterov) this
      is the same trajectory (``v = lr * buf``); with a schedule, timm scales past
      gradients by today's ``lr``, the paper (and this class) by the ``lr`` of the
      step that added them.
    * timm adapts and decays only in param groups with ``weight_decay != 0``
      (or ``always_adapt=True``); this class decides per tensor with ``exclude``, so
      a group with ``weight_decay=0`` is still adapted.
    * timm's optional LARC clipping (``trust_clip``), dampening and Nesterov are
      not part of the paper and not offered here.

    Args:
        params: parameters, or dicts defining param groups. A group may set its own
            ``lr``, ``momentum``, ``weight_decay``, ``trust_coefficient``, ``eps``
            and ``exclude``.
        lr: global learning rate (the paper's gamma), >= 0.
        momentum: momentum factor in [0, 1) (default: 0.9).
        weight_decay: L2 penalty (the paper's beta), >= 0 (default: 0.0).
        trust_coefficient: the paper's eta, > 0 (default: 0.001).
        eps: added to the local learning rate's denominator, >= 0 (default: 1e-8).
        exclude: which tensors skip adaptation and weight decay. ``None`` or
            ``True``: those with ``ndim <= 1`` (biases, norm weights); ``False``:
            none; a callable ``(param) -> bool``: those for which it returns True.
            It is kept in the param groups and so in :meth:`state_dict`: to
            ``torch.save`` that, use ``None``, a bool or a module-level function
            (default: None).

    Raises:
        ValueError: an argument is out of range; the message names it.

    Example::

        opt = LARS(model.parameters(), lr=2.0, momentum=0.9, weight_decay=5e-4)
        loss_fn(model(x), y).backward()
        opt.step()
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        trust_coefficient: float = 0.001,
        eps: float = 1e-8,
        exclude: Exclude = None,
    ) -> None:
        defaults: dict[str, Any] = {
            "lr": lr,
            "momentum": momentum,
            "weight_decay": weight_decay,
            "trust_coefficient": trust_coefficient,
            "eps": eps,
            "exclude": exclude,
        }
        super().__init__(params, defaults)

    _check_group = staticmethod(_check_group)

    def _update(self, p: Tensor, grad: Tensor, group: Mapping[str, Any]) -> None:
        if grad.is_sparse:
            raise RuntimeError("LARS does not support sparse gradients")
        if is_excluded(p, group["exclude"]):
            step = grad.mul(group["lr"])
        else:
            wd = group["weight_decay"]
            w_norm = torch.linalg.vector_norm(p)
            g_norm = torch.linalg.vector_norm(grad)
            denominator = g_norm + wd * w_norm + group["eps"]
            local_lr = trust_ratio(group["trust_coefficient"] * w_norm, denominator, w_norm, g_norm)
            step = grad.add(p, alpha=wd).mul_(local_lr * group["lr"])
        momentum = group["momentum"]
        if momentum != 0.0:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            buf: Tensor = state["momentum_buffer"]
            step = buf.mul_(momentum).add_(step)
        p.sub_(step)
