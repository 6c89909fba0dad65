"""Split a model's parameters among parameter servers, balanced by bytes.

Every server owns a *shard*: a list of :class:`Piece` s, each a contiguous range
of one parameter tensor (flattened). Small tensors go whole to one server; a
tensor that does not fit in a server's share is cut, as MXNet's KVStore cuts
arrays above its "big array bound" (Chen et al. 2015, "MXNet").

Algorithm (:func:`plan_shards`), for ``S`` servers and ``T`` bytes in all:

1. every server gets a capacity ``C = ceil(T / S)`` bytes;
2. tensors are placed largest first on the least-loaded server;
3. a tensor that does not fit there is cut: the first piece fills that server up
   to ``C``, the rest goes on to the next least-loaded server, and so on --
   unless it is smaller than ``min_split_bytes``, then it goes whole;
4. a server left empty (fewer tensors than servers) is fixed by planning again
   with cutting allowed for every tensor and capacity ``floor(T / S)``.

The result puts at most ``C + min_split_bytes`` bytes on any server and cuts at
most ``S - 1`` tensors. Cost: ``O(n log n + n S)`` for ``n`` tensors.

A worker flattens its gradient for server ``s`` by concatenating that shard's
pieces (:meth:`Shard.gather`) and scatters the parameters it pulls back
(:meth:`Shard.scatter`); the server keeps each piece as its own tensor, so any
element-wise optimizer (SGD, momentum, Adam) gives the same result as on whole
tensors. Optimizers that use whole-tensor norms (LARS, LAMB) see pieces instead.
The tensors are ``model.parameters()``, where a parameter that several modules hold
(an embedding tied to the LM head) is listed once: one server owns each of its
elements, and a worker pushes and pulls it once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dtrain.errors import ConfigError

__all__ = ["Piece", "Shard", "plan_shards", "shard_model"]


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, start + numel)`` of parameter ``index`` (flattened).

    Attributes:
        index: position of the parameter in ``model.parameters()``.
        start: first element.
        numel: elements in the piece.
        whole: the piece is the entire tensor (its shape is kept on the server).
    """

    index: int
    start: int
    numel: int
    whole: bool

    def __str__(self) -> str:
        return f"p{self.index}" if self.whole else f"p{self.index}[{self.start}:{self.start + self.numel}]"


@dataclass(frozen=True)
class Shard:
    """The pieces one server owns, in a fixed order (the order of its flat buffers).

    Attributes:
        server: the server's index (= its rank).
        pieces: the pieces, in the order they are concatenated on the wire.
        numel: elements in all pieces.
    """

    server: int
    pieces: tuple[Piece, ...]

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.pieces)

    def offsets(self) -> list[int]:
        """Start of each piece in the flat buffer."""
        out, off = [], 0
        for p in self.pieces:
            out.append(off)
            off += p.numel
        return out

    def gather(self, tensors: Sequence[torch.Tensor | None], like: Sequence[torch.Tensor]) -> torch.Tensor:
        """Concatenate this shard's pieces of ``tensors`` into one flat tensor (``None`` reads as zeros)."""
        parts = []
        for p in self.pieces:
            t = tensors[p.index]
            if t is None:
                parts.append(torch.zeros(p.numel, dtype=like[p.index].dtype, device=like[p.index].device))
            else:
                parts.append(t.detach().reshape(-1)[p.start : p.start + p.numel])
        if not parts:
            return torch.zeros(0)
        return torch.cat(parts)

    def scatter(self, flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
        """Copy ``flat`` (as made by :meth:`gather`) into this shard's pieces of ``tensors``."""
        if flat.numel() != self.numel:
            raise ValueError(f"shard {self.server} has {self.numel} elements, got {flat.numel()}")
        with torch.no_grad():
            for p, off in zip(self.pieces, self.offsets()):
                tensors[p.index].view(-1)[p.start : p.start + p.numel].copy_(flat[off : off + p.numel])

    def __str__(self) -> str:
        return f"server {self.server}: " + " ".join(map(str, self.pieces))


def plan_shards(numels: Sequence[int], element_size: int, servers: int, *, min_split_bytes: int = 4096) -> list[Shard]:
    """Plan which server owns which elements of each tensor.

    Args:
        numels: elements of each parameter tensor, in model order.
        element_size: bytes per element (all parameters share one dtype).
        servers: number of servers ``S`` >= 1.
        min_split_bytes: tensors smaller than this are never cut (default: 4096).

    Returns:
        One :class:`Shard` per server; together they cover every element once.

    Raises:
        ConfigError: fewer elements than servers.
    """
    if servers < 1:
        raise ConfigError(f"servers must be >= 1, got {servers}")
    if any(n < 0 for n in numels):
        raise ValueError("tensor sizes must be >= 0")
    total = sum(numels)
    if total < servers:
        raise ConfigError(f"the model has {total} elements, fewer than the {servers} servers; use fewer servers")
    shards = _plan(numels, servers, math.ceil(total / servers), max(0, min_split_bytes // max(1, element_size)))
    if any(not s for s in shards):  # tiny model: cut everything, fill to floor(T / S), spread the rest
        shards = _plan(numels, servers, total // servers, 0)
    return [Shard(i, tuple(sorted(s, key=lambda p: (p.index, p.start)))) for i, s in enumerate(shards)]


def _plan(numels: Sequence[int], servers: int, cap: int, min_split: int) -> list[list[Piece]]:
    load = [0] * servers
    shards: list[list[Piece]] = [[] for _ in range(servers)]
    order = sorted((i for i, n in enumerate(numels) if n > 0), key=lambda i: (-numels[i], i))
    for i in order:
        n = numels[i]
        if n < min_split:
            s = min(range(servers), key=lambda k: (load[k], k))
            shards[s].append(Piece(i, 0, n, True))
            load[s] += n
            continue
        start = 0
        while start < n:
            s = min(range(servers), key=lambda k: (load[k], k))
            room = cap - load[s]
            take = n - start if room <= 0 or room >= n - start else room
            shards[s].append(Piece(i, start, take, take == n))
            load[s] += take
            start += take
    return shards


def shard_model(params: Sequence[torch.Tensor], servers: int, *, min_split_bytes: int = 4096) -> list[Shard]:
    """:func:`plan_shards` for a list of parameters (they must share one dtype)."""
    dtypes = {p.dtype for p in params}
    if len(dtypes) != 1:
        raise ConfigError(
            f"the parameter server needs parameters of one dtype, got {sorted(map(str, dtypes))}; "
            "cast the model (e.g. model.float()) first"
        )
    if not next(iter(dtypes)).is_floating_point:
        raise ConfigError(f"parameters must be floating point, got {next(iter(dtypes))}")
    return plan_shards([p.numel() for p in params], params[0].element_size(), servers, min_split_bytes=min_split_bytes)
