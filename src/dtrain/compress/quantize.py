"""Quantizers: fewer bits per gradient element.

=============  ======================  ===========  ======  =========================
compressor     bits per element        scales       biased  paper
=============  ======================  ===========  ======  =========================
FP16 / BF16    16                      none         ~no     (precision cast)
QSGD(L)        log2(L) + 1             1 per block  no      Alistarh et al. 2017
TernGrad       2                       1 per block  no      Wen et al. 2017
SignSGD        1                       1 per block  yes     Bernstein et al. 2018
OneBit         1                       2 per column yes     Seide et al. 2014
=============  ======================  ===========  ======  =========================

Tuning (measured with ``benchmarks/compression.py``, default CNN on digits, 4
workers): with SGD momentum 0.9 applied after averaging (lr 0.05) FP16, BF16 and
QSGD train like uncompressed SGD, while TernGrad, SignSGD and OneBit diverge after
a few epochs; without momentum (lr 0.2) all of them reach the uncompressed
accuracy. Momentum amplifies the delay error feedback adds (and TernGrad's
variance); signSGD's authors put momentum before the sign (Signum) for this reason.

Every quantizer works on the flattened tensor. Scales are fp32 and taken per
``block`` consecutive elements (per ``column_size`` for OneBit), which bounds the
variance a single large entry causes; the last block may be short. Payloads hold
the packed codes (``uint8``) followed by the fp32 scales, so the bytes a transport
sends are ``ceil(n * bits / 8) + 4 * scales``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from dtrain.compress._bits import as_blocks, pack_bits, unpack_bits
from dtrain.compress._random import CompressorRng
from dtrain.compress.base import Compressor, TensorMeta

__all__ = ["FP16", "BF16", "QSGD", "TernGrad", "SignSGD", "OneBit"]


def _flat32(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().reshape(-1).to(torch.float32)


def _out(flat: torch.Tensor, ctx: TensorMeta) -> torch.Tensor:
    return flat[: ctx.numel].reshape(ctx.shape).to(ctx.dtype)


def _check_block(name: str, block: int) -> None:
    if not isinstance(block, int) or block < 1:
        raise ValueError(f"{name} must be a positive int (elements per scale), got {block!r}")


def _valid_mask(n: int, block: int) -> torch.Tensor:
    """(num_blocks, block) mask: True where a padded block holds a real element."""
    return as_blocks(torch.ones(n, dtype=torch.bool), block)


# ----------------------------------------------------------------------------- casts


@dataclass(frozen=True, eq=False)
class FP16(Compressor):
    """Cast to IEEE half precision (2 bytes per element); summable.

    Values beyond +-65504 overflow to inf; gradients this large mean training has
    already diverged, and mixed-precision loss scaling is the place to handle them.
    """

    name = "fp16"
    summable = True
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
    biased = False

    def compress(self, tensor: torch.Tensor, key: str) -> tuple[list[torch.Tensor], TensorMeta]:
        return [tensor.detach().reshape(-1).to(torch.bfloat16)], TensorMeta.of(tensor)

    def decompress(self, payload: list[torch.Tensor], ctx: TensorMeta) -> torch.Tensor:
        return payload[0].reshape(ctx.shape).to(ctx.dtype)


# ----------------------------------------------------------------------------- QSGD


@dataclass(frozen=True, eq=False)
class QSGD(Compressor):
    """QSGD: stochastic rounding of ``|x| / ||x||`` to ``levels`` magnitude levels.

    Alistarh et al., "QSGD: Communication-Efficient SGD via Gradient Quantization
    and Encoding", NeurIPS 2017. Per block of ``block`` elements:

    1. ``norm = ||x_block||_2``; ``s = levels - 1`` (the paper's number of intervals);
    2. ``r = |x_i| / norm * s``; ``l_i = floor(r) + Bernoulli(r - floor(r))``, so
       ``E[l_i] = r`` (unbiased);
    3. send ``sign(x_i)`` (1 bit) and ``l_i`` (``log2(levels)`` bits) packed, plus
       ``norm`` (fp32); decode ``x_i ~ sign * norm * l_i / s``.

    Cost: ``n * (log2(levels) + 1) / 8 + 4 * ceil(n / block)`` bytes. Variance is at
    most ``min(block / s**2, sqrt(block) / s) * ||x||^2`` (paper, Lemma 3.1).

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

    def compress(self, tensor: torch.Tensor, key: str) -> tuple[list[torch.Tensor], TensorMeta]:
        x = _flat32(tensor)
        blocks = as_blocks(x, self.block)
        norms = blocks.norm(dim=1)
        s = self.levels - 1
        safe = torch.where(norms > 0, norms, torch.ones_like(norms))
        r = blocks.abs() / safe.unsqueeze(1) * s
        low = r.floor()
        level = low + (self._rng.rand(*r.shape) < (r - low)).to(r.dtype)
        level = level.clamp_(max=s).to(torch.uint8)
        sign = (blocks < 0).to(torch.uint8)
        codes = (sign << (self.bits - 1)) | level
        packed = pack_bits(codes.reshape(-1)[: x.numel()], self.bits)
        return [packed, norms], TensorMeta.of(tensor)

    def decompress(self, payload: list[torch.Tensor], ctx: TensorMeta) -> torch.Tensor:
        packed, norms = payload
        n = ctx.numel
        codes = unpack_bits(packed, self.bits, n)
        mag_bits = self.bits - 1
        level = (codes & ((1 << mag_bits) - 1)).to(torch.float32)
        sign = 1.0 - 2.0 * (codes >> mag_bits).to(torch.float32)
        scale = norms.to(torch.float32).repeat_interleave(self.block)[:n] / (self.levels - 1)
        return _out(sign * level * scale, ctx)

    def state_dict(self) -> dict[str, Any]:
        return self._rng.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._rng.load_state_dict(state)


# ----------------------------------------------------------------------------- TernGrad


@dataclass(frozen=True, eq=False)
class TernGrad(Compressor):
    """TernGrad: stochastic ternary values ``{-s, 0, +s}``, 2 bits each.

    Wen et al., "TernGrad: Ternary Gradients to Reduce Communication in Distributed
    Deep Learning", NeurIPS 2017. Per block:

    1. ``s = max |x_i|``;
    2. ``b_i ~ Bernoulli(|x_i| / s)``; send code 0 (zero), 1 (+) or 2 (-) per element;
    3. decode ``x_i ~ s * sign(x_i) * b_i``; ``E = x_i`` (unbiased).

    Cost: ``n / 4 + 4 * ceil(n / block)`` bytes. The paper's gradient clipping
    (which biases the estimate) is left to the optimizer.

    Args:
        block: elements sharing one scale (default: 512).
        seed: random seed (default: derived from the rank).
    """

    block: int = 512
    seed: int | None = None
    _rng: CompressorRng = field(init=False, repr=False)

    name = "terngrad"
    summable = False
    biased = False

    def __post_init__(self) -> None:
        _check_block("TernGrad block", self.block)
        object.__setattr__(self, "_rng", CompressorRng(self.seed))

    def compress(self, tensor: torch.Tensor, key: str) -> tuple[list[torch.Tensor], TensorMeta]:
        x = _flat32(tensor)
        blocks = as_blocks(x, self.block)
        scales = blocks.abs().amax(dim=1)
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        keep = self._rng.rand(*blocks.shape) < blocks.abs() / safe.unsqueeze(1)
        codes = keep.to(torch.uint8) * torch.where(blocks < 0, 2, 1).to(torch.uint8)
        return [pack_bits(codes.reshape(-1)[: x.numel()], 2), scales], TensorMeta.of(tensor)

    def decompress(self, payload: list[torch.Tensor], ctx: TensorMeta) -> torch.Tensor:
        packed, scales = payload
        n = ctx.numel
        codes = unpack_bits(packed, 2, n)
        val = (codes == 1).to(torch.float32) - (codes == 2).to(torch.float32)
        return _out(val * scales.to(torch.float32).repeat_interleave(self.block)[:n], ctx)

    def state_dict(self) -> dict[str, Any]:
        return self._rng.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._rng.load_state_dict(state)


# ----------------------------------------------------------------------------- sign


@dataclass(frozen=True, eq=False)
class SignSGD(Compressor):
    """Scaled sign: 1 bit per element plus the block's mean magnitude.

    Bernstein et al., "signSGD: Compressed Optimisation for Non-Convex Problems",
    ICML 2018; the scaled form with error feedback is Karimireddy et al.,
    "Error Feedback Fixes SignSGD and other Gradient Compression Schemes", ICML 2019.

    1. ``s = mean |x_i|`` over the block;
    2. send bit ``x_i >= 0``; decode ``s * (+1 | -1)``.

    With ``majority_vote=True`` the aggregate of several ranks is the elementwise
    majority of their signs (signSGD with majority vote, Bernstein et al. 2018/2019),
    scaled by the mean of their scales, instead of the mean of the decoded tensors.

    Cost: ``n / 8 + 4 * ceil(n / block)`` bytes. Biased: use error feedback.

    Args:
        block: elements sharing one scale (default: 512).
        majority_vote: aggregate by majority vote (default: False).
    """

    block: int = 512
    majority_vote: bool = False

    name = "sign"
    summable = False
    biased = True

    def __post_init__(self) -> None:
        _check_block("SignSGD block", self.block)

    def compress(self, tensor: torch.Tensor, key: str) -> tuple[list[torch.Tensor], TensorMeta]:
        x = _flat32(tensor)
        n = x.numel()
        blocks = as_blocks(x, self.block)
        counts = _valid_mask(n, self.block).sum(dim=1).clamp_(min=1)
        scales = blocks.abs().sum(dim=1) / counts
        return [pack_bits((x >= 0).to(torch.uint8), 1), scales], TensorMeta.of(tensor)

    def decompress(self, payload: list[torch.Tensor], ctx: TensorMeta) -> torch.Tensor:
        packed, scales = payload
        n = ctx.numel
        sign = unpack_bits(packed, 1, n).to(torch.float32) * 2.0 - 1.0
        return _out(sign * scales.to(torch.float32).repeat_interleave(self.block)[:n], ctx)

    def combine(self, decoded: Sequence[torch.Tensor]) -> torch.Tensor:
        if not self.majority_vote:
            return super().combine(decoded)
        votes = torch.sign(decoded[0])
        mags = decoded[0].abs()
        for d in decoded[1:]:
            votes += torch.sign(d)
            mags += d.abs()
        return torch.sign(votes).mul_(mags.div_(len(decoded)))


# ----------------------------------------------------------------------------- 1-bit SGD


@dataclass(frozen=True, eq=False)
class OneBit(Compressor):
    """1-bit SGD: sign bit per element, two reconstruction values per column.

    Seide et al., "1-Bit Stochastic Gradient Descent and its Application to
    Data-Parallel Distributed Training of Speech DNNs", Interspeech 2014.

    1. quantize each element by the threshold 0 to one bit;
    2. per column, the reconstruction values are the mean of the column's
       non-negative entries and the mean of its negative entries (this minimises
       the squared error for the given bits);
    3. decode each element to its column's value for its bit.

    The paper quantizes weight matrices column by column. dtrain compresses flat
    buckets that mix layers, so here a column is ``column_size`` consecutive
    elements of the flattened tensor. Cost: ``n / 8 + 8 * ceil(n / column_size)``
    bytes. Biased: the paper carries the quantization error into the next step
    (error feedback), which :func:`~dtrain.compress.from_spec` adds.

    Args:
        column_size: elements per column (default: 512).
    """

    column_size: int = 512

    name = "onebit"
    summable = False
    biased = True

    def __post_init__(self) -> None:
        _check_block("OneBit column_size", self.column_size)

    def compress(self, tensor: torch.Tensor, key: str) -> tuple[list[torch.Tensor], TensorMeta]:
        x = _flat32(tensor)
        n = x.numel()
        cols = as_blocks(x, self.column_size)
        valid = _valid_mask(n, self.column_size)
        pos = (cols >= 0) & valid
        neg = cols < 0
        pos_mean = (cols * pos).sum(dim=1) / pos.sum(dim=1).clamp(min=1)
        neg_mean = (cols * neg).sum(dim=1) / neg.sum(dim=1).clamp(min=1)
        return [pack_bits((x >= 0).to(torch.uint8), 1), pos_mean, neg_mean], TensorMeta.of(tensor)

    def decompress(self, payload: list[torch.Tensor], ctx: TensorMeta) -> torch.Tensor:
        packed, pos_mean, neg_mean = payload
        n = ctx.numel
        bit = unpack_bits(packed, 1, n).bool()
        c = self.column_size
        pos = pos_mean.to(torch.float32).repeat_interleave(c)[:n]
        neg = neg_mean.to(torch.float32).repeat_interleave(c)[:n]
        return _out(torch.where(bit, pos, neg), ctx)

