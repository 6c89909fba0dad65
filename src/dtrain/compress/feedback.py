"""Error feedback: remember what compression dropped and send it later.

Seide et al. 2014 (1-bit SGD's residual); Stich, Cordonnier & Jaggi, "Sparsified
SGD with Memory", NeurIPS 2018; Karimireddy et al., "Error Feedback Fixes SignSGD
and other Gradient Compression Schemes", ICML 2019.

Per key (tensor or bucket), at every step:

1. ``corrected = gradient + residual``;
2. ``payload = inner.compress(corrected)``; ``sent = inner.decompress(payload)``;
3. ``residual = corrected - sent``.

Nothing is lost: over ``T`` steps, ``sum(sent) = sum(gradient) - residual_T``
exactly, up to float rounding. Cost: one tensor of memory per key and one decode
per compress.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from dtrain.compress.base import Compressor, TensorMeta

__all__ = ["ErrorFeedback"]


class ErrorFeedback(Compressor):
    """Wrap a (biased) compressor with per-key residuals.

    Args:
        inner: the compressor whose error is fed back.

    Example::

        c = ErrorFeedback(TopK(ratio=0.01))
        payload, ctx = c.compress(grad, key="fc.weight")
        c.residual("fc.weight")     # what was not sent yet
    """

    def __init__(self, inner: Compressor) -> None:
        if not isinstance(inner, Compressor):
            raise TypeError(f"ErrorFeedback wraps a Compressor, got {type(inner).__name__}")
        if isinstance(inner, ErrorFeedback):
            raise ValueError("ErrorFeedback is already applied; do not wrap it twice")
        self.inner = inner
        self.name = inner.name
        self.summable = inner.summable
        self.biased = inner.biased
        self._residuals: dict[str, torch.Tensor] = {}

    # -- the three steps, also used by compressed_allreduce for collective compressors

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

    # -- Compressor

    def compress(self, tensor: torch.Tensor, key: str) -> tuple[list[torch.Tensor], TensorMeta]:
        c = self.corrected(tensor, key)
        payload, ctx = self.inner.compress(c, key)
        self.update(key, c, self.inner.decompress(payload, ctx))
        return payload, ctx

    def compress_layout(
        self, tensor: torch.Tensor, key: str, shapes: Sequence[Sequence[int]]
    ) -> tuple[list[torch.Tensor], TensorMeta]:
        c = self.corrected(tensor, key)
        payload, ctx = self.inner.compress_layout(c, key, shapes)
        self.update(key, c, self.inner.decompress(payload, ctx))
        return payload, ctx

    def decompress(self, payload: list[torch.Tensor], ctx: TensorMeta) -> torch.Tensor:
        return self.inner.decompress(payload, ctx)

    def combine(self, decoded: Sequence[torch.Tensor]) -> torch.Tensor:
        return self.inner.combine(decoded)

    def state_dict(self) -> dict[str, Any]:
        return {
            "residuals": {k: v.clone() for k, v in self._residuals.items()},
            "inner": self.inner.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = {"residuals", "inner"} - set(state)
        if missing:
            raise ValueError(f"ErrorFeedback state lacks {sorted(missing)}")
        self._residuals = {k: v.clone() for k, v in state["residuals"].items()}
        self.inner.load_state_dict(state["inner"])

    def reset(self) -> None:
        self._residuals.clear()
        self.inner.reset()

    def _forget(self, key: str) -> None:
        self._residuals.pop(key, None)
        self.inner._forget(key)

    def __repr__(self) -> str:
        return f"ErrorFeedback({self.inner!r})"
