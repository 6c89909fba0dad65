"""The performance model of pipeline parallelism (``pipeline``): pure functions.

One pipeline of ``P`` workers holds one replica: worker ``w`` runs virtual stages
``w, w + P, ...`` (``v`` of them; ``v > 1`` only for the interleaved schedule, as
:class:`dtrain.Pipeline` places them), every worker sees the whole batch, and a step
is ``M`` micro-batches of ``batch / M`` samples each. Nothing is run; the
quantities, per micro-batch and in this order:

1. the cut: ``sizes`` (layers per virtual stage), or the exact minimal-max
   partition of per-layer forward + backward time
   (:func:`dtrain.pipeline.partition.block_partition`; the cut and its checks are
   :mod:`dtrain.perfmodel.pipeline_cut`);
2. each worker's forward ``t_f`` and backward ``t_b``: the sum over its layers of
   :func:`~dtrain.perfmodel.predict.compute_times` at the profile's batch, scaled
   linearly to the micro-batch (``1 / M``, as :meth:`ModelProfile.at_batch` scales);
   recomputation adds ``t_f`` to each backward (``checkpoint="always"``) or to all but
   the last micro-batch's (``"except_last"``: ``(M - 1) / M`` of ``t_f`` on average);
3. each boundary's transfer ``t_comm = alpha + bytes * beta`` over the link between
   the two workers, ``bytes`` the cut layer's activation at the micro-batch size; the
   activation goes forward and its gradient (as large) comes back. A worker's
   stage pays both directions of the larger of its two boundaries, so a worker with
   ``v`` virtual stages pays ``v`` times as much (Narayanan et al. 2021);
4. the slowest worker's cycle ``c = t_f + t_b + 2 t_comm`` and the step (below),
   plus the optimizer step of the worker with the most parameter bytes (its share
   of the whole model's).

Step times (``P`` workers, ``M`` micro-batches):

* ``gpipe`` (Huang et al., "GPipe", NeurIPS 2019) and ``1f1b`` (PipeDream-Flush,
  Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN Training", ICML 2021):
  synchronous, with a flush: ``(M + P - 1) c``; the idle (bubble) fraction is
  ``(P - 1) / (M + P - 1)``. 1F1B reorders the work, not its length.
* ``interleaved`` (Narayanan et al., "Efficient Large-Scale Language Model Training
  on GPU Clusters Using Megatron-LM", SC 2021, section 2.2.2): the bubble shrinks
  ``v``-fold, ``(M + (P - 1) / v) c`` with ``c`` holding the worker's ``v`` stages and
  ``v``-fold communication; the bubble fraction is ``(P - 1) / (v M + P - 1)``.
* ``2bw`` (PipeDream-2BW, Narayanan et al. ICML 2021): no flush, so the steady state
  ``M c`` is paid in full; every call still ends with the loss sent to every rank,
  so the next call's first micro-batch must reach the last stage again: a fill of
  ``P - 1`` forwards (with their transfers) per call, ``M c + (P - 1)(t_f + t_comm)``.
  That holds for ``M >= P - 1``; with fewer micro-batches a stage defers all of its
  backwards and they wait for the next stage's, within the call, so the call is
  dtrain's 2bw schedule played in time with the slowest stage's ``t_f + t_comm`` and
  ``t_b + t_comm`` (:func:`dtrain.pipeline.schedules.simulate`; equal to the closed
  form where it holds).

The closed forms put every transfer on the critical path beside compute (an upper
bound where the transport overlaps sends with compute), and they count neither the
scheduler's ``wake`` nor a message's ``floor`` (:class:`~dtrain.perfmodel.spec.Device`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from dtrain.errors import ConfigError
from dtrain.perfmodel.pipeline_cut import _boundary_bytes, _check, _checked_sizes, _spans, stage_cut
from dtrain.perfmodel.predict import Memory, Prediction, StepInputs, _opt_state, compute_times
from dtrain.pipeline.partition import block_partition
from dtrain.pipeline.schedules import bubble_closed_form, generate, simulate

if TYPE_CHECKING:
    from dtrain.perfmodel.collectives import CompressionModel
    from dtrain.perfmodel.profile import ModelProfile
    from dtrain.perfmodel.spec import ClusterSpec
    from dtrain.registry import Choice

__all__ = [
    "PipelineCost",
    "PipelineLike",
    "pipeline_cost",
    "pipeline_memory",
    "in_flight",
    "stage_cut",
    "predict",
    "memory",
]


@runtime_checkable
class PipelineLike(Protocol):
    """What the model reads of the pipeline's options (:class:`dtrain.strategies.pipeline.PipelineOptions`)."""

    @property
    def microbatches(self) -> int: ...
    @property
    def schedule(self) -> str: ...
    @property
    def chunks(self) -> int: ...
    @property
    def balance(self) -> str: ...
    @property
    def recompute(self) -> str: ...
    @property
    def virtual(self) -> int: ...


