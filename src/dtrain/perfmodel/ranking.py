"""Planner: enumerate strategies, predict each, rank by predicted throughput.

:func:`plan` profiles the model at every per-worker batch the candidates need,
predicts every candidate on the cluster (:func:`~dtrain.perfmodel.predict.predict`),
drops those that do not fit a device's memory (the cluster's, or ``memory_limit``) or have
more workers than the global batch has samples (listed as rejected, with the reason) and ranks the rest by samples
per second. A batch that does not divide over the workers is predicted as a run trains
it: ``batch // workers`` per worker (:func:`dtrain.workloads.batch.split_batch`).
Candidates, for ``W`` devices:

* one process (the baseline every distributed strategy must beat);
* data parallel on ``W`` workers with each allreduce algorithm (hierarchical only
  on a cluster with several devices per node), bucket sizes, priority overlap,
  and each compressor of ``compressions``; ZeRO stages 1-3 (``--shard``, ring, the largest
  bucket), which trade communication for memory; torch DDP (the peer);
* the parameter server with ``S`` servers and ``W - S`` workers, each consistency
  policy of ``consistencies``;
* with ``averaging=True``: local SGD, EASGD and gossip (model averaging);
* with ``pipeline=True``: pipelines of one stage per device (gpipe, 1f1b, interleaved, 2bw).
* with ``mesh=True``: tensor parallelism and the DP x PP x TP factorizations of the workers (gpt models).

Approximate strategies (compressed, asynchronous) are ranked on speed like the
rest; their line says what they trade (compression error, staleness), and
``exact_only=True`` keeps only those equivalent to single-process training.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dtrain.errors import ConfigError
from dtrain.perfmodel.collectives import ALGORITHMS, CompressionModel
from dtrain.perfmodel.compression import compression_model
from dtrain.perfmodel.hooks import ModelHooks, PlanSpace, Prediction
from dtrain.perfmodel.predict import predict
from dtrain.perfmodel.profile import ModelProfile, profile_model
from dtrain.perfmodel.spec import ClusterSpec, load_cluster
from dtrain.perfmodel.units import format_bytes, parse_bytes
from dtrain.registry import Choice, registered
from dtrain.workloads.batch import split_batch

__all__ = [
    "Plan",
    "candidates",
    "plan",
    "parse_memory_limit",
    "DEFAULT_COMPRESSIONS",
    "DEFAULT_CONSISTENCIES",
    "DEFAULT_BUCKETS",
]

DEFAULT_COMPRESSIONS = ("fp16", "powersgd:2", "qsgd", "onebit", "topk:0.01")
DEFAULT_CONSISTENCIES = ("bsp", "asp", "ssp:3")
DEFAULT_BUCKETS = (25.0, 1.0)


def parse_memory_limit(value: str | float | int) -> float:
    """A per-device memory limit ("2GB", "512MB", "1.5GiB", or bytes) -> bytes (> 0).

    Raises:
        ConfigError: naming the value when it is unreadable or not positive.
    """
    try:
        n = parse_bytes(value)
    except ConfigError:
        raise ConfigError(
            f"cannot read the memory limit {value!r}; write it like 2GB, 512MB, 1.5GiB or a number of bytes"
        ) from None
    if not (math.isfinite(n) and n > 0):
        raise ConfigError(f"the memory limit must be a positive size, got {value!r}")
    return n


@dataclass
class Plan:
    """A ranked list of strategies for one model, global batch and cluster.

    Attributes:
        cluster: what was planned for.
        batch: global batch size.
        ranked: predictions of the strategies that fit, fastest first.
        rejected: (strategy, reason) of those that do not.
        profiles: per-worker batch -> the model profile used.
        memory_limit: the per-device memory planned for when it was given (it replaced the cluster's).
    """

    cluster: ClusterSpec
    batch: int
    ranked: list[Prediction]
    rejected: list[tuple[Choice, str]] = field(default_factory=list)
    profiles: dict[int, ModelProfile] = field(default_factory=dict)
    memory_limit: float | None = None

    @property
    def best(self) -> Prediction:
        if not self.ranked:
            raise ConfigError("no strategy fits: see the rejected list (memory or batch size)")
        return self.ranked[0]

    def find(self, label: str) -> Prediction | None:
        return next((p for p in self.ranked if p.strategy.label() == label), None)

    def table(self, top: int | None = None) -> str:
        """The ranked table (and the rejected strategies) as text."""
        limit = f"; memory limit {format_bytes(self.memory_limit)}" if self.memory_limit is not None else ""
        rows = [
            f"plan for {self.cluster.describe()}; global batch {self.batch}{limit}",
            f"{'#':>3}  {'strategy':<34}{'step ms':>9}{'samples/s':>11}{'mem/dev':>10}{'sent/step':>11}  why",
        ]
        for i, p in enumerate(self.ranked[:top] if top else self.ranked, 1):
            rows.append(
                f"{i:>3}  {p.strategy.label():<34}{p.step_s * 1e3:>9.3g}{p.samples_per_s:>11.4g}"
                f"{format_bytes(p.memory.total):>10}{format_bytes(p.bytes_per_step):>11}  {p.why}"
            )
        if top and len(self.ranked) > top:
            rows.append(f"     ... {len(self.ranked) - top} more")
        for s, reason in self.rejected:
            rows.append(f"  -  {s.label():<34}rejected: {reason}")
        return "\n".join(rows)

    def __str__(self) -> str:
        return self.table()


def candidates(
    cluster: ClusterSpec,
    workers: int | None = None,
    *,
    compressions: Sequence[str] = DEFAULT_COMPRESSIONS,
    consistencies: Sequence[str] = DEFAULT_CONSISTENCIES,
    buckets: Sequence[float] = DEFAULT_BUCKETS,
    algorithms: Sequence[str] = ALGORITHMS,
    exact_only: bool = False,
    single: bool = True,
    ddp: bool = True,
    averaging: bool = False,
    pipeline: bool = False,
    mesh: bool = False,
) -> list[Choice]:
    """Every choice the planner considers on ``workers`` devices (default: all of the cluster's):
    each registered strategy's ``candidates`` hook over the same :class:`PlanSpace`."""
    space = PlanSpace(
        cluster,
        workers or cluster.devices,
        tuple(compressions),
        tuple(consistencies),
        tuple(buckets),
        tuple(algorithms),
        exact_only,
        single,
        ddp,
        averaging,
        pipeline,
        mesh,
    )
    out: list[Choice] = []
    for entry in registered().values():
        hook = ModelHooks.of(entry).candidates
        if hook is not None:
            out += hook(space)
    return out


def _batch_of(sample: Any, b: int) -> Any:
    """The first ``b`` samples of a batch (repeated when the batch is smaller)."""

    def cut(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            return t
        reps = -(-b // t.shape[0])
        full = t.repeat(reps, *([1] * (t.dim() - 1))) if reps > 1 else t
        return full[:b]

    if isinstance(sample, (tuple, list)):
        return type(sample)(cut(t) for t in sample)
    return cut(sample)


def _global_batch(sample: Any) -> int:
    x = sample[0] if isinstance(sample, (tuple, list)) else sample
    return int(x.shape[0])


def plan(
    model: nn.Module,
    sample_batch: Any,
    cluster: str | Path | ClusterSpec,
    *,
    batch: int | None = None,
    workers: int | None = None,
    name: str | None = None,
    optimizer: str = "sgd",
    compressions: Sequence[str] = DEFAULT_COMPRESSIONS,
    consistencies: Sequence[str] = DEFAULT_CONSISTENCIES,
    exact_only: bool = False,
    strategies: Sequence[Choice] | None = None,
    measure: bool = True,
    averaging: bool = False,
    pipeline: bool = False,
    memory_limit: str | float | None = None,
    mesh: bool = False,
) -> Plan:
    """Rank the strategies for training ``model`` on ``cluster``.

    Args:
        model: the model to train.
        sample_batch: ``(inputs, targets)`` of one global batch (its size is the
            global batch unless ``batch`` is given).
        cluster: a cluster TOML path or a :class:`ClusterSpec` (:func:`dtrain.plan`
            calibrates this machine when given none).
        batch: global batch size (default: the sample batch's size).
        workers: devices to use (default: all of the cluster's).
        name: model name for the cluster's ``[models.NAME]`` table (default: class name).
        optimizer: "sgd", "sgd0" or "adam" (optimizer state in the memory estimate).
        compressions / consistencies: what to try (see :func:`candidates`).
        exact_only: only strategies equivalent to single-process training.
        strategies: an explicit candidate list instead.
        measure: time the model here (False: FLOPs over the device rate only).
        averaging: also rank the model-averaging strategies (local SGD, EASGD, gossip), which
            change the optimisation itself: their steps are cheaper, not their progress per step.
        pipeline: also rank pipelines (gpipe, 1f1b, interleaved; 2bw unless ``exact_only``).
        mesh: also rank tensor parallelism and every DP x PP x TP factorization of the workers
            (``tensor`` / ``hybrid``; gpt models).
        memory_limit: bytes per device ("2GB", "1.5GiB", a number) instead of the cluster's
            device memory: choices predicted to need more are rejected, so under a tight
            limit a ZeRO stage (``dp --shard``) comes first.

    Returns:
        A :class:`Plan`; ``print(plan)`` shows the table.
    """
    spec, limit = _cluster_under(cluster, memory_limit)
    gbatch = batch or _global_batch(sample_batch)
    name = name or type(model).__name__.lower()
    cands = (
        list(strategies)
        if strategies is not None
        else candidates(
            spec,
            workers,
            compressions=compressions,
            consistencies=consistencies,
            exact_only=exact_only,
            averaging=averaging,
            pipeline=pipeline,
            mesh=mesh,
        )
    )
    ranker = _Ranker(model, sample_batch, spec, name, optimizer, measure, limited=limit is not None)
    return ranker.plan(cands, gbatch, limit)


def _cluster_under(
    cluster: str | Path | ClusterSpec, memory_limit: str | float | None
) -> tuple[ClusterSpec, float | None]:
    """The cluster spec, its device memory replaced by ``memory_limit`` where one is given, and that limit."""
    spec = cluster if isinstance(cluster, ClusterSpec) else load_cluster(cluster)
    limit = parse_memory_limit(memory_limit) if memory_limit is not None else None
    if limit is not None:
        spec = replace(spec, device=replace(spec.device, memory=limit))
    return spec, limit


class _Ranker:
    """Predicts candidates one by one, profiling the model once per per-worker batch."""

    def __init__(
        self,
        model: nn.Module,
        sample: Any,
        spec: ClusterSpec,
        name: str,
        optimizer: str,
        measure: bool,
        limited: bool = False,
    ) -> None:
        self.model, self.sample, self.spec, self.name = model, sample, spec, name
        self.has = "over the memory limit of" if limited else "has"
        self.optimizer, self.measure = optimizer, measure
        self.profiles: dict[int, ModelProfile] = {}
        self.comps: dict[str, CompressionModel] = {}
        self.ranked: list[Prediction] = []
        self.rejected: list[tuple[Choice, str]] = []
        self.seen: set[Hashable] = set()

    def plan(self, cands: Sequence[Choice], gbatch: int, limit: float | None) -> Plan:
        """Every candidate predicted at ``gbatch``, the ones that fit ranked by samples per second."""
        for s in cands:
            self.add(s, gbatch)
        self.ranked.sort(key=lambda p: -p.samples_per_s)
        return Plan(
            cluster=self.spec,
            batch=gbatch,
            ranked=self.ranked,
            rejected=self.rejected,
            profiles=self.profiles,
            memory_limit=limit,
        )

    def add(self, s: Choice, gbatch: int) -> None:
        spec = self.spec
        if gbatch < s.workers:
            self.rejected.append((s, f"global batch {gbatch} is smaller than {s.workers} workers"))
            return
        if s.processes > spec.devices:
            self.rejected.append((s, f"needs {s.processes} processes; the cluster has {spec.devices} devices"))
            return
        b = split_batch(gbatch, s.workers)[0]  # as a run does: 64 over 3 workers is 21 each, 63 a step
        if b not in self.profiles:
            self.profiles[b] = profile_model(
                self.model,
                _batch_of(self.sample, b),
                name=self.name,
                measure=self.measure,
                optimizer=self.optimizer,
                threads=spec.device.threads,
            )
        key = (s.strategy, s.workers, ModelHooks.of(s.entry).identity(s.opts, self.profiles[b]))
        if key in self.seen:
            return
        self.seen.add(key)
        comp_spec = s.opts.compressor_spec()
        comp = None
        if comp_spec != "none":
            comp = self.comps.setdefault(comp_spec, compression_model(comp_spec, spec, measure=self.measure))
        pred = predict(
            self.profiles[b],
            spec.with_devices(s.processes) if s.processes < spec.devices else spec,
            s,
            comp,
            overhead_s=spec.device.overhead,
        )
        if not pred.fits:
            if math.isfinite(pred.memory.total):
                need, has = format_bytes(pred.memory.total), format_bytes(spec.device.memory)
                why = f"needs {need} per device, {self.has} {has}"
            else:  # a choice the model cannot run at all (a pipeline of more stages than layers): the hook says why
                why = pred.why
            self.rejected.append((s, why))
            return
        note = s.opts.approximation()
        self.ranked.append(replace(pred, why=f"{pred.why}; {note}" if note else pred.why))
