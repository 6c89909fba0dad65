"""The :class:`Compressor` contract shared by every gradient compressor.

A compressor turns a gradient tensor into a *payload* (a list of tensors, already
packed: bits in ``uint8``, indices in ``int32``) plus a *context* that is fully
determined by the input's shape and dtype (:class:`TensorMeta`). Everything that
depends on the data travels in the payload, so a receiver that knows only the
shape and dtype can decode: that is what :meth:`Compressor.from_wire` relies on.

Three ways the rest of dtrain moves a payload:

* ``summable`` compressors (FP16, BF16, PowerSGD's factors) have payloads that an
  allreduce may sum element-wise as they are;
* the others are exchanged and decoded before summing
  (:func:`dtrain.compress.compressed_allreduce` picks the collective);
* the parameter server ships one tensor at a time as bytes:
  :meth:`Compressor.to_wire` / :meth:`Compressor.from_wire`.

Stateful compressors (error-feedback residuals, PowerSGD's warm-start ``Q``, random
generators) keep their state per ``key`` (one key per tensor or bucket) and expose
it through :meth:`Compressor.state_dict` so that checkpoints save it.
"""

from __future__ import annotations

import abc
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["COLLECTIVES", "Compressor", "Identity", "TensorMeta", "pack_payload", "unpack_payload", "payload_nbytes"]


@dataclass(frozen=True)
class TensorMeta:
    """Context of a compressed tensor: what :meth:`Compressor.decompress` needs besides the payload.

    Attributes:
        shape: the original tensor's shape.
        dtype: the original tensor's dtype.
    """

    shape: torch.Size
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= int(s)
        return n

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorMeta:
        return cls(torch.Size(tensor.shape), tensor.dtype)


#: the collectives a compressor's payloads travel by (:attr:`Compressor.collective`)
COLLECTIVES = ("summable", "lowrank", "sparse", "gathered")


