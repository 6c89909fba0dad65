"""Predicted step time, memory and traffic of each strategy: pure functions.

Every function here takes a :class:`~dtrain.perfmodel.profile.ModelProfile` (at
the per-worker batch), a :class:`~dtrain.perfmodel.spec.ClusterSpec` and a
:class:`~dtrain.registry.Choice` (a registered strategy, its options and workers),
and returns a :class:`Prediction`. Nothing is run.

Compute. Per-layer forward and backward times come, in this order of
preference, from the cluster's ``[models.NAME]`` throughput (split over layers
by FLOPs), from the profile's measured times when they were measured on the
cluster's host (times the cluster's ``compute_scale``), or from FLOPs over the
device's FLOP rate.

Data parallel (``dp``, ``ddp``; DDP/Horovod-style buckets, Li et al. VLDB 2020;
Sergeev & Del Balso 2018):

1. Gradients become ready layer by layer in backward; buckets are formed in
   that order (:func:`dtrain.comm.fusion.assign_buckets`: a 1 MiB first bucket,
   then ``bucket_mb``).
2. Bucket ``j`` is ready at the end of the backward of its earliest layer; one
   communication stream reduces buckets in order:
   ``start_j = max(ready_j, end_{j-1})``, ``end_j = start_j + T_allreduce(bytes_j)``
   (plus encode/decode with a compressor, and :func:`bucket_latency`: the
   cluster's ``wake`` latency once per step, since on shared cores the first
   message after compute waits for the scheduler, and twice per bucket when the
   bucket is handed to dtrain's communication thread and back). Each step of a
   bucket's collective takes at least the cluster's ``floor``
   (:func:`~dtrain.perfmodel.collectives.collective_steps`; a compressed call's
   encode and decode count toward it, PowerSGD's add to it): on cores shared by more ranks than they
   can run at once every message waits for the scheduler (0 on dedicated hosts).
3. ``step = fwd + max(bwd, end_last) + optimizer + overhead``; the exposed
   communication is ``max(0, end_last - bwd)``.
   With ``overlap="forward"`` (priority scheduling, Jayarajan et al. "Priority-based
   parameter propagation", SysML 2019) the optimizer runs per bucket and the next
   forward of a layer waits only for its own bucket; the step is the steady-state
   period of that pipeline.

Sharded data parallel (``dp --shard``, ZeRO stages 1-3; Rajbhandari et al., "ZeRO: memory
optimizations toward training trillion parameter models", SC 2020): memory from
:func:`sharded_memory`, time from :func:`predict_sharded`. The units are the layers
with parameters, each one flat buffer; every collective is half a ring allreduce
(:func:`shard_collective`), and every rank steps only its ``1/P`` shard of the
optimizer (``optimizer / P`` seconds).

* stages 1-2 (``optimizer``, ``gradients``): each unit's gradient is reduce-scattered
  when its backward is done, overlapped with backward as the buckets above; then the
  updated parameters are allgathered unit by unit in forward's order: exposed before
  the next forward, or with ``overlap="forward"`` waited for layer by layer. The bytes
  of a ring allreduce, ``2(P-1)/P n``.
* stage 3 (``parameters``): a unit is allgathered before its forward (the next one
  prefetched while a unit computes), again before its backward (prefetched likewise),
  and its gradient reduce-scattered after it, on one communication stream in the
  order they are issued: ``3(P-1)/P n``, 1.5 times a ring allreduce's bytes.

Parameter server (``ps``; Li et al. OSDI 2014), ranks ``0..S-1`` serve and the
``N`` workers follow, placed node by node:

* a push moves each worker's gradient, cut in ``S`` shards, to the servers; the
  link of each server carries ``N*n/S`` bytes in, and a pull as many out;
  a phase takes as long as its busiest network interface (flow model).
* ``bsp``: ``compute + push + server apply + pull`` and everyone waits;
  ``backup:b`` the same with the ``b`` slowest not waited for (no help without
  stragglers); ``asp``/``ssp:s``/``softsync:k``: workers do not wait for each
  other, so the cycle is ``compute + push + pull`` plus the time a push and its
  pull queue behind other workers' at a server (:func:`async_cycle`), unless the
  servers' links are saturated, in which case throughput is the servers' link
  rate. Push, apply and pull together take at least ``2 S`` floors (a push to and
  a pull from each server).

Bytes cross a link at its one-way rate, except in the steps of ring, recursive
doubling and Rabenseifner, where every node sends and receives at once: there
the link's ``duplex_bandwidth`` (:mod:`dtrain.perfmodel.collectives`). The
binomial tree's one-way messages are replayed against the links' token buckets
(``burst``, emulated links only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from dtrain.comm.fusion import MB, assign_buckets
from dtrain.errors import ConfigError
from dtrain.perfmodel.collectives import (
    CompressionModel,
    collective_steps,
    compressed_allreduce_bytes,
    compressed_allreduce_time,
)
from dtrain.perfmodel.hooks import Memory, ModelHooks, Prediction, StepInputs
from dtrain.perfmodel.profile import ModelProfile
from dtrain.perfmodel.spec import ClusterSpec

if TYPE_CHECKING:
    from dtrain.registry import Choice

__all__ = [
    "Memory",
    "Prediction",
    "StepInputs",
    "DataParallelLike",
    "ServerLike",
    "compute_times",
    "predict",
    "memory_per_device",
    "data_parallel_memory",
    "server_memory",
    "predict_data_parallel",
    "predict_parameter_server",
    "async_cycle",
    "bucket_latency",
    "buckets_of",
    "bucket_shapes",
    "bucket_collective",
    "ps_costs",
    "WAKES_FIRST_BUCKET",
    "WAKES_PER_BUCKET",
]

_FIRST_BUCKET_MB = 1.0


class DataParallelLike(Protocol):
    """What the model reads of a data-parallel strategy's options."""

    @property
    def algorithm(self) -> str: ...
    @property
    def bucket_mb(self) -> float: ...
    @property
    def overlap(self) -> str: ...


