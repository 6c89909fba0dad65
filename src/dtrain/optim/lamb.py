"""LAMB: Adam with a per-tensor trust ratio.

You et al., "Large Batch Optimization for Deep Learning: Training BERT in 76
minutes", arXiv:1904.00962 (ICLR 2020), Algorithm 2. For each parameter tensor
``w`` with gradient ``g``, at step ``t`` (counted per tensor, from 1):

1. ``m = beta1 * m + (1 - beta1) * g``; ``v = beta2 * v + (1 - beta2) * g**2``;
2. ``m_hat = m / (1 - beta1**t)``; ``v_hat = v / (1 - beta2**t)``;
3. ``r = m_hat / (sqrt(v_hat) + eps)``; ``u = r + weight_decay * w``;
4. ``w = w - lr * ||w|| / ||u|| * u``  (phi is the identity; the ratio is 1 when
   ``||w||`` or ``||u||`` is 0).

Cost: two moment buffers per parameter, two norms per parameter per step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor
from torch.optim.optimizer import ParamsT

from dtrain.optim._layerwise import Exclude, LayerwiseOptimizer, check_exclude, is_excluded, trust_ratio

__all__ = ["LAMB"]


def _check_group(group: Mapping[str, Any]) -> None:
    lr, betas, eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    if not 0.0 <= lr:
        raise ValueError(f"lr must be >= 0, got {lr}")
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    for i, beta in enumerate(betas):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"betas[{i}] must be in [0, 1), got {beta}")
    if not 0.0 <= eps:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if not 0.0 <= wd:
        raise ValueError(f"weight_decay must be >= 0, got {wd}")
    check_exclude(group["exclude"])


class LAMB(LayerwiseOptimizer):
    """Layer-wise adaptive moments (LAMB): Adam whose step is rescaled per tensor.

    Implements Algorithm 2 of You et al., "Large Batch Optimization for Deep
    Learning: Training BERT in 76 minutes", arXiv:1904.00962, with bias correction
    and phi the identity::

        m = beta1 * m + (1 - beta1) * g            v = beta2 * v + (1 - beta2) * g**2
        r = (m / (1 - beta1**t)) / (sqrt(v / (1 - beta2**t)) + eps)
        u = r + weight_decay * w
        w = w - lr * (||w|| / ||u||) * u           (ratio 1 if ||w|| or ||u|| is 0)

    Excluded parameters (see ``exclude``) take the plain Adam step
    ``w = w - lr * r``: trust ratio 1 and no weight decay.

    Differences from timm's ``Lamb`` (1.0.31), whose defaults are not the paper's:

    * timm clips the global gradient norm to ``max_grad_norm=1.0`` before the
      moments by default; this class does not clip (timm with ``max_grad_norm=None``).
    * timm adapts and decays only in param groups with ``weight_decay != 0``
      (or ``always_adapt=True``); this class decides per tensor with ``exclude``, so
      a group with ``weight_decay=0`` is still adapted.
    * timm counts ``t`` per param group (it advances even for tensors without a
      gradient that step); this class counts per tensor, as torch's Adam does.
    * timm's ``grad_averaging=False``, ``bias_correction=False``, ``trust_clip``,
      ``caution`` and ``decoupled_decay`` are not part of Algorithm 2 and not
      offered here; this class behaves like timm's defaults for them.

    Args:
        params: parameters, or dicts defining param groups. A group may set its own
            ``lr``, ``betas``, ``eps``, ``weight_decay`` and ``exclude``.
        lr: learning rate (the paper's eta_t), >= 0.
        betas: moment decay rates, each in [0, 1) (default: (0.9, 0.999)).
        eps: added to ``sqrt(v_hat)``, >= 0 (default: 1e-6).
        weight_decay: the paper's lambda, >= 0 (default: 0.01).
        exclude: which tensors skip the trust ratio and weight decay. ``None`` or
            ``True``: those with ``ndim <= 1`` (biases, norm weights); ``False``:
            none; a callable ``(param) -> bool``: those for which it returns True.
            It is kept in the param groups and so in :meth:`state_dict`: to
            ``torch.save`` that, use ``None``, a bool or a module-level function
            (default: None).

    Raises:
        ValueError: an argument is out of range; the message names it.

    Example::

        opt = LAMB(model.parameters(), lr=1e-3, weight_decay=0.01)
        loss_fn(model(x), y).backward()
        opt.step()
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        exclude: Exclude = None,
    ) -> None:
        defaults: dict[str, Any] = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "exclude": exclude,
        }
        super().__init__(params, defaults)

    _check_group = staticmethod(_check_group)

    def _update(self, p: Tensor, grad: Tensor, group: Mapping[str, Any]) -> None:
        if grad.is_sparse:
            raise RuntimeError("LAMB does not support sparse gradients")
        state = self.state[p]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["step"] += 1
        t: int = state["step"]
        beta1, beta2 = group["betas"]
        m: Tensor = state["exp_avg"]
        v: Tensor = state["exp_avg_sq"]
        m.mul_(beta1).add_(grad, alpha=1.0 - beta1)
        v.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        m_hat = m / (1.0 - beta1**t)
        v_hat = v / (1.0 - beta2**t)
        update = m_hat.div_(v_hat.sqrt_().add_(group["eps"]))
        if not is_excluded(p, group["exclude"]):
            update.add_(p, alpha=group["weight_decay"])
            w_norm = torch.linalg.vector_norm(p)
            u_norm = torch.linalg.vector_norm(update)
            update.mul_(trust_ratio(w_norm, u_norm, w_norm, u_norm))
        p.sub_(update, alpha=group["lr"])
