"""What every allreduce kernel shares: its tunables, the wrapper that makes it a registry entry, tag bases.

An algorithm of :mod:`dtrain.comm.allreduce` is an in-place kernel on a flat tensor,
``inner(transport, flat, op, options)``, wrapped by :func:`algorithm` into the entry
``fn(transport, tensor, op="sum", options=None)`` that :data:`dtrain.comm.allreduce.ALGORITHMS`
holds. The tag bases keep the phases of one algorithm (and of hierarchical's
sub-worlds) apart, and are kept here together so that they stay distinct.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dtrain.comm import cost as _cost
from dtrain.comm._reduce import average, check_op, check_tensor
from dtrain.comm.transport import Transport
from dtrain.errors import CommError, ConfigError

__all__ = [
    "RING_PIECE_BYTES",
    "RING_MAX_PIECES",
    "AllreduceOptions",
    "AlgorithmFn",
    "algorithm",
    "TAG_TREE_REDUCE",
    "TAG_TREE_BCAST",
    "TAG_FOLD",
    "TAG_INTRA",
    "TAG_INTER",
]

RING_PIECE_BYTES = _cost.RING_PIECE_BYTES
RING_MAX_PIECES = _cost.RING_MAX_PIECES

# tag bases keep the phases of one algorithm (and of hierarchical's sub-worlds) apart
TAG_TREE_REDUCE = 1 << 22
TAG_TREE_BCAST = 2 << 22
TAG_FOLD = 3 << 22
TAG_INTRA = 1 << 26
TAG_INTER = 2 << 26


@dataclass(frozen=True)
class AllreduceOptions:
    """Tunables of the allreduce algorithms.

    Attributes:
        piece_bytes: the ring cuts each of its P segments into pieces of about this
            many bytes and pipelines them (default: 1 MiB, gloo's own segment
            size; 0.25 MiB was measured slower on loopback gloo).
        max_pieces: but into at most this many pieces per segment, so large
            tensors travel in larger pieces (default: 2, gloo's own ring's
            choice: one piece in flight while the other is reduced). Every
            message costs the Python loop and the process group's calls on top
            of its bytes; 4 ranks on 2 cores, loopback gloo, busbw against
            native (``dtrain bench allreduce``, 20 runs, twice each): at most 2
            pieces 0.86/0.88 at 16 MiB and 0.92/0.94 at 64 MiB; at most 64 (1 MiB
            pieces) 0.76 and 0.83.
        window: receives the ring keeps posted ahead, so the next piece arrives
            while the current one is reduced (default: 2, as gloo's ring).
        node_size: hierarchical only: consecutive ranks per node (default: the
            launcher's LOCAL_WORLD_SIZE, i.e. the processes of one machine).
        nodes: hierarchical only: node id of every rank, for placements that are
            not consecutive blocks; overrides ``node_size``.
    """

    piece_bytes: int = RING_PIECE_BYTES
    max_pieces: int = RING_MAX_PIECES
    window: int = 2
    node_size: int | None = None
    nodes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.piece_bytes < 1:
            raise ConfigError(f"piece_bytes must be >= 1 (try {RING_PIECE_BYTES}), got {self.piece_bytes}")
        if self.max_pieces < 1:
            raise ConfigError(f"max_pieces must be >= 1 (try {RING_MAX_PIECES}), got {self.max_pieces}")
        if self.window < 1:
            raise ConfigError(f"window must be >= 1 (try 2), got {self.window}")
        if self.node_size is not None and self.node_size < 1:
            raise ConfigError(f"node_size must be >= 1 ranks per node, got {self.node_size}")


AlgorithmFn = Callable[..., torch.Tensor]
_Inner = Callable[[Transport, torch.Tensor, str, AllreduceOptions], None]


def algorithm(name: str) -> Callable[[_Inner], AlgorithmFn]:
    """Wrap an in-place kernel on a flat tensor into a registry entry.

    The wrapper validates, returns early for an empty tensor or a world of one,
    reduces ``avg`` as ``sum`` and divides at the end, and renames transport errors
    to ``allreduce(<name>) send/recv`` so a failure says which collective hung.
    """

    def deco(inner: _Inner) -> AlgorithmFn:
        @functools.wraps(inner)
        def run(
            transport: Transport, tensor: torch.Tensor, op: str = "sum", options: AllreduceOptions | None = None
        ) -> torch.Tensor:
            check_op(op)
            flat = check_tensor(tensor)
            opts = options or AllreduceOptions()
            if flat.numel() == 0 or transport.world_size == 1:
                return tensor
            try:
                with torch.no_grad():
                    inner(transport, flat, "sum" if op == "avg" else op, opts)
                    if op == "avg":
                        average(flat, transport.world_size)
            except CommError as e:
                if e.op.startswith("allreduce("):
                    raise
                label = f"allreduce({name}) {e.op}"
                raise type(e)(e.rank, label, e.cause, peer=e.peer, step=e.step) from e
            return tensor

        return run

    return deco
