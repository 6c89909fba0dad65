"""What ``dtrain report`` reads from a run folder, reduced to the figures its page shows.

* :func:`load_run` reads the run folder's summary, metrics rows, configuration and ``trace.json``
  (only the summary is required; :mod:`dtrain.rundir.files`) into a :class:`RunData`.
* :func:`digest_trace` keeps of a Chrome trace the "step" spans (track 0) and a pipeline's action
  spans (track 1, args ``stage``/``mb``/``op``); every other event kind (metadata, flows, counters),
  other tracks and unknown keys are ignored, and the raw trace goes no further.
* :func:`figures` and :func:`deltas`: what runs are compared by (the median step time after the
  first step, samples/s, the metric, bytes per step, final loss) and each run's difference from
  the first.
* :func:`rank_breakdown`: per rank the mean step as own work, communication and waiting for a later
  rank (definitions 1, 2 and 4 of :mod:`dtrain.observe.attribution`: the three add up to the step).
* :func:`span_bubbles` and :func:`pipeline_bubbles`: a pipeline's bubble from the trace's spans
  (``1 - compute actions / step span`` per rank and step) beside the metrics rows' ``bubble``, the
  closed form ``(P-1)/(v*M+P-1)`` and the schedule simulated at the measured F and B times.
* :func:`predict`: the performance model's step for the run's own strategy (it may calibrate
  this machine first, once per process count: ``dtrain report --predict``).
"""

from __future__ import annotations

import contextlib
import json
import math
import statistics
from bisect import bisect_left, bisect_right
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from dtrain.errors import DTrainError

if TYPE_CHECKING:
    from dtrain.registry import StrategyOptions

__all__ = [
    "Act",
    "TraceDigest",
    "RunData",
    "COMPUTE_OPS",
    "DELTA_KEYS",
    "digest_trace",
    "step_acts",
    "span_bubbles",
    "load_run",
    "figures",
    "deltas",
    "rank_breakdown",
    "pipeline_bubbles",
    "schedule_shape",
    "run_options",
    "predict",
    "number",
    "after_warmup",
    "per_step",
    "by_rank",
    "mean_or_none",
]

COMPUTE_OPS = ("F", "B", "I", "W")  # the ops that compute; the rest send, receive or step
DELTA_KEYS = (
    ("step_ms", "step ms (median)", True),
    ("samples_per_s", "samples/s", True),
    ("metric", "metric", False),
    ("bytes_per_step", "bytes/step", True),
    ("final_loss", "final loss", False),
)


class Act(NamedTuple):
    """One pipeline action span (the trace's track 1): rank, start and duration (us), op, stage, micro-batch."""

    rank: int
    ts: float
    dur: float
    op: str
    stage: int
    mb: int | None


@dataclass
class TraceDigest:
    """What the report keeps of a trace: ``steps[(rank, step)] = (start us, duration us)`` of each
    "step" span, and the pipeline's actions (``acts``, sorted by rank and start)."""

    steps: dict[tuple[int, int], tuple[float, float]] = field(default_factory=dict)
    acts: list[Act] = field(default_factory=list)


@dataclass
class RunData:
    """One run folder's files: the summary, the metrics rows, the configuration (``{}`` when
    missing), the digest of ``trace.json`` (None when missing) and a prediction when there is one."""

    path: Path
    summary: dict[str, Any]
    rows: list[dict[str, Any]]
    config: dict[str, Any] = field(default_factory=dict)
    trace: TraceDigest | None = None
    prediction: dict[str, Any] | None = None

    @property
    def label(self) -> str:
        tables = [v for v in self.config.values() if isinstance(v, dict)]
        opts = ", ".join(f"{k}={v}" for t in tables for k, v in t.items() if k in _LABEL_KEYS)
        return f"{self.path.name}: {self.summary.get('strategy', '?')}" + (f" ({opts})" if opts else "")


_LABEL_KEYS = ("algorithm", "compression", "servers", "consistency", "schedule", "microbatches", "shard")