class ServerLike(Protocol):
    """What the model reads of a parameter server's options."""

    @property
    def servers(self) -> int: ...
    @property
    def consistency(self) -> str: ...


# ---------------------------------------------------------------------- compute


def compute_times(prof: ModelProfile, c: ClusterSpec) -> tuple[list[float], list[float], float]:
    """(forward seconds per layer, backward seconds per layer, optimizer seconds) on one device of ``c``."""
    n = len(prof.layers)
    rate = c.models.get(prof.name)
    if rate is not None:
        total = prof.batch / rate.samples_per_s
        fw, bw = total * (1 - rate.backward_fraction), total * rate.backward_fraction
        return (
            _split(fw, [ly.fwd_flops for ly in prof.layers]),
            _split(bw, [ly.bwd_flops for ly in prof.layers]),
            rate.optimizer_s,
        )
    if prof.measured and c.device.host == prof.host:
        s = c.device.compute_scale
        return [ly.fwd_s * s for ly in prof.layers], [ly.bwd_s * s for ly in prof.layers], prof.optimizer_s * s
    f = c.device.flops
    opt = 4.0 * prof.param_bytes * c.device.gamma  # read param, grad, state; write back
    return [ly.fwd_flops / f for ly in prof.layers], [ly.bwd_flops / f for ly in prof.layers], opt if n else 0.0


def _split(total: float, weights: list[float]) -> list[float]:
    s = sum(weights)
    if s <= 0:
        return [total / max(1, len(weights))] * len(weights)
    return [total * w / s for w in weights]


# ---------------------------------------------------------------------- memory


def _opt_state(prof: ModelProfile) -> float:
    return {"adam": 2.0, "sgd": 1.0, "sgd0": 0.0}.get(prof.optimizer, 1.0) * prof.param_bytes


