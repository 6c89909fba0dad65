"""Error feedback: remember what compression dropped and send it later.

Seide et al. 2014 (1-bit SGD's residual); Stich, Cordonnier & Jaggi, "Sparsified
SGD with Memory", NeurIPS 2018; Karimireddy et al., "Error Feedback Fixes SignSGD
and other Gradient Compression Schemes", ICML 2019.

Per key (tensor or bucket), at every step:

0. with ``momentum`` beta > 0: ``velocity = beta * velocity + gradient``, and
   ``velocity`` takes the gradient's place below;
1. ``corrected = gradient + residual``;
2. ``payload = inner.compress(corrected)``; ``sent = inner.decompress(payload)``;
3. ``residual = corrected - sent``.

Nothing is lost: over ``T`` steps, ``sum(sent) = sum(input) - residual_T``
exactly, up to float rounding, where the input is the gradient, or the velocity
with momentum. Cost: one tensor of memory per key (two with momentum) and one
decode per compress.

Momentum (step 0) is "momentum correction" (Lin et al., "Deep Gradient
Compression", ICLR 2018) and EF-SGD with momentum (Karimireddy et al. 2019;
Zheng et al., "Communication-Efficient Distributed Blockwise Momentum SGD with
Error-Feedback", NeurIPS 2019): each worker keeps its own velocity and compresses
it, and the optimizer applies the averaged result *without* momentum of its own.
Applying momentum to the average of error-fed compressed gradients instead lets
the step sizes the compressor invents (a sign quantizer moves every element by
its group's mean magnitude; error feedback takes the overshoot back later) be
amplified ``1 / (1 - beta)`` times and oscillate: on the default CNN with sign
compression and momentum 0.9 the weights' norm doubles and training diverges,
while momentum before the compressor trains like uncompressed SGD
(``benchmarks/compression.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from dtrain.compress.base import Compressor, TensorMeta

__all__ = ["ErrorFeedback"]


class ErrorFeedback(Compressor):
    """Wrap a (biased) compressor with per-key residuals, and optionally momentum.

    Args:
        inner: the compressor whose error is fed back.
        momentum: SGD momentum applied per worker before compressing (step 0),
            in [0, 1). With momentum > 0 the optimizer must run *without*
            momentum (``torch.optim.SGD(..., momentum=0)``), or it is applied
            twice; :attr:`momentum` tells the caller (default: 0, none).

    Example::

        c = ErrorFeedback(TopK(ratio=0.01))
        payload, ctx = c.compress(grad, key="fc.weight")
        c.residual("fc.weight")     # what was not sent yet

        c = ErrorFeedback(SignSGD(), momentum=0.9)   # EF-signSGD with momentum
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.0)
    """

    def __init__(self, inner: Compressor, momentum: float = 0.0) -> None:
        if not isinstance(inner, Compressor):
            raise TypeError(f"ErrorFeedback wraps a Compressor, got {type(inner).__name__}")
        if isinstance(inner, ErrorFeedback):
            raise ValueError("ErrorFeedback is already applied; do not wrap it twice")
        if not isinstance(momentum, (int, float)) or not 0.0 <= float(momentum) < 1.0:
            raise ValueError(
                f"ErrorFeedback momentum must be in [0, 1) (the optimizer's SGD momentum, e.g. 0.9), got {momentum!r}"
            )
        self.inner = inner
        self.name = inner.name
        self.summable = inner.summable
        self.collective = inner.collective
        self.biased = inner.biased
        self.momentum_first = inner.momentum_first
        self.mean_combine = inner.mean_combine
        self.momentum = float(momentum)
        self._residuals: dict[str, torch.Tensor] = {}
        self._velocity: dict[str, torch.Tensor] = {}

    # -- the steps, also used by compressed_allreduce for collective compressors

    def accumulate(self, tensor: torch.Tensor, key: str) -> torch.Tensor:
        """Step 0: ``velocity[key] = momentum * velocity[key] + tensor``, returned (``tensor`` without momentum)."""
        if not self.momentum:
            return tensor
        t = tensor.detach()
        v = self._velocity.get(key)
        if v is None:
            v = t.clone()
        elif v.shape != t.shape:
            raise ValueError(
                f"ErrorFeedback key {key!r} held a velocity of shape {tuple(v.shape)} "
                f"but got a tensor of shape {tuple(t.shape)}; use one key per tensor"
            )
        else:
            v = v.mul_(self.momentum).add_(t.to(v.dtype))
        self._velocity[key] = v
        return v

    def corrected(self, tensor: torch.Tensor, key: str) -> torch.Tensor:
        """Step 1: ``tensor + residual[key]`` (a new tensor; the input is not changed)."""
        r = self._residuals.get(key)
        t = tensor.detach()
        if r is None:
            return t.clone()
        if r.shape != t.shape:
            raise ValueError(
                f"ErrorFeedback key {key!r} held a residual of shape {tuple(r.shape)} "
                f"but got a tensor of shape {tuple(t.shape)}; use one key per tensor"
            )
        return t + r.to(t.dtype)

    def update(self, key: str, corrected: torch.Tensor, sent: torch.Tensor) -> None:
        """Step 3: remember ``corrected - sent`` for ``key``."""
        self._residuals[key] = (corrected - sent.reshape(corrected.shape).to(corrected.dtype)).detach()

    def residual(self, key: str) -> torch.Tensor | None:
        """The residual currently held for ``key`` (None before its first step)."""
        return self._residuals.get(key)

    def velocity(self, key: str) -> torch.Tensor | None:
        """The velocity held for ``key`` (None without momentum or before its first step)."""
        return self._velocity.get(key)

    def recompress(
        self, tensor: torch.Tensor, key: str, shapes: Sequence[Sequence[int]] | None = None, offset: int = 0
    ) -> tuple[list[torch.Tensor], TensorMeta]:
        """Steps 1-3 only, without momentum: for an aggregate that already carries
        every rank's velocity (the chunk owner's second compression in
        :func:`~dtrain.compress.compressed_allreduce`)."""
        c = self.corrected(tensor, key)
        if shapes is None:
            payload, ctx = self.inner.compress(c, key)
        else:
            payload, ctx = self.inner.compress_layout(c, key, shapes, offset)
        self.update(key, c, self.inner.decompress(payload, ctx))
        return payload, ctx

    # -- Compressor

    def compress(self, tensor: torch.Tensor, key: str) -> tuple[list[torch.Tensor], TensorMeta]:
        return self.recompress(self.accumulate(tensor, key), key)

    def compress_layout(
        self, tensor: torch.Tensor, key: str, shapes: Sequence[Sequence[int]], offset: int = 0
    ) -> tuple[list[torch.Tensor], TensorMeta]:
        return self.recompress(self.accumulate(tensor, key), key, shapes, offset)

    def decompress(self, payload: list[torch.Tensor], ctx: TensorMeta) -> torch.Tensor:
        return self.inner.decompress(payload, ctx)

    def combine(self, decoded: Sequence[torch.Tensor]) -> torch.Tensor:
        return self.inner.combine(decoded)

    def state_dict(self) -> dict[str, Any]:
        return {
            "residuals": {k: v.clone() for k, v in self._residuals.items()},
            "velocity": {k: v.clone() for k, v in self._velocity.items()},
            "inner": self.inner.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = {"residuals", "inner"} - set(state)
        if missing:
            raise ValueError(f"ErrorFeedback state lacks {sorted(missing)}")
        velocity = state.get("velocity", {})
        if velocity and not self.momentum:
            raise ValueError("the saved ErrorFeedback state holds momentum velocities, this one has momentum 0")
        self._residuals = {k: v.clone() for k, v in state["residuals"].items()}
        self._velocity = {k: v.clone() for k, v in velocity.items()}
        self.inner.load_state_dict(state["inner"])

    def reset(self) -> None:
        self._residuals.clear()
        self._velocity.clear()
        self.inner.reset()

    def _forget(self, key: str) -> None:
        self._residuals.pop(key, None)
        self._velocity.pop(key, None)
        self.inner._forget(key)

    def __repr__(self) -> str:
        if self.momentum:
            return f"ErrorFeedback({self.inner!r}, momentum={self.momentum:g})"
        return f"ErrorFeedback({self.inner!r})"
