"""Calibration: measure a cluster and write its description (``dtrain bench calibrate``).

What is measured, and how (every figure is a median over repetitions):

1. **alpha, beta per level** -- ping-pong in disjoint pairs of ranks, one pair at
   a time (the others idle), over message sizes from 4 B upward (growing 4x
   until a round trip takes ~0.3 s or 16 MiB); one-way time = mean round trip / 2;
   then ``t = alpha + n * beta``: alpha from the small messages, beta a
   least-squares slope over the large ones (:func:`~dtrain.perfmodel.fit.fit_alpha_beta`). The
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
7. **load** -- what other processes took of the machine in a second before and one after
   (:mod:`dtrain.planning.load`): the ``[calibrated]`` table, which :func:`local_cluster` reads
   before reusing a cached calibration.

The result is a cluster TOML (:mod:`dtrain.perfmodel.spec`), printed and written
to ``--out`` (default: ``~/.cache/dtrain/cluster-NAME.toml`` for an emulated
cluster, ``~/.cache/dtrain/local-HOST-wN.toml`` for this machine).

This module starts the processes and measures in this one (the loop overhead,
the FLOP rate, the compressors); what each process of the job measures is
:mod:`dtrain.planning._probes`, and the arithmetic that turns the measurements
into the description's terms is :mod:`dtrain.perfmodel.fit` (pure).
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

import torch

from dtrain.errors import DTrainError
from dtrain.perfmodel.fit import (
    fit_compute_scale,
    fit_cpu_ratio,
    fit_duplex_rate,
    fit_floor,
    fit_imbalance,
    fit_link,
    fit_p2p_floor,
    fit_wake,
)
from dtrain.perfmodel.spec import (
    LOADED_CORES,
    ClusterSpec,
    CompressorCost,
    Device,
    Link,
    dump_cluster,
    load_cluster,
    this_host,
)
from dtrain.perfmodel.units import format_rate, format_time
from dtrain.planning._probes import calibration_worker, train_passes
from dtrain.planning.load import load_around, others_cores

__all__ = [
    "main",
    "calibrate_cluster",
    "refresh_load",
    "pool_load",
    "calibrate_local",
    "local_cluster",
    "local_cores",
    "summary",
    "cache_dir",
    "cluster_file",
]

_CAL_COMPRESSIONS = ("fp16", "powersgd:2", "qsgd", "onebit", "topk:0.01")


def cache_dir() -> Path:
    return Path(os.environ.get("DTRAIN_CACHE", Path.home() / ".cache" / "dtrain"))


def cluster_file(name: str) -> Path:
    """Where the calibration of emulated cluster ``name`` is kept."""
    return cache_dir() / f"cluster-{name}.toml"


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


def _loop_overhead(
    model_name: str, dataset: str, batch: int, steps: int = 200, runs: int = 3, threads: int = 1
) -> float:
    """The training loop's own time a step (one worker, this process, ``threads`` intra-op threads): the wall
    time of ``dtrain run``'s loop a step, less the mean bare training pass; the median over ``runs``.

    A step's wall time is that of a run of ``steps + steps // 10`` steps less that of one of ``steps // 10``
    (their start-up and last evaluation alike), over the ``steps`` between: what a user's clock sees of a
    step, between one step's row and the next. The loop's own step timer (its rows' ``step_s``) leaves out
    the time between steps, which for a small model is a large share of its step. The loop runs here rather
    than through the launcher so that it gets the intra-op threads each worker of the job gets. The median
    of three: a lone measurement on a loaded machine can be several times the others, and it would move
    every prediction of that cluster.
    """
    from dtrain.config.schema import RunConfig
    from dtrain.job.run import worker_main
    from dtrain.workloads.load import load_model
    from dtrain.workloads.models import is_language_model

    def wall(n: int) -> float:
        with tempfile.TemporaryDirectory() as d:
            cfg = RunConfig(
                model=model_name,
                dataset="pytext" if is_language_model(model_name) else dataset,
                workers=1,
                batch_size=batch,
                max_steps=n,
                epochs=100000,
                eval_every=n,
                trace=False,
                progress=False,
                out=d,
                strategy="dp",
                eval_samples=64,
            )
            t0 = time.perf_counter()
            worker_main(cfg.to_dict(), d)
            return time.perf_counter() - t0

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    overheads, few = [], max(1, steps // 10)
    try:
        model, sample, _ = load_model(model_name, dataset, batch=batch)
        train_passes(model, sample, 0.05)
        wall(few)  # warm: the first run pays its imports
        for _ in range(runs):
            bare = train_passes(model, sample, 0.5)
            per_step = (wall(few + steps) - wall(few)) / steps
            bare = (bare + train_passes(model, sample, 0.5)) / 2
            overheads.append(max(0.0, per_step - bare))
    finally:
        torch.set_num_threads(old)
    return float(statistics.median(overheads))


def _compressors(specs: Sequence[str], results: dict[int, Any] | None = None) -> dict[str, CompressorCost]:
    from dtrain.perfmodel.compression import measure_compressor

    out = {}
    for s in specs:
        ratio, enc, dec = measure_compressor(s)
        out[s] = CompressorCost(
            ratio=ratio, encode_s_per_byte=enc, decode_s_per_byte=dec, cpu_ratio=fit_cpu_ratio(s, results or {})
        )
    return out


def _assemble(
    name: str,
    nodes: int,
    per_node: int,
    inter: Link | None,
    intra: Link,
    results: dict[int, Any],
    flops: float,
    overhead_alone: float,
    compressions: Sequence[str],
    threads: int = 1,
) -> ClusterSpec:
    scale = fit_compute_scale(results)
    gamma = statistics.median(r["gamma"] for r in results.values())
    wake = fit_wake(results)
    floor = fit_floor(results)
    imbalance = fit_imbalance(results)
    device = Device(
        kind="cpu",
        flops=flops,
        memory=float(_memory_per_device(nodes * per_node)),
        gamma=gamma,
        compute_scale=scale,
        host=this_host(),
        overhead=overhead_alone * scale,
        wake=wake,
        floor=floor,
        imbalance=imbalance,
        p2p_floor=fit_p2p_floor(results),
        threads=threads,
    )
    return ClusterSpec(
        nodes=nodes,
        devices_per_node=per_node,
        inter=inter or intra,
        intra=intra,
        device=device,
        compressors=_compressors(compressions, results),
        name=name,
    )


def _memory_per_device(devices: int) -> int:
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover
        total = 8 << 30
    return int(total // max(1, devices))


def calibrate_cluster(
    name: str,
    *,
    model: str = "cnn",
    dataset: str = "digits",
    batch: int = 64,
    quick: bool = False,
    compressions: Sequence[str] = _CAL_COMPRESSIONS,
) -> ClusterSpec:
    """Calibrate emulated cluster ``name`` (one process per host; intra level measured locally), recording the
    load it was made under."""
    spec, load = load_around(
        lambda: _calibrate_cluster(
            name, model=model, dataset=dataset, batch=batch, quick=quick, compressions=compressions
        )
    )
    return replace(spec, load=load)


def _calibrate_cluster(
    name: str, *, model: str, dataset: str, batch: int, quick: bool, compressions: Sequence[str]
) -> ClusterSpec:
    from dtrain.cluster import load, run_on_cluster
    from dtrain.cluster.netns import tbf_burst
    from dtrain.launch.agent import launch

    c = load(name)
    per_worker = max(1, batch // c.hosts)
    res = run_on_cluster(
        calibration_worker,
        (_pairs(c.hosts), model, dataset, per_worker, quick, False, tuple(compressions)),
        cluster=c,
        timeout_s=600,
    )
    inter = fit_link([pt for r in res.values() if "pingpong" in r for pt in r["pingpong"]])
    inter = replace(
        inter, duplex_bandwidth=fit_duplex_rate(res, inter), burst=float(tbf_burst(c.rate_bps, c.mtu))
    )  # the emulation's token bucket: known, not fitted
    local = launch(calibration_worker, (_pairs(2), model, dataset, per_worker, True), nprocs=2, threads=1)
    intra = fit_link(local[0]["pingpong"])
    intra = replace(intra, duplex_bandwidth=fit_duplex_rate(local, intra))
    overhead = _loop_overhead(model, dataset, per_worker)
    spec = _assemble(name, c.hosts, 1, inter, intra, res, _flops_rate(), overhead, compressions)
    return spec


def refresh_load(
    spec: ClusterSpec, name: str, *, model: str = "cnn", dataset: str = "digits", batch: int = 64
) -> ClusterSpec:
    """Re-measure what the machine's load moves -- wake, floor, compute scale, the duplex rate -- keeping
    the links' latency and one-way rate.

    On an emulated cluster whose cores are shared with other work, scheduling
    delays and compute change from minute to minute while the shaped links do
    not; this takes ~25 s instead of a full calibration. The device's ``wake``,
    ``floor``, ``imbalance`` and ``compute_scale`` are replaced; ``overhead`` is
    rescaled; the inter link's ``duplex_bandwidth`` (ring exchanges, every host
    sending and receiving at once) is measured again: whether more processes than
    cores keep both directions busy moves with the load, and every ring-based
    prediction with it; the compressed collectives' CPU time
    (:func:`dtrain.perfmodel.compression.compressed_traffic`) is counted once more when next
    predicted and the median of every count so far is used (a single count, from one moment's
    load, would move the predictions as much as the load does:
    :func:`dtrain.perfmodel.compression.recount_traffic`).

    The ping-pong alpha is kept: re-measured alone, the medians of every pair's small
    messages jump between two levels an order of magnitude apart whatever the load,
    and one such refresh would take every prediction with it.
    """
    from dtrain.cluster import load, run_on_cluster
    from dtrain.perfmodel.compression import recount_traffic

    recount_traffic()  # the compressed collectives' CPU time is counted once more when next asked
    c = load(name)
    per_worker = max(1, batch // c.hosts)
    res = run_on_cluster(
        calibration_worker, (_pairs(c.hosts), model, dataset, per_worker, True, True), cluster=c, timeout_s=600
    )
    scale = fit_compute_scale(res, default=spec.device.compute_scale)
    old = spec.device
    device = replace(
        old,
        compute_scale=scale,
        wake=fit_wake(res),
        floor=fit_floor(res),
        p2p_floor=fit_p2p_floor(res),
        imbalance=fit_imbalance(res),
        overhead=old.overhead / old.compute_scale * scale,
    )
    inter = replace(spec.inter, duplex_bandwidth=fit_duplex_rate(res, spec.inter) or spec.inter.duplex_bandwidth)
    return replace(spec, device=device, inter=inter)


def pool_load(specs: Sequence[ClusterSpec]) -> ClusterSpec:
    """The last of ``specs`` with each term :func:`refresh_load` re-measures replaced by its median over all of them.

    Where the emulated hosts share few cores, refreshes a minute apart read compute
    scales far apart, and a high reading need not come before slow steps: a refresh
    reads the load of its own ~20 s, not of the run after it. Pooled, a lone high or
    low reading no longer decides a prediction; a shift that lasts moves the median
    once it is in half the readings.
    """
    if not specs:
        raise ValueError("pool_load needs at least one cluster description")

    def median(values: Sequence[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return float(statistics.median(known)) if known else None

    devices = [s.device for s in specs]
    last = specs[-1]
    device = replace(
        last.device,
        compute_scale=median([d.compute_scale for d in devices]) or last.device.compute_scale,
        wake=median([d.wake for d in devices]) or 0.0,
        floor=median([d.floor for d in devices]) or 0.0,
        p2p_floor=median([d.p2p_floor for d in devices]),
        imbalance=median([d.imbalance for d in devices]) or 0.0,
        overhead=median([d.overhead for d in devices]) or 0.0,
    )
    inter = replace(last.inter, duplex_bandwidth=median([s.inter.duplex_bandwidth for s in specs]))
    return replace(last, device=device, inter=inter)


def _say(progress: bool, text: str) -> None:
    if progress:
        print(f"dtrain: {text}", file=sys.stderr, flush=True)


def calibrate_local(
    workers: int = 4,
    *,
    model: str = "cnn",
    dataset: str = "digits",
    batch: int = 64,
    quick: bool = True,
    compressions: Sequence[str] = _CAL_COMPRESSIONS,
    progress: bool = False,
) -> ClusterSpec:
    """Calibrate this machine for ``workers`` local processes (one node; loopback is the only level), each
    with the intra-op threads ``dtrain run`` gives it (:func:`~dtrain.launch.agent.threads_per_worker`).

    One process has no link to measure and no one to share its cores with: its compute scale is 1, and
    only the loop's overhead and the FLOP rate are measured (in this process). The load it was made under is
    recorded (``spec.load``)."""
    spec, load = load_around(
        lambda: _calibrate_local(
            workers,
            model=model,
            dataset=dataset,
            batch=batch,
            quick=quick,
            compressions=compressions,
            progress=progress,
        )
    )
    return replace(spec, load=load)


def _calibrate_local(
    workers: int, *, model: str, dataset: str, batch: int, quick: bool, compressions: Sequence[str], progress: bool
) -> ClusterSpec:
    from dtrain.launch.agent import launch, threads_per_worker

    t0, threads = time.perf_counter(), threads_per_worker(workers)
    per_worker = max(1, batch // workers)
    if workers == 1:
        _say(progress, f"  1/1 the training loop's overhead at {threads} thread(s) ...")
        overhead = _loop_overhead(model, dataset, per_worker, threads=threads)
        device = Device(
            kind="cpu",
            flops=_flops_rate(),
            memory=float(_memory_per_device(1)),
            host=this_host(),
            overhead=overhead,
            threads=threads,
        )
        _say(progress, f"  done in {time.perf_counter() - t0:.0f} s")
        return ClusterSpec(nodes=1, devices_per_node=1, device=device, name=f"local-{this_host()}")
    _say(
        progress,
        f"  1/2 {workers} processes at {threads} thread(s) each: links, compute alone and together, "
        f"collectives' floors, compressors ...",
    )
    res = launch(
        calibration_worker,
        (_pairs(workers), model, dataset, per_worker, quick, False, tuple(compressions), threads),
        nprocs=workers,
        threads=threads,
    )
    intra = fit_link([pt for r in res.values() if "pingpong" in r for pt in r["pingpong"]])
    intra = replace(intra, duplex_bandwidth=fit_duplex_rate(res, intra))
    _say(progress, f"  2/2 the training loop's overhead ({time.perf_counter() - t0:.0f} s so far) ...")
    overhead = _loop_overhead(model, dataset, per_worker, threads=threads)
    spec = _assemble(
        f"local-{this_host()}", 1, workers, None, intra, res, _flops_rate(), overhead, compressions, threads=threads
    )
    _say(progress, f"  done in {time.perf_counter() - t0:.0f} s")
    return spec


def local_cores() -> int:
    """The cores this process may run on (its CPU affinity)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