def memory_per_device(prof: ModelProfile, s: Choice, comp: CompressionModel | None = None) -> Memory:
    """Bytes per device for ``s``: parameters, gradients, optimizer state, activations, buffers.

    One process holds the model, its gradients and optimizer state and the
    activations; a distributed strategy adds its own (its ``memory`` hook).
    """
    p = float(prof.param_bytes)
    act = prof.activation_bytes + prof.input_bytes
    hook = ModelHooks.of(s.entry).memory
    if s.kind == "single" or hook is None:
        return Memory(params=p, grads=p, optimizer=_opt_state(prof), activations=act)
    return hook(prof, s, comp)


def _residual(prof: ModelProfile, comp: CompressionModel | None) -> float:
    """An error-feedback residual per parameter for biased compressors."""
    return float(prof.param_bytes) if comp is not None and comp.kind not in ("dense", "summable") else 0.0


def data_parallel_memory(prof: ModelProfile, comp: CompressionModel | None) -> Memory:
    """Data parallel keeps flat bucket copies of the gradients (one model's worth) and, with a
    biased compressor, an error-feedback residual per parameter."""
    p = float(prof.param_bytes)
    act = prof.activation_bytes + prof.input_bytes
    return Memory(params=p, grads=p, optimizer=_opt_state(prof), activations=act, buffers=p + _residual(prof, comp))


def server_memory(prof: ModelProfile, o: ServerLike, comp: CompressionModel | None) -> Memory:
    """A parameter-server worker keeps a push buffer; a server holds its ``1/S`` shard of parameters
    and optimizer state plus one gradient accumulator. The larger of the two."""
    p = float(prof.param_bytes)
    act = prof.activation_bytes + prof.input_bytes
    payload = (comp.ratio if comp is not None else 1.0) * p
    worker = Memory(params=p, grads=p, optimizer=0.0, activations=act, buffers=payload + _residual(prof, comp))
    server = Memory(
        params=p / o.servers,
        grads=0.0,
        optimizer=_opt_state(prof) / o.servers,
        activations=0.0,
        buffers=2 * p / o.servers,
    )
    return worker if worker.total >= server.total else server


# ---------------------------------------------------------------------- strategies


def predict(
    prof: ModelProfile, c: ClusterSpec, s: Choice, comp: CompressionModel | None = None, *, overhead_s: float = 0.0
) -> Prediction:
    """Predict one strategy (its registered ``predict`` hook; one process needs none).

    Args:
        prof: the model profile at the per-worker batch (``global batch / workers``).
        c: the cluster (the strategy's processes fill its nodes in order).
        s: the strategy, its options and workers.
        comp: the compressor's cost model (required when the strategy compresses).
        overhead_s: fixed seconds per step beyond model and communication (the
            training loop's own bookkeeping; calibration measures it).

    Raises:
        ConfigError: the strategy needs more processes than the cluster has devices,
            or has no performance model.
    """
    if s.processes > c.devices:
        raise ConfigError(f"{s.label()} needs {s.processes} processes, the cluster has {c.devices} devices")
    spec = s.opts.compressor_spec()
    if spec != "none" and comp is None:
        raise ConfigError(f"strategy {s.label()} needs a CompressionModel for {spec!r}")
    comp = comp or CompressionModel()
    fwd, bwd, opt = compute_times(prof, c)
    mem = memory_per_device(prof, s, comp)
    fits = mem.total <= c.device.memory
    if s.kind == "single":
        step = sum(fwd) + sum(bwd) + opt + overhead_s
        return Prediction(
            s,
            step,
            prof.batch * s.workers / step,
            step - overhead_s,
            0.0,
            0.0,
            0.0,
            0.0,
            mem,
            fits,
            "compute only: no communication",
        )
    hook = ModelHooks.of(s.entry).predict
    if hook is None:
        raise ConfigError(f"strategy {s.strategy!r} has no performance model (its registry entry has no predict)")
    return hook(prof, c, s, comp, StepInputs(fwd, bwd, opt, overhead_s, mem, fits))