@dataclass(frozen=True)
class PipelineCost:
    """What one step of a pipeline costs (seconds, bytes; see the module docstring).

    Attributes:
        sizes: layers per virtual stage (the cut), in forward order.
        fwd_s / bwd_s: per worker, forward / backward seconds of one micro-batch (its
            virtual stages summed; ``bwd_s`` without recomputation).
        recompute_s: per worker, recomputed forward seconds per micro-batch (mean over the step).
        comm_s: per boundary between virtual stages ``k`` and ``k + 1``, seconds of one
            transfer of a micro-batch's activation (its gradient takes as long back; 0 when
            both stages are on one worker).
        link_s: per worker, seconds of transfers charged to it per micro-batch.
        cycle_s: per worker, ``fwd + bwd + recompute + link`` of one micro-batch.
        pipeline_s: the pipelined part of a step (fill, steady state, drain).
        opt_s: the optimizer step of the worker with the most parameter bytes.
        step_s: ``pipeline_s + opt_s``.
        bubble: the fraction of ``pipeline_s`` the slowest worker idles.
        bytes_sent: per worker, bytes it sends per step (activations forward, gradients back).
    """

    sizes: tuple[int, ...]
    fwd_s: tuple[float, ...]
    bwd_s: tuple[float, ...]
    recompute_s: tuple[float, ...]
    comm_s: tuple[float, ...]
    link_s: tuple[float, ...]
    cycle_s: tuple[float, ...]
    pipeline_s: float
    opt_s: float
    step_s: float
    bubble: float
    bytes_sent: tuple[float, ...]

    @property
    def slowest(self) -> int:
        """The worker whose cycle sets the pace."""
        return max(range(len(self.cycle_s)), key=lambda w: self.cycle_s[w])


# ---------------------------------------------------------------------- time


def _transfers(c: ClusterSpec, nbytes: list[float], stages: int) -> list[float]:
    """Seconds of one transfer over each boundary (0 where both virtual stages are on one worker)."""
    out = []
    for k, b in enumerate(nbytes):
        src, dst = k % stages, (k + 1) % stages
        out.append(0.0 if src == dst else c.link(src, dst).time(b))
    return out


def _link_per_worker(comm: list[float], stages: int, parts: int) -> list[float]:
    """Per worker: both directions of the larger boundary beside each of its virtual stages."""
    link = [0.0] * stages
    for k in range(parts):
        before = comm[k - 1] if k > 0 else 0.0
        after = comm[k] if k < parts - 1 else 0.0
        link[k % stages] += 2 * max(before, after)
    return link


def _bytes_per_worker(nbytes: list[float], stages: int, microbatches: int) -> list[float]:
    """Per worker and step: each activation it sends forward and each input gradient it sends back."""
    sent = [0.0] * stages
    for k, b in enumerate(nbytes):
        src, dst = k % stages, (k + 1) % stages
        if src != dst:
            sent[src] += microbatches * b  # the activation, forward
            sent[dst] += microbatches * b  # its gradient, backward
    return sent


