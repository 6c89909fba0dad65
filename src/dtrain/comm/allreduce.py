"""Allreduce algorithms written against a :class:`~dtrain.comm.transport.Transport`.

``allreduce(tensor, op, algorithm, group)`` reduces a tensor across the ranks of a
process group in place. The algorithms are the classic ones of the MPI
literature (Thakur, Rabenseifner & Gropp, "Optimization of Collective
Communication Operations in MPICH", IJHPCA 2005; Patarasuk & Yuan, "Bandwidth
optimal all-reduce algorithms for clusters of workstations", JPDC 2009), surveyed
for deep learning by Ben-Nun & Hoefler (arXiv 1802.09941, sec. 5.2). Each one is a
plain function ``fn(transport, tensor, op, options)`` in :data:`ALGORITHMS`, so the
same code runs over threads in a unit test (``ThreadTransport``) and over
torch.distributed in production (``TorchTransport``).

Costs below are per rank, for ``P`` ranks and ``n`` bytes, in the alpha-beta-gamma
model (alpha per message, beta per byte sent, gamma per byte reduced); the exact
message and byte counts, and the times, are in :mod:`dtrain.comm.cost`.

Semantics shared by every algorithm:

* ``op`` is ``sum``, ``avg``, ``max`` or ``min``. ``avg`` is the sum divided by
  ``P`` at the end; for integer dtypes that division is floor division (rounds
  toward minus infinity), the same as the ``native`` path, since gloo has no
  integer average.
* Reductions run in the tensor's dtype, one rounding per addition, as gloo and
  NCCL do; float16/bfloat16 sums therefore differ from an exact sum by at most
  about ``(P-1) * eps * sum(|x_i|)``.
* Every rank ends with bitwise the same result.
* Messages and bytes go through the transport, which counts them in ``stats``.

Layout: this module holds the registry (:data:`ALGORITHMS`) and the entry points
(:func:`allreduce`, :func:`allreduce_over`, :func:`get_transport`); the algorithms
live one family a module -- :mod:`._ring`, :mod:`._tree`, :mod:`._butterfly`
(recursive doubling, Rabenseifner), :mod:`._hierarchical`, :mod:`._native` -- on
what :mod:`._kernel` gives them all (:class:`AllreduceOptions`, the registry-entry
wrapper, the tag bases), and are re-exported here.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import torch

from dtrain import trace as _trace
from dtrain.comm import cost as _cost
from dtrain.comm._butterfly import rabenseifner, recursive_doubling
from dtrain.comm._hierarchical import hierarchical
from dtrain.comm._kernel import RING_MAX_PIECES, RING_PIECE_BYTES, AlgorithmFn, AllreduceOptions
from dtrain.comm._native import native
from dtrain.comm._reduce import OPS, check_op, check_tensor
from dtrain.comm._ring import ring
from dtrain.comm._tree import tree
from dtrain.comm.transport import DEFAULT_TIMEOUT_S, TorchTransport, Transport
from dtrain.errors import CommError, ConfigError

__all__ = [
    "ALGORITHMS",
    "OPS",
    "RING_PIECE_BYTES",
    "RING_MAX_PIECES",
    "AllreduceOptions",
    "allreduce",
    "allreduce_over",
    "get_transport",
    "native",
    "ring",
    "tree",
    "recursive_doubling",
    "rabenseifner",
    "hierarchical",
]


ALGORITHMS: dict[str, AlgorithmFn] = {
    "native": native,
    "ring": ring,
    "tree": tree,
    "recursive_doubling": recursive_doubling,
    "rabenseifner": rabenseifner,
    "hierarchical": hierarchical,
}
assert tuple(ALGORITHMS) == _cost.ALGORITHMS


def _check_algorithm(algorithm: str) -> AlgorithmFn:
    try:
        return ALGORITHMS[algorithm]
    except (KeyError, TypeError):
        raise ConfigError(f"unknown allreduce algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}") from None


def allreduce_over(
    transport: Transport,
    tensor: torch.Tensor,
    op: str = "sum",
    algorithm: str = "ring",
    options: AllreduceOptions | None = None,
) -> torch.Tensor:
    """Allreduce ``tensor`` in place over any transport (threads in tests, a process group in production).

    Args:
        transport: the ranks to reduce over.
        tensor: a contiguous tensor, the same shape and dtype on every rank.
        op: ``sum``, ``avg``, ``max`` or ``min`` (default: sum).
        algorithm: a name in :data:`ALGORITHMS` (default: ring).
        options: tunables (default: :class:`AllreduceOptions`).

    Returns:
        ``tensor``, now holding the reduction.

    Raises:
        ConfigError: unknown algorithm or op, or an unusable tensor.
        CommError: a peer failed; CommTimeoutError: a wait exceeded the transport's timeout.
    """
    fn = _check_algorithm(algorithm)
    check_op(op)
    check_tensor(tensor)
    with _trace.span(f"allreduce({algorithm})", bytes=tensor.numel() * tensor.element_size()):
        return fn(transport, tensor, op, options)


_TRANSPORTS: dict[tuple[int, float], tuple[Any, TorchTransport]] = {}
_TRANSPORTS_LOCK = threading.Lock()


def get_transport(group: Any = None, timeout: float | None = None) -> TorchTransport:
    """The cached :class:`TorchTransport` of ``group`` (default: the default group).

    One transport, and so one ``stats`` counter, per group; a call with another
    ``timeout`` gets a transport that shares the group's counters.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        raise CommError(0, "allreduce", "torch.distributed is not initialized; call dtrain.init() first")
    key_group = group if group is not None else dist.group.WORLD
    t_out = float(timeout if timeout is not None else DEFAULT_TIMEOUT_S)
    with _TRANSPORTS_LOCK:
        base_key = (id(key_group), DEFAULT_TIMEOUT_S)
        hit = _TRANSPORTS.get(base_key)
        if hit is None or hit[0] is not key_group:
            hit = (key_group, TorchTransport(group, timeout=DEFAULT_TIMEOUT_S))
            _TRANSPORTS[base_key] = hit
            for k in [k for k in _TRANSPORTS if k[0] == id(key_group) and k != base_key]:
                del _TRANSPORTS[k]
        if t_out == DEFAULT_TIMEOUT_S:
            return hit[1]
        key = (id(key_group), t_out)
        other = _TRANSPORTS.get(key)
        if other is None or other[0] is not key_group:
            tr = TorchTransport(group, timeout=t_out)
            tr.stats = hit[1].stats
            other = (key_group, tr)
            _TRANSPORTS[key] = other
        return other[1]


