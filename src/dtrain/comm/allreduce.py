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
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from dtrain.comm import cost as _cost
from dtrain.comm._reduce import (
    BUFFERS,
    OPS,
    SubTransport,
    average,
    check_op,
    check_tensor,
    combine,
    post_recv,
    post_send,
)
from dtrain.comm._schedule import (
    Fold,
    RingPlan,
    binomial_children,
    binomial_parent,
    doubling_rounds,
    halving_rounds,
    offsets,
)
from dtrain.comm.transport import DEFAULT_TIMEOUT_S, TorchTransport, Transport
from dtrain.errors import CommError, CommTimeoutError, ConfigError

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

RING_PIECE_BYTES = _cost.RING_PIECE_BYTES
RING_MAX_PIECES = _cost.RING_MAX_PIECES

# tag bases keep the phases of one algorithm (and of hierarchical's sub-worlds) apart
_TAG_TREE_REDUCE = 1 << 22
_TAG_TREE_BCAST = 2 << 22
_TAG_FOLD = 3 << 22
_TAG_INTRA = 1 << 26
_TAG_INTER = 2 << 26


@dataclass(frozen=True)
class AllreduceOptions:
    """Tunables of the allreduce algorithms.

    Attributes:
        piece_bytes: the ring cuts each of its P segments into pieces of about this
            many bytes and pipelines them (default: 1 MiB, gloo's own segment
            size; 0.25 MiB was measured slower on loopback gloo, see DESIGN.md).
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


def _algorithm(name: str) -> Callable[[_Inner], AlgorithmFn]:
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


# ----------------------------------------------------------------------------- ring


def _ring(t: Transport, flat: torch.Tensor, op: str, opts: AllreduceOptions) -> None:
    P, r = t.world_size, t.rank
    plan = RingPlan.build(flat.numel(), P, max(1, opts.piece_bytes // flat.element_size()), opts.max_pieces)
    k, steps = plan.pieces, plan.steps()
    right, left = (r + 1) % P, (r - 1) % P

    # views[seg * k + j]: piece j of segment seg (None when empty, i.e. never sent)
    views: list[torch.Tensor | None] = []
    for seg in range(P):
        base, cut = plan.seg[seg], offsets(plan.seg[seg + 1] - plan.seg[seg], k)
        views += [flat[base + cut[j] : base + cut[j + 1]] if cut[j + 1] > cut[j] else None for j in range(k)]
    # what this rank receives, in order: (step, piece key); at step s it is segment r-s-1
    recvs = [
        (s, key)
        for s in range(steps)
        for key in range(((r - s - 1) % P) * k, ((r - s - 1) % P) * k + k)
        if views[key] is not None
    ]
    pending: dict[int, Any] = {}  # piece key -> send in flight from that slice
    sent: set[int] = set()

    def send(step: int, key: int) -> None:
        view = views[key]
        if view is None:
            return
        old = pending.pop(key, None)
        if old is not None:
            old.wait()
        pending[key] = post_send(t, view, right, step * k + key % k)
        sent.add(key)

    window = opts.window
    n_rs = sum(1 for s, _ in recvs if s < P - 1)
    nbuf = min(window, n_rs) + 1
    width = plan.max_piece()
    pool = BUFFERS.take(nbuf * width, flat.dtype, flat.device)
    free = [pool[i * width : (i + 1) * width] for i in range(nbuf)]
    inflight: deque[tuple[Any, torch.Tensor | None]] = deque()
    nxt = 0

    def post_ahead() -> None:
        # keep `window` receives posted; allgather ones only once the slice they
        # overwrite has been sent during reduce-scatter
        nonlocal nxt
        while nxt < len(recvs) and len(inflight) < window:
            ps, pkey = recvs[nxt]
            if ps < P - 1:
                if not free:
                    break
                buf = free.pop()
                target = views[pkey]
                assert target is not None
                inflight.append((post_recv(t, buf[: target.numel()], left, ps * k + pkey % k), buf))
            else:
                if pkey not in sent:
                    break
                old = pending.pop(pkey, None)
                if old is not None:
                    old.wait()
                into = views[pkey]
                assert into is not None
                inflight.append((post_recv(t, into, left, ps * k + pkey % k), None))
            nxt += 1

    # receives first, then the first sends: over gloo, a 38 KB ring step on emulated 50 Mbit links
    # took 10.5 ms with the send posted first and 7.0 ms with the receive posted first
    post_ahead()
    for key in range(r * k, r * k + k):
        send(0, key)
    for s, key in recvs:
        post_ahead()
        work, scratch = inflight.popleft()
        work.wait()
        if scratch is not None:
            acc = views[key]
            assert acc is not None
            combine(acc, scratch[: acc.numel()], op)
            free.append(scratch)
        if s < steps - 1:
            send(s + 1, key)
    for work in pending.values():
        work.wait()
    BUFFERS.give(pool)


@_algorithm("ring")
def ring(t: Transport, flat: torch.Tensor, op: str, opts: AllreduceOptions) -> None:
    """Ring allreduce: reduce-scatter then allgather around a ring, pipelined in pieces.

    Steps (rank ``r`` of ``P``, vector cut into ``P`` near-equal segments):

    1. Reduce-scatter, ``P-1`` steps: at step ``s`` send segment ``r-s`` to ``r+1``,
       receive segment ``r-s-1`` from ``r-1`` and reduce it into the local copy.
       Afterwards rank ``r`` holds the full reduction of segment ``r+1``.
    2. Allgather, ``P-1`` steps: pass the finished segments on around the ring,
       receiving straight into place.

    Each segment travels in pieces of about ``options.piece_bytes`` (at most
    ``options.max_pieces`` of them, larger ones for large tensors); a piece is
    forwarded as soon as it is reduced, and ``options.window`` receives are kept
    posted, so sending, receiving and reducing overlap. Receive buffers are reused
    across calls.

    Cost: ``2(P-1)`` steps of ``n/P`` bytes: ``2(P-1)·alpha + 2(P-1)/P·n·beta +
    (P-1)/P·n·gamma`` -- bandwidth-optimal (Patarasuk & Yuan, JPDC 2009).
    """
    _ring(t, flat, op, opts)


# ----------------------------------------------------------------------------- tree


def _tree_reduce(t: Transport, flat: torch.Tensor, op: str) -> None:
    children = binomial_children(t.rank, t.world_size)
    if children:
        buf = BUFFERS.take(flat.numel(), flat.dtype, flat.device)
        for c in reversed(children):  # nearest (smallest subtree) first, as its partial sum is ready first
            post_recv(t, buf, c, _TAG_TREE_REDUCE).wait()
            combine(flat, buf, op)
        BUFFERS.give(buf)
    parent = binomial_parent(t.rank)
    if parent >= 0:
        post_send(t, flat, parent, _TAG_TREE_REDUCE).wait()


def _tree_bcast(t: Transport, flat: torch.Tensor) -> None:
    parent = binomial_parent(t.rank)
    if parent >= 0:
        post_recv(t, flat, parent, _TAG_TREE_BCAST).wait()
    works = [post_send(t, flat, c, _TAG_TREE_BCAST) for c in binomial_children(t.rank, t.world_size)]
    for w in works:
        w.wait()


@_algorithm("tree")
def tree(t: Transport, flat: torch.Tensor, op: str, opts: AllreduceOptions) -> None:
    """Binomial-tree reduce to rank 0, then binomial-tree broadcast from it.

    Steps: in round ``i`` (``i = 0..ceil(log2 P)-1``) every rank whose bit ``i`` is
    set sends its partial result to ``rank - 2**i`` and drops out; the receivers
    reduce. Rank 0 then holds the result and sends it back down the same tree,
    farthest subtree first. Works for any ``P``.

    Cost: ``2·ceil(log2 P)·(alpha + n·beta) + ceil(log2 P)·n·gamma`` -- latency-optimal
    up to a factor 2, but every round moves the whole vector (Thakur et al. 2005).
    """
    _tree_reduce(t, flat, op)
    _tree_bcast(t, flat)


# ----------------------------------------------------------------------------- power-of-two core with a fold


def _fold_in(t: Transport, flat: torch.Tensor, op: str, fold: Fold) -> None:
    if fold.partner < 0:
        return
    if fold.new_rank < 0:
        post_send(t, flat, fold.partner, _TAG_FOLD).wait()
    else:
        buf = BUFFERS.take(flat.numel(), flat.dtype, flat.device)
        post_recv(t, buf, fold.partner, _TAG_FOLD).wait()
        combine(flat, buf, op)
        BUFFERS.give(buf)


def _fold_out(t: Transport, flat: torch.Tensor, fold: Fold) -> None:
    if fold.partner < 0:
        return
    if fold.new_rank < 0:
        post_recv(t, flat, fold.partner, _TAG_FOLD + 1).wait()
    else:
        post_send(t, flat, fold.partner, _TAG_FOLD + 1).wait()


def _exchange(
    t: Transport, send: torch.Tensor, recv: torch.Tensor, peer: int, tag: int
) -> None:
    """Send ``send`` to and receive ``recv`` from ``peer`` at once (either may be empty: skipped)."""
    rw = post_recv(t, recv, peer, tag) if recv.numel() else None
    sw = post_send(t, send, peer, tag) if send.numel() else None
    if rw is not None:
        rw.wait()
    if sw is not None:
        sw.wait()


@_algorithm("recursive_doubling")
def recursive_doubling(t: Transport, flat: torch.Tensor, op: str, opts: AllreduceOptions) -> None:
    """Recursive doubling (butterfly): ``log2 P`` rounds of full-vector exchange.

    Steps: in round ``i`` rank ``r`` swaps its whole vector with ``r XOR 2**i`` and
    both reduce, so after ``log2 P`` rounds everyone holds the result. For ``P``
    not a power of two the first ``2·(P - 2**floor(log2 P))`` ranks fold pairwise
    into a power-of-two core first and get the result back after (MPICH's scheme).

    Cost (power of two): ``log2 P·(alpha + n·beta + n·gamma)``; the fold adds
    ``2·alpha + 2·n·beta + n·gamma`` (Thakur et al. 2005).
    """
    fold = Fold.of(t.rank, t.world_size)
    _fold_in(t, flat, op, fold)
    if fold.new_rank >= 0 and fold.core > 1:
        buf = BUFFERS.take(flat.numel(), flat.dtype, flat.device)
        d, rnd = 1, 0
        while d < fold.core:
            peer = fold.real(fold.new_rank ^ d)
            _exchange(t, flat, buf, peer, rnd)
            combine(flat, buf, op)
            d, rnd = d << 1, rnd + 1
        BUFFERS.give(buf)
    _fold_out(t, flat, fold)


@_algorithm("rabenseifner")
def rabenseifner(t: Transport, flat: torch.Tensor, op: str, opts: AllreduceOptions) -> None:
    """Rabenseifner's allreduce: recursive-halving reduce-scatter, recursive-doubling allgather.

    Steps (``P`` a power of two, vector cut into ``P`` blocks):

    1. Reduce-scatter, ``log2 P`` rounds: with distance ``d = P/2, P/4, ..., 1``,
       swap half of the current window of blocks with ``r XOR d`` -- send the half
       the partner keeps, reduce the half you keep. Rank ``r`` ends with block ``r``.
    2. Allgather, ``log2 P`` rounds: ``d = 1, 2, ..., P/2``, swap the windows built
       so far with ``r XOR d``, receiving into place.

    Non-powers of two fold into the power-of-two core first (full vector), as in
    MPICH. Cost (power of two): ``2·log2 P·alpha + 2(P-1)/P·n·beta +
    (P-1)/P·n·gamma``; the fold adds ``2·alpha + 2·n·beta + n·gamma``
    (Rabenseifner, ICCS 2004; Thakur et al. 2005).
    """
    fold = Fold.of(t.rank, t.world_size)
    _fold_in(t, flat, op, fold)
    if fold.new_rank >= 0 and fold.core > 1:
        blocks = offsets(flat.numel(), fold.core)
        half = blocks[fold.core // 2]  # the first window kept is the largest
        buf = BUFFERS.take(max(half, flat.numel() - half), flat.dtype, flat.device)
        rnd = 0
        for peer_new, keep, give in halving_rounds(fold.new_rank, fold.core):
            klo, khi = blocks[keep[0]], blocks[keep[1]]
            glo, ghi = blocks[give[0]], blocks[give[1]]
            got = buf[: khi - klo]
            _exchange(t, flat[glo:ghi], got, fold.real(peer_new), rnd)
            combine(flat[klo:khi], got, op)
            rnd += 1
        BUFFERS.give(buf)
        for peer_new, mine, theirs in doubling_rounds(fold.new_rank, fold.core):
            mlo, mhi = blocks[mine[0]], blocks[mine[1]]
            tlo, thi = blocks[theirs[0]], blocks[theirs[1]]
            _exchange(t, flat[mlo:mhi], flat[tlo:thi], fold.real(peer_new), rnd)
            rnd += 1
    _fold_out(t, flat, fold)


# ----------------------------------------------------------------------------- hierarchical


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


@_algorithm("hierarchical")
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
    intra = SubTransport(t, members, _TAG_INTRA)
    if len(members) > 1:
        _tree_reduce(intra, flat, op)
    if t.rank == members[0] and len(leaders) > 1:
        _ring(SubTransport(t, leaders, _TAG_INTER), flat, op, opts)
    if len(members) > 1:
        _tree_bcast(intra, flat)


# ----------------------------------------------------------------------------- native


@_algorithm("native")
def native(t: Transport, flat: torch.Tensor, op: str, opts: AllreduceOptions) -> None:
    """The backend's own ``torch.distributed.all_reduce`` on the transport's group.

    ``avg`` is reduced as a sum and divided afterwards (gloo has no integer
    average). gloo and NCCL do not report what they send; ``stats`` is charged what
    an unpipelined ring sends (``2(P-1)`` messages, ``2(P-1)/P·n`` bytes), which is
    the algorithm gloo's and NCCL's default allreduce use for large tensors.
    Needs a :class:`TorchTransport`.
    """
    if not isinstance(t, TorchTransport):
        raise ConfigError("algorithm 'native' runs the backend's own allreduce and needs a TorchTransport, "
                          f"got {type(t).__name__}")
    import torch.distributed as dist

    red = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
    try:
        work = dist.all_reduce(flat, op=red, group=t.group, async_op=True)
        ok = work.wait(timeout=datetime.timedelta(seconds=t.timeout))
    except RuntimeError as e:
        msg = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
        cls = CommTimeoutError if "imeout" in msg or "timed out" in msg else CommError
        raise cls(t.rank, "allreduce(native)", msg) from e
    if ok is False:
        raise CommTimeoutError(t.rank, "allreduce(native)", f"not completed within {t.timeout:.0f}s")
    traffic = _cost.native_traffic(t.world_size, flat.numel(), flat.element_size())
    t.stats.messages += traffic.messages[t.rank]
    t.stats.bytes_sent += traffic.bytes_sent[t.rank]


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
        raise ConfigError(
            f"unknown allreduce algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}"
        ) from None


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
    if backend == "gloo" and dev != "cpu":
        raise ConfigError(
            f"allreduce on a gloo group needs a CPU tensor, got one on {tensor.device}; "
            "move it with .cpu() or use an NCCL group for CUDA tensors"
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
        tensor: a contiguous tensor on the backend's device (CPU for gloo), the
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
    return ALGORITHMS[algorithm](transport, tensor, op, opts)
