"""The parameter server's end of a run: serving, the workers' statistics, the merged report.

The training side of ``dtrain run --strategy ps`` is :mod:`dtrain.strategies.ps`.
At the end every process publishes its :meth:`ParameterServer.stats` to the c10d
store (:func:`publish_worker_stats` for workers); the first server (:func:`serve`)
merges them, writes ``ps_stats.json`` to the run folder, prints a table, and
returns ``staleness`` and ``clock_lag`` (``{max, mean, hist}`` over all servers'
applied gradients) for the run's summary.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

from dtrain.param_server.consistency import parse_consistency
from dtrain.param_server.parameter_server import ParameterServer
from dtrain.param_server.server_stats import hist_summary

__all__ = ["serve", "publish_worker_stats", "lr_scale", "format_table", "merge_stats"]


def lr_scale(consistency: str, workers: int) -> float:
    """Learning-rate factor so that ``--lr`` means the rate of a global batch under every policy.

    An update averages ``m`` of the ``W`` workers' gradients (``m = W`` for bsp,
    ``W - b`` for backup:b, ``k`` for softsync:k, 1 for asp and ssp), i.e. a batch
    ``m / W`` of the global one; the linear scaling rule (Goyal et al. 2017) gives
    it ``lr * m / W``. Without it an asynchronous run takes ``W`` full-size steps
    per global batch and diverges where bsp converges.
    """
    spec = parse_consistency(consistency)
    per_update = {"bsp": workers, "backup": workers - spec.arg, "softsync": min(spec.arg, workers)}.get(spec.kind, 1)
    return per_update / workers


def serve(
    ps: ParameterServer, out_dir: Path, *, batch_size: int, timeout_s: float, table: bool = True
) -> dict[str, Any]:
    """A server's whole run: serve until every worker is done, publish the stats; the first server
    merges everyone's into ``ps_stats.json`` and returns the summary's parameter-server keys."""
    stats = ps.serve()
    store = ps.store
    store.set(_stats_key(ps, ps.rank), json.dumps(stats))
    out: dict[str, Any] = {"role": "server", "ps": stats}
    if ps.rank != 0:
        return out
    lost = {int(w) for w in stats["lost"]}
    ranks = [r for r in range(ps.world_size) if r not in lost]
    everything = _collect(store, [_stats_key(ps, r) for r in ranks], timeout_s=min(60.0, timeout_s))
    merged = merge_stats(list(everything.values()), batch_per_worker=batch_size // ps.num_workers)
    (out_dir / "ps_stats.json").write_text(json.dumps(merged, indent=2) + "\n")
    if table:
        print(format_table(merged), flush=True)
    keys = (
        "consistency",
        "servers",
        "staleness",
        "clock_lag",
        "updates",
        "gradients_dropped",
        "samples_computed",
        "samples_applied",
        "lost_workers",
        "bytes_received_per_step",
    )
    out["summary_extra"] = {k: merged[k] for k in keys}
    return out


def publish_worker_stats(ps: ParameterServer) -> dict[str, Any]:
    """A worker's :meth:`ParameterServer.stats` after :meth:`finish`, published for the first server."""
    st = ps.stats()
    ps.store.set(_stats_key(ps, ps.rank), json.dumps(st))
    return st


# ---------------------------------------------------------------------- stats


def _stats_key(ps: ParameterServer, rank: int) -> str:
    return f"{ps.store_prefix}/stats/{rank}"