def _bucket_groups(prof: ModelProfile, bucket_mb: float) -> list[list[int]]:
    """The layers (indices, in the order backward fills them) of each bucket."""
    order = [i for i in reversed(range(len(prof.layers))) if prof.layers[i].param_bytes > 0]
    sizes = [prof.layers[i].param_bytes for i in order]
    if not sizes:
        return []
    groups = assign_buckets(
        sizes, cap_bytes=max(1, int(bucket_mb * MB)), first_cap_bytes=max(1, int(min(_FIRST_BUCKET_MB, bucket_mb) * MB))
    )
    return [[order[k] for k in g] for g in groups]


def buckets_of(prof: ModelProfile, bucket_mb: float) -> list[tuple[float, int]]:
    """(bytes, index of the earliest layer in it) of each bucket, in the order backward fills them."""
    return [(float(sum(prof.layers[i].param_bytes for i in g)), g[-1]) for g in _bucket_groups(prof, bucket_mb)]


def bucket_shapes(prof: ModelProfile, bucket_mb: float) -> list[tuple[tuple[int, ...], ...]]:
    """Each bucket's parameter shapes (:func:`buckets_of`'s buckets; empty where the profile has none): the
    layout the data-parallel reducer hands a compressor, whose buckets take the parameters last to first."""
    return [tuple(sh for i in g for sh in reversed(prof.layers[i].shapes)) for g in _bucket_groups(prof, bucket_mb)]


def predict_data_parallel(
    prof: ModelProfile, c: ClusterSpec, s: Choice, o: DataParallelLike, comp: CompressionModel, inputs: StepInputs
) -> Prediction:
    """Data parallel (``dp``, ``ddp``): buckets reduced in backward's order (module docstring)."""
    fwd, bwd, opt, overhead, mem, fits = inputs.fwd, inputs.bwd, inputs.opt, inputs.overhead, inputs.memory, inputs.fits
    p = s.workers
    algorithm = o.algorithm
    node_size = min(c.devices_per_node, p)
    # backward finishes layer i at ready[i] (layers run last to first)
    ready, t = [0.0] * len(bwd), 0.0
    for i in reversed(range(len(bwd))):
        t += bwd[i]
        ready[i] = t
    bwd_total = t
    end, comm_total, coding_total, sent = 0.0, 0.0, 0.0, 0.0
    bucket_end: dict[int, float] = {}
    layouts = bucket_shapes(prof, o.bucket_mb)
    for j, (nbytes, first_layer) in enumerate(buckets_of(prof, o.bucket_mb)):
        comm, coding = bucket_collective(c, algorithm, nbytes, p, comp, layouts[j])
        comm += bucket_latency(c, s, comp, j)
        copy = 2 * nbytes * c.device.gamma  # flatten into and out of the bucket
        dur = comm + coding + copy
        start = max(ready[first_layer], end)
        end = start + dur
        bucket_end[first_layer] = end
        comm_total += comm
        coding_total += coding + copy
        sent += compressed_allreduce_bytes(algorithm, nbytes, p, comp, node_size)
    f_total = sum(fwd)
    if o.overlap == "forward":
        step = _forward_overlap_period(fwd, bwd, opt, prof, bucket_end, bwd_total)
    else:
        step = f_total + max(bwd_total, end) + opt
    wait = c.device.imbalance if p > 1 else 0.0  # every step waits for the slowest rank's pass
    step += overhead + wait
    compute = f_total + bwd_total + opt
    exposed = max(0.0, step - overhead - wait - compute)
    bound = "communication" if exposed > 0.5 * compute else "compute"
    why = (
        f"{bound}-bound: {comm_total * 1e3:.3g} ms of allreduce, {exposed * 1e3:.3g} ms not hidden by "
        f"{bwd_total * 1e3:.3g} ms of backward"
    )
    if comp.kind != "dense":
        why += f"; {coding_total * 1e3:.3g} ms to encode/decode"
    return Prediction(
        s,
        step,
        prof.batch * p / step,
        compute,
        comm_total + coding_total,
        exposed,
        wait,
        sent,
        mem,
        fits,
        why,
        {"fwd_s": f_total, "bwd_s": bwd_total, "opt_s": opt, "coding_s": coding_total},
    )


