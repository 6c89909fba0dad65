"""``dtrain run``: the parent process and each process's entry point.

The parent process (:func:`run`) validates the configuration, lets the strategy
resolve itself (``auto`` asks the planner), creates the run folder, starts the
processes through :func:`dtrain.launch.launch`, and when they end merges their
metrics and writes ``summary.json``. Each process runs :func:`worker_main`,
which builds a :class:`~dtrain.training.context.TrainContext` and hands it to
the registered strategy's ``run`` hook (:mod:`dtrain.strategies`); the
strategies' workers share one loop (:func:`dtrain.training.loop.run_loop`).

A process body returns this process's part of the summary: ``role`` ("worker"
or "server"), and for workers ``steps``, ``samples``, ``train_s``,
``final_loss``, ``bytes_sent`` and, on the rank that evaluates, the metric
(``metric_name``, ``metric``, ``metric_history``; ``test_accuracy`` and
``accuracy_history`` for a classifier, ``val_loss`` and ``perplexity`` for a
language model; ``time_to_target_s`` under ``--target``). It may add keys (e.g. the parameter
server's ``staleness`` under ``summary_extra``).
"""

from __future__ import annotations

import json
import math
import time
import traceback
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import torch.distributed as dist

from dtrain.config import RunConfig, dump_toml
from dtrain.errors import ConfigError
from dtrain.strategies.base import get
from dtrain.trace import MetricsWriter, Tracer, merge_rank_files
from dtrain.training.context import TrainContext, lr_factor, schedule_updates

__all__ = ["TrainContext", "run", "worker_main", "default_out_dir", "summarize", "lr_factor", "iter_metrics"]

_schedule_updates = schedule_updates  # the name tests and older scripts import


def default_out_dir(cfg: RunConfig) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{stamp}-{cfg.strategy}"


def worker_main(cfg_dict: dict[str, Any], out_dir: str) -> dict[str, Any]:
    """Entry point of every process of a run (called by the elastic launcher)."""
    cfg = RunConfig.from_mapping(cfg_dict)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    out = Path(out_dir)
    ctx = TrainContext(
        cfg=cfg, rank=rank, world_size=world, out_dir=out,
        data=cfg.load_data(),
        metrics=MetricsWriter(out, rank), tracer=Tracer(rank, enabled=cfg.trace),
    )
    body = cfg.entry.run
    if body is None:
        raise ConfigError(f"strategy {cfg.strategy!r} has no process body; it must resolve to one that has")
    try:
        result = body(ctx)
    except BaseException:
        (out / f"error.rank{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        ctx.metrics.close()
        ctx.tracer.dump(out)
    result["rank"] = rank
    return result


def summarize(cfg: RunConfig, results: dict[int, dict[str, Any]], wall_s: float) -> dict[str, Any]:
    """Combine the processes' results into ``summary.json``'s contents.

    ``samples_per_s`` counts every sample a worker computed a gradient of. A
    parameter-server run also gets ``computed_samples_per_s`` (the same) and
    ``applied_samples_per_s``: samples whose gradients went into an update, per
    second -- lower under backup:b, which drops gradients (see
    :func:`dtrain.param_server.runner.merge_stats`).
    """
    workers = [r for r in results.values() if r.get("role") == "worker"]
    if not workers:
        raise RuntimeError("no worker returned a result")
    steps = max(int(w["steps"]) for w in workers)
    evaluator = next((w for w in workers if "metric" in w), {})
    train_s = max(float(w["train_s"]) for w in workers)
    samples = sum(int(w["samples"]) for w in workers)
    s: dict[str, Any] = {
        "strategy": cfg.strategy,
        "world_size": len(results),
        "workers": len(workers),
        "steps": steps,
        "wall_s": round(wall_s, 3),
        "train_s": round(train_s, 3),
        "samples_per_s": samples / train_s if train_s > 0 else math.nan,
        "test_accuracy": evaluator.get("test_accuracy"),
        "final_loss": sum(float(w["final_loss"]) for w in workers) / len(workers),
        "bytes_sent_per_step": sum(float(w["bytes_sent"]) / max(1, int(w["steps"])) for w in workers) / len(workers),
        "accuracy_history": evaluator.get("accuracy_history", []),
        "metric_name": evaluator.get("metric_name"),
        "metric": evaluator.get("metric"),
        "metric_history": evaluator.get("metric_history", []),
    }
    for k in ("val_loss", "perplexity", "target", "time_to_target_s", "target_step"):
        if k in evaluator:
            s[k] = evaluator[k]
    if cfg.resume:
        s["resumed_from"] = cfg.resume
        s["start_step"] = max(int(w.get("start_step", 0)) for w in workers)
    for r in results.values():  # strategy-specific extras (e.g. staleness) from any process
        for k, v in r.get("summary_extra", {}).items():
            s.setdefault(k, v)
    if s.get("samples_applied") is not None and train_s > 0:  # parameter server: work done vs work used
        s["computed_samples_per_s"] = s["samples_per_s"]
        s["applied_samples_per_s"] = s["samples_applied"] / train_s
    return s


def run(cfg: RunConfig, *, quiet: bool = False) -> tuple[dict[str, Any], Path]:
    """Run a whole training job from the parent process; returns (summary, run folder).

    The strategy's ``resolve`` hook runs first (``auto`` asks the planner and runs
    its first choice); ``cluster="NAME"`` spreads the processes over the hosts
    of an emulated cluster (``dtrain cluster up``) instead of this machine.
    """
    cfg = get(cfg.validate().strategy).resolve(cfg)
    out = Path(cfg.out) if cfg.out else default_out_dir(cfg)
    out.mkdir(parents=True, exist_ok=True)
    for stale in list(out.glob("metrics*.jsonl")) + list(out.glob("trace*.json")) + list(out.glob("error.rank*.txt")):
        stale.unlink()
    cfg = cfg.replace(out=str(out))
    if cfg.resume:  # the concrete checkpoint, so every process (and config.toml) names the same one
        from dtrain.checkpoint import find_checkpoint

        cfg = cfg.replace(resume=str(find_checkpoint(cfg.resume).resolve()))
    (out / "config.toml").write_text(dump_toml(cfg))
    from dtrain.launch import launch

    t0 = time.perf_counter()
    try:
        if cfg.cluster:
            from dtrain.cluster import launch_on_cluster

            results = launch_on_cluster(worker_main, (cfg.to_dict(), str(out)), nprocs=cfg.num_processes,
                                        cluster=cfg.cluster, stream_first=not quiet)
        else:
            results = launch(worker_main, (cfg.to_dict(), str(out)), nprocs=cfg.num_processes,
                             backend=cfg.backend or None)
    finally:
        merge_rank_files(out)
    summary = summarize(cfg, results, time.perf_counter() - t0)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if (out / "metrics.jsonl").is_file():
        from dtrain.report import plot_run

        plot_run(out)
    return summary, out


def iter_metrics(out_dir: str | Path) -> Iterator[dict[str, Any]]:
    """Rows of a finished run's metrics.jsonl."""
    for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines():
        if line.strip():
            yield json.loads(line)


