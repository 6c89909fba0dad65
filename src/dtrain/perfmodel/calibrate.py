"""Calibration: measure a cluster and write its description (``dtrain bench calibrate``).

What is measured, and how (every figure is a median over repetitions):

1. **alpha, beta per level** -- ping-pong in disjoint pairs of ranks, one pair at
   a time (the others idle), over message sizes from 4 B upward (growing 4x
   until a round trip takes ~0.3 s or 16 MiB); one-way time = mean round trip / 2;
   then ``t = alpha + n * beta``: alpha from the small messages, beta a
   least-squares slope over the large ones (:func:`fit_alpha_beta`). The
   backend's own collectives are charged the same alpha (``native_latency``
   is left unset): their steps' contention is the floor's (see 4). The inter level
   is rank 0 <-> rank 1 on different hosts of an emulated cluster; the intra
   level is two processes of one machine over loopback. ``duplex_bandwidth``:
   every rank sends 256 KiB to 1 MiB (four sizes) to the next rank while
   receiving as much from the previous one (a ring step, the receive posted
   first); their bytes over their time.
   ``burst`` (an emulated cluster's token bucket) is taken from its tc settings.
2. **gamma** -- every worker at once times ``a += b`` on 4 MiB fp32 buffers:
   seconds per byte reduced, under the same contention as a real step.
3. **compute** -- worker 0 profiles the model alone (the median pass, as the
   planner measures), then all workers run training passes at once for a while;
   ``compute_scale`` = their mean pass / the profile (the hosts of an emulated
   cluster share this machine's cores, and a mean counts the passes that lost the
   CPU). ``flops`` = a 256x256 matmul's FLOP rate on one thread.
4. **wake, imbalance, floor** -- every rank runs steps without payload: the
   model's training pass, then a 4-byte allreduce handed to a second thread and
   back (a data-parallel step's pattern). ``imbalance`` is the slowest rank's pass
   minus a rank's own, per step (synchronous strategies wait for it); the mean
   step beyond the slowest pass and the allreduce's own time (the shortest over
   ranks, timed in the same step), over the wake-ups the model charges one
   bucket, is ``wake`` (the scheduler's delays after compute and at each
   hand-off). ``floor`` is the backend's allreduce of
   1 KiB, every rank at once, over its ``2(P-1)`` steps: the least time of a
   collective's step on cores shared by more ranks than they can run at once.
   All about 0 on dedicated hosts.
5. **overhead** -- the training loop of ``dtrain run`` for one worker at the
   per-worker batch, in this process on one thread: its mean step minus the mean
   bare training pass is the loop's own bookkeeping per step (times ``compute_scale``).
6. **compressors** -- payload ratio and encode/decode time per byte of each spec.

The result is a cluster TOML (:mod:`dtrain.perfmodel.spec`), printed and written
to ``--out`` (default: ``~/.cache/dtrain/cluster-NAME.toml`` for an emulated
cluster, ``~/.cache/dtrain/local-HOST-wN.toml`` for this machine).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dtrain.errors import DTrainError
from dtrain.perfmodel._units import format_rate, format_time
from dtrain.perfmodel.spec import ClusterSpec, CompressorCost, Device, Link, dump_cluster, load_cluster, this_host

__all__ = ["main", "fit_alpha_beta", "trimmed_mean", "calibrate_cluster", "refresh_load", "calibrate_local",
           "local_cluster",
           "cache_dir", "cluster_file"]  # fmt: skip

# the floor's probe: 1 KiB, a few bytes in every rank's segment but latency-bound at any link rate
_FLOOR_NUMEL = 256
_CAL_COMPRESSIONS = ("fp16", "powersgd:2", "qsgd", "onebit", "topk:0.01")


def cache_dir() -> Path:
    return Path(os.environ.get("DTRAIN_CACHE", Path.home() / ".cache" / "dtrain"))


def cluster_file(name: str) -> Path:
    """Where the calibration of emulated cluster ``name`` is kept."""
    return cache_dir() / f"cluster-{name}.toml"


def trimmed_mean(xs: Sequence[float], cut: float = 0.1) -> float:
    """Mean without the largest ``cut`` fraction: counts the common delays, not a rare stall."""
    v = sorted(xs)
    keep = v[: max(1, int(round(len(v) * (1 - cut))))]
    return float(sum(keep) / len(keep))


def fit_alpha_beta(sizes: Sequence[float], times: Sequence[float], *, small: float = 1024,
                   large: float = 256 * 1024) -> tuple[float, float]:  # fmt: skip
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


# ---------------------------------------------------------------------- worker side


def _pingpong(peer: int, me: int, max_rtt: float, reps: int, max_size: int = 16 << 20) -> list[tuple[int, float]]:
    """(bytes, mean one-way seconds) per message size, growing 4x from 4 B.

    A mean, not the median: a step pays every message's latency, so the common
    slow ones (a busy machine's scheduling delays) count in proportion; the
    slowest 10% are cut (:func:`trimmed_mean`) so that one stall does not decide.
    Small messages get ``4 * reps`` round trips, since their latency is noisier.
    """
    import torch.distributed as dist

    out = []
    size = 4
    while size <= max_size:
        buf = torch.zeros(size // 4)
        times = []
        n = 12 * reps if size <= 1024 else (4 * reps if size <= 64 << 10 else reps)
        for r in range(n + 1):
            t0 = time.perf_counter()
            if me < peer:
                dist.send(buf, peer)
                dist.recv(buf, peer)
            else:
                dist.recv(buf, peer)
                dist.send(buf, peer)
            if r:
                times.append((time.perf_counter() - t0) / 2)
        one_way = trimmed_mean(times)
        out.append((size, one_way))
        # both sides must agree to go on: the initiator decides and tells the peer
        flag = torch.tensor([1.0 if 2 * one_way < max_rtt and size < max_size else 0.0])
        if me < peer:
            dist.send(flag, peer)
        else:
            dist.recv(flag, peer)
        if flag.item() == 0.0:
            break
        size *= 4
    return out


def _sync_steps(model_name: str, dataset: str, batch: int, steps: int) -> dict[str, float]:
    """Synchronous steps without payload: a training pass, then a 4-byte allreduce on a second thread.

    Every rank runs the model's training pass and then hands a 4-byte tensor to a
    second thread, which allreduces it with the backend and hands it back -- the
    pattern of a data-parallel step (hooks hand the bucket to the communication
    thread; the first message follows a burst of compute) with nothing to move.
    Returns the means of the step, of this rank's pass, of the slowest rank's
    pass in the same step (on cores shared by several ranks the passes differ
    from step to step, and a synchronous step waits for the slowest) and of the
    step's shortest allreduce over ranks, timed on the thread that runs it: the
    last rank to arrive waits for nobody, so its allreduce is the collective's
    own time in that step.
    """
    from concurrent.futures import ThreadPoolExecutor

    import torch.distributed as dist
    from torch import nn

    from dtrain.workload import load_model

    model, (x, y), _ = load_model(model_name, dataset, batch=batch)
    opt = torch.optim.SGD(model.parameters(), lr=0.0, momentum=0.9)
    t = torch.zeros(1)

    def allreduce() -> float:
        t0 = time.perf_counter()
        dist.all_reduce(t)
        return time.perf_counter() - t0

    step_s, rows = [], []
    with ThreadPoolExecutor(1) as pool:
        for i in range(steps + 3):
            t0 = time.perf_counter()
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            t1 = time.perf_counter()
            coll = pool.submit(allreduce).result()
            if i >= 3:  # warm-up
                step_s.append(time.perf_counter() - t0)
                rows.append((t1 - t0, -coll))
    per_step = torch.tensor(rows, dtype=torch.float64)
    mine = per_step[:, 0].mean()
    dist.all_reduce(per_step, op=dist.ReduceOp.MAX)  # the slowest pass, the shortest allreduce
    return {"step": float(statistics.mean(step_s)), "pass": float(mine), "slowest": float(per_step[:, 0].mean()),
            "collective": float(-per_step[:, 1].mean())}  # fmt: skip


def _train_passes(model: Any, sample: Any, seconds: float) -> float:
    """Mean wall time of forward+backward+SGD step passes run back to back for ``seconds``.

    The mean over a window, not the median of a few passes: on shared cores a
    pass that loses the CPU takes far longer, and a step pays that as often as it
    happens.
    """
    from torch import nn

    opt = torch.optim.SGD(model.parameters(), lr=0.0, momentum=0.9)
    x, y = sample
    n, t0 = 0, time.perf_counter()
    while n < 3 or time.perf_counter() - t0 < seconds:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        n += 1
    return (time.perf_counter() - t0) / n


def _compute_alone_and_together(model_name: str, dataset: str, batch: int, reps: int) -> dict[str, float]:
    """Rank 0's profile alone (median, as the planner measures) and every rank's mean pass, all at once."""
    import torch.distributed as dist

    from dtrain.perfmodel.profile import profile_model
    from dtrain.workload import load_model

    model, sample, _ = load_model(model_name, dataset, batch=batch)
    _train_passes(model, sample, 0.05)  # warm-up
    alone = 0.0
    dist.barrier()
    if dist.get_rank() == 0:
        p = profile_model(model, sample, name=model_name, repeats=reps, warmup=2)
        alone = p.fwd_s + p.bwd_s + p.optimizer_s
    dist.barrier()
    together = _train_passes(model, sample, 0.1 * reps)
    dist.barrier()
    return {"alone": alone, "together": together}


def _gamma(reps: int) -> float:
    import torch.distributed as dist

    a, b = torch.ones(1 << 20), torch.ones(1 << 20)
    a.add_(b)
    dist.barrier()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        a.add_(b)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / (a.numel() * 4)


def _worker(pairs: list[tuple[int, int]], model_name: str, dataset: str, batch: int, quick: bool,
            load_only: bool = False) -> dict[str, Any]:  # fmt: skip
    """One process of a calibration job: ping-pong in its pair, duplex exchanges, gamma, compute, floor.

    ``load_only`` skips the link measurements (ping-pong, duplex exchange) and
    keeps what the load moves, for :func:`refresh_load`.
    """
    import torch.distributed as dist

    rank = dist.get_rank()
    reps = 3 if quick else 7
    torch.set_num_threads(1)
    out: dict[str, Any] = {"rank": rank}
    out.update(_compute_alone_and_together(model_name, dataset, batch, reps * 2))
    dist.barrier()
    if not load_only:
        # one pair at a time, the other ranks idle in the barrier: alpha and beta of an uncontended
        # link (contention is the floor's and wake's). All pairs at once, the small messages' median
        # came out at ~0.13 ms or ~1.85 ms from one calibration to the next on the emulated 1 Gbit cluster
        for a, b in pairs:
            if rank in (a, b):
                peer = b if rank == a else a
                out["pingpong"] = _pingpong(peer, rank, 0.3 if quick else 0.6, reps)
            dist.barrier()
        out["duplex"] = _duplex(reps)
    dist.barrier()
    out["sync"] = _sync_steps(model_name, dataset, batch, 50 * reps)
    dist.barrier()
    out["floor"] = _native_small(40 * reps, _FLOOR_NUMEL)
    out["gamma"] = _gamma(reps * 3)
    return out


def _duplex(reps: int, sizes: Sequence[int] = (256 << 10, 512 << 10, 768 << 10, 1 << 20)) -> list[tuple[int, float]]:
    """(size, median seconds) of ring exchanges: every rank sends ``size`` bytes to the next rank and
    receives as many from the previous one, all at once, as a ring step does (at least 5 each)."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    out = []
    for size in sizes:
        a, b = torch.zeros(size // 4), torch.zeros(size // 4)
        times = []
        dist.barrier()
        for i in range(max(5, reps) + 1):
            t0 = time.perf_counter()
            works = [dist.irecv(b, left), dist.isend(a, right)]  # the receive first, as the algorithms post it
            for w in works:
                if w is not None:  # None only for a rank outside the group
                    w.wait()
            if i:  # the first one warms the connection up
                times.append(time.perf_counter() - t0)
        out.append((size, float(statistics.median(times))))
    return out


def _duplex_rate(results: dict[int, Any], one_way: Link) -> float | None:
    """Bytes per second each way in ring exchanges: the bytes of one exchange of each size over the
    sum of the sizes' medians over ranks (at most the one-way rate; None when there is no exchange).

    Medians, not means: with the mean of 3 exchanges per rank one calibration at
    50 Mbit/s gave 35.1 Mbit/s against 44.5-46.6 in three others. Throughput over
    all the sizes, not the slope between two: on 4 emulated 50 Mbit hosts, six
    rounds of exchanges of 256 KiB to 1 MiB gave 42.4-45.0 Mbit/s this way, 40.5-48.9
    as the slope between 256 KiB and 1 MiB (one calibration gave 39.5). It counts
    each exchange's own start-up, as a ring step pays it.
    """
    by_size: dict[int, list[float]] = {}
    for r in results.values():
        for size, t in r.get("duplex", []):
            by_size.setdefault(size, []).append(t)
    if not by_size:
        return None
    seconds = sum(statistics.median(ts) for ts in by_size.values())
    return min(one_way.bandwidth, sum(by_size) / seconds) if seconds > 0 else one_way.bandwidth


def _native_small(reps: int, numel: int) -> float:
    """Trimmed mean seconds of the backend's own allreduce of ``numel`` floats, every rank at once."""
    import torch.distributed as dist

    t = torch.ones(numel)
    dist.all_reduce(t)
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(t)
        times.append(time.perf_counter() - t0)
    return trimmed_mean(times)


def _pairs(world: int) -> list[tuple[int, int]]:
    """Disjoint neighbour pairs (0,1), (2,3), ...: on an emulated cluster each pair spans two hosts."""
    return [(i, i + 1) for i in range(0, world - 1, 2)]


# ---------------------------------------------------------------------- parent side


def _flops_rate() -> float:
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(256, 256), torch.randn(256, 256)
        a @ b
        times = []
        for _ in range(9):
            t0 = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - t0)
        return 2 * 256**3 / statistics.median(times)
    finally:
        torch.set_num_threads(old)


def _loop_overhead(model_name: str, dataset: str, batch: int, steps: int = 60, runs: int = 3) -> float:
    """Mean step of the training loop (one worker, this process, one thread) minus the mean bare pass;
    the median over ``runs`` such measurements.

    The loop runs here rather than through the launcher so that it gets one
    intra-op thread, as each worker of a job does; both are means, measured one
    right after the other, so a busy machine inflates both alike. The median of
    three: one lone measurement came out at 1.26 ms against 0.2-0.5 ms in the
    calibrations before and after it, and moved every prediction of that cluster.
    """
    import json

    from dtrain.config import RunConfig
    from dtrain.train import worker_main
    from dtrain.workload import load_model

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    overheads = []
    try:
        model, sample, _ = load_model(model_name, dataset, batch=batch)
        _train_passes(model, sample, 0.05)
        for _ in range(runs):
            bare = _train_passes(model, sample, 0.5)
            with tempfile.TemporaryDirectory() as d:
                cfg = RunConfig(model=model_name, dataset=dataset, workers=1, batch_size=batch, max_steps=steps,
                                epochs=1000, trace=False, progress=False, out=d, strategy="dp")  # fmt: skip
                worker_main(cfg.to_dict(), d)
                rows = [json.loads(x) for x in (Path(d) / "metrics.rank0.jsonl").read_text().splitlines()
                        if x.strip()]  # fmt: skip
            bare = (bare + _train_passes(model, sample, 0.5)) / 2
            dts = [batch / r["samples_per_s"] for r in rows[steps // 4 :]]
            overheads.append(max(0.0, float(statistics.mean(dts)) - bare))
    finally:
        torch.set_num_threads(old)
    return float(statistics.median(overheads))


def _wake(results: dict[int, Any]) -> float:
    """``wake``: what a payload-free synchronous step (:func:`_sync_steps`) costs beyond the slowest
    rank's pass and its allreduce's own time, per wake-up that the model charges such a step
    (:data:`dtrain.perfmodel.predict.WAKES_FIRST_BUCKET`).

    The allreduce is timed in the same steps (the shortest over ranks, per step).
    Subtracting one measured apart, back to back, the estimate moved between
    0.52 and 0.96 ms from one refresh to the next on the emulated 1 Gbit cluster
    (4 hosts on 2 cores) while the measured ring steps did not; timed in the
    steps, it stayed within 0.52-0.58 ms over six refreshes.
    """
    from dtrain.perfmodel.predict import WAKES_FIRST_BUCKET

    rs = [r["sync"] for r in results.values()]
    beyond = statistics.mean(float(r["step"]) - float(r["slowest"]) - float(r["collective"]) for r in rs)
    return max(0.0, beyond / WAKES_FIRST_BUCKET)


def _imbalance(results: dict[int, Any]) -> float:
    """``imbalance``: the slowest rank's pass minus a rank's own, per step (mean over steps and ranks)."""
    rs = list(results.values())
    if len(rs) < 2:
        return 0.0
    return max(0.0, statistics.mean(float(r["sync"]["slowest"]) - float(r["sync"]["pass"]) for r in rs))


def _floor(results: dict[int, Any]) -> float:
    """``floor``: the backend's allreduce of 1 KiB, every rank at once, over its ``2(P-1)`` steps (0 for one rank).

    Of 1 KiB, not of a single float, whose segments are empty on every rank but one.

    It is not also the backend's per-step latency (``native_latency``): a step's
    scheduling delays pass while its bytes are on the wire. Charged both ways
    (the floor as each of native's steps' alpha, and as its least time), native
    was overpredicted by 8.5-17.9% at 50 Mbit, where its training steps took as
    long as dtrain's ring's (48.9-50.3 ms against 49.4-50.1), and by 8.6-11.5% at
    1 Gbit (model_vs_measured, three runs).

    On 4 ranks sharing 2 cores, back to back, an allreduce of 64 or 256 floats
    took 4.4-4.9 ms and one of 16 KiB..300 KiB 4.6-7.1 ms, against 0.6-1.2 ms for
    one float (whose segments are empty on all ranks but one), over loopback and
    emulated links alike. In training steps on an emulated 1 Gbit cluster the
    150 KB CNN's ring allreduce took about those 6 steps' floor, recursive
    doubling's 2 steps their duplex transfer time, and the tree its one-way
    messages' time.
    """
    rs = [float(r["floor"]) for r in results.values() if "floor" in r]
    return float(statistics.mean(rs)) / (2 * (len(rs) - 1)) if len(rs) > 1 else 0.0


def _link(points: list[tuple[int, float]]) -> Link:
    """Fit one level from (size, one-way time) points (several pairs' points may be pooled)."""
    by_size: dict[int, list[float]] = {}
    for size, t in points:
        by_size.setdefault(size, []).append(t)
    sizes = sorted(by_size)
    alpha, beta = fit_alpha_beta(sizes, [statistics.mean(by_size[n]) for n in sizes])
    return Link(bandwidth=1.0 / beta, latency=alpha)


def _compressors(specs: Sequence[str]) -> dict[str, CompressorCost]:
    from dtrain.perfmodel.compression import measure_compressor

    out = {}
    for s in specs:
        ratio, enc, dec = measure_compressor(s)
        out[s] = CompressorCost(ratio=ratio, encode_s_per_byte=enc, decode_s_per_byte=dec)
    return out


def _assemble(name: str, nodes: int, per_node: int, inter: Link | None, intra: Link, results: dict[int, Any],
              flops: float, overhead_alone: float, compressions: Sequence[str]) -> ClusterSpec:  # fmt: skip
    alone = results[0]["alone"]
    together = statistics.mean(r["together"] for r in results.values())
    scale = max(1.0, together / alone) if alone > 0 else 1.0
    gamma = statistics.median(r["gamma"] for r in results.values())
    wake = _wake(results)
    floor = _floor(results)
    imbalance = _imbalance(results)
    device = Device(kind="cpu", flops=flops, memory=float(_memory_per_device(nodes * per_node)), gamma=gamma,
                    compute_scale=scale, host=this_host(), overhead=overhead_alone * scale, wake=wake,
                    floor=floor, imbalance=imbalance)  # fmt: skip
    return ClusterSpec(nodes=nodes, devices_per_node=per_node, inter=inter or intra, intra=intra, device=device,
                       compressors=_compressors(compressions), name=name)  # fmt: skip


def _memory_per_device(devices: int) -> int:
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover
        total = 8 << 30
    return int(total // max(1, devices))


def calibrate_cluster(
    name: str, *, model: str = "cnn", dataset: str = "digits", batch: int = 64, quick: bool = False,
    compressions: Sequence[str] = _CAL_COMPRESSIONS,
) -> ClusterSpec:  # fmt: skip
    """Calibrate emulated cluster ``name`` (one process per host; intra level measured locally)."""
    from dtrain.cluster import load, run_on_cluster
    from dtrain.cluster.netns import tbf_burst
    from dtrain.launch import launch

    c = load(name)
    per_worker = max(1, batch // c.hosts)
    res = run_on_cluster(_worker, (_pairs(c.hosts), model, dataset, per_worker, quick), cluster=c, timeout_s=600)
    inter = _link([pt for r in res.values() if "pingpong" in r for pt in r["pingpong"]])
    inter = replace(inter, duplex_bandwidth=_duplex_rate(res, inter),
                    burst=float(tbf_burst(c.rate_bps, c.mtu)))  # the emulation's token bucket: known, not fitted
    local = launch(_worker, (_pairs(2), model, dataset, per_worker, True), nprocs=2, threads=1)
    intra = _link(local[0]["pingpong"])
    intra = replace(intra, duplex_bandwidth=_duplex_rate(local, intra))
    overhead = _loop_overhead(model, dataset, per_worker)
    spec = _assemble(name, c.hosts, 1, inter, intra, res, _flops_rate(), overhead, compressions)
    return spec


def refresh_load(spec: ClusterSpec, name: str, *, model: str = "cnn", dataset: str = "digits",
                 batch: int = 64) -> ClusterSpec:  # fmt: skip
    """Re-measure what the machine's load moves -- wake, floor, compute scale -- keeping the links.

    On an emulated cluster whose cores are shared with other work, scheduling
    delays and compute change from minute to minute while the shaped links do
    not; this takes ~10 s instead of a full calibration. The device's ``wake``,
    ``floor``, ``imbalance`` and ``compute_scale`` are replaced; ``overhead`` is
    rescaled; the compressed collectives' counted CPU time
    (:func:`dtrain.perfmodel.compression.compressed_traffic`) is forgotten, to be
    counted again when next predicted (kept, one count at the 1 Gbit phase's
    start put topk:0.01 at 2.5 ms of CPU through the 50 Mbit phase, +25.6%).

    The ping-pong alpha is kept: re-measured alone it came out at either ~0.13 ms
    or ~1.85 ms on the emulated 1 Gbit cluster (medians of every pair's small
    messages, six refreshes), whatever the load, and one such refresh took every
    prediction with it.
    """
    from dtrain.cluster import load, run_on_cluster
    from dtrain.perfmodel.compression import compressed_traffic

    compressed_traffic.cache_clear()  # the compressed collectives' CPU time is counted again when next asked
    c = load(name)
    per_worker = max(1, batch // c.hosts)
    res = run_on_cluster(_worker, (_pairs(c.hosts), model, dataset, per_worker, True, True), cluster=c,
                         timeout_s=600)  # fmt: skip
    alone = res[0]["alone"]
    together = statistics.mean(r["together"] for r in res.values())
    scale = max(1.0, together / alone) if alone > 0 else spec.device.compute_scale
    old = spec.device
    device = replace(old, compute_scale=scale, wake=_wake(res), floor=_floor(res), imbalance=_imbalance(res),
                     overhead=old.overhead / old.compute_scale * scale)  # fmt: skip
    return replace(spec, device=device)


def calibrate_local(
    workers: int = 4, *, model: str = "cnn", dataset: str = "digits", batch: int = 64, quick: bool = True,
    compressions: Sequence[str] = _CAL_COMPRESSIONS,
) -> ClusterSpec:  # fmt: skip
    """Calibrate this machine for ``workers`` local processes (one node; loopback is the only level)."""
    from dtrain.launch import launch

    per_worker = max(1, batch // workers)
    res = launch(_worker, (_pairs(workers), model, dataset, per_worker, quick), nprocs=workers, threads=1)
    intra = _link([pt for r in res.values() if "pingpong" in r for pt in r["pingpong"]])
    intra = replace(intra, duplex_bandwidth=_duplex_rate(res, intra))
    overhead = _loop_overhead(model, dataset, per_worker)
    return _assemble(f"local-{this_host()}", 1, workers, None, intra, res, _flops_rate(), overhead, compressions)


def local_cluster(workers: int | None = None, *, refresh: bool = False) -> ClusterSpec:
    """This machine's description for ``workers`` local processes, from the cache or a quick calibration."""
    w = workers or 4
    path = cache_dir() / f"local-{this_host()}-w{w}.toml"
    if path.exists() and not refresh:
        return load_cluster(path)
    print(f"dtrain: calibrating this machine for {w} local processes (once; cached in {path}) ...", file=sys.stderr)
    spec = calibrate_local(w)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dump_cluster(spec, comment=f"dtrain bench calibrate --workers {w} ({time.ctime()})"))
    return spec


def summary(spec: ClusterSpec) -> str:
    d = spec.device
    native = "" if spec.inter.native_latency is None else f" (backend's own {format_time(spec.inter.native_latency)})"
    lines = [
        spec.describe(),
        f"  inter: alpha {format_time(spec.inter.alpha)}{native}, "
        f"bandwidth {format_rate(spec.inter.bandwidth)}, "
        f"sending and receiving at once {format_rate(spec.inter.duplex_bandwidth or spec.inter.bandwidth)}",
        f"  intra: alpha {format_time(spec.intra.alpha)}, bandwidth {format_rate(spec.intra.bandwidth)}",
        f"  device: {d.flops / 1e9:.3g} GFLOP/s (1 thread), gamma {d.gamma * 1e9:.3g} ns/byte, "
        f"compute x{d.compute_scale:.2f} when all compute at once, loop overhead {format_time(d.overhead)}/step, "
        f"wake {format_time(d.wake)}, floor {format_time(d.floor)} per collective step, "
        f"slowest pass +{format_time(d.imbalance)}",
    ]
    for s, cc in spec.compressors.items():
        lines.append(f"  {s}: ratio {cc.ratio:.4g}, encode {cc.encode_s_per_byte * 1e9:.3g} ns/B, "
                     f"decode {cc.decode_s_per_byte * 1e9:.3g} ns/B")  # fmt: skip
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dtrain bench calibrate",
                                 description="Measure alpha/beta per level, gamma, compute and loop overhead; "
                                             "write a cluster TOML.")  # fmt: skip
    ap.add_argument("--cluster", default="", help="emulated cluster name (default: this machine's local processes)")
    ap.add_argument("--workers", type=int, default=4, help="local processes (without --cluster; default: 4)")
    ap.add_argument("--model", default="cnn", help="model whose compute rate to measure (default: cnn)")
    ap.add_argument("--dataset", default="digits", help="dataset giving the input shape (default: digits)")
    ap.add_argument("--batch", type=int, default=64, help="global batch (default: 64)")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--out", default="", help="where to write the TOML (default: the cache)")
    ns = ap.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        t0 = time.perf_counter()
        if ns.cluster:
            spec = calibrate_cluster(ns.cluster, model=ns.model, dataset=ns.dataset, batch=ns.batch, quick=ns.quick)
            path = Path(ns.out) if ns.out else cluster_file(ns.cluster)
            spec = replace(spec, name=ns.cluster)
        else:
            spec = calibrate_local(ns.workers, model=ns.model, dataset=ns.dataset, batch=ns.batch, quick=ns.quick)
            path = Path(ns.out) if ns.out else cache_dir() / f"local-{this_host()}-w{ns.workers}.toml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(dump_cluster(spec, comment=f"dtrain bench calibrate {' '.join(argv or sys.argv[1:])} "
                                                   f"({time.ctime()})"))  # fmt: skip
        print(summary(spec))
        print(f"wrote {path} ({time.perf_counter() - t0:.0f} s)")
        return 0
    except DTrainError as e:
        print(f"dtrain bench calibrate: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    # run the importable module's main, so worker functions pickle as dtrain.perfmodel.calibrate.*, not __main__.*
    from dtrain.perfmodel.calibrate import main as _main

    sys.exit(_main())
