"""Megatron's conjugate operators as autograd functions, on dtrain's collectives.

Shoeybi et al., "Megatron-LM" (arXiv 1909.08053), section 3: a column-parallel linear
followed by a row-parallel one needs one allreduce in forward and one in backward. Two
operators place them:

* ``f`` = :func:`copy_to_tp`: identity in forward, allreduce of the gradient in backward
  (entering a tensor-parallel region, whose ranks each add their share to the input's
  gradient);
* ``g`` = :func:`reduce_from_tp`: allreduce in forward (each rank holds a partial sum),
  identity in backward.

Sequence parallelism (Korthikanti et al., "Reducing Activation Recomputation in Large
Transformer Models", arXiv 2205.05198) keeps the regions between them (layer norms,
dropout, residuals) sharded along the sequence, and replaces the allreduces by the two
halves of a ring allreduce: :func:`gather_sequence` (allgather in forward, reduce-scatter
in backward) and :func:`reduce_scatter_sequence` (reduce-scatter in forward, allgather in
backward); :func:`split_sequence` enters a sharded region from a replicated tensor (take
this rank's chunk; allgather in backward), and :func:`leave_sequence` leaves it into a replicated region
(allgather in forward; in backward every rank holds the same whole gradient and keeps its chunk).

Every collective goes through :mod:`dtrain.comm` on the tensor-parallel group's
transport, so its bytes are counted, traced and costed like data parallelism's.
"""

from __future__ import annotations

import time
import weakref
from typing import Any

import torch

from dtrain.comm.allreduce import allreduce
from dtrain.comm.shard import allgather, reduce_scatter, segment
from dtrain.comm.waits import add_blocked

__all__ = [
    "TPGroup",
    "copy_to_tp",
    "reduce_from_tp",
    "gather_sequence",
    "gather_linear",
    "reduce_scatter_sequence",
    "split_sequence",
    "leave_sequence",
]


