"""The calibration's probes: what each process of a calibration job measures (:func:`calibration_worker`).

Every function here runs inside a launched worker (``torch.distributed`` is
initialised) except :func:`train_passes`, which the parent's loop-overhead
measurement uses too. :mod:`dtrain.planning.calibrate` starts the processes and
:mod:`dtrain.perfmodel.fit` turns what they return into a cluster description.
The worker is a module-level function of this importable module, so it pickles
as ``dtrain.planning._probes.calibration_worker`` however the calibration was started.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from dtrain.measure.p2p import round_trip
from dtrain.perfmodel.fit import trimmed_mean

__all__ = [
    "FLOOR_NUMEL",
    "calibration_worker",
    "pingpong",
    "duplex",
    "sync_steps",
    "train_passes",
    "compute_alone_and_together",
    "gamma",
    "native_small",
    "coding_cpu",
]

# the coding probe runs on gradients of up to this many floats (larger models: not measured, ratio 1)
CODING_MAX_NUMEL = 4 << 20
# ... called until each rank has spent this much CPU in a compressor's calls (its user share is
# sampled by the tick), in at most so many calls
CODING_SHARE_CPU = 0.2
CODING_SHARE_CALLS = 200

# the floor's probe: 1 KiB, a few bytes in every rank's segment but latency-bound at any link rate
FLOOR_NUMEL = 256


def pingpong(peer: int, me: int, max_rtt: float, reps: int, max_size: int = 16 << 20) -> list[tuple[int, float]]:
    """(bytes, mean one-way seconds) per message size, growing 4x from 4 B.

    A mean, not the median: a step pays every message's latency, so the common
    slow ones (a busy machine's scheduling delays) count in proportion; the
    slowest 10% are cut (:func:`~dtrain.perfmodel.fit.trimmed_mean`) so that one stall does not decide.
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
            rt = round_trip("native", None, buf, peer, me < peer)
            if r:
                times.append(rt / 2)
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


def sync_steps(model_name: str, dataset: str, batch: int, steps: int) -> dict[str, float]:
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

    from dtrain.workloads.load import load_model
    from dtrain.workloads.models import task_loss

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
            task_loss(model(x), y).backward()
            opt.step()
            t1 = time.perf_counter()
            coll = pool.submit(allreduce).result()
            if i >= 3:  # warm-up
                step_s.append(time.perf_counter() - t0)
                rows.append((t1 - t0, -coll))
    per_step = torch.tensor(rows, dtype=torch.float64)
    mine = per_step[:, 0].mean()
    dist.all_reduce(per_step, op=dist.ReduceOp.MAX)  # the slowest pass, the shortest allreduce
    return {
        "step": float(statistics.mean(step_s)),
        "pass": float(mine),
        "slowest": float(per_step[:, 0].mean()),
        "collective": float(-per_step[:, 1].mean()),
    }


def train_passes(model: Any, sample: Any, seconds: float) -> float:
    """Mean wall time of forward+backward+SGD step passes run back to back for ``seconds``.

    The mean over a window, not the median of a few passes: on shared cores a
    pass that loses the CPU takes far longer, and a step pays that as often as it
    happens.
    """
    from dtrain.workloads.models import task_loss

    opt = torch.optim.SGD(model.parameters(), lr=0.0, momentum=0.9)
    x, y = sample
    n, t0 = 0, time.perf_counter()
    while n < 3 or time.perf_counter() - t0 < seconds:
        opt.zero_grad()
        task_loss(model(x), y).backward()
        opt.step()
        n += 1
    return (time.perf_counter() - t0) / n


def compute_alone_and_together(model_name: str, dataset: str, batch: int, reps: int) -> dict[str, float]:
    """Rank 0's profile alone (median, as the planner measures, at this process's intra-op threads) and every
    rank's mean pass, all at once."""
    import torch.distributed as dist

    from dtrain.perfmodel.profile import profile_model
    from dtrain.workloads.load import load_model

    model, sample, _ = load_model(model_name, dataset, batch=batch)
    train_passes(model, sample, 0.05)  # warm-up
    alone = 0.0
    dist.barrier()
    if dist.get_rank() == 0:
        p = profile_model(model, sample, name=model_name, repeats=reps, warmup=2, threads=torch.get_num_threads())
        alone = p.fwd_s + p.bwd_s + p.optimizer_s
    dist.barrier()
    together = train_passes(model, sample, 0.1 * reps)
    dist.barrier()
    return {"alone": alone, "together": together}


def gamma(reps: int) -> float:
    """Median seconds per byte of ``a += b`` on 4 MiB fp32 buffers, every rank at once."""
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


def calibration_worker(
    pairs: list[tuple[int, int]],
    model_name: str,
    dataset: str,
    batch: int,
    quick: bool,
    load_only: bool = False,
    compressors: Sequence[str] = (),
    threads: int = 1,
) -> dict[str, Any]:
    """One process of a calibration job: ping-pong in its pair, duplex exchanges, gamma, compute, floor,
    and each of ``compressors``' CPU in its collective (:func:`coding_cpu`).

    ``load_only`` skips the ping-pong and keeps what the load moves (the duplex
    exchange among them), for :func:`dtrain.planning.calibrate.refresh_load`. ``threads``: the intra-op
    threads each worker of the job being calibrated for computes with.
    """
    import torch.distributed as dist

    rank = dist.get_rank()
    reps = 3 if quick else 7
    torch.set_num_threads(threads)
    out: dict[str, Any] = {"rank": rank}
    out.update(compute_alone_and_together(model_name, dataset, batch, reps * 2))
    dist.barrier()
    if not load_only:
        # one pair at a time, the other ranks idle in the barrier: alpha and beta of an uncontended
        # link (contention is the floor's and wake's). All pairs at once, the small messages' median
        # came out at ~0.13 ms or ~1.85 ms from one calibration to the next on the emulated 1 Gbit cluster
        for a, b in pairs:
            if rank in (a, b):
                peer = b if rank == a else a
                out["pingpong"] = pingpong(peer, rank, 0.3 if quick else 0.6, reps)
            dist.barrier()
    out["duplex"] = duplex(reps)
    dist.barrier()
    out["sync"] = sync_steps(model_name, dataset, batch, 50 * reps)
    dist.barrier()
    out["floor"] = native_small(40 * reps, FLOOR_NUMEL)
    dist.barrier()
    out["p2p_floor"] = native_small(40 * reps, FLOOR_NUMEL, algorithm="ring")
    out["gamma"] = gamma(reps * 3)
    if compressors:
        dist.barrier()
        out["coding_cpu"] = coding_cpu(model_name, dataset, compressors, 2 * reps)
    return out


def coding_cpu(model_name: str, dataset: str, specs: Sequence[str], reps: int) -> dict[str, Any]:
    """This rank's user-mode CPU seconds in each compressor's allreduce of the model's gradient, called
    with its parameter shapes as the data-parallel reducer calls it. Also ``numel`` and ``shapes``, for
    the thread count to compare with (:func:`dtrain.perfmodel._traffic.compressed_traffic`), and
    ``user_share`` and ``calls`` per compressor. Empty for gradients over :data:`CODING_MAX_NUMEL` floats.

    A call's CPU is its ``time.thread_time`` (no waiting), the median of at least ``reps`` calls, times
    the share of user time in all the calls' CPU (the thread's ``getrusage``). The kernel's time on the
    calling thread is the sends (and, over veth, the receiving stack's), which the transfer terms already
    hold: counted as coding it would charge them twice. Linux splits a thread's CPU into user and system by
    sampling the scheduler tick (milliseconds), so the calls
    go on until every rank has spent :data:`CODING_SHARE_CPU` seconds (at most
    :data:`CODING_SHARE_CALLS` calls; the count is agreed by an allreduce, as the calls are collective).
    """
    import resource

    import torch.distributed as dist

    from dtrain.comm.allreduce import get_transport
    from dtrain.compress import from_spec
    from dtrain.compress.reduce import compressed_allreduce
    from dtrain.workloads.load import load_model

    model, _, _ = load_model(model_name, dataset, batch=1)
    shapes = [tuple(int(d) for d in p.shape) for p in model.parameters() if p.requires_grad]
    numel = sum(math.prod(sh) for sh in shapes)
    if numel > CODING_MAX_NUMEL:
        return {}
    t = get_transport()
    x = torch.randn(numel, generator=torch.Generator().manual_seed(dist.get_rank()))
    cpu: dict[str, float] = {}
    share: dict[str, float] = {}
    made: dict[str, int] = {}
    first = max(3, reps)
    for spec in specs:
        comp, layout = from_spec(spec), [list(sh) for sh in shapes]
        compressed_allreduce(x.clone(), comp, "calibration", t, algorithm="ring", shapes=layout)  # warm-up
        times: list[float] = []
        user = system = 0.0
        calls = first
        while len(times) < calls:
            dist.barrier()
            r0, c0 = resource.getrusage(resource.RUSAGE_THREAD), time.thread_time()
            compressed_allreduce(x.clone(), comp, "calibration", t, algorithm="ring", shapes=layout)
            c1, r1 = time.thread_time(), resource.getrusage(resource.RUSAGE_THREAD)
            times.append(c1 - c0)
            user += r1.ru_utime - r0.ru_utime
            system += r1.ru_stime - r0.ru_stime
            if len(times) == first:
                per_call = max(statistics.median(times), 1e-6)
                want = torch.tensor([min(CODING_SHARE_CALLS, math.ceil(CODING_SHARE_CPU / per_call))])
                dist.all_reduce(want, op=dist.ReduceOp.MAX)
                calls = max(first, int(want.item()))
        share[spec] = user / (user + system) if user + system > 0 else 1.0
        made[spec] = len(times)
        cpu[spec] = float(statistics.median(times)) * share[spec]
    return {"numel": numel, "shapes": [list(sh) for sh in shapes], "cpu": cpu, "user_share": share, "calls": made}


def duplex(reps: int, sizes: Sequence[int] = (256 << 10, 512 << 10, 768 << 10, 1 << 20)) -> list[tuple[int, float]]:
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


def native_small(reps: int, numel: int, algorithm: str = "native") -> float:
    """Trimmed mean seconds of an allreduce of ``numel`` floats, every rank at once: the backend's
    own (``native``) or one of dtrain's algorithms (the p2p floor's probe)."""
    import torch.distributed as dist

    from dtrain.comm.allreduce import allreduce

    def reduce(t: torch.Tensor) -> None:
        if algorithm == "native":
            dist.all_reduce(t)
        else:
            allreduce(t, algorithm=algorithm)

    t = torch.ones(numel)
    reduce(t)
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        reduce(t)
        times.append(time.perf_counter() - t0)
    return trimmed_mean(times)
