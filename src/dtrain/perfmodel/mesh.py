"""The performance model of the hybrid DP x PP x TP mesh: one step of ``dp x pp x tp`` and every
factorization of a world ranked.

Each replica of the mesh is a pipeline (:mod:`dtrain.perfmodel.pipeline`) of ``pp`` stages whose
layers are split over a tensor-parallel group (:mod:`dtrain.perfmodel.tensor`: the split, its memory,
its collectives and the placement of the ranks); after the flush each pipeline worker allreduces its
gradient over the ``dp`` replicas and steps its optimizer share. Pure functions, nothing is run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

from dtrain.errors import ConfigError
from dtrain.perfmodel.collectives import allreduce_bytes
from dtrain.perfmodel.pipeline import PipelineCost, idle_aware, in_flight, pipeline_cost
from dtrain.perfmodel.pipeline_cut import _spans, stage_cut
from dtrain.perfmodel.predict import Memory, Prediction, bucket_collective, compute_times
from dtrain.perfmodel.profile import LayerProfile, ModelProfile
from dtrain.perfmodel.spec import ClusterSpec
from dtrain.perfmodel.tensor import (
    _DENSE,
    TensorComm,
    TransformerShape,
    _factor,
    _grads_comm,
    _Layer,
    _layer_comm,
    _rank_layers,
    group_cluster,
    mesh_groups,
    tp_reason,
)
from dtrain.perfmodel.units import format_bytes
from dtrain.registry import Choice

__all__ = ["MeshChoice", "predict_hybrid", "mesh_reason", "factorizations", "rank_factorizations"]

_HOST = "<tensor-parallel stage>"  # no cluster's host: the pipeline model reads a stage's times as measured here


def mesh_reason(
    dp: int,
    pp: int,
    tp: int,
    *,
    heads: int,
    hidden: int,
    layers: int,
    batch: int,
    microbatches: int,
    devices: int | None = None,
) -> str:
    """Why no run could use the mesh ``dp x pp x tp`` ("" when one could): tp must divide the heads and
    the width, pp be at most the blocks, dp split the batch and ``M`` each replica's batch."""
    if min(dp, pp) < 1 or microbatches < 1:
        return f"dp, pp and micro-batches must be >= 1, got {dp}, {pp}, {microbatches}"
    if devices is not None and dp * pp * tp > devices:
        return f"the mesh needs {dp * pp * tp} devices, the cluster has {devices}"
    if reason := tp_reason(tp, heads, hidden):
        return reason
    if pp > layers:
        return f"pp={pp} stages for {layers} transformer blocks"
    if batch % dp:
        return f"the batch of {batch} does not split over dp={dp} replicas"
    if (batch // dp) % microbatches:
        return f"{microbatches} micro-batches do not divide a replica's batch of {batch // dp}"
    return ""


def _stage_profile(
    replica: ModelProfile,
    times: tuple[list[float], list[float]],
    ranked: list[_Layer],
    comm: list[TensorComm],
    tp: int,
    m: int,
) -> ModelProfile:
    """The replica as one rank of a tp group computes it: each layer's time ``/ t`` plus its ``M``
    micro-batches' tp collectives, its parameter bytes on the rank, and as activation the output a
    stage sends (per rank). Its host is :data:`_HOST`: on a cluster of that host these are the times."""
    fwd, bwd = times
    layers = tuple(
        LayerProfile(
            name=ly.name,
            params=ly.params,
            param_bytes=int(round(r.param_bytes)),
            fwd_flops=0.0,
            bwd_flops=0.0,
            activation_bytes=m * r.boundary_bytes,
            fwd_s=f / tp + m * x.fwd_s,
            bwd_s=b / tp + m * x.bwd_s,
        )
        for ly, r, x, f, b in zip(replica.layers, ranked, comm, fwd, bwd)
    )
    return replace(replica, name=_HOST, layers=layers, optimizer_s=0.0, host=_HOST)


@dataclass(frozen=True)
class _Worker:
    """One pipeline worker (a stage's rank) after the flush: its share of the step's tail."""

    fwd_s: float
    bwd_s: float
    tp: TensorComm
    grads: TensorComm
    dp_s: float
    dp_bytes: float
    opt_s: float
    memory: Memory


def _workers(
    ranked: list[_Layer],
    comm: list[TensorComm],
    owned: list[list[int]],
    fwd: list[float],
    bwd: list[float],
    opt_per_byte: float,
    views: tuple[ClusterSpec, ClusterSpec],
    mesh: tuple[int, int, int],
    sched: tuple[str, int, int],
    algorithms: tuple[str, str],
    factor: float,
    inputs: float,
) -> list[_Worker]:
    """Per pipeline worker: compute, tp collectives, sequence parallelism's gradient allreduce, the dp
    allreduce of its gradient (one bucket, exposed after the flush), its optimizer share (``opt_per_byte`` of
    its parameter bytes on the rank), memory."""
    dp, pp, tp = mesh
    schedule, m, v = sched
    tp_view, dp_view = views
    tp_algorithm, algorithm = algorithms
    out = []
    for w, mine in enumerate(owned):
        params = math.fsum(ranked[i].param_bytes for i in mine)
        sp_grads = math.fsum(ranked[i].replicated_bytes for i in mine)
        tpc = sum((comm[i] for i in mine), TensorComm())
        dp_s = bucket_collective(dp_view, algorithm, params, dp, _DENSE)[0]
        dp_s += dp_view.device.wake if dp > 1 else 0.0  # the first message after compute, from the loop
        held = in_flight(schedule, pp, m, v, w) * math.fsum(ranked[i].activation_bytes for i in mine)
        two = int(schedule == "2bw")  # PipeDream-2BW's second weight version (pipeline_memory)
        mem = Memory(
            params=(1 + two) * params,
            grads=(1 + two) * params,
            optimizer=factor * params,
            activations=held,
            buffers=inputs + params * (int(dp > 1) + two),
        )
        out.append(
            _Worker(
                fwd_s=math.fsum(fwd[i] for i in mine) / tp,
                bwd_s=math.fsum(bwd[i] for i in mine) / tp,
                tp=tpc.times(m),
                grads=_grads_comm(tp_view, tp_algorithm, tp, sp_grads) if sp_grads else TensorComm(),
                dp_s=dp_s,
                dp_bytes=allreduce_bytes(algorithm, params, dp, dp_view.devices_per_node),
                opt_s=opt_per_byte * params,
                memory=mem,
            )
        )
    return out


def predict_hybrid(
    prof: ModelProfile,
    c: ClusterSpec,
    *,
    dp: int,
    pp: int,
    tp: int,
    microbatches: int,
    schedule: str,
    sequence_parallel: bool,
    batch: int,
    seq: int,
    hidden: int,
    layers: int,
    heads: int,
    vocab: int,
    algorithm: str = "ring",
    tp_algorithm: str = "ring",
    optimizer_state_factor: float | None = None,
    chunks: int | None = None,
    dtype_bytes: int = 4,
    overhead_s: float = 0.0,
    memory_limit: float | None = None,
    balance: str = "time",
    strategy: Choice | None = None,
) -> Prediction:
    """One step of the mesh ``dp x pp x tp`` (placement: :func:`mesh_rank`).

    1. Each replica (``batch / dp`` samples; ``prof`` rescaled to it) is one pipeline of ``pp`` stages
       (:func:`~dtrain.perfmodel.pipeline.pipeline_cost`: cut, bubble, transfers) whose layers take
       ``1/t`` of their time plus their tp collectives (per micro-batch, on the critical path). A cut
       sends ``e b s h`` (``/ t`` with sequence parallelism) per rank and micro-batch each way, on the
       pp groups' link. ``pp = 1``: the ``M`` micro-batches one after the other (accumulation).
    2. After the flush each worker allreduces its replicated parameters' gradients over tp (sequence
       parallelism), its gradient over dp (one bucket, exposed: the pipeline model overlaps no
       reduction) and steps its optimizer share: the step's tail is the slowest worker's.
    3. ``step = pipeline + tail + imbalance + overhead``; memory the most loaded worker's (docs/perfmodel.md).

    ``detail``: tp_s, tp_bytes, pp_s (transfers + bubble), pp_bytes, bubble (fraction), dp_s, dp_bytes,
    fwd_s, bwd_s, opt_s, dp, pp, tp, microbatches. ``algorithm``: dp's allreduce, ``tp_algorithm`` the tp
    group's (ring or native with sequence parallelism). ``balance``: the cut, as the pipeline's (:func:`stage_cut`,
    on the split layers' times). ``strategy``: the Choice to name (default: ``dp`` of the world as a
    stand-in). ConfigError for a mesh no run would take (:func:`mesh_reason`).
    """
    if reason := mesh_reason(
        dp, pp, tp, heads=heads, hidden=hidden, layers=layers, batch=batch, microbatches=microbatches, devices=c.devices
    ):
        raise ConfigError(reason)
    m = microbatches
    sched = (schedule, chunks or (2 if schedule == "interleaved" else 1)) if pp > 1 else ("1f1b", 1)
    replica = prof.at_batch(batch // dp)
    shape = TransformerShape(batch // dp // m, seq, hidden, layers, heads, vocab, dtype_bytes=dtype_bytes)
    pipe = _replica_pipeline(replica, c, shape, (dp, pp, tp, m), sched, sequence_parallel, tp_algorithm, balance)
    workers = _mesh_workers(pipe, replica, c, (dp, pp, tp, m), sched, (tp_algorithm, algorithm), optimizer_state_factor)
    return _assemble(
        pipe.cost,
        workers,
        c,
        (dp, pp, tp, m),
        batch,
        sequence_parallel,
        overhead_s,
        memory_limit,
        strategy or Choice("dp", dp * pp * tp),
    )


class _ReplicaPipeline(NamedTuple):
    """Step 1 of :func:`predict_hybrid`: one replica's layers split over tp, and its pipeline's cost."""

    ranked: list[_Layer]
    comm: list[TensorComm]
    fwd: list[float]
    bwd: list[float]
    opt_s: float
    tp_view: ClusterSpec
    cost: PipelineCost


def _replica_pipeline(
    replica: ModelProfile,
    c: ClusterSpec,
    shape: TransformerShape,
    mesh: tuple[int, int, int, int],
    sched: tuple[str, int],
    sequence_parallel: bool,
    tp_algorithm: str,
    balance: str,
) -> _ReplicaPipeline:
    """The replica's layers as a tp rank computes them (with their collectives on the tp groups' link), cut
    into the pipeline's stages as the mesh places them, and that pipeline's cost."""
    dp, pp, tp, m = mesh
    ranked = _rank_layers(replica, shape, tp, sequence_parallel)
    tp_view = group_cluster(c, mesh_groups("tp", dp, pp, tp))
    n, loss_n = float(shape.batch * shape.seq * shape.hidden * shape.dtype_bytes), 4.0 * shape.batch * shape.seq
    comm = [_layer_comm(r.kind, tp_view, tp_algorithm, tp, sequence_parallel, n, loss_n) for r in ranked]
    stages = group_cluster(c, mesh_groups("pp", dp, pp, tp))  # the stages placed as the mesh places them
    stages = replace(stages, models={}, device=replace(c.device, host=_HOST, compute_scale=1.0))
    # workers sharing cores compute less at once in a pipeline (its bubble): pipeline.idle_aware
    fwd, bwd, opt = compute_times(replica, idle_aware(c, sched[0], pp, m, sched[1]) if pp > 1 else c)
    stage_prof = _stage_profile(replica, (fwd, bwd), ranked, comm, tp, m)
    pc = pipeline_cost(stage_prof, stages, pp, m, *sched, sizes=stage_cut(stage_prof, pp * sched[1], balance, m))
    return _ReplicaPipeline(ranked, comm, fwd, bwd, opt, tp_view, pc)


def _mesh_workers(
    pipe: _ReplicaPipeline,
    replica: ModelProfile,
    c: ClusterSpec,
    mesh: tuple[int, int, int, int],
    sched: tuple[str, int],
    algorithms: tuple[str, str],
    optimizer_state_factor: float | None,
) -> list[_Worker]:
    """Step 2 of :func:`predict_hybrid`: the layers each pipeline worker owns, and its share of the tail."""
    dp, pp, tp, m = mesh
    owned = [[i for k, span in enumerate(_spans(pipe.cost.sizes)) if k % pp == w for i in span] for w in range(pp)]
    views = (pipe.tp_view, group_cluster(c, mesh_groups("dp", dp, pp, tp)))
    return _workers(
        pipe.ranked,
        pipe.comm,
        owned,
        pipe.fwd,
        pipe.bwd,
        pipe.opt_s / max(1, replica.param_bytes),
        views,
        (dp, pp, tp),
        (sched[0], m, sched[1]),
        algorithms,
        _factor(replica, optimizer_state_factor),
        replica.input_bytes,
    )


def _assemble(
    pc: PipelineCost,
    workers: list[_Worker],
    c: ClusterSpec,
    mesh: tuple[int, int, int, int],
    batch: int,
    sp: bool,
    overhead_s: float,
    memory_limit: float | None,
    strategy: Choice,
) -> Prediction:
    """The :class:`Prediction` of :func:`predict_hybrid` from the pipeline's cost and the workers'."""
    dp, pp, tp, m = mesh
    slow = workers[pc.slowest]
    tail = max(workers, key=lambda w: w.grads.seconds + w.dp_s + w.opt_s)
    transfers = m * pc.link_s[pc.slowest]
    bubble_s = pc.pipeline_s - m * pc.cycle_s[pc.slowest]
    tp_s = slow.tp.seconds + tail.grads.seconds
    wait = c.device.imbalance if dp * pp * tp > 1 else 0.0
    step = pc.pipeline_s + tail.grads.seconds + tail.dp_s + tail.opt_s + wait + overhead_s
    tp_bytes = math.fsum(w.tp.bytes + w.grads.bytes for w in workers) / pp
    pp_bytes = math.fsum(pc.bytes_sent) / pp
    dp_bytes = math.fsum(w.dp_bytes for w in workers) / pp
    mem = max((w.memory for w in workers), key=lambda x: x.total)
    limit = c.device.memory if memory_limit is None else memory_limit
    comm = tp_s + transfers + tail.dp_s
    why = (
        f"mesh dp={dp} x pp={pp} x tp={tp}{' (sequence parallel)' if sp else ''}: {tp_s * 1e3:.3g} ms of tensor-"
        f"parallel collectives, bubble {pc.bubble:.0%} and {transfers * 1e3:.3g} ms of stage transfers, "
        f"{tail.dp_s * 1e3:.3g} ms of gradient allreduce; {format_bytes(mem.total)} per device"
    )
    detail = {
        "tp_s": tp_s,
        "tp_bytes": tp_bytes,
        "pp_s": transfers + bubble_s,
        "pp_bytes": pp_bytes,
        "bubble": pc.bubble,
        "dp_s": tail.dp_s,
        "dp_bytes": dp_bytes,
        "fwd_s": slow.fwd_s,
        "bwd_s": slow.bwd_s,
        "opt_s": tail.opt_s,
        "dp": float(dp),
        "pp": float(pp),
        "tp": float(tp),
        "microbatches": float(m),
    }
    return Prediction(
        strategy,
        step,
        batch / step if step > 0 else math.inf,
        slow.fwd_s + slow.bwd_s + tail.opt_s,
        comm,
        comm,
        bubble_s + wait,
        tp_bytes + pp_bytes + dp_bytes,
        mem,
        mem.total <= limit,
        why,
        detail,
    )


# ---------------------------------------------------------------------- factorizations


def factorizations(world: int) -> list[tuple[int, int, int]]:
    """Every ``(dp, pp, tp)`` with ``dp * pp * tp == world``, in increasing ``(dp, pp)``."""
    if world < 1:
        raise ConfigError(f"world must be >= 1, got {world}")
    return [
        (dp, pp, world // dp // pp)
        for dp in range(1, world + 1)
        if world % dp == 0
        for pp in range(1, world // dp + 1)
        if (world // dp) % pp == 0
    ]


@dataclass(frozen=True)
class MeshChoice:
    """One factorization of :func:`rank_factorizations`: its prediction (None when no run could take the
    mesh) and, when it is infeasible, why (a memory-bound one keeps its prediction)."""

    dp: int
    pp: int
    tp: int
    prediction: Prediction | None
    reason: str = ""

    @property
    def feasible(self) -> bool:
        return not self.reason

    @property
    def step_s(self) -> float:
        return self.prediction.step_s if self.prediction is not None and self.feasible else math.inf


def rank_factorizations(
    prof: ModelProfile,
    c: ClusterSpec,
    world: int,
    *,
    heads: int,
    layers: int,
    vocab: int,
    batch: int,
    seq: int,
    hidden: int,
    memory_limit: float | None = None,
    microbatches: int = 8,
    schedule: str = "1f1b",
    sequence_parallel: bool = False,
    **options: Any,
) -> list[MeshChoice]:
    """:func:`predict_hybrid` of every factorization of ``world``: the feasible ones by step time, then
    the others (in :func:`factorizations`' order) with their reason: :func:`mesh_reason`'s, what the
    pipeline model refuses (too few layers for the stages, an interleaved ``M``), or memory over
    ``memory_limit`` (default: the device's). ``pp = 1`` takes one micro-batch, ``pp > 1`` ``microbatches``;
    ``options`` go to :func:`predict_hybrid` (algorithm, tp_algorithm, optimizer_state_factor, balance, ...).
    """
    limit = c.device.memory if memory_limit is None else memory_limit
    out = []
    for dp, pp, tp in factorizations(world):
        m = microbatches if pp > 1 else 1
        pred, reason = (
            None,
            mesh_reason(
                dp, pp, tp, heads=heads, hidden=hidden, layers=layers, batch=batch, microbatches=m, devices=c.devices
            ),
        )
        if not reason:
            try:
                pred = predict_hybrid(
                    prof,
                    c,
                    dp=dp,
                    pp=pp,
                    tp=tp,
                    microbatches=m,
                    schedule=schedule,
                    sequence_parallel=sequence_parallel,
                    batch=batch,
                    seq=seq,
                    hidden=hidden,
                    layers=layers,
                    heads=heads,
                    vocab=vocab,
                    memory_limit=limit,
                    **options,
                )
            except ConfigError as e:
                reason = str(e)
        if pred is not None and not pred.fits:
            reason = f"needs {format_bytes(pred.memory.total)} per device, over the limit of {format_bytes(limit)}"
        out.append(MeshChoice(dp, pp, tp, pred, reason))
    return sorted(out, key=lambda r: (not r.feasible, r.step_s if r.feasible else 0.0))
