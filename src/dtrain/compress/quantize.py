"""Quantizers: fewer bits per gradient element.

=============  ======================  ===========  ======  =========================
compressor     bits per element        scales       biased  paper
=============  ======================  ===========  ======  =========================
FP16 / BF16    16                      none         ~no     (precision cast)
QSGD(L)        log2(L) + 1             1 per group  no      Alistarh et al. 2017
TernGrad       2                       1 per group  no*     Wen et al. 2017
SignSGD        1                       1 per group  yes     Bernstein et al. 2018
OneBit         1                       2 per group  yes     Seide et al. 2014
=============  ======================  ===========  ======  =========================

(*) unbiased for the clipped gradient; TernGrad's clipping at 2.5 sigma is biased
in principle and negligibly so in practice (Wen et al. sec. 3.3).

Scales are fp32, one per *group* of at most ``block`` elements (``column_size``
for OneBit). :meth:`~Compressor.compress` groups a flat tensor in ``block``
consecutive elements. :meth:`~Compressor.compress_layout` -- what DataParallel's
buckets and the parameter server's shards use -- is told the shapes of the tensors
packed in the flat tensor: groups then never cross a tensor boundary and follow
its rows (see :mod:`dtrain.compress._groups`), so every layer is scaled by its own
magnitudes, as the papers scale per layer (TernGrad, EF-signSGD) or per column
(1-bit SGD). A layer whose gradients are 100x smaller than its neighbour's in the
same bucket otherwise moves by the neighbour's step size.

Payloads hold the packed codes (``uint8``) and the fp32 scales, so the bytes a
transport sends are ``ceil(n * bits / 8) + 4 * scales``; with a layout an
``int32`` table of three numbers per tensor comes first (12 bytes per tensor).
"""

from __future__ import annotations

import abc
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dtrain.compress._bits import pack_bits, unpack_bits
from dtrain.compress._groups import Segments, from_table, group_index, segments_of, to_table, whole
from dtrain.compress._random import CompressorRng
from dtrain.compress.base import Compressor, TensorMeta

__all__ = ["FP16", "BF16", "QSGD", "TernGrad", "SignSGD", "OneBit"]