def bucket_collective(
    c: ClusterSpec,
    algorithm: str,
    nbytes: float,
    p: int,
    comp: CompressionModel,
    shapes: tuple[tuple[int, ...], ...] = (),
) -> tuple[float, float]:
    """(communication, encode+decode) seconds of one bucket's collective on ``p`` ranks (``shapes``: its
    parameters' shapes, :func:`bucket_shapes`): every one of
    its steps (:func:`~dtrain.perfmodel.collectives.collective_steps`) takes at least the device's
    ``floor`` (the backend's own allreduce; dtrain's collectives the ``p2p_floor``).

    In all, a compressed call costs its per-byte encode and decode plus the largest of its transfer,
    its floors and the rest of its counted CPU (the merging); PowerSGD's, the larger of its transfer
    and floors plus all of its coding. Why:

    A compressed call's encode and decode count toward those floors, except PowerSGD's: its encode
    (``P = M Q``), orthogonalisation (``Q = M^T P``) and decode run between its two ring allreduces,
    while no message is in flight, so they add to the 2 x 2(P-1) steps' floors. The other compressors'
    counted messages go to every peer at once (the count overstates their sequential steps), and their
    coding stays counted against the floors, except their encode before the first message and decode
    after the last (the calibration's per-byte times, scaled as the counted coding is), which no
    message overlaps.

    The merging waits inside a transfer-bound call's wire time as it does inside the floors: the
    CPU counted between the first message and the last runs while bytes are in flight.
    ``benchmarks/compression_traced.py`` (one call, traced) and ``benchmarks/model_vs_measured.py``
    (training steps) compare these terms with measurements.
    """
    comm, coding = compressed_allreduce_time(c, algorithm, nbytes, p, comp, shapes)
    if p > 1:
        native = algorithm == "native" and comp.kind == "dense"
        floor = c.device.floor if native else c.device.own_floor
        if comp.kind == "lowrank":  # PowerSGD: the coding sits between its allreduces' steps
            inside = 0.0
        else:
            edges = comp.per_byte_coding(nbytes) * c.device.compute_scale
            inside = max(0.0, coding - edges)
        comm = max(0.0, max(comm, collective_steps(c, algorithm, p, comp, nbytes) * floor) - inside)
    return comm, coding


WAKES_PER_BUCKET = 2  # hand-off to the communication thread and back
WAKES_FIRST_BUCKET = 3  # and the step's first message after compute


def bucket_latency(c: ClusterSpec, s: Choice | None, comp: CompressionModel, index: int) -> float:
    """Scheduling latency a data-parallel bucket pays besides its collective (``wake`` units).

    The step's first message waits once for the scheduler after compute. Every
    bucket is then handed to another thread and back, two more wake-ups: dtrain's
    own algorithms, compressors and priority overlap run on its communication
    thread, and the backend's ``native`` allreduce (DataParallel's and DDP's,
    issued asynchronously from the hooks) runs on the backend's worker thread, so
    native and DDP steps pay the hand-off as the ring's do.
    """
    return c.device.wake * (WAKES_FIRST_BUCKET if index == 0 else WAKES_PER_BUCKET)


def _forward_overlap_period(
    fwd: list[float], bwd: list[float], opt: float, prof: ModelProfile, bucket_end: dict[int, float], bwd_total: float
) -> float:
    """Steady-state step of priority scheduling: layer i's next forward waits for its bucket's update."""
    total_params = max(1, prof.param_bytes)
    # which bucket (keyed by its earliest layer) holds each layer: the nearest key at or below it
    keys = sorted(bucket_end)
    done = {}
    for k in keys:
        share = sum(ly.param_bytes for ly in prof.layers[k:]) / total_params
        done[k] = bucket_end[k] + opt * share  # per-bucket optimizer step after its allreduce
    t = bwd_total  # next forward may start when backward ends
    for i, f in enumerate(fwd):
        owner = max((k for k in keys if k <= i), default=None)
        if owner is None and keys:
            owner = keys[0]
        if owner is not None and prof.layers[i].param_bytes > 0:
            t = max(t, done[owner])
        t += f
    return t  # from the start of one backward to the start of the next (= fwd + bwd + waits)