def _pipelined(schedule: str, stages: int, microbatches: int, chunks: int, cycle: float, fill: float) -> float:
    """The pipelined part of a step from the slowest worker's ``cycle`` and its forward with one
    transfer, ``fill`` (module docstring for the sources)."""
    m, p = microbatches, stages
    if schedule == "interleaved":
        return (m + (p - 1) / chunks) * cycle
    if schedule != "2bw":
        return (m + p - 1) * cycle
    if m >= p - 1:
        return m * cycle + (p - 1) * fill
    return simulate(generate("2bw", p, m), tf=fill, tb=cycle - fill).makespan


def pipeline_cost(
    prof: ModelProfile,
    cluster: ClusterSpec,
    stages: int,
    microbatches: int,
    schedule: str,
    chunks: int = 1,
    sizes: Sequence[int] | None = None,
    checkpoint: str = "never",
) -> PipelineCost:
    """The step of one pipeline of ``stages`` workers (the module docstring gives each formula and its source).

    Args:
        prof: the model at the pipeline's batch (every worker sees all of it); times per
            layer from :func:`~dtrain.perfmodel.predict.compute_times` on ``cluster``.
        cluster: worker ``w`` is the cluster's rank ``w`` (nodes filled in order).
        stages: workers, ``P``.
        microbatches: ``M``; must divide ``prof.batch``.
        schedule: gpipe, 1f1b, interleaved or 2bw.
        chunks: virtual stages per worker, ``v`` (>= 2 for interleaved, 1 otherwise) (default: 1).
        sizes: layers per virtual stage (default: the minimal-max partition of forward + backward time).
        checkpoint: never, except_last or always (default: never).

    Raises:
        ConfigError: arguments no run would accept (too few layers, M not dividing the batch, ...).
    """
    _check(prof, stages, microbatches, schedule, chunks, checkpoint)
    parts = stages * chunks
    fwd, bwd, opt = compute_times(prof, cluster)
    scale = 1.0 / microbatches  # linear in the samples, as ModelProfile.at_batch scales
    fwd, bwd = [t * scale for t in fwd], [t * scale for t in bwd]
    if sizes is None:
        cut = tuple(block_partition([f + b for f, b in zip(fwd, bwd)], parts))
    else:
        cut = _checked_sizes(sizes, len(prof.layers), parts)
    spans = _spans(cut)
    f_w, b_w, p_w = [0.0] * stages, [0.0] * stages, [0.0] * stages
    for k, span in enumerate(spans):
        f_w[k % stages] += math.fsum(fwd[i] for i in span)
        b_w[k % stages] += math.fsum(bwd[i] for i in span)
        p_w[k % stages] += sum(prof.layers[i].param_bytes for i in span)
    redo = {"never": 0.0, "always": 1.0, "except_last": (microbatches - 1) / microbatches}[checkpoint]
    r_w = [redo * f for f in f_w]
    nbytes = _boundary_bytes(prof, spans, microbatches)
    comm = _transfers(cluster, nbytes, stages)
    link = _link_per_worker(comm, stages, parts)
    cycle = [f + b + r + x for f, b, r, x in zip(f_w, b_w, r_w, link)]
    slow = max(range(stages), key=lambda w: cycle[w])
    fill = f_w[slow] + link[slow] / 2  # a forward and one transfer, for 2bw's refill
    pipe = _pipelined(schedule, stages, microbatches, chunks, cycle[slow], fill)
    total_params = sum(p_w)
    opt_s = opt * max(p_w) / total_params if total_params else opt / stages
    bubble = 1.0 - microbatches * max(cycle) / pipe if pipe > 0 else 0.0
    return PipelineCost(
        sizes=cut,
        fwd_s=tuple(f_w),
        bwd_s=tuple(b_w),
        recompute_s=tuple(r_w),
        comm_s=tuple(comm),
        link_s=tuple(link),
        cycle_s=tuple(cycle),
        pipeline_s=pipe,
        opt_s=opt_s,
        step_s=pipe + opt_s,
        bubble=bubble,
        bytes_sent=tuple(_bytes_per_worker(nbytes, stages, microbatches)),
    )