def _flat32(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().reshape(-1).to(torch.float32)


def _out(flat: torch.Tensor, ctx: TensorMeta) -> torch.Tensor:
    return flat[: ctx.numel].reshape(ctx.shape).to(ctx.dtype)


def _check_scale(name: str, scale: str) -> None:
    if scale not in ("rms", "mean"):
        raise ValueError(
            f"{name} scale must be 'rms' (root mean square, keeps the norm) or 'mean' (mean magnitude), got {scale!r}"
        )


def _check_block(name: str, block: int) -> None:
    if not isinstance(block, int) or block < 1:
        raise ValueError(f"{name} must be a positive int (elements per scale), got {block!r}")


class _Grouped(Compressor):
    """A quantizer with per-group scales: the layout plumbing shared by QSGD, TernGrad, SignSGD, OneBit.

    Subclasses implement ``_encode(x, ids, count)`` (``x`` flat fp32, ``ids`` the
    group of each element, ``count`` groups) returning the payload, and
    ``_decode(payload, ids, count, n)`` returning the flat fp32 values.
    """

    @abc.abstractmethod
    def _group_size(self) -> int:
        """Elements per group at most."""

    @abc.abstractmethod
    def _encode(self, x: torch.Tensor, ids: torch.Tensor, count: int) -> list[torch.Tensor]:
        """The payload (without the layout table) of flat fp32 ``x``."""

    @abc.abstractmethod
    def _decode(self, payload: list[torch.Tensor], ids: torch.Tensor, count: int, n: int) -> torch.Tensor:
        """The flat fp32 values of a payload (without the layout table)."""

    def _run(self, tensor: torch.Tensor, segments: Segments) -> list[torch.Tensor]:
        x = _flat32(tensor)
        ids, count = group_index(segments, self._group_size())
        return self._encode(x, ids, count)

    def compress(self, tensor: torch.Tensor, key: str) -> tuple[list[torch.Tensor], TensorMeta]:
        return self._run(tensor, whole(tensor.numel())), TensorMeta.of(tensor)

    def compress_layout(
        self, tensor: torch.Tensor, key: str, shapes: Sequence[Sequence[int]], offset: int = 0
    ) -> tuple[list[torch.Tensor], TensorMeta]:
        """Scales per group of each tensor of ``shapes`` (``tensor`` is elements
        ``[offset, offset + numel)`` of them packed back to back); the payload starts
        with the segment table, so :meth:`decompress` needs no layout."""
        segs = segments_of(shapes, offset, tensor.numel())
        return [to_table(segs), *self._run(tensor, segs)], TensorMeta.of(tensor)

    def decompress(self, payload: list[torch.Tensor], ctx: TensorMeta) -> torch.Tensor:
        n = ctx.numel
        segs = whole(n)
        if payload and payload[0].dtype == torch.int32:  # made by compress_layout
            segs, payload = from_table(payload[0], n), payload[1:]
        ids, count = group_index(segs, self._group_size())
        return _out(self._decode(payload, ids, count, n), ctx)


def _gsum(v: torch.Tensor, ids: torch.Tensor, count: int) -> torch.Tensor:
    """Per-group sums of ``v``."""
    return torch.zeros(count, dtype=v.dtype).index_add_(0, ids, v)


def _gmax(v: torch.Tensor, ids: torch.Tensor, count: int) -> torch.Tensor:
    """Per-group maxima of a non-negative ``v`` (0 for an empty group)."""
    return torch.zeros(count, dtype=v.dtype).scatter_reduce_(0, ids, v, reduce="amax")


def _gcount(ids: torch.Tensor, count: int) -> torch.Tensor:
    return torch.bincount(ids, minlength=count).to(torch.float32)


# ----------------------------------------------------------------------------- casts


@dataclass(frozen=True, eq=False)
class FP16(Compressor):
    """Cast to IEEE half precision (2 bytes per element); summable.

    Values beyond +-65504 overflow to inf; gradients this large mean training has
    already diverged, and mixed-precision loss scaling is the place to handle them.
    """

    name = "fp16"
    summable = True
    collective = "summable"
    biased = False

    def compress(self, tensor: torch.Tensor, key: str) -> tuple[list[torch.Tensor], TensorMeta]:
        return [tensor.detach().reshape(-1).to(torch.float16)], TensorMeta.of(tensor)

    def decompress(self, payload: list[torch.Tensor], ctx: TensorMeta) -> torch.Tensor:
        return payload[0].reshape(ctx.shape).to(ctx.dtype)


@dataclass(frozen=True, eq=False)
class BF16(Compressor):
    """Cast to bfloat16 (fp32's exponent range, 8-bit mantissa; 2 bytes); summable."""

    name = "bf16"
    summable = True
    collective = "summable"
    biased = False

    def compress(self, tensor: torch.Tensor, key: str) -> tuple[list[torch.Tensor], TensorMeta]:
        return [tensor.detach().reshape(-1).to(torch.bfloat16)], TensorMeta.of(tensor)

    def decompress(self, payload: list[torch.Tensor], ctx: TensorMeta) -> torch.Tensor:
        return payload[0].reshape(ctx.shape).to(ctx.dtype)


# ----------------------------------------------------------------------------- QSGD


@dataclass(frozen=True, eq=False)
class QSGD(_Grouped):
    """QSGD: stochastic rounding of ``|x| / ||x||`` to ``levels`` magnitude levels.

    Alistarh et al., "QSGD: Communication-Efficient SGD via Gradient Quantization
    and Encoding", NeurIPS 2017. Per group of at most ``block`` elements:

    1. ``norm = ||x_group||_2``; ``s = levels - 1`` (the paper's number of intervals);
    2. ``r = |x_i| / norm * s``; ``l_i = floor(r) + Bernoulli(r - floor(r))``, so
       ``E[l_i] = r`` (unbiased);
    3. send ``sign(x_i)`` (1 bit) and ``l_i`` (``log2(levels)`` bits) packed, plus
       ``norm`` (fp32); decode ``x_i ~ sign * norm * l_i / s``.

    Cost: ``n * (log2(levels) + 1) / 8 + 4 * groups`` bytes. Variance is at most
    ``min(block / s**2, sqrt(block) / s) * ||x||^2`` (paper, Lemma 3.1).

    Args:
        levels: magnitude levels including zero; a power of two >= 2 (default: 16).
        block: elements sharing one norm (default: 512).
        seed: random seed (default: derived from the rank).
    """

    levels: int = 16
    block: int = 512
    seed: int | None = None
    _rng: CompressorRng = field(init=False, repr=False)

    name = "qsgd"
    summable = False
    biased = False

    def __post_init__(self) -> None:
        if not isinstance(self.levels, int) or self.levels < 2 or self.levels & (self.levels - 1):
            raise ValueError(f"QSGD levels must be a power of two >= 2 (e.g. 4, 16, 128), got {self.levels!r}")
        if self.levels > 128:
            raise ValueError(f"QSGD levels must be <= 128 so a code fits one byte, got {self.levels}")
        _check_block("QSGD block", self.block)
        object.__setattr__(self, "_rng", CompressorRng(self.seed))

    @property
    def bits(self) -> int:
        return int(math.log2(self.levels)) + 1

    def _group_size(self) -> int:
        return self.block

    def _encode(self, x: torch.Tensor, ids: torch.Tensor, count: int) -> list[torch.Tensor]:
        norms = _gsum(x * x, ids, count).sqrt_()
        s = self.levels - 1
        safe = torch.where(norms > 0, norms, torch.ones_like(norms))
        r = x.abs() / safe[ids] * s
        low = r.floor()
        level = low + (self._rng.rand(x.numel()) < (r - low)).to(r.dtype)
        level = level.clamp_(max=s).to(torch.uint8)
        codes = ((x < 0).to(torch.uint8) << (self.bits - 1)) | level
        return [pack_bits(codes, self.bits), norms]

    def _decode(self, payload: list[torch.Tensor], ids: torch.Tensor, count: int, n: int) -> torch.Tensor:
        packed, norms = payload
        codes = unpack_bits(packed, self.bits, n)
        mag_bits = self.bits - 1
        level = (codes & ((1 << mag_bits) - 1)).to(torch.float32)
        sign = 1.0 - 2.0 * (codes >> mag_bits).to(torch.float32)
        return sign * level * (norms.to(torch.float32) / (self.levels - 1))[ids]

    def state_dict(self) -> dict[str, Any]:
        return self._rng.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._rng.load_state_dict(state)


# ----------------------------------------------------------------------------- TernGrad


@dataclass(frozen=True, eq=False)
class TernGrad(_Grouped):
    """TernGrad: stochastic ternary values ``{-s, 0, +s}``, 2 bits each.

    Wen et al., "TernGrad: Ternary Gradients to Reduce Communication in Distributed
    Deep Learning", NeurIPS 2017. Per group of at most ``block`` elements:

    1. clip (sec. 3.3): ``x_i = clamp(x_i, -c sigma, c sigma)`` with ``sigma`` the
       group's root mean square (the paper's standard deviation, taken about zero
       so that a gradient of one sign is not cut to its spread) and ``c = clip``;
    2. ``s = max |x_i|``;
    3. ``b_i ~ Bernoulli(|x_i| / s)``; send code 0 (zero), 1 (+) or 2 (-) per element;
    4. decode ``x_i ~ s * sign(x_i) * b_i``; ``E = x_i`` (the clipped value).

    Without clipping ``s`` is the group's largest entry, and a group whose other
    entries are much smaller sends almost only zeros with a large ``s``: the
    variance ``sum |x_i| (s - |x_i|)`` grows with ``s``. Clipping at 2.5 sigma
    changes less than 1.3% of the entries of a Gaussian (the paper measures no
    accuracy loss from it) and bounds ``s`` by ``2.5 sigma``.

    Cost: ``n / 4 + 4 * groups`` bytes.

    Args:
        block: elements sharing one scale (default: 512).
        clip: clip at this many sigmas; ``None`` keeps every value, and then the
            estimate is exactly unbiased (default: 2.5, the paper's).
        seed: random seed (default: derived from the rank).
    """

    block: int = 512
    clip: float | None = 2.5
    seed: int | None = None
    _rng: CompressorRng = field(init=False, repr=False)

    name = "terngrad"
    summable = False
    biased = False

    def __post_init__(self) -> None:
        _check_block("TernGrad block", self.block)
        clip = self.clip
        if clip is not None and (not isinstance(clip, (int, float)) or not clip > 0 or math.isinf(clip)):
            raise ValueError(
                f"TernGrad clip must be a finite number of sigmas > 0 (the paper's is 2.5) or None, got {clip!r}"
            )
        object.__setattr__(self, "_rng", CompressorRng(self.seed))

    def _group_size(self) -> int:
        return self.block

    def clipped(self, tensor: torch.Tensor, segments: Segments | None = None) -> torch.Tensor:
        """Step 1 alone: the values whose expectation the payload carries (flat fp32)."""
        x = _flat32(tensor)
        ids, count = group_index(segments if segments is not None else whole(x.numel()), self.block)
        return self._clip(x, ids, count)

    def _clip(self, x: torch.Tensor, ids: torch.Tensor, count: int) -> torch.Tensor:
        if self.clip is None:
            return x
        rms = (_gsum(x * x, ids, count) / _gcount(ids, count).clamp_(min=1)).sqrt_()
        c = (self.clip * rms)[ids]
        return torch.minimum(torch.maximum(x, -c), c)

    def _encode(self, x: torch.Tensor, ids: torch.Tensor, count: int) -> list[torch.Tensor]:
        x = self._clip(x, ids, count)
        mag = x.abs()
        scales = _gmax(mag, ids, count)
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        keep = self._rng.rand(x.numel()) < mag / safe[ids]
        codes = keep.to(torch.uint8) * torch.where(x < 0, 2, 1).to(torch.uint8)
        return [pack_bits(codes, 2), scales]

    def _decode(self, payload: list[torch.Tensor], ids: torch.Tensor, count: int, n: int) -> torch.Tensor:
        packed, scales = payload
        codes = unpack_bits(packed, 2, n)
        val = (codes == 1).to(torch.float32) - (codes == 2).to(torch.float32)
        return val * scales.to(torch.float32)[ids]

    def state_dict(self) -> dict[str, Any]:
        return self._rng.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._rng.load_state_dict(state)


# ----------------------------------------------------------------------------- sign


@dataclass(frozen=True, eq=False)
class SignSGD(_Grouped):
    """Scaled sign: 1 bit per element plus one scale per group.

    Bernstein et al., "signSGD: Compressed Optimisation for Non-Convex Problems",
    ICML 2018; the scaled form with error feedback is Karimireddy et al.,
    "Error Feedback Fixes SignSGD and other Gradient Compression Schemes", ICML 2019,
    who scale each layer by its own mean magnitude.

    1. ``s`` = the group's root mean square ``||x|| / sqrt(m)`` (``scale="rms"``),
       or its mean magnitude ``||x||_1 / m`` (``scale="mean"``);
    2. send bit ``x_i >= 0``; decode ``s * (+1 | -1)``.

    The mean magnitude minimises the squared error of one step, but the step it
    sends is shorter than the input by the factor ``||x||_1 / (sqrt(m) ||x||)``,
    which is small where a few entries dominate a group; error feedback then
    holds back most of those entries for many steps. The root mean square keeps
    the norm of the input (as 1-bit Adam's compressed allreduce does: Tang et al.,
    "1-bit Adam", ICML 2021): on the default CNN with momentum before the sign it
    trained in every run, the mean in most (``benchmarks/compression.py``).

    With ``majority_vote=True`` the aggregate of several ranks is the elementwise
    majority of their signs (signSGD with majority vote, Bernstein et al. 2018/2019),
    scaled by the mean of their scales, instead of the mean of the decoded tensors.

    Every element moves by its group's ``s`` each step, small entries included; error
    feedback takes the overshoot back on the next steps. Momentum belongs before the
    sign (Signum; EF-signSGD with momentum): :class:`~dtrain.compress.ErrorFeedback`
    ``(momentum=...)`` does that, and :func:`~dtrain.compress.from_spec` sets it up.

    Cost: ``n / 8 + 4 * groups`` bytes. Biased: use error feedback.

    Args:
        block: elements sharing one scale (default: 512).
        majority_vote: aggregate by majority vote (default: False).
        scale: ``"rms"`` or ``"mean"`` (default: ``"rms"``).
    """

    block: int = 512
    majority_vote: bool = False
    scale: str = "rms"

    name = "sign"
    summable = False
    biased = True
    momentum_first = True

    def __post_init__(self) -> None:
        _check_block("SignSGD block", self.block)
        _check_scale("SignSGD", self.scale)
        object.__setattr__(self, "mean_combine", not self.majority_vote)

    def _group_size(self) -> int:
        return self.block

    def _encode(self, x: torch.Tensor, ids: torch.Tensor, count: int) -> list[torch.Tensor]:
        m = _gcount(ids, count).clamp_(min=1)
        if self.scale == "rms":
            scales = (_gsum(x * x, ids, count) / m).sqrt_()
        else:
            scales = _gsum(x.abs(), ids, count) / m
        return [pack_bits((x >= 0).to(torch.uint8), 1), scales]

    def _decode(self, payload: list[torch.Tensor], ids: torch.Tensor, count: int, n: int) -> torch.Tensor:
        packed, scales = payload
        sign = unpack_bits(packed, 1, n).to(torch.float32) * 2.0 - 1.0
        return sign * scales.to(torch.float32)[ids]

    def combine(self, decoded: Sequence[torch.Tensor]) -> torch.Tensor:
        if not self.majority_vote:
            return super().combine(decoded)
        if not decoded:
            raise ValueError("combine needs at least one tensor")
        votes = torch.sign(decoded[0])
        mags = decoded[0].abs()
        for d in decoded[1:]:
            votes += torch.sign(d)
            mags += d.abs()
        return torch.sign(votes).mul_(mags.div_(len(decoded)))


# ----------------------------------------------------------------------------- 1-bit SGD


@dataclass(frozen=True, eq=False)
class OneBit(_Grouped):
    """1-bit SGD: sign bit per element, two reconstruction values per column.

    Seide et al., "1-Bit Stochastic Gradient Descent and its Application to
    Data-Parallel Distributed Training of Speech DNNs", Interspeech 2014.

    1. quantize each element by the threshold 0 to one bit;
    2. per column, two reconstruction values: for the non-negative entries and
       for the negative ones, their mean (``scale="mean"``, the paper's: it
       minimises the squared error for the given bits) or their root mean square
       with the sign (``scale="rms"``: keeps the norm of each class, which error
       feedback with momentum before the quantizer needs, as for
       :class:`SignSGD`);
    3. decode each element to its column's value for its bit.

    The paper's columns are the weights of one output unit. With a layout
    (:meth:`compress_layout`) a column is a row of a PyTorch weight (its fan-in,
    the paper's column of the transposed matrix), several short rows together or
    a long one cut, at most ``column_size`` elements; without one, ``column_size``
    consecutive elements. Cost: ``n / 8 + 8 * columns`` bytes. Biased: the paper
    carries the quantization error into the next step (error feedback), which
    :func:`~dtrain.compress.from_spec` adds, with momentum before the quantizer as
    for :class:`SignSGD`.

    Args:
        column_size: elements per column at most (default: 512).
        scale: ``"rms"`` or ``"mean"`` (default: ``"rms"``).
    """

    column_size: int = 512
    scale: str = "rms"

    name = "onebit"
    summable = False
    biased = True
    momentum_first = True

    def __post_init__(self) -> None:
        _check_block("OneBit column_size", self.column_size)
        _check_scale("OneBit", self.scale)

    def _group_size(self) -> int:
        return self.column_size

    def _encode(self, x: torch.Tensor, ids: torch.Tensor, count: int) -> list[torch.Tensor]:
        pos = (x >= 0).to(torch.float32)
        neg = 1.0 - pos
        n_pos, n_neg = _gsum(pos, ids, count).clamp_(min=1), _gsum(neg, ids, count).clamp_(min=1)
        if self.scale == "rms":
            x2 = x * x
            pos_val = (_gsum(x2 * pos, ids, count) / n_pos).sqrt_()
            neg_val = (_gsum(x2 * neg, ids, count) / n_neg).sqrt_().neg_()
        else:
            pos_val = _gsum(x * pos, ids, count) / n_pos
            neg_val = _gsum(x * neg, ids, count) / n_neg
        return [pack_bits(pos.to(torch.uint8), 1), pos_val, neg_val]

    def _decode(self, payload: list[torch.Tensor], ids: torch.Tensor, count: int, n: int) -> torch.Tensor:
        packed, pos_val, neg_val = payload
        bit = unpack_bits(packed, 1, n).bool()
        return torch.where(bit, pos_val.to(torch.float32)[ids], neg_val.to(torch.float32)[ids])
