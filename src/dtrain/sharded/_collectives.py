"""The collectives of a sharded model: at wrap, the ranks' agreement on the model and options and rank 0's
weights; each step, the buffers' broadcast and each unit's flat allgather and reduce-scatter, which return
the bytes this rank sent (dtrain's ring counts them; the backend's ``native`` ones by the ring's formula)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dtrain.comm.replicas import broadcast_tensors, check_same_everywhere, describe_module
from dtrain.comm.shard import allgather, allgather_over, reduce_scatter, reduce_scatter_over
from dtrain.comm.waits import wait_work
from dtrain.errors import ConfigError

_CAP_BYTES = 25 << 20  # the broadcasts' bucket


def agree_at_wrap(
    module: nn.Module,
    params: list[torch.Tensor],
    others: list[torch.Tensor],
    opts: str,
    group: Any,
    ranks: list[int],
    rank: int,
    timeout_s: float,
) -> None:
    """Every rank holds the same model (``describe_module``) and ``opts`` (ConfigError naming the one that
    differs), then takes rank 0's ``others`` (what no unit holds: frozen parameters, buffers; the units'
    parameters come in their flat buffers, :func:`broadcast_flat`). A gloo group reduces CPU tensors only."""
    devs = {p.device.type for p in params}
    backend = str(dist.get_backend(group)).lower()
    if backend == "gloo" and devs != {"cpu"}:
        raise ConfigError(f"a gloo group reduces CPU tensors; the module has parameters on {sorted(devs)}")
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    check_same_everywhere(describe_module(module), opts, group=group, device=device, ranks=ranks, timeout_s=timeout_s)
    broadcast_tensors(
        [t.detach() for t in others],
        src=ranks[0],
        group=group,
        rank=rank,
        cap_bytes=_CAP_BYTES,
        timeout_s=timeout_s,
        op="ShardedDataParallel broadcast of rank 0's buffers and frozen parameters",
    )


def broadcast_flat(flat: torch.Tensor, name: str, group: Any, ranks: list[int], rank: int, timeout_s: float) -> None:
    """Rank 0's flat parameters of a unit into ``flat``, in place: no fused copy of the model at wrap."""
    work = dist.broadcast(flat, src=ranks[0], group=group, async_op=True)
    wait_work(work, timeout_s, rank, f"ShardedDataParallel broadcast of rank 0's parameters of unit {name}")


def broadcast_buffers(
    buffers: Sequence[torch.Tensor], group: Any, ranks: list[int], rank: int, timeout_s: float, step: int
) -> None:
    """Rank 0's buffers to every rank, before a forward (as DDP's ``broadcast_buffers``)."""
    broadcast_tensors(
        list(buffers),
        src=ranks[0],
        group=group,
        rank=rank,
        cap_bytes=_CAP_BYTES,
        timeout_s=timeout_s,
        op=f"ShardedDataParallel broadcast of buffers at step {step}",
    )


def allgather_flat(flat: torch.Tensor, group: Any, algorithm: str, world: int, timeout_s: float) -> int:
    """Every rank's segment of ``flat`` into ``flat``, in place; the bytes this rank sent."""
    if algorithm == "native":
        allgather(flat, group=group, algorithm="native", timeout=timeout_s)
        return (world - 1) * flat.numel() // world * flat.element_size()
    from dtrain.comm.allreduce import get_transport

    t = get_transport(group, timeout_s)
    before = t.stats.bytes_sent
    allgather_over(t, flat)
    return int(t.stats.bytes_sent - before)


def reduce_scatter_flat(
    wire: torch.Tensor, group: Any, algorithm: str, world: int, timeout_s: float, out: torch.Tensor | None = None
) -> int:
    """The average of ``wire`` over the ranks, this rank's segment reduced in place (or into ``out``, one
    segment of another storage, ``wire`` then scratch); the bytes this rank sent."""
    if algorithm == "native":
        reduce_scatter(wire, op="avg", group=group, algorithm="native", timeout=timeout_s, out=out)
        return (world - 1) * wire.numel() // world * wire.element_size()
    from dtrain.comm.allreduce import get_transport

    t = get_transport(group, timeout_s)
    before = t.stats.bytes_sent
    reduce_scatter_over(t, wire, "avg", out=out)
    return int(t.stats.bytes_sent - before)