# ---------------------------------------------------------------------- memory


def in_flight(schedule: str, stages: int, microbatches: int, chunks: int, worker: int) -> float:
    """Micro-batches whose activations ``worker`` holds at its peak, in units of its whole share.

    * gpipe: all ``M`` forwards run before the first backward (Huang et al. 2019);
    * 1f1b: ``min(M, P - w)``, the warm-up forwards plus one (Narayanan et al. 2021:
      worker 0 holds ``P``);
    * 2bw: ``min(M + 1, P - w)``: the previous batch's ``min(M, P - w - 1)`` deferred
      micro-batches are held when a call starts, then one more forward
      (:func:`dtrain.pipeline.schedules.peak_in_flight_bound`);
    * interleaved: Megatron-LM's warm-up, ``2 (P - w - 1) + (v - 1) P`` chunk forwards,
      plus one, at most ``v M``; over ``v`` chunks that is ``P (1 + (P - 1) / (P v))``
      micro-batches for worker 0, as Narayanan et al. (SC 2021) and Korthikanti et al.
      ("Reducing Activation Recomputation in Large Transformer Models", 2022) state.
    """
    m, p, v = microbatches, stages, chunks
    if schedule == "gpipe":
        return float(m)
    if schedule == "interleaved":
        return min(v * m, 2 * (p - worker - 1) + (v - 1) * p + 1) / v
    return float(min(m + 1 if schedule == "2bw" else m, p - worker))


def _worker_memory(
    prof: ModelProfile,
    spans: list[range],
    worker: int,
    stages: int,
    microbatches: int,
    schedule: str,
    chunks: int,
    checkpoint: str,
) -> Memory:
    mine = [k for k in range(len(spans)) if k % stages == worker]
    params = float(sum(prof.layers[i].param_bytes for k in mine for i in spans[k]))
    share = params / prof.param_bytes if prof.param_bytes else 0.0
    # a stage's input: the batch's slice on stage 0 (a view of the batch, counted below), else the cut activation
    inputs = [prof.layers[spans[k - 1][-1]].activation_bytes / microbatches if k else 0.0 for k in mine]
    acts = [math.fsum(prof.layers[i].activation_bytes for i in spans[k]) / microbatches for k in mine]
    n = in_flight(schedule, stages, microbatches, chunks, worker)
    whole = n * (math.fsum(inputs) + math.fsum(acts))
    if checkpoint == "never":
        held = whole
    else:  # inputs only, plus one stage's activations while it is recomputed (and the last micro-batch's, kept)
        kept = 2 if checkpoint == "except_last" and n > 1 else 1
        held = min(whole, n * math.fsum(inputs) + kept * max(acts))
    versions = 2 if schedule == "2bw" else 1
    return Memory(
        params=versions * params,
        grads=versions * params,
        optimizer=_opt_state(prof) * share,
        activations=held,
        buffers=prof.input_bytes + (params if schedule == "2bw" else 0.0),
    )


def pipeline_memory(
    prof: ModelProfile,
    stages: int,
    microbatches: int,
    schedule: str,
    chunks: int = 1,
    sizes: Sequence[int] | None = None,
    checkpoint: str = "never",
) -> Memory:
    """Bytes on the most loaded worker of one pipeline.

    A worker holds its stages' parameters, gradients and optimizer state (the
    optimizer's factor from ``prof.optimizer``: 1 for sgd, 2 for adam, 0 for sgd0),
    the whole batch's inputs (every worker reads the batch; ``buffers``) and the
    activations of :func:`in_flight` micro-batches at the micro-batch size: each
    stage's input and its layers' outputs. With recomputation only the inputs stay,
    plus one stage's activations while it is recomputed (``except_last``: and the last
    micro-batch's, never dropped).

    2bw (PipeDream-2BW, Narayanan et al. 2021) keeps two weight versions (``params``),
    and in dtrain's executor the previous batch's gradient and this one's accumulate
    apart (``grads``, two) while the live weights the optimizer steps are a third copy
    beside the versions the forwards use (``buffers``).

    Args:
        prof: the model at the pipeline's batch.
        stages / microbatches / schedule / chunks / checkpoint: as for :func:`pipeline_cost`.
        sizes: layers per virtual stage (default: :func:`stage_cut` by time, from the profile alone).
    """
    _check(prof, stages, microbatches, schedule, chunks, checkpoint)
    parts = stages * chunks
    cut = stage_cut(prof, parts) if sizes is None else _checked_sizes(sizes, len(prof.layers), parts)
    spans = _spans(cut)
    per = [_worker_memory(prof, spans, w, stages, microbatches, schedule, chunks, checkpoint) for w in range(stages)]
    return max(per, key=lambda m: m.total)


