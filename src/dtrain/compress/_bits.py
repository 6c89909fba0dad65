"""Bit packing shared by the quantizers (private); their scale groups are in ``_groups``."""

from __future__ import annotations

import torch

__all__ = ["pack_bits", "unpack_bits"]

_BYTE_WEIGHTS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)
_BYTE_SHIFTS = torch.arange(7, -1, -1, dtype=torch.uint8)


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack non-negative integer ``codes`` (each ``< 2**bits``) into ``ceil(n*bits/8)`` bytes.

    Codes are written most significant bit first, one after another, with no
    padding between them; the last byte is zero-padded.
    """
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    codes = codes.reshape(-1).to(torch.uint8)
    n = codes.numel()
    if bits == 8:
        return codes.clone()
    if bits == 1:
        flat = codes
    else:
        shifts = torch.arange(bits - 1, -1, -1, dtype=torch.uint8)
        flat = ((codes.unsqueeze(1) >> shifts) & 1).reshape(-1)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    del n
    return (flat.view(-1, 8) * _BYTE_WEIGHTS).sum(dim=1, dtype=torch.int32).to(torch.uint8)


def unpack_bits(buf: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``n`` codes as ``int64``."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    need = (n * bits + 7) // 8
    if buf.numel() < need:
        raise ValueError(f"packed buffer too short: {buf.numel()} bytes for {n} codes of {bits} bits")
    if bits == 8:
        return buf[:n].to(torch.int64)
    flat = ((buf[:need].unsqueeze(1) >> _BYTE_SHIFTS) & 1).reshape(-1)[: n * bits]
    if bits == 1:
        return flat.to(torch.int64)
    weights = 2 ** torch.arange(bits - 1, -1, -1, dtype=torch.int64)
    return (flat.view(n, bits).to(torch.int64) * weights).sum(dim=1)
