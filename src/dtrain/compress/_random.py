"""The random generator of stochastic compressors (private).

Stochastic rounding and random selection must be independent across ranks (else
the rounding errors of P ranks do not average out), yet reproducible. A compressor
given ``seed=None`` therefore seeds its generator with ``rank`` of the default
``torch.distributed`` group (0 without one); an explicit ``seed`` is used as is.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["CompressorRng"]

_RANK_STRIDE = 1_000_003


class CompressorRng:
    """A lazily seeded ``torch.Generator`` whose state can be checkpointed."""

    def __init__(self, seed: int | None) -> None:
        self.seed = seed
        self._gen: torch.Generator | None = None

    @staticmethod
    def _default_seed() -> int:
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                return _RANK_STRIDE * dist.get_rank()
        except (ImportError, RuntimeError):
            pass
        return 0

    @property
    def generator(self) -> torch.Generator:
        if self._gen is None:
            g = torch.Generator()
            g.manual_seed(self.seed if self.seed is not None else self._default_seed())
            self._gen = g
        return self._gen

    def rand(self, *shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=self.generator)

    def randperm(self, n: int) -> torch.Tensor:
        return torch.randperm(n, generator=self.generator)

    def state_dict(self) -> dict[str, Any]:
        return {"rng": self.generator.get_state().clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["rng"])
