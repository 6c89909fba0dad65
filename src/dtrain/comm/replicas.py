"""Wrap-time agreement of replicas: every rank has the same model and options, and rank 0's weights.

What the engines that keep a replica per rank do when they wrap a model (:mod:`dtrain.data_parallel`,
:mod:`dtrain.sharded`, :mod:`dtrain.decentralized`). Steps, all on the engine's group:

1. Each rank hashes a description of its model (every parameter's and buffer's
   name, shape, dtype, trainability) and of its DataParallel options into two
   64-bit digests; one ``all_gather`` of 16 bytes per rank compares them.
2. Only when digests differ are the full descriptions gathered
   (``all_gather_object``), to name the first differing parameter and the ranks
   that differ; every rank raises the same error, so none is left waiting.
3. Rank 0's parameters and buffers are broadcast, fused into flat buckets.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dtrain.comm.fusion import assign_buckets, flatten, unflatten_into
from dtrain.comm.waits import wait_work
from dtrain.errors import ConfigError, ModelMismatchError

__all__ = ["describe_module", "check_same_everywhere", "broadcast_tensors"]

Entry = tuple[str, str, tuple[int, ...], str, bool]


def describe_module(module: nn.Module) -> list[Entry]:
    """(kind, name, shape, dtype, requires_grad) of every parameter, then every buffer."""
    out: list[Entry] = [
        ("parameter", n, tuple(p.shape), str(p.dtype).replace("torch.", ""), bool(p.requires_grad))
        for n, p in module.named_parameters()
    ]
    out += [("buffer", n, tuple(b.shape), str(b.dtype).replace("torch.", ""), False) for n, b in module.named_buffers()]
    return out


def _digest(obj: Any) -> int:
    return int.from_bytes(hashlib.sha256(repr(obj).encode()).digest()[:8], "little", signed=True)


def _fmt(e: Entry | None) -> str:
    if e is None:
        return "nothing at that position"
    kind, _, shape, dtype, rg = e
    return f"{kind} of shape {tuple(shape)} {dtype}" + ("" if rg or kind == "buffer" else " (frozen)")


def _explain(descs: Sequence[list[Entry]], ranks: Sequence[int]) -> str:
    ref = descs[0]
    first: int | None = None
    for d in descs[1:]:
        n = max(len(d), len(ref))
        for i in range(n):
            a = ref[i] if i < len(ref) else None
            b = d[i] if i < len(d) else None
            if a != b:
                first = i if first is None else min(first, i)
                break
    assert first is not None
    at = [d[first] if first < len(d) else None for d in descs]
    name = next(e[1] for e in at if e is not None)
    differ = [ranks[k] for k in range(1, len(descs)) if at[k] != at[0]]

    def renamed(e: Entry | None) -> str:
        return "" if e is None or e[1] == name else f" named {e[1]!r}"

    parts = [f"rank {ranks[0]} has {_fmt(at[0])}"] + [
        f"rank {ranks[k]} has {_fmt(at[k])}{renamed(at[k])}" for k in range(1, len(descs)) if at[k] != at[0]
    ]
    return (
        f"ranks wrapped different models: first difference at {at[0][0] if at[0] else 'parameter'} {name!r}: "
        + "; ".join(parts)
        + f" (ranks differing from rank {ranks[0]}: {differ}). "
        "Build the same model (same layers, shapes, dtypes, frozen parameters) on every rank before wrapping it."
    )


def check_same_everywhere(
    desc: list[Entry], options: str, *, group: Any, device: torch.device, ranks: Sequence[int], timeout_s: float
) -> None:
    """Raise the same error on every rank unless all ranks have the same model and options.

    Args:
        desc: this rank's :func:`describe_module`.
        options: this rank's options line (:meth:`DataParallelConfig.describe`).
        group: the data-parallel process group.
        device: where collective tensors live for this backend (CPU for gloo).
        ranks: global rank of each group rank, for messages.
        timeout_s: wait limit.

    Raises:
        ModelMismatchError: names the first differing parameter and the ranks.
        ConfigError: the models agree but the DataParallel options do not.
    """
    me = dist.get_rank(group)
    size = len(ranks)
    mine = torch.tensor([_digest(desc), _digest(options)], dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(size)]
    work = dist.all_gather(gathered, mine, group=group, async_op=True)
    wait_work(work, timeout_s, ranks[me], "DataParallel model check")
    digests = [tuple(g.tolist()) for g in gathered]
    if all(d == digests[0] for d in digests):
        return
    objs: list[Any] = [None] * size
    dist.all_gather_object(objs, (desc, options), group=group)
    if any(d[0] != digests[0][0] for d in digests):
        raise ModelMismatchError(_explain([o[0] for o in objs], ranks))
    differ = [ranks[k] for k in range(size) if objs[k][1] != objs[0][1]]
    raise ConfigError(
        f"ranks wrapped the model with different DataParallel options: rank {ranks[0]} has ({objs[0][1]}); "
        + "; ".join(f"rank {ranks[k]} has ({objs[k][1]})" for k in range(size) if objs[k][1] != objs[0][1])
        + f" (ranks {differ}). Pass the same options on every rank."
    )


def broadcast_tensors(
    tensors: Sequence[torch.Tensor],
    *,
    src: int,
    group: Any,
    rank: int,
    cap_bytes: int,
    timeout_s: float,
    op: str = "broadcast",
) -> None:
    """Overwrite ``tensors`` with rank ``src``'s values, fused into buckets of about ``cap_bytes``.

    Args:
        tensors: the same shapes and dtypes on every rank (checked before).
        src: global rank to copy from.
        group: the process group.
        rank: this process's global rank (for errors).
        cap_bytes: fusion bucket size.
        timeout_s: wait limit per bucket.
        op: operation name for errors.
    """
    if not tensors:
        return
    keys = [(t.device, t.dtype) for t in tensors]
    sizes = [t.numel() * t.element_size() for t in tensors]
    with torch.no_grad():
        for idx in assign_buckets(sizes, keys, cap_bytes=cap_bytes):
            members = [tensors[i] for i in idx]
            flat = flatten(members)
            wait_work(dist.broadcast(flat, src=src, group=group, async_op=True), timeout_s, rank, op)
            if rank != src:
                unflatten_into(flat, members)
