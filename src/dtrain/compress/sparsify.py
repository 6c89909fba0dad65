"""Sparsifiers: send a few (index, value) pairs instead of the whole tensor.

Every sparsifier's payload is ``[indices (int32, ascending), values (input dtype)]``,
``k * (4 + value bytes)`` bytes for ``k`` kept elements. Payloads of several ranks
are not summable as they are (their index sets differ); they are reduced by
:func:`dtrain.comm.sparse.sparse_allreduce`, which merges the pairs and switches
to a dense representation when the merged density makes that cheaper.

===========  ===============================  ======  =========================
compressor   keeps                            biased  paper
===========  ===============================  ======  =========================
TopK         the ``k`` largest ``|x_i|``        yes     Aji & Heafield 2017; Stich et al. 2018
RandomK      ``k`` uniformly random, x n/k      no      Wangni et al. 2018; Stich et al. 2018
RandomK      ``k`` uniformly random (memory)    yes     Stich et al. 2018 (rand-k with memory)
Threshold    every ``|x_i| >= value``           yes     Strom 2015
===========  ===============================  ======  =========================

``k = max(1, ceil(ratio * n))``.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from dtrain.compress._random import CompressorRng
from dtrain.compress.base import Compressor, TensorMeta

__all__ = ["SparseCompressor", "TopK", "RandomK", "Threshold"]

_MAX_INDEX = 2**31 - 1


def _check_ratio(name: str, ratio: float) -> None:
    if not isinstance(ratio, (int, float)) or not 0.0 < float(ratio) <= 1.0:
        raise ValueError(f"{name} ratio must be in (0, 1] (fraction of elements kept, e.g. 0.01), got {ratio!r}")


class SparseCompressor(Compressor):
    """Base of compressors whose payload is ``[indices int32, values]``.

    Subclasses implement :meth:`select`; packing, decoding and the index-range
    check live here.
    """

    summable = False
    collective = "sparse"

    @abc.abstractmethod
    def select(self, flat: torch.Tensor, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Pick ``(indices int64 ascending, values)`` from the flat tensor."""

    def compress(self, tensor: torch.Tensor, key: str) -> tuple[list[torch.Tensor], TensorMeta]:
        flat = tensor.detach().reshape(-1)
        if flat.numel() > _MAX_INDEX:
            raise ValueError(f"{type(self).__name__}: tensors over 2**31-1 elements need int64 indices")
        idx, vals = self.select(flat, key)
        return [idx.to(torch.int32), vals.contiguous()], TensorMeta.of(tensor)

    def decompress(self, payload: list[torch.Tensor], ctx: TensorMeta) -> torch.Tensor:
        idx, vals = payload
        out = torch.zeros(ctx.numel, dtype=ctx.dtype)
        out[idx.to(torch.int64)] = vals.to(ctx.dtype)
        return out.reshape(ctx.shape)

    @staticmethod
    def k_for(n: int, ratio: float) -> int:
        return min(n, max(1, math.ceil(ratio * n)))


@dataclass(frozen=True, eq=False)
class TopK(SparseCompressor):
    """Keep the ``ratio`` fraction of elements largest in magnitude.

    1. ``k = max(1, ceil(ratio * n))``; 2. ``torch.topk(|x|, k)``; 3. send the sorted
    indices and their values. Cost: ``8 k`` bytes for fp32 (vs ``4 n`` dense), plus
    ``O(n log k)`` to select. Biased (it drops the small entries for good unless
    error feedback keeps them): Stich, Cordonnier & Jaggi, "Sparsified SGD with
    Memory", NeurIPS 2018; Aji & Heafield, "Sparse Communication for Distributed
    Gradient Descent", EMNLP 2017.

    Args:
        ratio: fraction of elements kept, in (0, 1] (default: 0.01).
    """

    ratio: float = 0.01

    name = "topk"
    biased = True

    def __post_init__(self) -> None:
        _check_ratio("TopK", self.ratio)

    def select(self, flat: torch.Tensor, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        k = self.k_for(flat.numel(), self.ratio)
        idx = torch.topk(flat.abs(), k, sorted=False).indices.sort().values
        return idx, flat[idx]


@dataclass(frozen=True, eq=False)
class RandomK(SparseCompressor):
    """Keep ``k`` elements chosen uniformly without replacement.

    1. ``k = max(1, ceil(ratio * n))``; draw ``k`` distinct indices uniformly;
    2. ``scale=True``: send the values times ``n / k``. Each element is kept with
       probability ``k / n``, so the estimate is unbiased (Wangni et al., "Gradient
       Sparsification for Communication-Efficient Distributed Optimization",
       NeurIPS 2018); its variance is ``(n / k - 1) * ||x||^2``: 99 times the
       gradient's own square norm at ratio 0.01;
    3. ``scale=False``: send the values as they are. Biased (it drops ``1 - k/n`` of
       the gradient), meant for error feedback, which :func:`~dtrain.compress.from_spec`
       adds: every element is sent, in full, about every ``n / k`` steps --
       rand-k with memory, Stich, Cordonnier & Jaggi, "Sparsified SGD with
       Memory", NeurIPS 2018.

    Neither trains as well as TopK with error feedback: the scaled form is too
    noisy, the memory form sends each element ``n / k`` steps late on average
    (``benchmarks/compression.py`` measures them). Cost: ``8 k`` bytes.

    Args:
        ratio: fraction of elements kept, in (0, 1] (default: 0.01).
        scale: multiply by ``n / k`` (unbiased) or not (memory) (default: True).
        seed: random seed (default: derived from the rank).
    """

    ratio: float = 0.01
    scale: bool = True
    seed: int | None = None
    _rng: CompressorRng = field(init=False, repr=False)

    name = "randomk"
    biased = False

    def __post_init__(self) -> None:
        _check_ratio("RandomK", self.ratio)
        if not isinstance(self.scale, bool):
            raise ValueError(
                f"RandomK scale must be True (unbiased, x n/k) or False (for error feedback), got {self.scale!r}"
            )
        object.__setattr__(self, "biased", not self.scale)
        object.__setattr__(self, "_rng", CompressorRng(self.seed))

    def select(self, flat: torch.Tensor, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        n = flat.numel()
        k = self.k_for(n, self.ratio)
        idx = self._rng.randperm(n)[:k].sort().values
        return idx, flat[idx] * (n / k) if self.scale else flat[idx].clone()

    def state_dict(self) -> dict[str, Any]:
        return self._rng.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._rng.load_state_dict(state)


@dataclass(frozen=True, eq=False)
class Threshold(SparseCompressor):
    """Keep every element with ``|x_i| >= value``.

    Strom, "Scalable Distributed DNN Training Using Commodity GPU Cloud Computing",
    Interspeech 2015. The number kept varies from step to step (zero to ``n``);
    the payload carries its own length. Biased: use error feedback, which also
    lets small entries accumulate until they cross the threshold.

    Args:
        value: the magnitude threshold, > 0 (default: 1e-3).
    """

    value: float = 1e-3

    name = "threshold"
    biased = True

    def __post_init__(self) -> None:
        if not isinstance(self.value, (int, float)) or not float(self.value) > 0.0 or math.isinf(self.value):
            raise ValueError(f"Threshold value must be a finite number > 0, got {self.value!r}")

    def select(self, flat: torch.Tensor, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.nonzero(flat.abs() >= self.value, as_tuple=True)[0]
        return idx, flat[idx]