def _nic_load(c: ClusterSpec, flows: list[tuple[int, int, float]]) -> float:
    """Seconds to move ``flows`` (src rank, dst rank, bytes) at once: the busiest interface decides."""
    out_: dict[int, float] = {}
    in_: dict[int, float] = {}
    intra_t = 0.0
    for a, b, nbytes in flows:
        na, nb = c.node_of(a), c.node_of(b)
        if na == nb:
            intra_t = max(intra_t, nbytes * c.intra.beta)
            continue
        out_[na] = out_.get(na, 0.0) + nbytes
        in_[nb] = in_.get(nb, 0.0) + nbytes
    busiest = max([*out_.values(), *in_.values(), 0.0])
    return max(intra_t, busiest * c.inter.beta)


@dataclass(frozen=True)
class PSCosts:
    """The parameter server's phases for one strategy (seconds).

    Attributes:
        push_all / pull_all: all ``N`` workers push (pull) at once (bsp); the busiest link decides.
        push_one / pull_one: one worker alone (no contention at the servers).
        in_per_push / out_per_pull: how long one worker's push (pull) occupies the servers' links.
        apply_one: server time to fold in one gradient (its shard: sum + optimizer step).
        coding: encode + decode of a compressed gradient on the worker.
        payload: bytes one worker sends per push.
        floor: least time of a push, apply and pull together: ``2 S`` steps (a push
            to and a pull from each server) of the device's ``floor``.
    """

    push_all: float
    pull_all: float
    push_one: float
    pull_one: float
    in_per_push: float
    out_per_pull: float
    apply_one: float
    coding: float
    payload: float
    floor: float


def ps_costs(
    prof: ModelProfile, c: ClusterSpec, s: Choice, o: ServerLike, comp: CompressionModel, opt: float
) -> PSCosts:
    """Phase times of the parameter server (ranks ``0..S-1`` serve, workers follow, placed node by node)."""
    S, N = o.servers, s.workers
    n = float(prof.param_bytes)
    payload = comp.ratio * n if comp.kind != "dense" else n
    coding = comp.per_byte_coding(n) if comp.kind != "dense" else 0.0
    servers, workers = range(S), range(S, S + N)
    lat = 2 * S * (c.inter.alpha if c.nodes > 1 else c.intra.alpha)  # header + payload per server and direction
    w0 = S  # a representative worker
    server_beta = c.link(0, w0).beta
    wake = c.device.wake  # the push is the first message after compute
    return PSCosts(
        push_all=_nic_load(c, [(w, sv, payload / S) for w in workers for sv in servers]) + lat + wake,
        pull_all=_nic_load(c, [(sv, w, n / S) for w in workers for sv in servers]) + lat,
        push_one=_nic_load(c, [(w0, sv, payload / S) for sv in servers]) + lat + wake,
        pull_one=_nic_load(c, [(sv, w0, n / S) for sv in servers]) + lat,
        in_per_push=payload / S * server_beta,
        out_per_pull=n / S * server_beta,
        apply_one=(n / S) * c.device.gamma + opt / S,
        coding=coding,
        payload=payload,
        floor=2 * S * c.device.floor,
    )