def _check_device(tensor: torch.Tensor, group: Any) -> None:
    import torch.distributed as dist

    backend = str(dist.get_backend(group)).lower()
    dev = tensor.device.type
    if backend == "gloo" and dev not in ("cpu", "cuda"):
        raise ConfigError(
            f"allreduce on a gloo group needs a CPU or CUDA tensor (CUDA goes through host memory), got one on "
            f"{tensor.device}"
        )
    if backend == "nccl" and dev != "cuda":
        raise ConfigError(f"allreduce on an NCCL group needs a CUDA tensor, got one on {tensor.device}")
    if backend == "mpi" and dev != "cpu":
        raise ConfigError(f"allreduce on an MPI group needs a CPU tensor, got one on {tensor.device}")


def allreduce(
    tensor: torch.Tensor,
    op: str = "sum",
    algorithm: str = "ring",
    group: Any = None,
    timeout: float | None = None,
    node_size: int | None = None,
    *,
    options: AllreduceOptions | None = None,
) -> torch.Tensor:
    """Reduce ``tensor`` across the ranks of ``group`` in place and return it.

    Every algorithm gives the ``native`` result up to floating-point summation
    order (bitwise for integers, max and min). Without an initialised process group
    the world is one rank and the tensor is returned unchanged.

    Args:
        tensor: a contiguous tensor on the backend's device (CPU for gloo, or CUDA
            through host memory), the
            same shape and dtype on every rank; float32/64, float16, bfloat16,
            int32 or int64.
        op: ``sum``, ``avg``, ``max`` or ``min`` (default: sum). ``avg`` of an
            integer tensor is the floor of the mean.
        algorithm: ``native``, ``ring``, ``tree``, ``recursive_doubling``,
            ``rabenseifner`` or ``hierarchical`` (default: ring).
        group: the process group (default: the default group).
        timeout: seconds any single wait may block before CommTimeoutError
            (default: 300).
        node_size: hierarchical only: consecutive ranks per node (default: the
            launcher's LOCAL_WORLD_SIZE).
        options: further tunables (piece size, window); ``node_size`` wins over
            ``options.node_size``.

    Raises:
        ConfigError: unknown algorithm/op, unusable tensor, or a device the
            backend cannot use. Raised before anything is sent.
        CommError / CommTimeoutError: a peer died or went silent; the message
            names this rank, the operation and the peer.

    Example::

        grad = torch.randn(1000)
        dtrain.comm.allreduce(grad, op="avg", algorithm="ring")
    """
    import torch.distributed as dist

    _check_algorithm(algorithm)
    check_op(op)
    check_tensor(tensor)
    if node_size is not None:
        opts = dataclasses.replace(options or AllreduceOptions(), node_size=node_size)
    else:
        opts = options or AllreduceOptions()
    if not dist.is_initialized():
        return tensor
    if group is not None and dist.get_rank(group) < 0:
        raise ConfigError(f"rank {dist.get_rank()} is not a member of the group it asked to allreduce over")
    _check_device(tensor, group)
    transport = get_transport(group, timeout)
    with _trace.span(f"allreduce({algorithm})", bytes=tensor.numel() * tensor.element_size()):
        return ALGORITHMS[algorithm](transport, tensor, op, opts)
