"""The two-level allreduce: a tree inside each node, a ring across node leaders (:func:`hierarchical`)."""

from __future__ import annotations

import torch

from dtrain.comm._kernel import TAG_INTER, TAG_INTRA, AllreduceOptions, algorithm
from dtrain.comm._reduce import SubTransport
from dtrain.comm._ring import ring_kernel
from dtrain.comm._tree import tree_bcast, tree_reduce
from dtrain.comm.transport import TorchTransport, Transport
from dtrain.errors import ConfigError

__all__ = ["hierarchical"]


def _node_ids(t: Transport, opts: AllreduceOptions) -> list[int]:
    P = t.world_size
    if opts.nodes is not None:
        if len(opts.nodes) != P:
            raise ConfigError(f"nodes gives {len(opts.nodes)} node ids for a world of {P} ranks; give one per rank")
        return list(opts.nodes)
    if opts.node_size is not None:
        return [r // opts.node_size for r in range(P)]
    if isinstance(t, TorchTransport):
        import torch.distributed as dist

        from dtrain.runtime import local_world_size

        per_node = max(1, local_world_size())
        ranks = [dist.get_global_rank(t.group, r) if t.group is not None else r for r in range(P)]
        return [g // per_node for g in ranks]
    return [0] * P


@algorithm("hierarchical")
def hierarchical(t: Transport, flat: torch.Tensor, op: str, opts: AllreduceOptions) -> None:
    """Two-level allreduce: reduce inside each node, ring across node leaders, broadcast back.

    Steps:

    1. Inside each node (by default the launcher's LOCAL_WORLD_SIZE consecutive
       ranks, or ``options.node_size`` / ``options.nodes``), a binomial-tree reduce to
       the node's lowest rank, its leader.
    2. The leaders run the pipelined ring allreduce among themselves.
    3. Each leader broadcasts the result down its node's binomial tree.

    Only one rank per node crosses the slow inter-node links, and it sends
    ``2(N-1)/N·n`` bytes there for ``N`` nodes. Cost, with ``L`` ranks per node and
    per-level (alpha, beta): ``2·ceil(log2 L)·(alpha_in + n·beta_in) + ceil(log2 L)·
    n·gamma + 2(N-1)·alpha_out + 2(N-1)/N·n·beta_out + (N-1)/N·n·gamma``. The scheme
    is the hierarchical allreduce of Jia et al. (arXiv 1807.11205) with a tree
    inside the node.
    """
    ids = _node_ids(t, opts)
    members = [q for q in range(t.world_size) if ids[q] == ids[t.rank]]
    leaders = sorted({min(q for q in range(t.world_size) if ids[q] == i) for i in set(ids)})
    intra = SubTransport(t, members, TAG_INTRA)
    if len(members) > 1:
        tree_reduce(intra, flat, op)
    if t.rank == members[0] and len(leaders) > 1:
        ring_kernel(SubTransport(t, leaders, TAG_INTER), flat, op, opts)
    if len(members) > 1:
        tree_bcast(intra, flat)