def number(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def digest_trace(trace: Any) -> TraceDigest:
    """Reduce a Chrome trace (``{"traceEvents": [...]}`` or a bare list) to a :class:`TraceDigest`.

    Only complete ("X") events count: ``"step"`` spans on track 0 whose args hold ``step``, and
    track 1's actions whose args hold an ``op`` of :data:`~dtrain.pipeline.schedules.OPS` and a
    ``stage``. Metadata, flow and counter events, other tracks and unknown keys are ignored.
    """
    from dtrain.pipeline.schedules import OPS

    events = trace.get("traceEvents") if isinstance(trace, dict) else trace
    d = TraceDigest()
    for e in events if isinstance(events, list) else []:
        if not isinstance(e, dict) or e.get("ph") != "X":
            continue
        ts, dur, pid = number(e.get("ts")), number(e.get("dur")), e.get("pid")
        args: dict[str, Any] = e["args"] if isinstance(e.get("args"), dict) else {}
        if ts is None or dur is None or not isinstance(pid, int):
            continue
        tid = e.get("tid", 0)
        if tid == 0 and e.get("name") == "step" and isinstance(args.get("step"), int):
            d.steps[(pid, args["step"])] = (ts, dur)
        elif tid == 1 and args.get("op") in OPS and isinstance(args.get("stage"), int):
            mb = args.get("mb")
            d.acts.append(Act(pid, ts, dur, str(args["op"]), args["stage"], mb if isinstance(mb, int) else None))
    d.acts.sort(key=lambda a: (a.rank, a.ts))
    return d


def by_rank(d: TraceDigest) -> dict[int, list[Act]]:
    out: dict[int, list[Act]] = defaultdict(list)
    for a in d.acts:
        out[a.rank].append(a)
    return out


def step_acts(d: TraceDigest) -> dict[tuple[int, int], list[Act]]:
    """Per ``(rank, step)`` of a rank with pipeline actions: the actions that start within its step span."""
    lanes = by_rank(d)
    starts = {r: [a.ts for a in acts] for r, acts in lanes.items()}
    return {
        (rank, step): lanes[rank][bisect_left(starts[rank], t0) : bisect_right(starts[rank], t0 + dur)]
        for (rank, step), (t0, dur) in sorted(d.steps.items())
        if rank in lanes
    }


def span_bubbles(d: TraceDigest) -> dict[tuple[int, int], float]:
    """Per ``(rank, step)`` of a rank with pipeline actions: the share of its step span not spent in
    compute actions (F, B, I, W): ``1 - sum(compute durations) / step duration``."""
    out = {}
    for key, acts in step_acts(d).items():
        dur = d.steps[key][1]
        if dur > 0:
            out[key] = max(0.0, dur - sum(a.dur for a in acts if a.op in COMPUTE_OPS)) / dur
    return out


def after_warmup(keys: Sequence[int]) -> set[int]:
    """The steps after the first (it exchanges shapes and warms up), or all where there is one step."""
    steps = sorted(set(keys))
    return set(steps[1:]) if len(steps) > 1 else set(steps)


def load_run(run_dir: str | Path) -> RunData:
    """Read a finished run folder (the summary is required; metrics, config and trace are optional)."""
    from dtrain.config.files import read_toml
    from dtrain.rundir.files import CONFIG, is_run, read_metrics, read_summary

    d = Path(run_dir)
    summary, rows = read_summary(d), read_metrics(d)
    config = read_toml(d / CONFIG, "run config") if is_run(d) else {}
    trace = digest_trace(json.loads((d / "trace.json").read_text())) if (d / "trace.json").is_file() else None
    pred = summary.get("prediction") if isinstance(summary.get("prediction"), dict) else None
    return RunData(d, summary, [r for r in rows if isinstance(r, dict) and "step" in r], config, trace, pred)


def per_step(rows: Sequence[dict[str, Any]], key: str) -> dict[int, float]:
    """Per step, the mean of ``key`` over the ranks' rows that hold a number there."""
    vals: dict[int, list[float]] = defaultdict(list)
    for r in rows:
        v = number(r.get(key))
        if v is not None:
            vals[int(r["step"])].append(v)
    return {s: sum(v) / len(v) for s, v in sorted(vals.items())}


def figures(run: RunData) -> dict[str, float | None]:
    """The figures runs are compared by: step ms (the median over the steps after the first of the
    ranks' mean ``step_s``), samples/s, the metric, bytes sent per step, final loss, wall seconds."""
    steps = per_step(run.rows, "step_s")
    keep = after_warmup(list(steps))
    s = run.summary
    return {
        "step_ms": statistics.median(steps[k] for k in keep) * 1e3 if keep else None,
        "samples_per_s": number(s.get("samples_per_s")),
        "metric": number(s.get("metric", s.get("test_accuracy"))),
        "bytes_per_step": number(s.get("bytes_sent_per_step")),
        "final_loss": number(s.get("final_loss")),
        "wall_s": number(s.get("wall_s")),
    }


def deltas(runs: Sequence[RunData]) -> list[dict[str, Any]]:
    """For each run after the first, per key of the comparison: its value, the difference from the
    first run's and (for times, rates and bytes) the relative change; None where either is missing."""
    base = figures(runs[0])
    out = []
    for run in runs[1:]:
        f = figures(run)
        row: dict[str, Any] = {"run": run.label}
        for key, _, relative in DELTA_KEYS:
            a, b = base[key], f[key]
            diff = b - a if a is not None and b is not None else None
            rel = diff / a if relative and diff is not None and a else None
            row[key] = {"value": b, "diff": diff, "rel": rel}
        out.append(row)
    return out


def predict(run: RunData) -> dict[str, Any]:
    """The performance model's prediction for the run's own strategy, options and workers, on this
    machine's calibration (:func:`dtrain.planning.calibrate.local_cluster`: measured once per process
    count and cached, which can take a minute) or the run's emulated cluster's."""
    from dtrain.config.schema import RunConfig
    from dtrain.perfmodel.ranking import plan
    from dtrain.planning.auto import cluster_for, optimizer_kind
    from dtrain.planning.calibrate import local_cluster
    from dtrain.registry import Choice
    from dtrain.workloads.load import load_model

    cfg = RunConfig.from_mapping({k: v for k, v in run.config.items() if k not in ("out", "resume", "overwrite")})
    own = Choice(cfg.strategy, cfg.workers, cfg.options)
    model, sample, name = load_model(
        cfg.model,
        cfg.dataset,
        batch=cfg.batch_size,
        seed=cfg.seed,
        samples=cfg.samples,
        seq_len=cfg.seq_len,
        model_args=cfg.model_args,
        **cfg.gpt_overrides(),
    )
    spec = cluster_for(cfg.cluster, processes=own.processes) if cfg.cluster else local_cluster(own.processes)
    opt = optimizer_kind(cfg)
    p = plan(model, sample, spec, workers=own.processes, name=name, optimizer=opt, strategies=[own])
    if not p.ranked:
        why = "; ".join(r for _, r in p.rejected) or "no prediction"
        return {"label": own.label(), "step_s": None, "why": why}
    best = p.ranked[0]
    return {
        "label": own.label(),
        "step_s": best.step_s,
        "samples_per_s": best.samples_per_s,
        "compute_s": best.compute_s,
        "comm_s": best.comm_s,
        "wait_s": best.wait_s,
        "bytes_per_step": best.bytes_per_step,
        "why": best.why,
    }


def rank_breakdown(rows: Sequence[dict[str, Any]]) -> dict[int, tuple[float, float, float]]:
    """Per rank, mean seconds per step (after the first) of own work, communication and waiting for a
    later rank: definitions 1, 2 and 4 of :mod:`dtrain.observe.attribution`, so the three add up to the step."""
    from dtrain.observe.attribution import arrivals, own_s, step_time

    keep = after_warmup([int(r["step"]) for r in rows])
    waits = {a.step: a.waits for a in arrivals(rows)}
    acc: dict[int, list[tuple[float, float, float]]] = defaultdict(list)
    for r in rows:
        if int(r["step"]) not in keep:
            continue
        rank, t, own = int(r.get("rank", 0)), step_time(r), own_s(r)
        wait = min(waits.get(int(r["step"]), {}).get(rank, 0.0), max(0.0, t - own))
        acc[rank].append((own, max(0.0, t - own - wait), wait))
    return {k: tuple(sum(x[j] for x in v) / len(v) for j in range(3)) for k, v in sorted(acc.items())}  # type: ignore[misc]


def mean_or_none(vals: Sequence[float]) -> float | None:
    return sum(vals) / len(vals) if vals else None


def run_options(run: RunData) -> StrategyOptions | None:
    """The run's strategy options, as its registry entry builds them from the strategy's table in
    configuration (its defaults where the folder has none); None for a strategy not registered here,
    or a table its options refuse (a folder of another version)."""
    from dtrain.config.schema import build_options
    from dtrain.registry import get

    name = run.config.get("strategy") or run.summary.get("strategy")
    try:
        entry = get(str(name))
        table = run.config.get(entry.name)
        return build_options(entry, table if isinstance(table, dict) else {})
    except (DTrainError, TypeError, ValueError):
        return None


def schedule_shape(run: RunData) -> tuple[str, int, int, int] | None:
    """(schedule, P, M, v) of a run whose strategy plays a pipeline schedule (its options'
    ``pipeline_schedule()``), with P and v from the trace's ranks and stages where it has them."""
    opts = run_options(run)
    played = opts.pipeline_schedule() if opts is not None else None
    if played is None:
        return None
    schedule, microbatches, chunks = played
    acts = run.trace.acts if run.trace is not None else []
    ranks = len({a.rank for a in acts}) or int(run.summary.get("workers") or 1)
    stages = len({a.stage for a in acts})
    if chunks > 1 and acts and stages >= ranks:
        chunks = stages // ranks
    return schedule, ranks, microbatches, max(1, chunks)


def pipeline_bubbles(run: RunData) -> dict[str, float | None]:
    """A pipeline run's bubble, after the first step: ``rows`` (the mean of the metrics rows' ``bubble``),
    ``spans`` (the mean of :func:`span_bubbles`), ``closed_form`` ((P-1)/(v*M+P-1)), and ``plan`` (the
    schedule simulated at the measured mean forward and backward times, with ``tf_ms`` and ``tb_ms``)."""
    from dtrain.pipeline.schedules import ScheduleError, bubble_closed_form, generate, simulate

    rows = [(int(r["step"]), b) for r in run.rows if (b := number(r.get("bubble"))) is not None]
    keep = after_warmup([s for s, _ in rows])
    out: dict[str, float | None] = {"rows": mean_or_none([b for s, b in rows if s in keep])}
    spans = span_bubbles(run.trace) if run.trace is not None else {}
    keep = after_warmup([s for _, s in spans])
    out["spans"] = mean_or_none([v for (_, s), v in spans.items() if s in keep])
    spans_acts = step_acts(run.trace) if run.trace is not None else {}
    acts = [a for (_, s), step in spans_acts.items() if s in keep for a in step]
    tf = mean_or_none([a.dur / 1e3 for a in acts if a.op == "F"]) or 1.0
    tb = mean_or_none([a.dur / 1e3 for a in acts if a.op == "B"]) or 2 * tf
    out.update(closed_form=None, plan=None, tf_ms=tf, tb_ms=tb)
    shape = schedule_shape(run)
    if shape is not None:
        with contextlib.suppress(ScheduleError):  # a shape the generators refuse: no closed form or plan drawn
            out["closed_form"] = bubble_closed_form(*shape)
            out["plan"] = simulate(generate(*shape), tf, tb).bubble
    return out
