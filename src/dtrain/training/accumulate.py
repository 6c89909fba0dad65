"""A step's gradients over micro-steps (``--grad-accum N``), and clipping them by their global norm
(``--clip-grad-norm MAX``).

Accumulation. ``--batch-size`` stays the samples of one optimizer step. With ``N`` micro-steps each
rank splits its batch into ``N`` equal micro-batches and runs forward and backward on each, every
loss divided by ``N``, so that the gradients left in ``.grad`` are those of the whole batch (the mean
over the micro-batches' means), at a ``1/N`` of the activation memory. The engine's exchange happens
once, on the last micro-step: the ones before run inside the engine's ``no_sync()`` (an
:class:`Accumulates` engine: ``dp``'s buckets and ``ddp``'s hooks do not reduce, ZeRO keeps the
unsharded gradients and reduce-scatters their sum once), the way DDP's ``no_sync`` is used. An engine
that exchanges in its update only (a parameter server's push) needs nothing. A whole-step engine
(``train_step``: tensor parallelism) runs its step once per micro-batch, and the sum of the
micro-steps' gradients is divided by ``N`` afterwards. The step's loss is the mean over its
micro-steps, one metrics row per optimizer step.

Clipping. :func:`clip_` is ``torch.nn.utils.clip_grad_norm_`` when a step's gradient is held in pieces:
``total = sqrt(sum |g|^2)`` over the whole model's gradient, the squares of the pieces this rank holds
summed, then (``reduce``) summed over the ranks holding the other pieces; every piece is multiplied by
``min(1, MAX / (total + 1e-6))``. Each engine that can clip (:class:`ClipsGradients`) says which
pieces are its own: data parallelism holds the whole averaged gradient (no reduction), ZeRO a shard
(``ShardedDataParallel.clip_grad_norm_``), a pipeline stage its layers, a tensor-parallel rank its
slices with the replicated parameters counted once; a parameter server's servers clip the aggregated
gradient, each its shard (:mod:`dtrain.param_server.clipping`). The loop clips after fp16's unscaling and the
numerics guard, before the optimizer step, and records the norm before clipping as ``grad_norm``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = [
    "Accumulates",
    "ClipsGradients",
    "micro_batches",
    "micro_steps",
    "whole_micro_steps",
    "clip_",
    "gradients_of",
]


@runtime_checkable
class Accumulates(Protocol):
    """An adapter whose backward communicates: inside ``no_sync()`` a forward and backward only accumulate."""

    def no_sync(self) -> contextlib.AbstractContextManager[Any]:
        """A context in which forward and backward leave this rank's gradients unexchanged."""


@runtime_checkable
class ClipsGradients(Protocol):
    """An adapter that clips the step's gradient by its global 2-norm (every rank of the step calls it)."""

    def clip_grad_norm(self, max_norm: float) -> float | None:
        """Scale the gradients this rank applies so that the global norm is at most ``max_norm``; the norm before
        (None: the gradient is clipped after it leaves this rank, as a parameter server's servers do)."""


def _chunk(t: Any, n: int) -> list[Any]:
    if isinstance(t, torch.Tensor):
        return list(t.chunk(n, 0))
    if isinstance(t, (list, tuple)):
        parts = [_chunk(v, n) for v in t]
        return [type(t)(p[i] for p in parts) for i in range(n)]
    raise TypeError(f"--grad-accum splits tensors (or tuples of them) along the batch; got {type(t).__name__}")


def micro_batches(x: Any, y: Any, n: int) -> list[tuple[Any, Any]]:
    """``x`` and ``y`` cut into ``n`` equal micro-batches along dim 0 (the check before launch saw that they divide)."""
    size = len(y)
    if size % n:
        raise ValueError(f"a batch of {size} does not split into {n} equal micro-batches")
    return list(zip(_chunk(x, n), _chunk(y, n)))


def micro_steps(
    step: Callable[[Any, Any, float], float],
    x: Any,
    y: Any,
    n: int,
    no_sync: Callable[[], contextlib.AbstractContextManager[Any]] | None,
) -> float:
    """Run ``step(x_i, y_i, 1 / n)`` (forward, and backward of its loss times the weight) on each micro-batch,
    the ones before the last inside ``no_sync()`` (when the engine has one); the mean of their losses."""
    if n == 1:
        return step(x, y, 1.0)
    total = 0.0
    for i, (xi, yi) in enumerate(micro_batches(x, y, n)):
        quiet = no_sync() if no_sync is not None and i < n - 1 else contextlib.nullcontext()
        with quiet:
            total += step(xi, yi, 1.0 / n)
    return total / n


def whole_micro_steps(
    train_step: Callable[[Any, Any], float], params: Iterable[torch.Tensor], x: Any, y: Any, n: int
) -> float:
    """A whole-step engine's ``train_step`` on each micro-batch, then the summed gradients divided by ``n``;
    the mean of the micro-steps' losses."""
    if n == 1:
        return train_step(x, y)
    total = sum(train_step(xi, yi) for xi, yi in micro_batches(x, y, n))
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        torch._foreach_div_(grads, float(n))
    return total / n


def _squares(grads: list[torch.Tensor]) -> torch.Tensor:
    """``sum |g|^2`` over ``grads`` in float64 (0 when there is none)."""
    if not grads:
        return torch.zeros((), dtype=torch.float64)
    return torch.stack([g.detach().double().pow(2).sum() for g in grads]).sum()


def clip_(
    grads: Iterable[torch.Tensor],
    max_norm: float,
    *,
    reduce: Callable[[torch.Tensor], None] | None = None,
    once: Iterable[torch.Tensor] = (),
    share: int = 1,
) -> float:
    """Clip by the global norm of a gradient held in pieces; returns the norm before clipping.

    Args:
        grads: the pieces only this rank holds (its shard, its stage's layers, its tensor slices).
        max_norm: the largest norm kept.
        reduce: sums a float64 scalar over the ranks holding the other pieces, in place (None: this rank
            holds the whole gradient).
        once: pieces every one of ``share`` ranks holds alike (a tensor-parallel rank's replicated
            parameters): counted once in the norm.
        share: the ranks that hold each of ``once``.
    """
    own, same = [g for g in grads], [g for g in once]
    sq = _squares(own) + _squares(same) / share
    if reduce is not None:
        sq = sq.reshape(1).clone()
        reduce(sq)
        sq = sq[0]
    total = float(sq.sqrt())
    coef = min(1.0, max_norm / (total + 1e-6))
    pieces = own + same
    if coef < 1.0 and pieces:
        torch._foreach_mul_(pieces, coef)
    return total


def gradients_of(params: Iterable[torch.nn.Parameter]) -> Iterator[torch.Tensor]:
    """The gradients of ``params`` that exist."""
    for p in params:
        if p.grad is not None:
            yield p.grad