_now_loaded: list[float | None] = []  # the others' load now, measured once a process (a plan asks per count)


def _others_now() -> float | None:
    if not _now_loaded:
        _now_loaded.append(others_cores(1.0))
    return _now_loaded[0]


def local_cluster(workers: int | None = None, *, refresh: bool = False) -> ClusterSpec:
    """This machine's description for ``workers`` local processes (default: one a core), from the cache or a
    quick calibration (saying what it measures as it goes).

    A cached calibration made under load (other processes took :data:`~dtrain.perfmodel.spec.LOADED_CORES`
    or more meanwhile) is made again when the machine is quiet now, and otherwise reused with a line on
    stderr saying what it was made under: its compute and scheduling terms describe the busy machine."""
    w = workers or local_cores()
    path = cache_dir() / f"local-{this_host()}-w{w}.toml"
    if path.exists() and not refresh:
        spec = load_cluster(path)
        if spec.load is None or not spec.load.loaded:
            return spec
        now = _others_now()
        if now is None or now >= LOADED_CORES:
            print(
                f"dtrain: note: this machine's calibration for {w} process(es) ({path}) was made while "
                f"{spec.load.describe()}; now {'unknown' if now is None else f'{now:.2f} cores are busy'}: "
                f"predictions assume a machine that busy (`dtrain bench calibrate --workers {w}` measures it "
                f"again)",
                file=sys.stderr,
            )
            return spec
        print(
            f"dtrain: this machine's calibration for {w} process(es) was made while {spec.load.describe()}; "
            f"it is quiet now ({now:.2f} cores busy): calibrating again",
            file=sys.stderr,
        )
    print(f"dtrain: calibrating this machine for {w} local process(es) (once; cached in {path})", file=sys.stderr)
    spec = calibrate_local(w, progress=True)
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
        f"wake {format_time(d.wake)}, floor {format_time(d.floor)} per collective step "
        f"(dtrain's own: {format_time(d.own_floor)}), "
        f"slowest pass +{format_time(d.imbalance)}",
    ]
    for s, cc in spec.compressors.items():
        lines.append(
            f"  {s}: ratio {cc.ratio:.4g}, encode {cc.encode_s_per_byte * 1e9:.3g} ns/B, "
            f"decode {cc.decode_s_per_byte * 1e9:.3g} ns/B, CPU in processes x{cc.cpu_ratio:.2f} "
            f"the thread count"
        )
    if spec.load is not None:
        lines.append(
            f"  calibrated while {spec.load.describe()}"
            + (": under load, a plan that reuses it says so" if spec.load.loaded else "")
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="dtrain bench calibrate",
        description="Measure alpha/beta per level, gamma, compute and loop overhead; write a cluster TOML.",
    )
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
        path.write_text(
            dump_cluster(spec, comment=f"dtrain bench calibrate {' '.join(argv or sys.argv[1:])} ({time.ctime()})")
        )
        print(summary(spec))
        print(f"wrote {path} ({time.perf_counter() - t0:.0f} s)")
        return 0
    except DTrainError as e:
        print(f"dtrain bench calibrate: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    # the workers run dtrain.planning._probes.calibration_worker, which pickles under that importable name
    # even when this file runs as __main__
    sys.exit(main())