class TPGroup:
    """A tensor-parallel group: its process group, size, this rank's index, and how it communicates.

    Args:
        group: the process group (None: the default group; a world of one without torch.distributed).
        algorithm: allreduce algorithm of the ``f``/``g`` operators (default: ring).
        timeout_s: seconds a collective may wait (default: 300).
    """

    def __init__(self, group: Any = None, algorithm: str = "ring", timeout_s: float = 300.0) -> None:
        import torch.distributed as dist

        self.group = group
        self.algorithm = algorithm
        self.timeout_s = timeout_s
        init = dist.is_initialized()
        self.size = dist.get_world_size(group) if init else 1
        self.rank = dist.get_rank(group) if init else 0
        self.ranks = dist.get_process_group_ranks(group or dist.group.WORLD) if init else [0]
        self.seconds = 0.0  # spent in this group's collectives so far (they are on the critical path)
        # the last tensor that entered the region by ``copy_to_tp`` (weakly), its version, and what it returned
        self._entered: tuple[weakref.ref[torch.Tensor], int, torch.Tensor] | None = None

    def _count(self, seconds: float) -> None:
        self.seconds += seconds
        add_blocked(seconds)

    def allreduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        t = t.contiguous()
        if self.size > 1:
            t0 = time.perf_counter()
            allreduce(t, op=op, algorithm=self.algorithm, group=self.group, timeout=self.timeout_s)
            self._count(time.perf_counter() - t0)
        return t

    def bytes_sent(self) -> int:
        """Bytes this rank has sent on the group's transport so far (every tensor-parallel collective)."""
        if self.size <= 1:
            return 0
        from dtrain.comm.allreduce import get_transport

        return int(get_transport(self.group).stats.bytes_sent)

    def gather_seq(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Allgather chunks along ``dim``: every rank's chunk, in rank order."""
        if self.size == 1:
            return x
        moved = x.movedim(dim, 0).contiguous()
        flat = torch.zeros(self.size * moved.numel(), dtype=x.dtype, device=x.device)
        segment(flat, self.rank, self.size).copy_(moved.reshape(-1))
        t0 = time.perf_counter()
        allgather(flat, group=self.group, timeout=self.timeout_s)
        self._count(time.perf_counter() - t0)
        out = flat.view(self.size * moved.shape[0], *moved.shape[1:])
        return out.movedim(0, dim)

    def reduce_scatter_seq(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Sum over ranks and keep this rank's chunk along ``dim``."""
        if self.size == 1:
            return x
        moved = x.movedim(dim, 0).contiguous()
        flat = moved.reshape(-1).clone()
        t0 = time.perf_counter()
        reduce_scatter(flat, op="sum", group=self.group, timeout=self.timeout_s)
        self._count(time.perf_counter() - t0)
        mine = segment(flat, self.rank, self.size)
        return mine.view(moved.shape[0] // self.size, *moved.shape[1:]).movedim(0, dim)

    def chunk_seq(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        n = x.shape[dim] // self.size
        return x.narrow(dim, self.rank * n, n).contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, g: TPGroup) -> torch.Tensor:
        ctx.g = g
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.g._entered = None  # the forward that could share this entry is over
        return ctx.g.allreduce(grad.clone()), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, g: TPGroup) -> torch.Tensor:
        return g.allreduce(x.clone())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, g: TPGroup, dim: int) -> torch.Tensor:
        ctx.g, ctx.dim = g, dim
        return g.gather_seq(x, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return ctx.g.reduce_scatter_seq(grad, ctx.dim), None, None


class _ReduceScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, g: TPGroup, dim: int) -> torch.Tensor:
        ctx.g, ctx.dim = g, dim
        return g.reduce_scatter_seq(x, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return ctx.g.gather_seq(grad, ctx.dim), None, None


class _SplitSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, g: TPGroup, dim: int) -> torch.Tensor:
        ctx.g, ctx.dim = g, dim
        return g.chunk_seq(x, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return ctx.g.gather_seq(grad, ctx.dim), None, None


class _LeaveSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, g: TPGroup, dim: int) -> torch.Tensor:
        ctx.g, ctx.dim = g, dim
        return g.gather_seq(x, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return ctx.g.chunk_seq(grad, ctx.dim), None, None


class _GatherLinear(torch.autograd.Function):
    """``linear(allgather_seq(x), w, b)`` that keeps only the local chunk ``x`` for backward and gathers it
    again there (Korthikanti et al. 2022, section 4.2.2): the gathered input is never held across the step."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, g: TPGroup, dim: int
    ) -> torch.Tensor:
        ctx.g, ctx.dim, ctx.has_bias = g, dim, bias is not None
        ctx.save_for_backward(x, weight)
        return torch.nn.functional.linear(g.gather_seq(x, dim), weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x, weight = ctx.saved_tensors
        g: TPGroup = ctx.g
        full = g.gather_seq(x, ctx.dim)
        grad_in = grad.matmul(weight)
        grad_w = grad.reshape(-1, grad.shape[-1]).t().matmul(full.reshape(-1, full.shape[-1]))
        grad_b = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias else None
        return g.reduce_scatter_seq(grad_in, ctx.dim), grad_w, grad_b, None, None


def gather_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, g: TPGroup, dim: int = 1
) -> torch.Tensor:
    """Sequence parallel's column-parallel linear: allgather the sequence chunks, multiply; backward gathers the
    input again instead of keeping it, then reduce-scatters the input gradient."""
    out: torch.Tensor = _GatherLinear.apply(x, weight, bias, g, dim)  # type: ignore[no-untyped-call]
    return out


def copy_to_tp(x: torch.Tensor, g: TPGroup) -> torch.Tensor:
    """Megatron's ``f``: identity forward, allreduce of the gradient backward.

    Projections that read the same tensor (query, key and value; gate and up) enter the region once: the
    second and later calls on ``x`` (the same tensor, unmodified since) return the first call's output, so
    autograd sums their gradients before the one allreduce, as Megatron's single ``f`` before a fused QKV
    does, instead of one allreduce a projection. The sum is the same (the allreduce is linear).
    """
    if g.size > 1 and x.requires_grad and torch.is_grad_enabled():
        seen = g._entered
        if seen is not None and seen[0]() is x and seen[1] == x._version:
            return seen[2]
    out: torch.Tensor = _CopyToTP.apply(x, g)  # type: ignore[no-untyped-call]
    if g.size > 1 and x.requires_grad and torch.is_grad_enabled():
        g._entered = (weakref.ref(x), x._version, out)  # held until another tensor enters or backward reaches it
    return out


def reduce_from_tp(x: torch.Tensor, g: TPGroup) -> torch.Tensor:
    """Megatron's ``g``: allreduce forward (sum of the ranks' partial results), identity backward."""
    out: torch.Tensor = _ReduceFromTP.apply(x, g)  # type: ignore[no-untyped-call]
    return out


def gather_sequence(x: torch.Tensor, g: TPGroup, dim: int = 1) -> torch.Tensor:
    """Sequence parallel's ``g*``: allgather the sequence chunks forward, reduce-scatter backward."""
    out: torch.Tensor = _GatherSequence.apply(x, g, dim)  # type: ignore[no-untyped-call]
    return out


def reduce_scatter_sequence(x: torch.Tensor, g: TPGroup, dim: int = 1) -> torch.Tensor:
    """Sequence parallel's ``g``: reduce-scatter along the sequence forward, allgather backward."""
    out: torch.Tensor = _ReduceScatterSequence.apply(x, g, dim)  # type: ignore[no-untyped-call]
    return out


def split_sequence(x: torch.Tensor, g: TPGroup, dim: int = 1) -> torch.Tensor:
    """Enter a sequence-sharded region from a replicated tensor: this rank's chunk; allgather backward."""
    out: torch.Tensor = _SplitSequence.apply(x, g, dim)  # type: ignore[no-untyped-call]
    return out


def leave_sequence(x: torch.Tensor, g: TPGroup, dim: int = 1) -> torch.Tensor:
    """Leave the sequence-sharded region into a replicated one: allgather forward; backward keeps this rank's
    chunk of the gradient, which every rank computed whole and the same."""
    out: torch.Tensor = _LeaveSequence.apply(x, g, dim)  # type: ignore[no-untyped-call]
    return out