# ---------------------------------------------------------------------- the registry's hooks


def _options(s: Choice) -> PipelineLike:
    o = s.opts
    if not isinstance(o, PipelineLike):
        raise ConfigError(f"{s.label()}: the pipeline model needs PipelineOptions, got {type(o).__name__}")
    return o


def _infeasible(whole: ModelProfile, s: Choice, o: PipelineLike) -> str:
    """Why the run would refuse this pipeline for this model and batch ("" when it would not)."""
    try:
        _check(whole, s.workers, o.microbatches, o.schedule, o.virtual, o.recompute)
        stage_cut(whole, s.workers * o.virtual, o.balance, o.microbatches)
    except ConfigError as e:
        return str(e)
    return ""


def _whole(prof: ModelProfile, s: Choice) -> ModelProfile:
    """The hooks get the profile at the per-worker batch (global / workers); a pipeline's batch is the global one."""
    return prof.at_batch(prof.batch * s.workers)


def memory(prof: ModelProfile, s: Choice, comp: CompressionModel | None) -> Memory:
    """The registry's ``memory`` hook: :func:`pipeline_memory` of the cut ``balance`` makes.

    A pipeline the run would refuse (too few layers, ``M`` not dividing the batch)
    needs unbounded memory here, so it never fits (see :func:`predict`).
    """
    o = _options(s)
    whole = _whole(prof, s)
    if _infeasible(whole, s, o):
        return Memory(buffers=math.inf)
    sizes = stage_cut(whole, s.workers * o.virtual, o.balance, o.microbatches)
    return pipeline_memory(whole, s.workers, o.microbatches, o.schedule, o.virtual, sizes, o.recompute)


def idle_aware(c: ClusterSpec, schedule: str, stages: int, microbatches: int, chunks: int = 1) -> ClusterSpec:
    """The cluster as a pipeline's workers see it when they share cores (an emulated cluster on one machine).

    A calibrated ``compute_scale`` ``s`` is the slowdown when every device computes at once;
    a pipeline's workers idle the bubble ``b`` of the step, so on average ``P (1 - b)`` of the
    ``P`` compute together and each runs ``max(1, s (1 - b))`` slower, not ``s``. On a real
    cluster (``s = 1``) nothing changes.
    """
    scale = c.device.compute_scale
    if scale <= 1.0 or stages <= 1:
        return c
    from dataclasses import replace

    busy = 1.0 - bubble_closed_form(schedule, stages, microbatches, chunks)
    return replace(c, device=replace(c.device, compute_scale=max(1.0, scale * busy)))


