"""``dtrain run --strategy auto`` and :func:`dtrain.plan`: the planner on a run's model and cluster.

:func:`pick_plan` is what the ``auto`` strategy's ``resolve`` hook calls before
launching: it builds the configured model and one global batch, finds the
cluster description (the calibration of the emulated cluster ``cfg.cluster``, or
this machine's cached quick calibration), runs the planner over the registered
strategies' candidates that ``dtrain run`` can execute with ``cfg.workers``
processes, prints the top of the table and returns the winner, a
:class:`~dtrain.strategies.Choice`.

This layer measures (it calibrates and profiles); :mod:`dtrain.perfmodel` stays pure.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from torch import nn

from dtrain.config.schema import RunConfig
from dtrain.errors import ConfigError
from dtrain.perfmodel import memo
from dtrain.perfmodel.ranking import DEFAULT_COMPRESSIONS, DEFAULT_CONSISTENCIES, Plan, candidates
from dtrain.perfmodel.ranking import plan as rank
from dtrain.perfmodel.spec import ClusterSpec, dump_cluster, load_cluster, this_host
from dtrain.planning.calibrate import cache_dir, calibrate_cluster, cluster_file, local_cluster, local_cores
from dtrain.registry import Choice
from dtrain.workloads.load import load_model

__all__ = ["pick_plan", "plan", "plan_local", "plan_for_config", "cluster_for", "optimizer_kind", "measured_here"]


_CANDIDATE_FLAGS = ("exact_only", "averaging", "pipeline", "mesh")


def plan(
    model: nn.Module,
    sample_batch: Any,
    cluster: str | Path | ClusterSpec | None = None,
    *,
    workers: int | None = None,
    compressions: Sequence[str] = DEFAULT_COMPRESSIONS,
    consistencies: Sequence[str] = DEFAULT_CONSISTENCIES,
    **kw: Any,
) -> Plan:
    """Rank the strategies for ``model`` (:func:`dtrain.perfmodel.plan`); with no ``cluster``, on this
    machine (:func:`plan_local`: default one worker a core). What it measures (the model's profile, the
    compressed collectives' counts) is kept for the next plan on this machine (:func:`measured_here`)."""
    with memo.kept_in(measured_here()):
        return _plan(
            model, sample_batch, cluster, workers=workers, compressions=compressions, consistencies=consistencies, **kw
        )


def measured_here() -> Path:
    """Where this machine keeps the planner's measurements (:mod:`dtrain.perfmodel.memo`), beside its calibration."""
    return cache_dir() / f"measured-{this_host()}"


def _plan(
    model: nn.Module,
    sample_batch: Any,
    cluster: str | Path | ClusterSpec | None,
    *,
    workers: int | None,
    compressions: Sequence[str],
    consistencies: Sequence[str],
    **kw: Any,
) -> Plan:
    if cluster is not None:
        return rank(
            model, sample_batch, cluster, workers=workers, compressions=compressions, consistencies=consistencies, **kw
        )
    w = workers or local_cores()
    flags = {k: kw.pop(k) for k in _CANDIDATE_FLAGS if k in kw}  # for the candidates, not the ranking
    cands = kw.pop("strategies", None)
    if cands is None:
        cands = candidates(local_cluster(w), w, compressions=compressions, consistencies=consistencies, **flags)
    return plan_local(model, sample_batch, list(cands), w, **kw)


def plan_local(model: nn.Module, sample_batch: Any, cands: Sequence[Choice], workers: int, **kw: Any) -> Plan:
    """Rank ``cands`` on this machine: each on the calibration for its own number of processes.

    A job of P processes gives each ``cores // P`` intra-op threads (:func:`~dtrain.launch.agent.threads_per_worker`)
    and, past one a core, shares the cores: one process of a 2-core machine computes on 2 threads alone, four
    on one each, two to a core. So the single process is predicted on the calibration for 1 (the model
    profiled at 2 threads, compute as measured) and dp on 4 on the one for 4 (profiled at 1 thread, compute
    slowed by the measured sharing), rather than every choice on one calibration.
    """
    by_procs: dict[int, list[Choice]] = {}
    for s in cands:
        by_procs.setdefault(s.processes, []).append(s)
    plans = [
        rank(model, sample_batch, local_cluster(p), workers=p, strategies=group, **kw)
        for p, group in sorted(by_procs.items())
    ]
    if not plans:
        return rank(model, sample_batch, local_cluster(workers), workers=workers, strategies=[], **kw)
    head = next((p for p in plans if p.cluster.devices == workers), plans[-1])
    ranked = sorted((r for p in plans for r in p.ranked), key=lambda r: -r.samples_per_s)
    profiles = {b: prof for p in plans for b, prof in p.profiles.items()}
    return replace(head, ranked=ranked, rejected=[r for p in plans for r in p.rejected], profiles=profiles)


def cluster_for(name: str, *, processes: int | None = None) -> ClusterSpec:
    """The calibrated description of emulated cluster ``name`` (calibrating it first if needed).

    With ``processes`` (a multiple of the hosts), each host holds ``processes / hosts`` devices.
    """
    path = cluster_file(name)
    if path.exists():
        spec = load_cluster(path)
    else:
        print(f"dtrain: calibrating emulated cluster {name!r} (once; kept in {path}) ...", file=sys.stderr)
        spec = calibrate_cluster(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(dump_cluster(spec, comment=f"dtrain bench calibrate --cluster {name}"))
    if processes and processes != spec.devices:
        if processes % spec.nodes:
            raise ConfigError(f"{processes} processes do not spread evenly over the {spec.nodes} hosts of {name!r}")
        spec = replace(spec, devices_per_node=processes // spec.nodes)
    return spec


def optimizer_kind(cfg: RunConfig) -> str:
    """The planner's name for ``cfg``'s optimizer state: "adam" (two moments: adam, adamw, lamb), "sgd"
    (momentum) or "sgd0" (none)."""
    if cfg.optimizer in ("adam", "adamw", "lamb"):
        return "adam"
    return "sgd" if cfg.momentum > 0 else "sgd0"


def plan_for_config(cfg: RunConfig) -> Plan:
    """The planner's table for a :class:`~dtrain.config.schema.RunConfig` (its model, batch, workers, cluster)."""
    with memo.kept_in(measured_here()):
        return _plan_for_config(cfg)


def _plan_for_config(cfg: RunConfig) -> Plan:
    model, sample, name = load_model(
        cfg.model,
        cfg.dataset,
        batch=cfg.batch_size,
        seed=cfg.seed,
        samples=cfg.samples,
        seq_len=cfg.seq_len,
        model_args=cfg.model_args,
        data=cfg.load_data(),
        **cfg.gpt_overrides(),
    )
    spec = cluster_for(cfg.cluster, processes=cfg.workers) if cfg.cluster else local_cluster(cfg.workers)
    spec = spec.with_devices(cfg.workers) if cfg.workers < spec.devices else spec
    cands = candidates(spec, cfg.workers, single=not cfg.cluster)
    if not cfg.cluster:
        return plan_local(model, sample, cands, cfg.workers, name=name, optimizer=optimizer_kind(cfg))
    # the emulated cluster spreads processes over hosts evenly: keep those that do
    cands = [s for s in cands if s.processes == cfg.workers]
    return rank(model, sample, spec, workers=cfg.workers, name=name, optimizer=optimizer_kind(cfg), strategies=cands)


def pick_plan(cfg: RunConfig, *, verbose: bool = True) -> Choice:
    """The planner's first choice for ``cfg`` (a strategy, its options and workers).

    Args:
        cfg: a :class:`~dtrain.config.schema.RunConfig` (its ``strategy`` is ignored).
        verbose: print the top of the plan to stderr.
    """
    p = plan_for_config(cfg)
    if verbose:
        print(p.table(top=8), file=sys.stderr)
    best = p.best.strategy
    if verbose:
        print(f"dtrain: --strategy auto chose: {best.label()}", file=sys.stderr)
    return best
