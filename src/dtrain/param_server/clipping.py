"""Clipping the aggregated gradient by its global norm on the servers (``clip_grad_norm`` of
:class:`~dtrain.param_server.ParameterServer`; ``dtrain run --strategy ps --clip-grad-norm MAX``).

Under bsp every server applies update ``v`` from the same workers' gradients, each to its own shard, so
the norm of the gradient that update applies is ``sqrt(sum over servers of |shard|^2)``: each server
posts its shard's sum of squares under the update's key in the job's store, waits for the others', and
multiplies its shard's gradient by ``min(1, MAX / (total + 1e-6))`` before its optimizer step -- what
``torch.nn.utils.clip_grad_norm_`` does to one process's averaged gradient. A worker reads the same keys
after its pull to record the norm. Each server deletes its key of the update before, which every worker
has read by then (it pulled ``v`` before pushing the gradients of ``v + 1``). A server that stops meanwhile
leaves the others waiting until the store's timeout.
"""

from __future__ import annotations

import datetime
import math
from typing import Any

import torch

__all__ = ["ShardClipper", "read_norm"]


def _key(prefix: str, version: int, server: int) -> str:
    return f"{prefix}/clip/{version}/{server}"


def read_norm(store: Any, prefix: str, version: int, servers: int, timeout_s: float) -> float:
    """The norm (before clipping) of update ``version``'s aggregated gradient, from every server's post."""
    keys = [_key(prefix, version, s) for s in range(servers)]
    store.wait(keys, datetime.timedelta(seconds=timeout_s))
    return math.sqrt(sum(float(store.get(k).decode()) for k in keys))


class ShardClipper:
    """A server's part of clipping each update's aggregated gradient by the global norm.

    Args:
        store: the job's key-value store; prefix: this parameter server's keys.
        rank: this server's rank (``0..servers-1``); servers: how many there are.
        max_norm: the largest norm an update applies.
        timeout_s: how long to wait for the other servers' sums.
    """

    def __init__(self, store: Any, prefix: str, rank: int, servers: int, max_norm: float, timeout_s: float) -> None:
        if not max_norm > 0:
            raise ValueError(f"clip_grad_norm must be > 0 to clip, got {max_norm}")
        self.store, self.prefix, self.rank, self.servers = store, prefix, rank, servers
        self.max_norm, self.timeout_s = float(max_norm), float(timeout_s)

    def __call__(self, grads: list[torch.Tensor], version: int) -> float:
        """Clip this shard's gradients of update ``version`` in place; the global norm before."""
        sq = float(sum((g.double().pow(2).sum() for g in grads), torch.zeros((), dtype=torch.float64)))
        self.store.set(_key(self.prefix, version, self.rank), repr(sq))
        if version > 0:
            self.store.delete_key(_key(self.prefix, version - 1, self.rank))
        total = read_norm(self.store, self.prefix, version, self.servers, self.timeout_s)
        coef = min(1.0, self.max_norm / (total + 1e-6))
        if coef < 1.0 and grads:
            torch._foreach_mul_(grads, coef)
        return total
