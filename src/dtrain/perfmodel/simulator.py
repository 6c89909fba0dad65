"""Event-driven replay of the cost model: stragglers, asynchrony, thousands of workers.

The closed forms of :mod:`dtrain.perfmodel.predict` assume every worker computes
equally fast. :func:`simulate` plays the same costs step by step with each
worker's compute time drawn from a :class:`Stragglers` distribution, and reports
throughput, scaling efficiency, waiting and (for asynchronous parameter-server
policies) the staleness of every applied gradient. With no stragglers it
reproduces the closed form exactly (tested).

Synchronous data parallel (``dp``/``ddp``), per step ``k``:

1. worker ``i`` starts at ``s_i`` and computes ``m_ik`` times slower than the
   profile; bucket ``j`` is ready on it at ``s_i + m_ik (fwd + ready_j)``;
2. the allreduce of bucket ``j`` starts when the last worker has it and the
   previous bucket is done: ``start_j = max(max_i ready_ij, end_{j-1})``;
3. worker ``i`` finishes at ``max(s_i + m_ik (fwd + bwd), end_last) + m_ik opt``
   and starts the next step there.

Parameter server (the ``S`` servers act as one, each holding ``1/S`` of every
push, pull and apply; costs from :func:`~dtrain.perfmodel.predict.ps_costs`):

* ``bsp``: a round starts its push when the last worker has computed, then the
  closed form's push, apply and pull phases follow; ``backup:b``: when the
  ``(N-b)``-th has (the late gradients are dropped and their workers restart from
  the new parameters with everyone else).
* ``asp``, ``ssp:s``, ``softsync:k``: discrete events in a priority queue.
  compute done -> push (the worker's own link, then the servers' inbound links,
  FIFO) -> apply (server CPU, FIFO; ``version += 1``; staleness = versions
  applied since the worker read its parameters) -> pull (servers' outbound
  links, FIFO) -> next compute. ``ssp:s`` holds a worker back while it is more
  than ``s`` steps ahead of the slowest; ``softsync:k`` applies one update per
  ``k`` pushes. Throughput is counted until the first worker has done all its
  steps, so a permanent straggler does not stretch the window.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import numpy as np

from dtrain.errors import ConfigError
from dtrain.perfmodel.collectives import CompressionModel
from dtrain.perfmodel.predict import (
    Strategy,
    bucket_collective,
    bucket_latency,
    buckets_of,
    compute_times,
    predict,
    ps_costs,
)
from dtrain.perfmodel.profile import ModelProfile
from dtrain.perfmodel.spec import ClusterSpec

__all__ = ["Stragglers", "SimResult", "simulate", "scaling_curve", "parse_policy"]


@dataclass(frozen=True)
class Stragglers:
    """How much slower than the profile each worker computes, step by step.

    Text forms (what ``--stragglers`` takes):
        ``none``; ``lognormal:S`` (multiplier ``exp(N(0,S^2) - S^2/2)``, mean 1);
        ``slow:F:X`` (a fraction ``F`` of the workers is always ``X`` times slower);
        ``random:P:X`` (each worker, each step, with probability ``P`` ``X`` times slower).
    """

    kind: str = "none"
    a: float = 0.0
    b: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in ("none", "lognormal", "slow", "random"):
            raise ConfigError(f"stragglers {self.kind!r} not known; use none, lognormal:S, slow:F:X or random:P:X")
        if self.kind in ("slow", "random") and not (0 <= self.a <= 1 and self.b >= 1):
            raise ConfigError(f"stragglers {self.kind}:{self.a}:{self.b}: need 0 <= fraction <= 1 and factor >= 1")
        if self.kind == "lognormal" and self.a < 0:
            raise ConfigError(f"lognormal sigma must be >= 0, got {self.a}")

    @classmethod
    def parse(cls, text: str) -> "Stragglers":
        parts = (text or "none").split(":")
        try:
            if parts[0] == "none":
                return cls()
            if parts[0] == "lognormal":
                return cls("lognormal", float(parts[1]))
            if parts[0] in ("slow", "random"):
                return cls(parts[0], float(parts[1]), float(parts[2]))
        except (IndexError, ValueError):
            pass
        raise ConfigError(f"cannot read stragglers {text!r}; use none, lognormal:0.1, slow:0.05:3 or random:0.01:5")

    def sample(self, rng: np.random.Generator, workers: int) -> np.ndarray:
        """Multipliers for one step of ``workers`` workers."""
        if self.kind == "none":
            return np.ones(workers)
        if self.kind == "lognormal":
            return np.exp(rng.normal(0.0, self.a, workers) - self.a**2 / 2)
        if self.kind == "slow":
            m = np.ones(workers)
            m[: int(math.ceil(self.a * workers))] = self.b
            return m
        return np.where(rng.random(workers) < self.a, self.b, 1.0)

    def __str__(self) -> str:
        if self.kind == "none":
            return "none"
        if self.kind == "lognormal":
            return f"lognormal:{self.a:g}"
        return f"{self.kind}:{self.a:g}:{self.b:g}"


@dataclass(frozen=True)
class SimResult:
    """What one simulation measured.

    Attributes:
        workers: training workers.
        strategy: its label.
        step_s: mean time per step (per worker iteration).
        samples_per_s: global throughput.
        efficiency: ``samples_per_s / (workers * one worker's samples/s alone)``.
        wait_frac: fraction of a worker's time spent not computing.
        staleness: histogram {staleness: count} of applied gradients (parameter server).
    """

    workers: int
    strategy: str
    step_s: float
    samples_per_s: float
    efficiency: float
    wait_frac: float
    staleness: dict[int, int] = field(default_factory=dict)

    @property
    def staleness_mean(self) -> float:
        n = sum(self.staleness.values())
        return sum(k * v for k, v in self.staleness.items()) / n if n else 0.0

    @property
    def staleness_max(self) -> int:
        return max(self.staleness, default=0)


def parse_policy(consistency: str) -> tuple[str, int]:
    """"bsp" -> ("bsp", 0); "ssp:3" -> ("ssp", 3); "softsync:2"; "backup:1"; "asp"."""
    name, _, arg = consistency.partition(":")
    if name in ("bsp", "asp"):
        return name, 0
    if name in ("ssp", "softsync", "backup"):
        try:
            k = int(arg)
        except ValueError:
            raise ConfigError(f"consistency {consistency!r} needs an integer, e.g. {name}:2") from None
        if k < (0 if name == "ssp" else 1):
            raise ConfigError(f"consistency {consistency!r}: the number must be >= {0 if name == 'ssp' else 1}")
        return name, k
    raise ConfigError(f"consistency {consistency!r} not known; use bsp, asp, ssp:S, softsync:K or backup:B")


def simulate(
    prof: ModelProfile,
    c: ClusterSpec,
    s: Strategy,
    *,
    comp: CompressionModel | None = None,
    stragglers: Stragglers = Stragglers(),
    steps: int = 30,
    seed: int = 0,
    overhead_s: float = 0.0,
) -> SimResult:
    """Replay ``steps`` steps of strategy ``s`` (see the module docstring).

    Args:
        prof: model profile at the per-worker batch.
        c: cluster; must hold ``s.processes`` devices (use ``c.with_devices``).
        s: the strategy.
        comp: compressor cost model when ``s.compression`` is set.
        stragglers: compute-time distribution.
        steps: steps per worker (the first is discarded as warm-up for sync DP).
        seed: random seed.
        overhead_s: fixed per-step overhead (as in :func:`~dtrain.perfmodel.predict.predict`).
    """
    if steps < 2:
        raise ConfigError(f"simulate needs steps >= 2, got {steps}")
    if s.processes > c.devices:
        raise ConfigError(f"{s.label()} needs {s.processes} processes; the cluster has {c.devices} devices")
    comp = comp or CompressionModel()
    rng = np.random.default_rng(seed)
    fwd, bwd, opt = compute_times(prof, c)
    alone = sum(fwd) + sum(bwd) + opt + overhead_s  # one worker, nothing to communicate
    if s.kind == "ps":
        return _simulate_ps(prof, c, s, comp, stragglers, steps, rng, fwd, bwd, opt, overhead_s, alone)
    return _simulate_sync(prof, c, s, comp, stragglers, steps, rng, fwd, bwd, opt, overhead_s, alone)


def _simulate_sync(
    prof: ModelProfile, c: ClusterSpec, s: Strategy, comp: CompressionModel, strag: Stragglers, steps: int,
    rng: np.random.Generator, fwd: list[float], bwd: list[float], opt: float, overhead: float, alone: float,
) -> SimResult:  # fmt: skip
    n = s.workers
    f = sum(fwd)
    ready = np.cumsum(bwd[::-1])[::-1] if bwd else np.zeros(0)  # ready[i]: backward done through layer i
    b_total = float(sum(bwd))
    algorithm = "native" if s.kind == "ddp" else s.algorithm
    buckets = []
    for j, (nbytes, first_layer) in enumerate(buckets_of(prof, s.bucket_mb) if n > 1 else []):
        comm, coding = bucket_collective(c, algorithm, nbytes, n, comp)
        wake = bucket_latency(c, s, comp, j)
        buckets.append((float(ready[first_layer]), comm + wake + coding + 2 * nbytes * c.device.gamma))
    if s.kind == "dp" and s.overlap == "forward" and n > 1:
        # priority scheduling: the closed form's period, compute stretched by the step's slowest worker
        base = predict(prof, c, s, comp if comp.kind != "dense" else None, overhead_s=overhead)
        comm_part = base.step_s - (f + b_total + opt + overhead)
        t_total = busy = 0.0
        for _ in range(steps):
            m = strag.sample(rng, n)
            t_total += float(m.max()) * (f + b_total + opt) + comm_part + overhead
            busy += float(np.mean(m)) * (f + b_total + opt)
        return _sync_result(s, prof, n, steps, t_total, busy, alone)
    start = np.zeros(n)
    busy = 0.0
    t_first = 0.0
    for k in range(steps):
        m = strag.sample(rng, n)
        end = 0.0
        for ready_j, dur in buckets:
            r = float(np.max(start + m * (f + ready_j)))
            end = max(r, end) + dur
        done = np.maximum(start + m * (f + b_total), end) + m * opt + overhead + c.device.imbalance
        busy += float(np.mean(m)) * (f + b_total + opt) * (k > 0)
        if k == 0:
            t_first = float(done.max())
        start = done
    t_total = float(start.max()) - t_first  # the first step is warm-up
    return _sync_result(s, prof, n, steps - 1, t_total, busy, alone)


def _sync_result(s: Strategy, prof: ModelProfile, n: int, steps: int, t_total: float, busy: float,
                 alone: float) -> SimResult:  # fmt: skip
    step_s = t_total / steps
    sps = prof.batch * n / step_s
    return SimResult(n, s.label(), step_s, sps, sps / (n * prof.batch / alone), max(0.0, 1 - busy / t_total))


def _simulate_ps(
    prof: ModelProfile, c: ClusterSpec, s: Strategy, comp: CompressionModel, strag: Stragglers, steps: int,
    rng: np.random.Generator, fwd: list[float], bwd: list[float], opt: float, overhead: float, alone: float,
) -> SimResult:  # fmt: skip
    N = s.workers
    policy, k = parse_policy(s.consistency)
    pc = ps_costs(prof, c, s, comp, opt)
    compute = sum(fwd) + sum(bwd)
    slow_count = int(math.ceil(strag.a * N)) if strag.kind == "slow" else 0

    if policy in ("bsp", "backup"):
        # a round ends when the (N-b)-th push is in; then apply, everyone pulls
        wait_for = N - (k if policy == "backup" else 0)
        if wait_for < 1:
            raise ConfigError(f"{s.consistency} with {N} workers waits for no one; use fewer backups")
        t = busy = 0.0
        for _ in range(steps):
            m = strag.sample(rng, N)
            t_in = float(np.sort(m * compute)[wait_for - 1])
            busy += float(np.mean(np.minimum(m * compute, t_in)))
            t += (t_in + c.device.imbalance + pc.coding + max(pc.floor, pc.push_all + N * pc.apply_one + pc.pull_all)
                  + overhead)  # fmt: skip
        step_s = t / steps
        sps = prof.batch * N / step_s
        return SimResult(N, s.label(), step_s, sps, sps / (N * prof.batch / alone), max(0.0, 1 - busy / t),
                         {0: steps * wait_for})  # fmt: skip

    # asynchronous policies: discrete events in time order; a cycle's push and pull take at least
    # the floor between them (as in predict)
    pad = max(0.0, pc.floor - (pc.push_one + pc.apply_one + pc.pull_one))
    version = 0
    clock = [0] * N  # pushes applied per worker
    read_version = [0] * N
    link_in = link_out = server_cpu = 0.0
    pending: list[int] = []  # softsync: pushes waiting to be applied together
    blocked: list[int] = []  # ssp: workers waiting for the slowest
    stale: dict[int, int] = {}
    busy = 0.0
    events: list[tuple[float, int, str, int]] = []
    seq = 0

    def schedule(t: float, kind: str, w: int) -> None:
        nonlocal seq
        heapq.heappush(events, (t, seq, kind, w))
        seq += 1

    def start_compute(t: float, w: int) -> None:
        nonlocal busy
        if strag.kind == "slow":
            m = strag.b if w < slow_count else 1.0
        else:
            m = float(strag.sample(rng, 1)[0])
        busy += m * compute
        schedule(t + m * compute + pc.coding, "pushed", w)

    def count(st: int) -> None:
        stale[st] = stale.get(st, 0) + 1

    for w in range(N):
        start_compute(0.0, w)
    t_end = 0.0
    pull_version = [0] * N
    applied_at: list[float] = []
    first_done = math.inf  # throughput is counted until the first worker finishes its steps
    while events:
        t, _, kind, w = heapq.heappop(events)
        if kind == "pushed":
            # the push crosses the worker's link, queues for the servers' inbound links, then their CPU
            arrive = max(t + pc.push_one, link_in + pc.in_per_push)
            link_in = arrive
            server_cpu = max(server_cpu, arrive) + pc.apply_one
            schedule(server_cpu, "applied", w)
            continue
        if kind == "applied":
            if policy == "softsync":
                pending.append(w)
                if len(pending) >= k:
                    for pw in pending:
                        count(version - read_version[pw])
                    version += 1
                    pending.clear()
            else:
                count(version - read_version[w])
                version += 1
            clock[w] += 1
            applied_at.append(t)
            pull_version[w] = version
            out = max(t + pc.pull_one, link_out + pc.out_per_pull)
            link_out = out
            schedule(out + pad + overhead, "pulled", w)
            continue
        read_version[w] = pull_version[w]  # pulled: the worker now holds these parameters
        t_end = max(t_end, t)
        if clock[w] >= steps:
            first_done = min(first_done, t)
        else:
            if policy == "ssp" and clock[w] - min(clock) > k:
                blocked.append(w)
            else:
                start_compute(t, w)
        if policy == "ssp" and blocked:
            low = min(clock)
            ready = [bw for bw in blocked if clock[bw] - low <= k]
            blocked = [bw for bw in blocked if clock[bw] - low > k]
            for bw in ready:
                start_compute(t, bw)
    window = min(first_done, t_end)
    updates = sum(1 for a in applied_at if a <= window)
    sps = prof.batch * updates / window
    step_s = prof.batch * N / sps  # mean time per step of one worker
    return SimResult(N, s.label(), step_s, sps, sps / (N * prof.batch / alone), max(0.0, 1 - busy / (N * t_end)),
                     dict(sorted(stale.items())))  # fmt: skip


def scaling_curve(
    prof_at: Callable[[int], ModelProfile],
    c: ClusterSpec,
    s: Strategy,
    workers: Sequence[int],
    *,
    comp: CompressionModel | None = None,
    stragglers: Stragglers = Stragglers(),
    steps: int = 20,
    seed: int = 0,
    overhead_s: float = 0.0,
) -> list[SimResult]:
    """Simulate ``s`` for each worker count (the cluster grows node by node to fit).

    Args:
        prof_at: per-worker profile for a worker count (fixed batch per device for
            weak scaling, ``global / workers`` for strong scaling).
    """
    out = []
    for n in workers:
        sn = replace(s, workers=n)
        cn = c.with_devices(sn.processes)
        out.append(simulate(prof_at(n), cn, sn, comp=comp, stragglers=stragglers, steps=steps, seed=seed,
                            overhead_s=overhead_s))  # fmt: skip
    return out
