"""Fitting a cluster description's terms to measured points: pure arithmetic, nothing measured here.

:mod:`dtrain.planning.calibrate` runs the probes (:mod:`dtrain.planning._probes`) on a cluster's
processes; what they return -- per rank a dict of ping-pong points, ring exchanges,
payload-free synchronous steps, the backend's small allreduce -- is turned here into
the numbers of :mod:`dtrain.perfmodel.spec`:

* :func:`fit_alpha_beta` / :func:`fit_link` -- one level's ``alpha`` and ``beta`` from
  ping-pong one-way times;
* :func:`fit_duplex_rate` -- the rate each way while every rank sends and receives;
* :func:`fit_wake`, :func:`fit_imbalance`, :func:`fit_floor` -- the load terms of shared
  cores; :func:`fit_compute_scale` -- compute with every worker at once over alone;
* :func:`trimmed_mean` -- the mean that the probes report.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

import numpy as np

from dtrain.perfmodel.spec import Link

__all__ = [
    "trimmed_mean",
    "fit_alpha_beta",
    "fit_link",
    "fit_duplex_rate",
    "fit_wake",
    "fit_imbalance",
    "fit_floor",
    "fit_p2p_floor",
    "fit_cpu_ratio",
    "fit_compute_scale",
]


def trimmed_mean(xs: Sequence[float], cut: float = 0.1) -> float:
    """Mean without the largest ``cut`` fraction: counts the common delays, not a rare stall."""
    v = sorted(xs)
    keep = v[: max(1, int(round(len(v) * (1 - cut))))]
    return float(sum(keep) / len(keep))


def fit_alpha_beta(
    sizes: Sequence[float], times: Sequence[float], *, small: float = 1024, large: float = 256 * 1024
) -> tuple[float, float]:
    """Fit ``t = alpha + n * beta`` to one-way times of ping-pong messages.

    ``beta`` is the least-squares slope of ``t - alpha`` against ``n`` over the large
    messages (``n >= large``; all sizes when fewer than two are that large),
    ``alpha`` the median of ``t - n * beta`` over the small ones (``n <= small``);
    each is refined once with the other. Fitting the
    two ends apart matters on shaped links: tc's token bucket lets a burst through
    at line rate, so mid-sized messages lie below the line that bulk transfers
    follow.

    Returns:
        (alpha seconds, beta seconds per byte), both >= 0.
    """
    n = np.asarray(sizes, dtype=float)
    t = np.asarray(times, dtype=float)
    if len(n) < 2:
        raise ValueError("fit_alpha_beta needs at least two sizes")
    lo = n <= small
    if not lo.any():
        lo = n == n.min()
    big = n >= large
    if big.sum() < 2:
        big = np.ones_like(n, dtype=bool)
    alpha, beta = float(np.median(t[lo])), 0.0
    for _ in range(2):  # alpha and beta each correct the other once
        x, y = n[big], t[big] - alpha
        beta = max(1e-15, float((x * y).sum() / (x * x).sum()))
        alpha = max(0.0, float(np.median(t[lo] - n[lo] * beta)))
    return alpha, beta


def fit_link(points: list[tuple[int, float]]) -> Link:
    """Fit one level from (size, one-way time) points (several pairs' points may be pooled)."""
    by_size: dict[int, list[float]] = {}
    for size, t in points:
        by_size.setdefault(size, []).append(t)
    sizes = sorted(by_size)
    alpha, beta = fit_alpha_beta(sizes, [statistics.mean(by_size[n]) for n in sizes])
    return Link(bandwidth=1.0 / beta, latency=alpha)


def fit_duplex_rate(results: dict[int, Any], one_way: Link) -> float | None:
    """Bytes per second each way in ring exchanges: the bytes of one exchange of each size over the
    sum of the sizes' medians over ranks (at most the one-way rate; None when there is no exchange).

    Medians, not means: one delayed exchange among a rank's few moves a mean far. Throughput
    over all the sizes, not the slope between two, which spreads wider from one calibration to
    the next. It counts each exchange's own start-up, as a ring step pays it.
    """
    by_size: dict[int, list[float]] = {}
    for r in results.values():
        for size, t in r.get("duplex", []):
            by_size.setdefault(size, []).append(t)
    if not by_size:
        return None
    seconds = sum(statistics.median(ts) for ts in by_size.values())
    return min(one_way.bandwidth, sum(by_size) / seconds) if seconds > 0 else one_way.bandwidth


def fit_wake(results: dict[int, Any]) -> float:
    """``wake``: what a payload-free synchronous step (:func:`dtrain.planning._probes.sync_steps`) costs beyond
    the slowest rank's pass and its allreduce's own time, per wake-up that the model charges such a step
    (:data:`dtrain.perfmodel.predict.WAKES_FIRST_BUCKET`).

    The allreduce is timed in the same steps (the shortest over ranks, per step): one measured
    apart, back to back, sees another moment's load, and the difference would move from one
    refresh to the next while the ring steps it predicts do not.
    """
    from dtrain.perfmodel.predict import WAKES_FIRST_BUCKET

    rs = [r["sync"] for r in results.values()]
    beyond = statistics.mean(float(r["step"]) - float(r["slowest"]) - float(r["collective"]) for r in rs)
    return max(0.0, beyond / WAKES_FIRST_BUCKET)


def fit_imbalance(results: dict[int, Any]) -> float:
    """``imbalance``: the slowest rank's pass minus a rank's own, per step (mean over steps and ranks)."""
    rs = list(results.values())
    if len(rs) < 2:
        return 0.0
    return max(0.0, statistics.mean(float(r["sync"]["slowest"]) - float(r["sync"]["pass"]) for r in rs))


def fit_floor(results: dict[int, Any]) -> float:
    """``floor``: the backend's allreduce of 1 KiB, every rank at once, over its ``2(P-1)`` steps (0 for one rank).

    Of 1 KiB, not of a single float, whose segments are empty on every rank but one.

    It is not also the backend's per-step latency (``native_latency``): a step's
    scheduling delays pass while its bytes are on the wire, so charging the floor
    both as each of native's steps' alpha and as its least time counts them twice.

    Where ranks share cores, a small allreduce costs several times one of a single
    float, over loopback and emulated links alike: a small model's ring allreduce is
    charged about its steps' floor, recursive doubling's two steps their duplex
    transfer time, and the tree its one-way messages' time.
    """
    rs = [float(r["floor"]) for r in results.values() if "floor" in r]
    return float(statistics.mean(rs)) / (2 * (len(rs) - 1)) if len(rs) > 1 else 0.0


def fit_p2p_floor(results: dict[int, Any]) -> float | None:
    """``p2p_floor``: dtrain's ring allreduce of 1 KiB, every rank at once, over its ``2(P-1)`` steps.

    dtrain's ring has a floor of its own: the backend's would charge it as much as gloo's
    allreduce, where the two differ. None when the probe did not run (an older calibration).
    """
    rs = [float(r["p2p_floor"]) for r in results.values() if "p2p_floor" in r]
    if len(rs) < 2:
        return None
    return float(statistics.mean(rs)) / (2 * (len(rs) - 1))


def fit_compute_scale(results: dict[int, Any], default: float = 1.0) -> float:
    """``compute_scale``: every rank's mean pass, all computing at once, over rank 0's profile alone
    (at least 1; ``default`` when rank 0 measured nothing alone)."""
    alone = results[0]["alone"]
    together = statistics.mean(r["together"] for r in results.values())
    return max(1.0, together / alone) if alone > 0 else default


def fit_cpu_ratio(spec: str, results: dict[int, Any]) -> float:
    """``cpu_ratio`` of compressor ``spec``: the busiest rank's CPU in its collective, measured in the
    calibration's processes (:func:`dtrain.planning._probes.coding_cpu`), over the CPU that
    :func:`dtrain.perfmodel._traffic.compressed_traffic` counts on threads for the same gradient and
    shapes. 1.0 where the probe did not run (one rank, a large model, an older calibration).

    On threads of one process the count overstates what gloo processes spend on the same gradient
    (``benchmarks/coding_cpu.py`` compares the two); this ratio corrects it. The probe counts user-mode
    CPU only: the kernel's work on the calling thread is the sends, which the transfer terms already
    charge.
    """
    from dtrain.perfmodel._traffic import compressed_traffic

    probes = [r["coding_cpu"] for r in results.values() if r.get("coding_cpu", {}).get("cpu", {}).get(spec)]
    if len(results) < 2 or not probes:
        return 1.0
    numel, shapes = int(probes[0]["numel"]), tuple(tuple(int(d) for d in sh) for sh in probes[0]["shapes"])
    counted = compressed_traffic(spec, len(results), numel, shapes)[2]
    real = max(float(p["cpu"][spec]) for p in probes)
    return real / counted if counted > 0 and real > 0 else 1.0