def predict_parameter_server(
    prof: ModelProfile, c: ClusterSpec, s: Choice, o: ServerLike, comp: CompressionModel, inputs: StepInputs
) -> Prediction:
    """The parameter server under its consistency policy (module docstring)."""
    fwd, bwd, opt, overhead, mem, fits = inputs.fwd, inputs.bwd, inputs.opt, inputs.overhead, inputs.memory, inputs.fits
    N = s.workers
    pc = ps_costs(prof, c, s, o, comp, opt)
    compute = sum(fwd) + sum(bwd)
    policy = o.consistency.split(":")[0]
    detail = {"push_s": pc.push_all, "pull_s": pc.pull_all, "apply_s": N * pc.apply_one}
    if policy in ("bsp", "backup"):
        comm = pc.push_all + pc.pull_all
        # everyone waits for the slowest pass (backup:b's b slowest too: no help without stragglers)
        step = (
            compute
            + c.device.imbalance
            + pc.coding
            + max(pc.floor, pc.push_all + N * pc.apply_one + pc.pull_all)
            + overhead
        )
        wait = N * pc.apply_one + c.device.imbalance
        why = (
            f"synchronous: {comm * 1e3:.3g} ms push+pull through {o.servers} server link(s) after "
            f"{compute * 1e3:.3g} ms compute"
        )
    else:
        comm = pc.push_one + pc.pull_one
        # workers whose passes vary in length (shared cores: imbalance > 0) reach the servers at random times
        # and queue there; identical ones settle into a round robin and do not (the simulator shows it)
        queues = (pc.in_per_push, pc.apply_one, pc.out_per_pull) if c.device.imbalance > 0 else ()
        work, exchange = compute + pc.coding + overhead, pc.push_one + pc.apply_one + pc.pull_one
        cycle = async_cycle(work, exchange, pc.floor, N, queues)
        detail["queue_s"] = cycle - (work + max(pc.floor, exchange))
        # the servers serve one push at a time per resource: link in, CPU, link out
        per_update = max(pc.in_per_push, pc.out_per_pull, pc.apply_one)
        step = max(cycle, N * per_update)
        wait = step - cycle
        why = f"asynchronous ({o.consistency}): no barrier; " + (
            "server links saturated" if N * per_update > cycle else "bounded by each worker's own cycle"
        )
    barrier = c.device.imbalance if policy in ("bsp", "backup") else 0.0
    exposed = max(0.0, step - compute - overhead - pc.coding - barrier)
    return Prediction(s, step, prof.batch * N / step, compute, comm, exposed, wait, pc.payload, mem, fits, why, detail)


def async_cycle(work: float, exchange: float, floor: float, n: int, services: tuple[float, ...]) -> float:
    """One asynchronous worker's cycle: ``work + max(floor, exchange + queueing)``, solved for the queueing.

    Workers that do not wait for each other, and whose passes vary in length (on
    shared cores; the caller passes no ``services`` for identical workers, which
    settle into a round robin), reach a server at random times, so a push finds the server's
    inbound link, CPU or outbound link busy with another worker's as often as
    that resource is busy: each of the ``n`` workers uses it ``service`` seconds
    a cycle, ``rho = n service / cycle``, and waits on average
    ``rho / (2 (1 - rho)) service`` (Pollaczek-Khinchine for deterministic
    service, M/D/1; Kleinrock, "Queueing Systems" vol. 1, 1975), at most
    ``(n - 1) service`` (only ``n - 1`` others can be ahead of it). The cycle
    appears on both sides: the root of an increasing function, by bisection.
    Without this term an asynchronous parameter server's step is predicted short
    (``benchmarks/model_vs_measured.py`` compares).
    """

    def queued(cycle: float) -> float:
        wait = 0.0
        for s in services:
            rho = n * s / cycle
            wait += (n - 1) * s if rho >= 1 else min((n - 1) * s, rho / (2 * (1 - rho)) * s)
        return work + max(floor, exchange + wait)

    lo = work + max(floor, exchange)
    if n <= 1 or lo <= 0 or not services:
        return lo
    hi = queued(lo)  # queued() falls as the cycle grows: the root lies in [lo, queued(lo)]
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if queued(mid) > mid:
            lo = mid
        else:
            hi = mid
    return hi
