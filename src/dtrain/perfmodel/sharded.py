"""The performance model of sharded data parallelism: ZeRO stages 1-3 (``dp --shard ...``).

Memory per rank (:func:`sharded_memory`) and step time (:func:`predict_sharded`) of
:class:`dtrain.ShardedDataParallel`: stages 1-2 reduce-scatter each unit's gradients as backward
finishes it and allgather the stepped parameters before the next forward; stage 3 gathers each
unit before its forward and again before its backward, and reduce-scatters after. Each collective
is half of a ring allreduce (:func:`~dtrain.perfmodel.collectives.ring_reduce_scatter_time`,
:func:`~dtrain.perfmodel.collectives.ring_allgather_time`). Split from :mod:`dtrain.perfmodel.predict`,
whose :class:`Memory`, :class:`Prediction` and bucket latency it uses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtrain.errors import ConfigError
from dtrain.perfmodel.collectives import CompressionModel, ring_allgather_time, ring_reduce_scatter_time
from dtrain.perfmodel.predict import (
    DataParallelLike,
    Memory,
    Prediction,
    StepInputs,
    _opt_state,
    bucket_latency,
    data_parallel_memory,
)
from dtrain.perfmodel.profile import ModelProfile
from dtrain.perfmodel.spec import ClusterSpec

if TYPE_CHECKING:
    from dtrain.registry import Choice

__all__ = ["ZERO_STAGES", "sharded_memory", "predict_sharded", "shard_collective"]


ZERO_STAGES = 3  # stage 0 is plain data parallelism; 1, 2, 3 shard optimizer, gradients, parameters


def _stage(stage: int) -> int:
    if not 0 <= stage <= ZERO_STAGES:
        raise ConfigError(f"ZeRO stage must be 0 to {ZERO_STAGES}, got {stage}")
    return stage


def sharded_memory(prof: ModelProfile, stage: int, p: int) -> Memory:
    """Bytes per rank of ZeRO stage ``stage`` on ``p`` ranks (Rajbhandari et al., "ZeRO: memory
    optimizations toward training trillion parameter models", SC 2020, section 5).

    With ``n`` the parameter bytes (``4 Psi`` in float32) and ``K`` the optimizer state
    (``8 Psi`` for Adam, ``_opt_state``), the model states per rank are:

    * stage 0: ``n + n + K`` (16 Psi with Adam) plus the flat bucket copy ``n`` (:func:`data_parallel_memory`);
    * stage 1: ``n + n + K/P`` (8 Psi + 8 Psi/P); the gradients live in the units' flat buffers, no copy;
    * stage 2: ``n + n/P + K/P`` (4 Psi + 12 Psi/P) plus the largest unit's gradient buffer in flight;
    * stage 3: ``(n + n + K)/P`` (16 Psi/P) plus two gathered units in flight (the one
      computing and the prefetched next one: the two largest).

    Units are the profile's layers with parameters (the sharded engine's default
    units, top-level children). Activations are those of plain data parallelism.

    Args:
        prof: the model profile (its optimizer sets ``K``).
        stage: 0 to 3.
        p: ranks the states are sharded over.
    """
    stage = _stage(stage)
    if stage == 0:
        return data_parallel_memory(prof, None)
    n = float(prof.param_bytes)
    k = _opt_state(prof)
    p = max(1, p)
    act = prof.activation_bytes + prof.input_bytes
    units = sorted((float(prof.layers[i].param_bytes) for i in _units(prof)), reverse=True)
    if stage == 1:
        return Memory(params=n, grads=n, optimizer=k / p, activations=act)
    if stage == 2:
        return Memory(params=n, grads=n / p, optimizer=k / p, activations=act, buffers=sum(units[:1]))
    return Memory(params=n / p, grads=n / p, optimizer=k / p, activations=act, buffers=sum(units[:2]))


def shard_collective(c: ClusterSpec, algorithm: str, nbytes: float, p: int, phase: str) -> float:
    """Seconds of one unit's ring reduce-scatter (``phase="rs"``) or allgather (``"ag"``) on ``p`` ranks:
    half a ring allreduce (:func:`~dtrain.perfmodel.collectives.ring_reduce_scatter_time`), and at
    least ``P-1`` steps of the device's ``floor`` (the backend's for ``native``, else ``p2p_floor``)."""
    if p <= 1 or nbytes <= 0:
        return 0.0
    if phase == "rs":
        t = ring_reduce_scatter_time(c, algorithm, nbytes, p)
    elif phase == "ag":
        t = ring_allgather_time(c, algorithm, nbytes, p)
    else:
        raise ConfigError(f"phase must be 'rs' or 'ag', got {phase!r}")
    floor = c.device.floor if algorithm == "native" else c.device.own_floor
    return max(t, (p - 1) * floor)


def predict_sharded(
    prof: ModelProfile, c: ClusterSpec, s: Choice, o: DataParallelLike, stage: int, inputs: StepInputs
) -> Prediction:
    """ZeRO stage 1, 2 or 3 of ``dp`` (module docstring; memory from :func:`sharded_memory`).

    Every collective is a ring reduce-scatter or allgather (:func:`shard_collective`)
    plus the hand-off latency of :func:`bucket_latency`; each rank's optimizer steps
    its ``1/P`` shard. Bytes one rank sends per step: ``2(P-1)/P n`` at stages 1-2
    (a ring allreduce's), ``3(P-1)/P n`` at stage 3.
    """
    if _stage(stage) == 0:
        raise ConfigError("predict_sharded takes ZeRO stage 1, 2 or 3; stage 0 is predict_data_parallel")
    fwd, bwd, overhead, mem, fits = inputs.fwd, inputs.bwd, inputs.overhead, inputs.memory, inputs.fits
    p = s.workers
    opt = inputs.opt / p  # each rank steps its shard
    f_total, b_total = sum(fwd), sum(bwd)
    if stage < 3:
        period, rs, ag = _zero12_period(prof, c, s, o, fwd, bwd, opt)
        factor = 2.0
    else:
        period, rs, ag = _zero3_period(prof, c, s, o, fwd, bwd, opt)
        factor = 3.0
    sent = factor * (p - 1) / p * float(prof.param_bytes) if p > 1 else 0.0
    wait = c.device.imbalance if p > 1 else 0.0
    step = period + overhead + wait
    compute = f_total + b_total + opt
    exposed = max(0.0, period - compute)
    bound = "communication" if exposed > 0.5 * compute else "compute"
    why = (
        f"{bound}-bound: ZeRO-{stage}, {rs * 1e3:.3g} ms of reduce-scatter and {ag * 1e3:.3g} ms of allgather, "
        f"{exposed * 1e3:.3g} ms not hidden by compute"
    )
    return Prediction(
        s,
        step,
        prof.batch * p / step,
        compute,
        rs + ag,
        exposed,
        wait,
        sent,
        mem,
        fits,
        why,
        {"fwd_s": f_total, "bwd_s": b_total, "opt_s": opt, "reduce_scatter_s": rs, "allgather_s": ag},
    )


def _units(prof: ModelProfile) -> list[int]:
    """The sharded engine's units: the profile's layers that hold parameters (top-level children, as
    :func:`dtrain.sharded` cuts a model by default), each one flat buffer and one message per ring step."""
    return [i for i, ly in enumerate(prof.layers) if ly.param_bytes > 0]


def _zero12_period(
    prof: ModelProfile, c: ClusterSpec, s: Choice, o: DataParallelLike, fwd: list[float], bwd: list[float], opt: float
) -> tuple[float, float, float]:
    """(step from the start of one backward to the next, reduce-scatter s, allgather s) of stages 1-2.

    Each unit's gradient is reduce-scattered when its backward is done, in backward's order
    (as :func:`predict_data_parallel` allreduces buckets), the shard's optimizer steps when
    the last is done, then the units' updated parameters are allgathered in forward's
    order. The next forward waits for all of them, or with ``overlap="forward"`` each
    layer for its own unit.
    """
    p, algorithm = s.workers, o.algorithm
    dense = CompressionModel()
    ready, t = [0.0] * len(bwd), 0.0
    for i in reversed(range(len(bwd))):
        t += bwd[i]
        ready[i] = t
    units = _units(prof)
    end = rs_total = 0.0
    for j, i in enumerate(reversed(units)):
        dur = shard_collective(c, algorithm, float(prof.layers[i].param_bytes), p, "rs") + bucket_latency(
            c, s, dense, j
        )
        end = max(ready[i], end) + dur
        rs_total += dur
    t = max(t, end) + opt
    gathered: dict[int, float] = {}  # unit -> when its parameters are back
    cursor = t
    for k, i in enumerate(units):  # forward's order
        cursor += shard_collective(c, algorithm, float(prof.layers[i].param_bytes), p, "ag") + bucket_latency(
            c, s, dense, k
        )
        gathered[i] = cursor
    ag_total = cursor - t
    if o.overlap != "forward":
        return cursor + sum(fwd), rs_total, ag_total
    for i, f in enumerate(fwd):
        t = max(t, gathered.get(i, t)) + f
    return t, rs_total, ag_total


def _zero3_period(
    prof: ModelProfile, c: ClusterSpec, s: Choice, o: DataParallelLike, fwd: list[float], bwd: list[float], opt: float
) -> tuple[float, float, float]:
    """(step, reduce-scatter s, allgather s) of stage 3, one communication stream in issue order.

    Units are the layers with parameters. Forward: unit ``k``'s gather is issued when
    unit ``k-1``'s forward starts (one prefetched: two gathered units at most) and the
    unit computes when it is back. Backward, last unit first: its gather again (the
    next one issued when a unit's backward starts), then its gradient's reduce-scatter
    when its backward ends. The shard's optimizer steps when backward and the last
    reduce-scatter are done.
    """
    p, algorithm = s.workers, o.algorithm
    dense = CompressionModel()
    units = _units(prof)
    cost = {
        (ph, i): shard_collective(c, algorithm, float(prof.layers[i].param_bytes), p, ph)
        for i in units
        for ph in ("ag", "rs")
    }
    spent = {"ag": 0.0, "rs": 0.0}
    comm = 0.0  # when the communication stream is free
    calls = 0

    def run(issued: float, phase: str, unit: int) -> float:
        nonlocal comm, calls
        dur = cost[(phase, unit)] + bucket_latency(c, s, dense, calls)
        comm = max(comm, issued) + dur
        spent[phase] += dur
        calls += 1
        return comm

    t = issue = 0.0  # compute free; when the next gather may be issued
    order = units[::-1]  # backward's
    pos = {u: k for k, u in enumerate(order)}
    for i, f in enumerate(fwd):
        if i in pos:
            t = max(t, run(issue, "ag", i))
            issue = t  # this unit computes: the next one's gather may start
        t += f
    back = {order[0]: run(t, "ag", order[0])} if order else {}
    for i in reversed(range(len(bwd))):
        if i in pos:
            t = max(t, back[i])
            if pos[i] + 1 < len(order):  # prefetch the next unit's gather
                nxt = order[pos[i] + 1]
                back[nxt] = run(t, "ag", nxt)
            t += bwd[i]
            run(t, "rs", i)  # its gradient's shards to their owners
        else:
            t += bwd[i]
    return max(t, comm) + opt, spent["rs"], spent["ag"]