class Compressor(abc.ABC):
    """Abstract gradient compressor.

    Subclasses implement :meth:`compress` and :meth:`decompress`; the wire format,
    byte counting and (empty) state handling come from here.

    Attributes:
        name: the registry name (``"topk"``, ``"qsgd"``, ...), used in specs and reports.
        summable: payloads of different ranks may be summed element-wise by an
            allreduce and then decoded once (divide by the world size afterwards).
        biased: ``E[decompress(compress(x))] != x``; :func:`dtrain.compress.from_spec`
            wraps biased compressors in :class:`~dtrain.compress.ErrorFeedback`.
        momentum_first: SGD's momentum must be applied before this compressor, not
            to the averaged result (sign-type quantizers, whose every element moves
            by a group's step size): :func:`dtrain.compress.from_spec` then gives
            the error feedback the optimizer's momentum.
        mean_combine: :meth:`combine` is the plain mean, so an aggregator may take
            the mean in its own order (False for majority vote).
        momentum: SGD momentum this compressor applies itself, per worker, before
            compressing (:class:`~dtrain.compress.ErrorFeedback` ``(momentum=...)``);
            when > 0 the optimizer must run with momentum 0.
        collective: which collective carries the payloads (:data:`COLLECTIVES`):
            "summable" (an allreduce of the payloads), "lowrank" (PowerSGD's two
            allreduces of factors), "sparse" (the sparse allreduce of (index, value)
            pairs) or "gathered" (every rank's payload to every rank, decoded and
            combined there: the quantizers). The compressed allreduce and the
            performance model read it; neither asks for the class.
    """

    name: str = "abstract"
    summable: bool = False
    collective: str = "gathered"
    biased: bool = False
    momentum_first: bool = False
    mean_combine: bool = True
    momentum: float = 0.0

    @abc.abstractmethod
    def compress(self, tensor: torch.Tensor, key: str) -> tuple[list[torch.Tensor], TensorMeta]:
        """Encode ``tensor``.

        Args:
            tensor: the gradient (any shape, floating point).
            key: names the tensor (or bucket) for per-tensor state; use the same key
                for the same tensor at every step.

        Returns:
            ``(payload, ctx)``: packed tensors to send, and the context to decode with.
        """

    @abc.abstractmethod
    def decompress(self, payload: list[torch.Tensor], ctx: TensorMeta) -> torch.Tensor:
        """Decode a payload into a tensor of ``ctx.shape`` and ``ctx.dtype``."""

    def compress_layout(
        self, tensor: torch.Tensor, key: str, shapes: Sequence[Sequence[int]], offset: int = 0
    ) -> tuple[list[torch.Tensor], TensorMeta]:
        """:meth:`compress` for a flat tensor that packs tensors of ``shapes`` back to back.

        ``tensor`` holds elements ``[offset, offset + numel)`` of that packing (a
        slice of a bucket; the whole of it by default). Compressors that can use
        the layout override it (PowerSGD factors each matrix on its own, the
        quantizers scale each tensor on its own); the others ignore it.
        :meth:`decompress` decodes either.
        """
        return self.compress(tensor, key)

    def combine(self, decoded: Sequence[torch.Tensor]) -> torch.Tensor:
        """Aggregate decoded tensors of several ranks into their average.

        Summed in the order given (rank order), so every rank that combines the
        same inputs gets bitwise the same result. Majority-vote SignSGD overrides it.
        """
        if not decoded:
            raise ValueError("combine needs at least one tensor")
        acc = decoded[0].clone()
        for d in decoded[1:]:
            acc += d
        return acc.div_(len(decoded))

    # ------------------------------------------------------------------ wire

    def to_wire(self, tensor: torch.Tensor, key: str, shapes: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
        """Compress ``tensor`` and pack the payload into one 1-D ``uint8`` tensor.

        The buffer is self-describing (a short header gives each payload tensor's
        dtype and shape), so :meth:`from_wire` needs only the original shape and
        dtype. Its length is ``buf.numel()``; put that in your message header.

        Args:
            tensor: what to send.
            key: names it for per-key state.
            shapes: optional layout of a flat ``tensor`` (see :meth:`compress_layout`);
                the receiver does not need it.
        """
        payload, _ = self.compress(tensor, key) if shapes is None else self.compress_layout(tensor, key, shapes)
        return pack_payload(payload)

    def from_wire(self, buf: torch.Tensor, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Decode a buffer made by :meth:`to_wire` into a tensor of ``shape`` and ``dtype``."""
        return self.decompress(unpack_payload(buf), TensorMeta(torch.Size(shape), dtype))

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """Compressor state to checkpoint (residuals, warm starts, RNG); empty if stateless."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        if state:
            raise ValueError(f"{type(self).__name__} is stateless but got state keys {sorted(state)}")

    def reset(self) -> None:
        """Forget all per-key state (residuals, warm starts)."""

    # ------------------------------------------------------------------ misc

    def payload_nbytes(self, tensor: torch.Tensor, key: str = "_size_probe") -> int:
        """Bytes of the packed payload for ``tensor`` (without the wire header).

        Runs :meth:`compress`, so it touches per-key state under ``key``; use a
        throwaway key.
        """
        payload, _ = self.compress(tensor, key)
        self._forget(key)
        return payload_nbytes(payload)

    def _forget(self, key: str) -> None:
        """Drop state held for ``key`` (used after size probes)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Identity(Compressor):
    """No compression: the payload is the tensor itself (summable, unbiased)."""

    collective = "summable"

    name = "none"
    summable = True
    biased = False

    def compress(self, tensor: torch.Tensor, key: str) -> tuple[list[torch.Tensor], TensorMeta]:
        return [tensor.detach().contiguous()], TensorMeta.of(tensor)

    def decompress(self, payload: list[torch.Tensor], ctx: TensorMeta) -> torch.Tensor:
        return payload[0].reshape(ctx.shape).to(ctx.dtype)


# ---------------------------------------------------------------------- wire format
#
# buf = [u8 count] + count * ([u8 dtype code][u8 ndim][ndim * u32 dim]) + concatenated raw bytes.

_DTYPES: tuple[torch.dtype, ...] = (
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.bool,
)
_CODE = {dt: i for i, dt in enumerate(_DTYPES)}


def payload_nbytes(payload: list[torch.Tensor]) -> int:
    """Bytes the payload tensors occupy (what a transport sends for them)."""
    return sum(t.numel() * t.element_size() for t in payload)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous().reshape(-1)
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    return t.view(torch.uint8)


def pack_payload(payload: list[torch.Tensor]) -> torch.Tensor:
    """Pack payload tensors into one self-describing 1-D ``uint8`` tensor."""
    if len(payload) > 255:
        raise ValueError(f"a payload holds at most 255 tensors, got {len(payload)}")
    header = bytearray(struct.pack("<B", len(payload)))
    for t in payload:
        if t.dtype not in _CODE:
            raise ValueError(f"cannot put dtype {t.dtype} on the wire; supported: {list(_CODE)}")
        header += struct.pack("<BB", _CODE[t.dtype], t.dim())
        if any(d > 0xFFFFFFFF for d in t.shape):
            raise ValueError(f"a payload dimension over 2**32-1 cannot go on the wire: {tuple(t.shape)}")
        header += struct.pack(f"<{t.dim()}I", *t.shape)
    head = torch.frombuffer(bytearray(header), dtype=torch.uint8)
    return torch.cat([head, *[_as_bytes(t) for t in payload]])


def unpack_payload(buf: torch.Tensor) -> list[torch.Tensor]:
    """Inverse of :func:`pack_payload`."""
    if buf.dtype != torch.uint8 or buf.dim() != 1:
        raise ValueError(f"expected a 1-D uint8 buffer, got {buf.dtype} of shape {tuple(buf.shape)}")
    if buf.numel() == 0:
        raise ValueError("empty wire buffer")
    raw = memoryview(buf.contiguous().numpy())  # type: ignore[arg-type]  # an ndarray is a buffer
    (count,) = struct.unpack_from("<B", raw, 0)
    off = 1
    specs: list[tuple[torch.dtype, tuple[int, ...]]] = []
    for _ in range(count):
        code, ndim = struct.unpack_from("<BB", raw, off)
        off += 2
        dims = struct.unpack_from(f"<{ndim}I", raw, off)
        off += 4 * ndim
        if code >= len(_DTYPES):
            raise ValueError(f"corrupt wire buffer: unknown dtype code {code}")
        specs.append((_DTYPES[code], tuple(int(d) for d in dims)))
    out: list[torch.Tensor] = []
    for dtype, dims in specs:
        n = 1
        for d in dims:
            n *= d
        size = n * torch.empty((), dtype=dtype).element_size()
        if off + size > buf.numel():
            raise ValueError(f"corrupt wire buffer: needs {off + size} bytes, has {buf.numel()}")
        chunk = buf[off : off + size].clone()
        off += size
        if dtype == torch.bool:
            t = chunk.to(torch.bool)
        else:
            t = chunk.view(dtype)
        out.append(t.reshape(dims))
    if off != buf.numel():
        raise ValueError(f"corrupt wire buffer: {buf.numel() - off} trailing bytes")
    return out
