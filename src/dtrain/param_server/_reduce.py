"""The server's average of several gradients, in a fixed order.

Float addition is not associative: ``(a + b) + c`` and ``a + (b + c)`` differ in
the last bit, and an optimizer that normalises the step (Adam's first steps are
about ``lr * sign(g)``) turns a last-bit difference in a gradient element that
cancels to ~1e-10 into a difference of ``lr`` in the parameter. Summing the
gradients of a step in the order they happened to arrive therefore makes a BSP
run irreproducible, and different from synchronous data parallelism by much more
than rounding.

:func:`ordered_mean` fixes the order. The gradients are sorted by worker (then
clock), and averaged exactly as :class:`dtrain.DataParallel` averages a bucket
with ``algorithm="tree"``:

1. pre-divide each gradient by the count ``n`` (as DDP and DataParallel do before
   the allreduce; for ``n`` not a power of two this rounds differently from
   dividing the sum);
2. sum along the binomial tree of :func:`dtrain.comm.allreduce` ``"tree"``
   (Thakur et al., IJHPCA 2005) with position ``i`` in the sorted list playing
   rank ``i``: every node adds the partial sums of its children to its own
   gradient, nearest child first. For 4 gradients that is
   ``(g0/4 + g1/4) + (g2/4 + g3/4)``; for 3, ``(g0/3 + g1/3) + g2/3``.

The result is bitwise the tree allreduce's, whatever the arrival order. Cost:
``n`` divisions and ``n - 1`` additions of the shard, ``n`` temporary shards.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dtrain.comm.indexing import binomial_children

__all__ = ["ordered_mean"]


def ordered_mean(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """Average ``grads`` (in the order given) as DataParallel's ``tree`` allreduce would.

    Args:
        grads: same-shape floating tensors, ``grads[i]`` taking the place of rank ``i``.

    Returns:
        ``sum(g / n)`` summed along the binomial tree rooted at 0; ``grads[0]``
        itself when there is one.
    """
    n = len(grads)
    if n == 0:
        raise ValueError("ordered_mean needs at least one gradient")
    if n == 1:
        return grads[0]
    parts = [g / n for g in grads]

    def subtree(r: int) -> torch.Tensor:
        acc = parts[r]
        for c in reversed(binomial_children(r, n)):  # nearest child first, as comm._tree.tree_reduce receives them
            acc.add_(subtree(c))
        return acc

    return subtree(0)
