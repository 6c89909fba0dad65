"""The numerics guard: a step whose loss or gradients are not finite stops the run, or is skipped.

Once per step, after backward and before the engine's update, :meth:`NonFiniteGuard.check`:

1. checks the loss, a float the loop holds anyway (free);
2. checks the norm of the gradients this rank is about to apply: one fused 2-norm per
   gradient (``torch._foreach_norm``), their sum, one host sync per step (:func:`first_nonfinite`;
   its cost is in :mod:`dtrain.training.loop`'s docstring);
3. without ``--skip-nonfinite`` (0): a non-finite loss or gradient raises
   :class:`~dtrain.errors.NonFiniteError` naming the rank, the step and the first parameter
   (model order) whose gradient is not finite, before the update: the step is never applied
   and no checkpoint holds it;
4. with ``--skip-nonfinite N``: the ranks that share the step agree (``agree``: which ranks
   found it bad); if any did, every one of them leaves the step out -- no optimizer step
   anywhere -- and the run goes on. The (N+1)-th such step stops the run as in 3, on every
   rank that shares it.

Who shares a step (the engines' ``agree``): data parallelism and torch DDP average the gradients
before the check, so every rank sees the same non-finite gradient, but each rank's loss is its
own shard's -- one tiny all-reduce per step decides; a pipeline's stages share the loss
(:meth:`dtrain.Pipeline.step` gives every rank the last stage's) but each holds its own stage's
gradients -- the same all-reduce; a parameter-server worker or a decentralized replica applies
its own gradients, so its own check decides (a skipped push, a skipped local step) and costs no
message (a parameter-server worker that skips is simply one push behind: under bsp the servers
wait for its next gradient, and nothing changed meanwhile). Without ``--skip-nonfinite`` nothing
is agreed: the rank that finds a non-finite value stops and the launcher stops the others, which
at most wait in the next collective -- a checkpoint save among them never completes.

Where a step cannot be held back, ``--skip-nonfinite`` is refused before any process starts:
dp with ``--overlap forward`` (the communication thread applies each bucket as soon as it is
averaged, so the check sees gradients being reduced; a non-finite one it misses shows in the
next step's loss) and dp with ``--compression`` (the compressor's state takes the gradient in
during backward). A skipped step counts as a step (its batch is consumed, its metrics row says
``"skipped": true``); a checkpoint after it holds the last applied update.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dtrain.errors import NonFiniteError

__all__ = ["NonFiniteGuard", "flagged_ranks", "first_nonfinite"]


def first_nonfinite(named: Iterable[tuple[str, nn.Parameter]]) -> tuple[str, str, int] | None:
    """The first parameter whose gradient norm is not finite: ``(name, kind, how many are)``, kind
    ``"nan"`` or ``"inf"`` (such an element in the gradient) or ``"norm overflow"`` (finite elements
    whose 2-norm overflows the dtype); None when every gradient norm is finite (or there is none).

    Fast path: one fused 2-norm per gradient (``torch._foreach_norm``), their sum, one host sync.
    (The max-norm would never overflow, but ``_foreach_norm(inf)`` takes about ten times as
    long on CPU.) The parameters are looked at one by one only when the sum is not finite.
    """
    pairs = [(n, p.grad) for n, p in named if p.grad is not None]
    if not pairs:
        return None
    norms = torch.stack(torch._foreach_norm([g for _, g in pairs]))
    if math.isfinite(float(norms.sum())):
        return None
    bad = (~norms.isfinite()).nonzero().flatten().tolist()
    if not bad:  # every norm finite, their sum is not: report the largest
        bad = [int(norms.argmax())]
    name, grad = pairs[bad[0]]
    if bool(grad.isnan().any()):
        kind = "nan"
    elif not bool(grad.isfinite().all()):
        kind = "inf"
    else:
        kind = "norm overflow"
    return name, kind, len(bad)


def flagged_ranks(bad: bool, group: Any = None) -> list[int]:
    """Collective over ``group`` (default: the whole job): the ranks of ``group`` that passed ``bad=True``.

    One all-reduce of ``world`` bytes (float32 flags on the backend's device).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return [0] if bad else []
    world, me = dist.get_world_size(group), dist.get_rank(group)
    nccl = str(dist.get_backend(group)).lower() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    flags = torch.zeros(world, device=device)
    flags[me] = float(bad)
    dist.all_reduce(flags, group=group)
    return [r for r, f in enumerate(flags.tolist()) if f > 0]


class NonFiniteGuard:
    """This rank's numerics check (see the module docstring).

    Args:
        named_parameters: the parameters whose gradients this rank applies, named as in the model.
        rank: this process's rank (named in the messages).
        budget: ``--skip-nonfinite``: steps that may be skipped before the run stops (0: none).
        agree: ``f(bad) -> ranks that found the step bad``, among those that share it (a
            collective where a step is shared); needed when ``budget > 0``.
    """

    def __init__(
        self,
        named_parameters: Iterable[tuple[str, nn.Parameter]],
        *,
        rank: int,
        budget: int = 0,
        agree: Callable[[bool], list[int]] | None = None,
    ) -> None:
        if budget < 0:
            raise ValueError(f"budget must be >= 0, got {budget}")
        if budget and agree is None:
            raise ValueError("skipping steps needs agree: which ranks found the step bad")
        self.named = [(n, p) for n, p in named_parameters if p.requires_grad]
        self.rank, self.budget, self.agree = rank, budget, agree
        self.skipped = 0  # steps left out so far

    def check(self, step: int, loss: float) -> bool:
        """Whether to apply ``step`` (False: leave it out); raises :class:`NonFiniteError` when it may not."""
        grad = first_nonfinite(self.named)
        mine = grad is not None or not math.isfinite(loss)
        if not self.budget:
            if mine:
                raise self._error(step, loss, grad, "stopped (--skip-nonfinite N skips up to N such steps)")
            return True
        assert self.agree is not None
        ranks = self.agree(mine)
        if not ranks:
            return True
        self.skipped += 1
        if self.skipped > self.budget:
            why = f"stopped: {self.budget} such step(s) skipped already (--skip-nonfinite {self.budget})"
            if not mine:
                raise NonFiniteError(self.rank, step, f"loss or gradient on rank(s) {_ranks(ranks)}; {why}")
            raise self._error(step, loss, grad, why)
        if mine:  # the ranks that found it say so; the others follow silently
            note = f"step skipped, no update from it ({self.skipped} of --skip-nonfinite {self.budget})"
            print(f"dtrain: {self._error(step, loss, grad, note)}", file=sys.stderr, flush=True)
        return False

    def _error(self, step: int, loss: float, grad: tuple[str, str, int] | None, tail: str) -> NonFiniteError:
        if grad is None:
            what = f"loss {loss:.4g} (every gradient of this rank is finite)"
            return NonFiniteError(self.rank, step, f"{what}; {tail}", parameter=None)
        name, kind, count = grad
        more = f", {count - 1} more of {len(self.named)}" if count > 1 else ""
        what = f"gradient ({kind}) in parameter {name!r} (the first{more}; loss {loss:.4g})"
        return NonFiniteError(self.rank, step, f"{what}; {tail}", parameter=name)


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)