def _collect(store: Any, keys: list[str], timeout_s: float) -> dict[str, dict[str, Any]]:
    import datetime

    out: dict[str, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    for key in keys:
        left = max(0.1, deadline - time.monotonic())
        try:
            store.wait([key], datetime.timedelta(seconds=left))
            out[key] = json.loads(store.get(key).decode())
        except Exception:  # noqa: BLE001 - a rank that died after finishing: report without it
            continue
    return out


def merge_stats(stats: list[dict[str, Any]], batch_per_worker: int | None = None) -> dict[str, Any]:
    """Combine the processes' :meth:`ParameterServer.stats` into one report.

    Work done and work used: ``gradients_computed`` is the workers' steps (every
    gradient pushed), ``gradients_applied`` the gradients the first server put into
    an update (as for ``updates`` and ``gradients_dropped``, the first server's
    count; every server sees every gradient). With ``batch_per_worker`` (every gradient is of that
    many samples, as in ``dtrain run``, whose loaders drop the last partial batch)
    they become ``samples_computed`` and ``samples_applied`` -- the same under bsp,
    asp, ssp and softsync; about ``N / (N + b)`` of it under backup:b, which drops
    the ``b`` latest gradients of every update while all ``N + b`` workers work (Chen et al. 2016, "Revisiting
    Distributed Synchronous SGD"), so applied samples per second is the training
    throughput and computed samples per second the hardware's.

    Args:
        stats: every process's :meth:`ParameterServer.stats`.
        batch_per_worker: samples per gradient (default: None, no sample counts).
    """
    servers = sorted((s for s in stats if s["role"] == "server"), key=lambda s: s["rank"])
    workers = sorted((s for s in stats if s["role"] == "worker"), key=lambda s: s["rank"])
    stale: Counter[int] = Counter()
    lag: Counter[int] = Counter()
    lost: dict[str, str] = {}
    for s in servers:
        stale.update({int(k): v for k, v in s["staleness"]["hist"].items()})
        lag.update({int(k): v for k, v in s["clock_lag"]["hist"].items()})
        lost.update(s["lost"])
    first = (servers or workers or [{}])[0]
    computed = sum(int(w["steps"]) for w in workers)
    applied = sum(servers[0]["applied"].values()) if servers else 0
    return {
        "consistency": first.get("consistency"),
        "servers": first.get("servers"),
        "workers": first.get("workers"),
        "staleness": hist_summary(stale),
        "clock_lag": hist_summary(lag),
        "updates": servers[0]["updates"] if servers else 0,
        "gradients_dropped": sum(sum(s["dropped"].values()) for s in servers[:1]),
        "gradients_computed": computed,
        "gradients_applied": applied,
        "samples_computed": computed * batch_per_worker if batch_per_worker is not None else None,
        "samples_applied": applied * batch_per_worker if batch_per_worker is not None else None,
        "lost_workers": lost,
        "bytes_received_per_step": (
            sum(w["bytes_received"] / max(1, w["steps"]) for w in workers) / len(workers) if workers else 0.0
        ),
        "per_server": servers,
        "per_worker": workers,
    }


def _n(k: int, word: str) -> str:
    return f"{k} {word}" + ("" if k == 1 else "s")


def format_table(m: dict[str, Any]) -> str:
    """The end-of-run table: one row per server, one per worker."""
    lines = [
        f"parameter server: {_n(m['servers'], 'server')}, {_n(m['workers'], 'worker')}, "
        f"consistency {m['consistency']}; "
        f"staleness mean {m['staleness']['mean']:.2f} max {m['staleness']['max']}, "
        f"clock lag mean {m['clock_lag']['mean']:.2f} max {m['clock_lag']['max']}",
        f"{'rank':>4} {'server':<7}{'updates':>8}{'applied':>9}{'dropped':>9}{'stale':>7}{'lag':>6}"
        f"{'MB in':>9}{'MB out':>9}{'busy':>7}",
    ]
    for s in m["per_server"]:
        busy = s["busy_s"] / s["wall_s"] if s["wall_s"] else 0.0
        lines.append(
            f"{s['rank']:>4} {'':<7}{s['updates']:>8}{sum(s['applied'].values()):>9}{sum(s['dropped'].values()):>9}"
            f"{s['staleness']['mean']:>7.2f}{s['clock_lag']['mean']:>6.2f}{s['bytes_in'] / 1e6:>9.2f}"
            f"{s['bytes_out'] / 1e6:>9.2f}{busy:>7.0%}"
        )
    lines.append(
        f"{'rank':>4} {'worker':<7}{'steps':>8}{'compute':>9}{'push':>9}{'wait':>7}{'pull':>6}{'MB out':>9}{'MB in':>9}"
    )
    for w in m["per_worker"]:
        lines.append(
            f"{w['rank']:>4} {'':<7}{w['steps']:>8}{w['compute_s']:>8.2f}s{w['push_s']:>8.2f}s{w['wait_s']:>6.1f}s"
            f"{w['pull_s']:>5.2f}s{w['bytes_sent'] / 1e6:>9.2f}{w['bytes_received'] / 1e6:>9.2f}"
        )
    first = m["per_server"][0]["rank"] if m["per_server"] else "-"
    work = f"gradients: {m['gradients_computed']} computed, {m['gradients_applied']} applied (server {first})"
    if m.get("samples_computed") is not None:
        work += f"; samples: {m['samples_computed']} computed, {m['samples_applied']} applied"
    lines.append(work)
    for r, why in m["lost_workers"].items():
        lines.append(f"worker rank {r} was dropped: {why}")
    return "\n".join(lines)