def work_aware(
    prof: ModelProfile,
    c: ClusterSpec,
    stages: int,
    microbatches: int,
    schedule: str,
    chunks: int = 1,
    sizes: Sequence[int] | None = None,
    checkpoint: str = "never",
) -> ClusterSpec:
    """The cluster as a pipeline's workers see it when they share cores, from the work each stage does.

    :func:`idle_aware` takes every worker to be as busy as the slowest (the closed-form bubble). With
    unequal stages, the others idle longer and the slowest gets more of the shared cores: on average a
    worker computes ``b = M * mean(t_f + t_b + t_r) / T`` of a step ``T`` played at full speed (the
    transfers and the bubble are idle), so each runs ``max(1, s b)`` slower. The step is then the larger
    of the critical path at full speed and the work ``s M sum(t_f + t_b + t_r) / P`` the shared cores get
    through when every worker computes: a 6-block model on 4 stages (one stage with a third of the work,
    the mean a quarter) is paced by the cores, not by ``s`` times its slowest stage. For equal stages it
    is :func:`idle_aware` less the transfers' time; on a real cluster (``s = 1``) nothing changes.
    """
    scale = c.device.compute_scale
    if scale <= 1.0 or stages <= 1:
        return c
    from dataclasses import replace

    alone = replace(c, device=replace(c.device, compute_scale=1.0))
    pc = pipeline_cost(prof, alone, stages, microbatches, schedule, chunks, sizes, checkpoint)
    work = microbatches * math.fsum(f + b + r for f, b, r in zip(pc.fwd_s, pc.bwd_s, pc.recompute_s)) / stages
    busy = work / pc.pipeline_s if pc.pipeline_s > 0 else 1.0
    return replace(c, device=replace(c.device, compute_scale=max(1.0, scale * busy)))


def predict(prof: ModelProfile, c: ClusterSpec, s: Choice, comp: CompressionModel, inputs: StepInputs) -> Prediction:
    """The registry's ``predict`` hook: :func:`pipeline_cost` as a :class:`Prediction`.

    ``prof`` is at the per-worker batch (global / workers) like every hook's; the
    pipeline's batch is the global one, so ``samples_per_s = prof.batch * workers / step``.
    ``compute_s`` is the slowest worker's forwards, backwards and recomputation plus the
    largest optimizer step; ``comm_s = exposed_s``, its transfers (the closed forms
    overlap none); ``wait_s`` the bubble plus the device's ``imbalance`` (every call ends
    with the loss sent to every rank); their sum and the overhead is ``step_s``.

    A pipeline the run would refuse comes back with an infinite step, no throughput and
    ``fits=False`` (the planner lists it as rejected), its ``why`` saying what is wrong.
    """
    o = _options(s)
    whole = _whole(prof, s)
    reason = _infeasible(whole, s, o)
    if reason:
        return Prediction(s, math.inf, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, inputs.memory, False, f"infeasible: {reason}")
    sizes = stage_cut(whole, s.workers * o.virtual, o.balance, o.microbatches)
    c = work_aware(whole, c, s.workers, o.microbatches, o.schedule, o.virtual, sizes, o.recompute)
    pc = pipeline_cost(whole, c, s.workers, o.microbatches, o.schedule, o.virtual, sizes, o.recompute)
    m, w = o.microbatches, pc.slowest
    compute = m * (pc.fwd_s[w] + pc.bwd_s[w] + pc.recompute_s[w]) + pc.opt_s
    comm = m * pc.link_s[w]
    wait = pc.pipeline_s - m * pc.cycle_s[w] + c.device.imbalance
    step = pc.step_s + c.device.imbalance + inputs.overhead
    why = (
        f"pipeline {o.schedule}: bubble {pc.bubble:.0%} of {s.workers} stages x {m} micro-batches; slowest stage "
        f"{pc.cycle_s[w] * 1e3:.3g} ms per micro-batch, {pc.link_s[w] * 1e3:.3g} ms of it transfers"
    )
    detail = {
        "fwd_s": m * pc.fwd_s[w],
        "bwd_s": m * pc.bwd_s[w],
        "recompute_s": m * pc.recompute_s[w],
        "opt_s": pc.opt_s,
        "bubble": pc.bubble,
        "pipeline_s": pc.pipeline_s,
    }
    sent = math.fsum(pc.bytes_sent) / len(pc.bytes_sent)
    return Prediction(
        s, step, prof.batch * s.workers / step, compute, comm, comm, wait, sent, inputs.memory, inputs.fits, why, detail
    )
