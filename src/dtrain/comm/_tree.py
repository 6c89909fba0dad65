"""The binomial tree: reduce to rank 0, then broadcast from it (:func:`tree`).

:func:`tree_reduce` and :func:`tree_bcast` are its two halves, which hierarchical
also runs inside each node.
"""

from __future__ import annotations

import torch

from dtrain.comm._kernel import TAG_TREE_BCAST, TAG_TREE_REDUCE, AllreduceOptions, algorithm
from dtrain.comm._reduce import BUFFERS, combine, post_recv, post_send
from dtrain.comm.indexing import binomial_children, binomial_parent
from dtrain.comm.transport import Transport

__all__ = ["tree", "tree_reduce", "tree_bcast"]


def tree_reduce(t: Transport, flat: torch.Tensor, op: str) -> None:
    """Binomial-tree reduce of ``flat`` to rank 0 in place (the other ranks' copies hold partial results)."""
    children = binomial_children(t.rank, t.world_size)
    if children:
        buf = BUFFERS.take(flat.numel(), flat.dtype, flat.device)
        for c in reversed(children):  # nearest (smallest subtree) first, as its partial sum is ready first
            post_recv(t, buf, c, TAG_TREE_REDUCE).wait()
            combine(flat, buf, op)
        BUFFERS.give(buf)
    parent = binomial_parent(t.rank)
    if parent >= 0:
        post_send(t, flat, parent, TAG_TREE_REDUCE).wait()


def tree_bcast(t: Transport, flat: torch.Tensor) -> None:
    """Binomial-tree broadcast of rank 0's ``flat`` into every rank's, farthest subtree first."""
    parent = binomial_parent(t.rank)
    if parent >= 0:
        post_recv(t, flat, parent, TAG_TREE_BCAST).wait()
    works = [post_send(t, flat, c, TAG_TREE_BCAST) for c in binomial_children(t.rank, t.world_size)]
    for w in works:
        w.wait()


@algorithm("tree")
def tree(t: Transport, flat: torch.Tensor, op: str, opts: AllreduceOptions) -> None:
    """Binomial-tree reduce to rank 0, then binomial-tree broadcast from it.

    Steps: in round ``i`` (``i = 0..ceil(log2 P)-1``) every rank whose bit ``i`` is
    set sends its partial result to ``rank - 2**i`` and drops out; the receivers
    reduce. Rank 0 then holds the result and sends it back down the same tree,
    farthest subtree first. Works for any ``P``.

    Cost: ``2·ceil(log2 P)·(alpha + n·beta) + ceil(log2 P)·n·gamma`` -- latency-optimal
    up to a factor 2, but every round moves the whole vector (Thakur et al. 2005).
    """
    tree_reduce(t, flat, op)
    tree_bcast(t, flat)
