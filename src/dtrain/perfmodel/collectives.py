"""Collective times on a two-level cluster, built on :mod:`dtrain.comm.cost`.

On one level (every rank on one node, or one rank per node) the time of each
allreduce algorithm is exactly :func:`dtrain.comm.cost.allreduce_time` with that
level's ``alpha``, ``beta`` and the device's ``gamma``. Across nodes with ``d``
devices each (ranks placed node by node) the algorithms meet the network
differently, and this module charges each round on the level it crosses:

* ring (and native, and the leaders' ring of hierarchical): every step moves
  ``n/P`` over every ring edge at once; ``N`` edges cross nodes, one flow per
  network interface each way, so a step costs ``alpha_inter + n/P beta_inter``.
* binomial tree: round ``k`` pairs ranks ``2^k`` apart; below ``d`` that is inside
  a node, above it at most one flow leaves a node per round.
* recursive doubling and Rabenseifner: rounds at distance ``D >= d`` pair every
  device of a node with a device of another node, so ``d`` flows share the
  node's interface: the round's bytes cost ``d`` times ``beta_inter``
  (contention). Rabenseifner's halving starts at the largest distance, so its
  biggest messages are the ones that cross nodes.
* hierarchical: tree inside nodes, ring among node leaders
  (:func:`dtrain.comm.cost.hierarchical_time`).

Compressed collectives follow :func:`dtrain.compress.compressed_allreduce`:
for up to 8 ranks a bucket costs ``m alpha + b beta + cpu`` for the ``m`` messages,
``b`` bytes and ``cpu`` seconds (encode, merge, decode, bookkeeping; times the
cluster's ``compute_scale``) of one rank, counted by running the collective once
on threads (:func:`~dtrain.perfmodel._traffic.compressed_traffic`). Beyond,
closed forms: summable payloads are allreduced with the chosen algorithm; PowerSGD
does two allreduces of its factors; quantizers a direct compressed reduce-scatter
+ allgather; sparse compressors the SparCML plan of :mod:`dtrain.comm.sparse`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from dtrain.comm import cost
from dtrain.errors import ConfigError
from dtrain.perfmodel._traffic import compressed_traffic
from dtrain.perfmodel.spec import ClusterSpec, Link

__all__ = [
    "ALGORITHMS",
    "link_cost",
    "cluster_allreduce_time",
    "allreduce_time",
    "allreduce_bytes",
    "allgather_time",
    "ring_reduce_scatter_time",
    "ring_allgather_time",
    "CompressionModel",
    "compressed_allreduce_time",
    "compressed_allreduce_bytes",
    "collective_steps",
]

ALGORITHMS = cost.ALGORITHMS
_COUNTED_WORLD = 8  # up to this many ranks, compressed collectives are counted by running them on threads


def link_cost(
    link: Link, gamma: float, contention: float = 1.0, native: bool = False, duplex: bool = False
) -> cost.LinkCost:
    """The ``LinkCost`` of one level; ``contention`` flows sharing it multiply ``beta``.

    ``native``: the backend's own collective, charged its own per-message latency.
    ``duplex``: every node sends and receives at once (ring, recursive doubling,
    Rabenseifner, direct allgathers): the link's ``duplex_beta``.
    """
    alpha = link.native_latency if native and link.native_latency is not None else link.alpha
    beta = link.duplex_beta if duplex else link.beta
    return cost.LinkCost(alpha=alpha, beta=beta * contention, gamma=gamma)


# algorithms whose every step sends and receives on each node's link at once (the binomial tree's
# rounds send one way)
_DUPLEX = frozenset({"ring", "native", "recursive_doubling", "rabenseifner", "hierarchical"})


def _levels(c: ClusterSpec, p: int) -> tuple[int, int]:
    """(devices per node ``d``, nodes ``N``) used by ``p`` ranks placed node by node."""
    d = min(c.devices_per_node, p)
    return d, math.ceil(p / d)


def _round_link(c: ClusterSpec, distance: int, d: int, flows: int, duplex: bool = False) -> cost.LinkCost:
    if distance < d:
        return link_cost(c.intra, c.device.gamma, duplex=duplex)
    return link_cost(c.inter, c.device.gamma, contention=flows, duplex=duplex)


def cluster_allreduce_time(c: ClusterSpec, algorithm: str, nbytes: float, p: int, *, pieces: bool = True) -> float:
    """Seconds for ``p`` ranks of cluster ``c`` to allreduce ``nbytes`` with ``algorithm``: the cluster's levels
    (a node's links, the links between nodes) put into :func:`dtrain.comm.cost.allreduce_time`'s formulas.

    Args:
        c: the cluster (ranks fill its nodes in order).
        algorithm: a name in :data:`ALGORITHMS`.
        nbytes: the vector's size.
        p: ranks taking part.
        pieces: charge the ring's per-piece messages as dtrain's ring sends them
            (default: True; False gives the textbook one message per step).
    """
    if p <= 1 or nbytes <= 0:
        return 0.0
    d, nodes = _levels(c, p)
    gamma = c.device.gamma
    piece = cost.RING_PIECE_BYTES if pieces else None
    nb = float(nbytes)
    native = algorithm == "native"
    duplex = algorithm in _DUPLEX
    if nodes == 1 or d == 1:
        level = c.intra if nodes == 1 else c.inter
        link = link_cost(level, gamma, native=native, duplex=duplex)
        if algorithm == "tree" and level.burst > 0:
            return _tree_time_with_burst(p, nb, link, level.burst)
        if algorithm == "hierarchical" and nodes > 1:
            return cost.allreduce_time("ring", nodes, _whole(nb), link, piece_bytes=piece)
        # the exchanges are charged the measured duplex rate throughout: on the emulated 1 Gbit links
        # recursive doubling's two 150 KB exchanges took 3.0-3.8 ms in training steps, as that rate
        # gives (3.2), not the 2.0 ms of a bucket that passes its first 125 KB at once
        return cost.allreduce_time(algorithm, p, _whole(nb), link, piece_bytes=piece if algorithm == "ring" else None)
    if algorithm in ("ring", "native"):
        link = link_cost(c.inter, gamma, native=native, duplex=True)
        return cost.allreduce_time(algorithm, p, _whole(nb), link, piece_bytes=piece if algorithm == "ring" else None)
    if algorithm == "hierarchical":
        return cost.allreduce_time(
            "hierarchical",
            p,
            _whole(nb),
            link_cost(c.intra, gamma),
            inter=link_cost(c.inter, gamma, duplex=True),
            node_size=d,
            piece_bytes=piece,
        )
    if algorithm == "tree":
        t = 0.0
        for k in range(cost.ceil_log2(p)):
            lk = _round_link(c, 1 << k, d, 1)
            t += 2 * (lk.alpha + nb * lk.beta) + nb * lk.gamma
        return t
    core = 1 << (p.bit_length() - 1)
    fold = 0.0
    if core != p:  # ranks 2i and 2i+1 fold together: neighbours, inside a node when d >= 2
        lk = _round_link(c, 1, d, 1)
        fold = 2 * lk.alpha + 2 * nb * lk.beta + nb * lk.gamma
    if algorithm == "recursive_doubling":
        t = 0.0
        dist = 1
        while dist < core:
            lk = _round_link(c, dist, d, d, duplex=True)
            t += lk.alpha + nb * lk.beta + nb * lk.gamma
            dist <<= 1
        return t + fold
    if algorithm == "rabenseifner":
        t = 0.0
        dist, part = core >> 1, nb / 2
        while dist >= 1:  # halving (reduce-scatter), then doubling (allgather) mirrors it
            lk = _round_link(c, dist, d, d, duplex=True)
            t += 2 * (lk.alpha + part * lk.beta) + part * lk.gamma
            dist >>= 1
            part /= 2
        return t + fold
    raise ConfigError(f"unknown allreduce algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}")


allreduce_time = cluster_allreduce_time  # the name older scripts import


def _tree_time_with_burst(p: int, nbytes: float, link: cost.LinkCost, burst: float) -> float:
    """The binomial tree (dtrain's ``tree``, one rank per node) over links with a token bucket.

    Every node's link has a bucket each way holding ``burst`` bytes, full at the
    start; a message's bytes beyond what both buckets hold (sender's out, receiver's
    in) pass at the link rate, and a bucket refills at that rate while its link is
    idle. Messages from one node go out one after the other; a parent reduces its
    children's partial sums in arrival order, then sends on; rank 0 sends the
    result down the same tree, farthest subtree first. The whole vector moves in
    every message, so on links whose bucket holds about a message (1 ms at 1
    Gbit/s: 125 KB, the CNN's gradient is 150 KB) most of it passes at once.
    """
    rate = 1.0 / link.beta if link.beta > 0 else math.inf
    free: dict[tuple[int, str], float] = {}  # (node, "out"/"in") -> time the link is next free
    credit: dict[tuple[int, str], tuple[float, float]] = {}  # (node, dir) -> (bytes in the bucket, as of time)

    def bucket(key: tuple[int, str], t: float) -> float:
        c, since = credit.get(key, (burst, 0.0))
        return min(burst, c + (t - since) * rate)

    def send(src: int, dst: int, ready: float) -> float:
        out, inn = (src, "out"), (dst, "in")
        start = max(ready, free.get(out, 0.0), free.get(inn, 0.0))
        c_out, c_in = bucket(out, start), bucket(inn, start)
        short = max(0.0, nbytes - min(c_out, c_in))
        end = start + link.alpha + short * link.beta
        for key, c in ((out, c_out), (inn, c_in)):
            # the paced part refilled `short` bytes of tokens, which it used (the fuller bucket keeps the rest)
            credit[key] = (min(burst, c - nbytes + short), end)
            free[key] = end
        return end

    rounds = cost.ceil_log2(p)
    ready = [0.0] * p
    for i in range(rounds):  # reduce: round i, every rank with bit i set (and no lower bit) sends up
        for r in range(1 << i, p, 1 << (i + 1)):
            parent = r - (1 << i)
            ready[parent] = max(ready[parent], send(r, parent, ready[r])) + nbytes * link.gamma
    have = [math.inf] * p
    have[0] = ready[0]
    for i in reversed(range(rounds)):  # broadcast: farthest subtree first
        for r in range(0, p, 1 << (i + 1)):
            if r + (1 << i) < p:
                have[r + (1 << i)] = send(r, r + (1 << i), have[r])
    return max(have)


def _whole(nbytes: float) -> int:
    """comm.cost counts ring pieces in whole 4-byte elements."""
    return max(4, int(math.ceil(nbytes / 4.0)) * 4)


def allreduce_bytes(algorithm: str, nbytes: float, p: int, node_size: int = 1) -> float:
    """Mean bytes a rank sends in one allreduce (exact counts from :mod:`dtrain.comm.cost` up to 64 ranks)."""
    if p <= 1 or nbytes <= 0:
        return 0.0
    if p <= 64:
        tr = cost.traffic(algorithm, p, _whole(nbytes), node_size=node_size if algorithm == "hierarchical" else None)
        return tr.total_bytes / p
    n = float(nbytes)
    if algorithm in ("ring", "native", "rabenseifner", "tree"):
        return 2 * (p - 1) / p * n  # tree: 2(P-1) messages of n over P ranks
    if algorithm == "recursive_doubling":
        return (p.bit_length() - 1) * n
    if algorithm == "hierarchical":
        nodes = math.ceil(p / node_size)
        return (2 * (p - nodes) * n + nodes * 2 * (nodes - 1) / nodes * n) / p
    raise ConfigError(f"unknown allreduce algorithm {algorithm!r}")


def allgather_time(c: ClusterSpec, nbytes_each: float, p: int) -> float:
    """Direct allgather: every rank sends its ``nbytes_each`` to the ``P-1`` others (one NIC, serialised)."""
    if p <= 1:
        return 0.0
    d, nodes = _levels(c, p)
    link = c.intra if nodes == 1 else c.inter
    flows = d if nodes > 1 else 1  # every device of a node sends off-node at once
    return (p - 1) * (link.alpha + nbytes_each * link.duplex_beta * flows)


def _halves(c: ClusterSpec, algorithm: str, nbytes: float, p: int) -> tuple[float, float]:
    """(reduce-scatter, allgather) seconds of the two halves of a ring allreduce of ``nbytes``."""
    if algorithm not in ("ring", "native"):
        raise ConfigError(
            f"a reduce-scatter or allgather of its own runs on the ring (ring or native), not {algorithm!r}"
        )
    full = cluster_allreduce_time(c, algorithm, nbytes, p)
    moved = cluster_allreduce_time(replace(c, device=replace(c.device, gamma=0.0)), algorithm, nbytes, p)
    return moved / 2 + (full - moved), moved / 2


def ring_reduce_scatter_time(c: ClusterSpec, algorithm: str, nbytes: float, p: int) -> float:
    """Seconds for ``p`` ranks to reduce-scatter ``nbytes`` on the ring (``ring`` or ``native``).

    The first half of the ring allreduce: ``(P-1)·alpha + (P-1)/P·n·beta + (P-1)/P·n·gamma``
    (alpha per piece as dtrain's ring sends them, each level charged as
    :func:`cluster_allreduce_time` charges it). With :func:`ring_allgather_time` it adds up
    to :func:`cluster_allreduce_time` exactly.
    """
    return _halves(c, algorithm, nbytes, p)[0]


def ring_allgather_time(c: ClusterSpec, algorithm: str, nbytes: float, p: int) -> float:
    """Seconds for ``p`` ranks to allgather ``nbytes`` (``n/P`` each) on the ring: the second half of the ring
    allreduce, ``(P-1)·alpha + (P-1)/P·n·beta`` (nothing to reduce)."""
    return _halves(c, algorithm, nbytes, p)[1]


# ---------------------------------------------------------------------- compression


@dataclass(frozen=True)
class CompressionModel:
    """How a compressor changes one bucket's allreduce.

    Attributes:
        spec: the compressor spec ("topk:0.01").
        kind: "dense" (no compression), "summable" (fp16/bf16: allreduce the payload),
            "lowrank" (PowerSGD: two allreduces), "sparse" (SparCML plan),
            "quantizer" (compressed reduce-scatter + allgather).
        ratio: payload bytes / dense bytes.
        encode_s_per_byte / decode_s_per_byte: compute cost per dense byte.
        cpu_ratio: a process's CPU over the thread count of the counted collective
            (:attr:`dtrain.perfmodel.spec.CompressorCost.cpu_ratio`).
    """

    spec: str = "none"
    kind: str = "dense"
    ratio: float = 1.0
    encode_s_per_byte: float = 0.0
    decode_s_per_byte: float = 0.0
    cpu_ratio: float = 1.0

    def per_byte_coding(self, nbytes: float) -> float:
        """Encode + decode seconds of ``nbytes`` dense bytes at the calibration's per-byte times."""
        return nbytes * (self.encode_s_per_byte + self.decode_s_per_byte)


def compressed_allreduce_time(
    c: ClusterSpec,
    algorithm: str,
    nbytes: float,
    p: int,
    comp: CompressionModel,
    shapes: tuple[tuple[int, ...], ...] = (),
) -> tuple[float, float]:
    """(communication seconds, encode+decode seconds) of one bucket of ``nbytes`` (``shapes``: its
    parameters' shapes, the layout a compressor gets; counted worlds only)."""
    if p <= 1 or nbytes <= 0:
        return 0.0, 0.0
    if comp.kind == "dense":
        return cluster_allreduce_time(c, algorithm, nbytes, p), 0.0
    payload = comp.ratio * nbytes
    coding = comp.per_byte_coding(nbytes)
    d, nodes = _levels(c, p)
    link = c.intra if nodes == 1 else c.inter
    flows = d if nodes > 1 else 1
    if p <= _COUNTED_WORLD and comp.spec not in ("", "none"):
        # small worlds: the implementation's own messages, bytes and CPU time (encode, merge, decode)
        msgs, sent, cpu = compressed_traffic(comp.spec, p, max(1, int(nbytes // 4)), shapes)
        return msgs * link.alpha + sent * link.duplex_beta * flows, cpu * comp.cpu_ratio * c.device.compute_scale
    if comp.kind == "summable":
        return cluster_allreduce_time(c, algorithm, payload, p), coding
    if comp.kind == "lowrank":  # two allreduces (P then Q), each about half the payload
        return 2 * cluster_allreduce_time(c, algorithm, payload / 2, p), coding
    if comp.kind == "quantizer":
        # direct RS + AG of compressed chunks: 2(P-1) messages of payload/P, decode P chunks twice
        t = 2 * (p - 1) * (link.alpha + payload / p * link.duplex_beta * flows)
        return t, coding * 2
    if comp.kind == "sparse":
        # count exchange, then the cheaper of allgather and split (SparCML), as comm.sparse plans it
        v, w = 4.0, 8.0
        k = payload / w  # pairs per rank
        n_el = nbytes / v
        counts = (p - 1) * (link.alpha + 8 * (p + 2) * link.duplex_beta * flows)
        b_ag = (p - 1) * min(k * w, n_el * v)
        c_j, k_j = n_el / p, k / p
        b_split = (p - 1) * min(k_j * w, c_j * v) + (p - 1) * (8 + min(min(p * k_j, c_j) * w, c_j * v))
        if b_ag <= b_split:
            t = (p - 1) * link.alpha + b_ag * link.duplex_beta * flows
        else:
            t = 2 * (p - 1) * link.alpha + b_split * link.duplex_beta * flows
        return counts + t, coding
    raise ConfigError(f"unknown compression kind {comp.kind!r}")


def collective_steps(c: ClusterSpec, algorithm: str, p: int, comp: CompressionModel, nbytes: float = 0.0) -> int:
    """Sequential message steps of one bucket's collective on ``p`` ranks (each pays the device's ``floor``).

    Dense: ring and the backend's ``2(P-1)``, the binomial tree ``2 ceil(log2 P)``,
    recursive doubling ``log2 P'`` and Rabenseifner ``2 log2 P'`` (``P'`` the
    power-of-two core; 2 more to fold the rest in and out), hierarchical its
    tree inside nodes and ring among them. Compressed: up to 8 ranks the busiest
    rank's messages, counted as :func:`compressed_allreduce_time` counts them
    (PowerSGD's two allreduces make twice a ring's); beyond, the same in closed form.
    """
    if p <= 1:
        return 0
    if comp.kind != "dense" and comp.spec not in ("", "none"):
        if p <= _COUNTED_WORLD:
            return compressed_traffic(comp.spec, p, max(1, int(nbytes // 4)))[0]
        if comp.kind == "lowrank":
            return 2 * collective_steps(c, algorithm, p, CompressionModel())
        if comp.kind == "summable":
            return collective_steps(c, algorithm, p, CompressionModel())
        return 2 * (p - 1)
    if algorithm in ("ring", "native"):
        return 2 * (p - 1)
    if algorithm == "tree":
        return 2 * cost.ceil_log2(p)
    rounds = p.bit_length() - 1  # log2 of the power-of-two core
    fold = 0 if p == 1 << rounds else 2
    if algorithm == "recursive_doubling":
        return rounds + fold
    if algorithm == "rabenseifner":
        return 2 * rounds + fold
    if algorithm == "hierarchical":
        d, nodes = _levels(c, p)
        return 2 * cost.ceil_log2(d) + 2 * (nodes - 1)
    raise ConfigError(f"unknown allreduce algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}")


def compressed_allreduce_bytes(
    algorithm: str, nbytes: float, p: int, comp: CompressionModel, node_size: int = 1
) -> float:
    """Mean bytes a rank sends for one bucket of ``nbytes`` under ``comp``."""
    if p <= 1 or nbytes <= 0:
        return 0.0
    if comp.kind == "dense":
        return allreduce_bytes(algorithm, nbytes, p, node_size)
    payload = comp.ratio * nbytes
    if comp.kind == "summable":
        return allreduce_bytes(algorithm, payload, p, node_size)
    if comp.kind == "lowrank":
        return 2 * allreduce_bytes(algorithm, payload / 2, p, node_size)
    if comp.kind == "quantizer":
        return 2 * (p - 1) / p * payload
    k = payload / 8.0
    n_el = nbytes / 4.0
    b_ag = (p - 1) * min(k * 8, n_el * 4)
    c_j, k_j = n_el / p, k / p
    b_split = (p - 1) * min(k_j * 8, c_j * 4) + (p - 1) * (8 + min(min(p * k_j, c_j) * 8, c_j * 4))
    return (p - 1) * 8 * (p + 2) + min(b_ag, b_split)
