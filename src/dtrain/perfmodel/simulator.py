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

With priority overlap (``overlap="forward"``) and ZeRO (``--shard``) a step is the
closed form's period with its compute stretched by the step's slowest worker.

Parameter server (the ``S`` servers act as one, each holding ``1/S`` of every
push, pull and apply; costs from :func:`~dtrain.perfmodel.predict.ps_costs`):

* ``bsp``: a round starts its push when the last worker has computed, then the
  closed form's push, apply and pull phases follow; ``backup:b``: when the
  ``(N-b)``-th has (the late gradients are dropped and their workers restart from
  the new parameters with everyone else).
* ``asp``, ``ssp:s``, ``softsync:k``: discrete events in a priority queue around
  the parameter server's own policy object (the state machine a run's servers
  use). compute done -> push (the worker's own link, then the servers' inbound
  links, FIFO) -> the policy takes it at the server CPU (FIFO): its ``Apply``
  actions count staleness (versions applied since the worker read its
  parameters), its ``Release`` actions send a pull (servers' outbound links,
  FIFO) -> next compute. So ``ssp:s`` holds a worker back while it is more than
  ``s`` steps ahead of the slowest and ``softsync:k`` applies one update per
  ``k`` pushes because the policy says so. Throughput is counted until the first worker has done all its
  steps, so a permanent straggler does not stretch the window.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from dtrain.errors import ConfigError
from dtrain.param_server.consistency import Action, Apply, Release
from dtrain.perfmodel.collectives import CompressionModel
from dtrain.perfmodel.hooks import ModelHooks, SimResult
from dtrain.perfmodel.predict import (
    DataParallelLike,
    PSCosts,
    ServerLike,
    bucket_collective,
    bucket_latency,
    bucket_shapes,
    buckets_of,
    compute_times,
    predict,
    ps_costs,
)
from dtrain.perfmodel.profile import ModelProfile
from dtrain.perfmodel.spec import ClusterSpec

if TYPE_CHECKING:
    from dtrain.registry import Choice

__all__ = [
    "Stragglers",
    "SimResult",
    "simulate_steps",
    "simulate",
    "simulate_sync",
    "simulate_ps",
    "scaling_curve",
    "parse_policy",
]


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
    def parse(cls, text: str) -> Stragglers:
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


def parse_policy(consistency: str) -> tuple[str, int]:
    """ "bsp" -> ("bsp", 0); "ssp:3" -> ("ssp", 3); "softsync:2"; "backup:1"; "asp".

    The parameter server's own parser (:func:`dtrain.param_server.consistency.parse_consistency`)
    decides, so the simulator accepts exactly the policies a run does.
    """
    from dtrain.param_server.consistency import parse_consistency

    spec = parse_consistency(consistency)
    return spec.kind, spec.arg


def simulate_steps(
    prof: ModelProfile,
    c: ClusterSpec,
    s: Choice,
    *,
    comp: CompressionModel | None = None,
    stragglers: Stragglers = Stragglers(),
    steps: int = 30,
    seed: int = 0,
    overhead_s: float = 0.0,
) -> SimResult:
    """Replay ``steps`` steps of strategy ``s`` (see the module docstring); one pipeline schedule's actions in
    time are :func:`dtrain.pipeline.schedules.simulate`'s.

    Args:
        prof: model profile at the per-worker batch.
        c: cluster; must hold ``s.processes`` devices (use ``c.with_devices``).
        s: the strategy.
        comp: compressor cost model when the strategy compresses.
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
    hook = ModelHooks.of(s.entry).simulate
    if hook is None:
        raise ConfigError(f"strategy {s.strategy!r} has no simulator (its registry entry has no simulate)")
    result: SimResult = hook(prof, c, s, comp, stragglers, steps, rng, fwd, bwd, opt, overhead_s, alone)
    return result


simulate = simulate_steps  # the name older scripts import


def simulate_sync(
    prof: ModelProfile,
    c: ClusterSpec,
    s: Choice,
    o: DataParallelLike,
    comp: CompressionModel,
    strag: Stragglers,
    steps: int,
    rng: np.random.Generator,
    fwd: list[float],
    bwd: list[float],
    opt: float,
    overhead: float,
    alone: float,
) -> SimResult:
    """Synchronous data parallel (``dp``, ``ddp``): buckets, step by step (module docstring)."""
    n = s.workers
    f = sum(fwd)
    ready = np.cumsum(bwd[::-1])[::-1] if bwd else np.zeros(0)  # ready[i]: backward done through layer i
    b_total = float(sum(bwd))
    algorithm = o.algorithm
    buckets = []
    layouts = bucket_shapes(prof, o.bucket_mb)
    for j, (nbytes, first_layer) in enumerate(buckets_of(prof, o.bucket_mb) if n > 1 else []):
        comm, coding = bucket_collective(c, algorithm, nbytes, n, comp, layouts[j])
        wake = bucket_latency(c, s, comp, j)
        buckets.append((float(ready[first_layer]), comm + wake + coding + 2 * nbytes * c.device.gamma))
    if (o.overlap == "forward" or getattr(o, "shard", "none") != "none") and n > 1:
        # priority scheduling and ZeRO: the closed form's period, compute stretched by the step's slowest worker
        base = predict(prof, c, s, comp if comp.kind != "dense" else None, overhead_s=overhead)
        work = base.compute_s  # f + b + opt (ZeRO: the optimizer of a 1/P shard)
        comm_part = base.step_s - (work + overhead)
        t_total = busy = 0.0
        for _ in range(steps):
            m = strag.sample(rng, n)
            t_total += float(m.max()) * work + comm_part + overhead
            busy += float(np.mean(m)) * work
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


def _sync_result(
    s: Choice, prof: ModelProfile, n: int, steps: int, t_total: float, busy: float, alone: float
) -> SimResult:
    step_s = t_total / steps
    sps = prof.batch * n / step_s
    return SimResult(n, s.label(), step_s, sps, sps / (n * prof.batch / alone), max(0.0, 1 - busy / t_total))


def simulate_ps(
    prof: ModelProfile,
    c: ClusterSpec,
    s: Choice,
    o: ServerLike,
    comp: CompressionModel,
    strag: Stragglers,
    steps: int,
    rng: np.random.Generator,
    fwd: list[float],
    bwd: list[float],
    opt: float,
    overhead: float,
    alone: float,
) -> SimResult:
    """The parameter server: rounds under bsp/backup, discrete events otherwise (module docstring)."""
    policy, k = parse_policy(o.consistency)
    pc = ps_costs(prof, c, s, o, comp, opt)
    if policy in ("bsp", "backup"):
        return _ps_rounds(prof, c, s, o, pc, strag, steps, rng, sum(fwd) + sum(bwd), overhead, alone, policy, k)
    sim = _AsyncServer(s.workers, pc, strag, rng, sum(fwd) + sum(bwd), overhead, o.consistency)
    return sim.run(prof, s, steps, alone)


def _ps_rounds(
    prof: ModelProfile,
    c: ClusterSpec,
    s: Choice,
    o: ServerLike,
    pc: PSCosts,
    strag: Stragglers,
    steps: int,
    rng: np.random.Generator,
    compute: float,
    overhead: float,
    alone: float,
    policy: str,
    k: int,
) -> SimResult:
    """bsp and backup:b: a round ends when the (N-b)-th push is in; then apply, everyone pulls."""
    N = s.workers
    wait_for = N - (k if policy == "backup" else 0)
    if wait_for < 1:
        raise ConfigError(f"{o.consistency} with {N} workers waits for no one; use fewer backups")
    t = busy = 0.0
    for _ in range(steps):
        m = strag.sample(rng, N)
        t_in = float(np.sort(m * compute)[wait_for - 1])
        busy += float(np.mean(np.minimum(m * compute, t_in)))
        t += (
            t_in
            + c.device.imbalance
            + pc.coding
            + max(pc.floor, pc.push_all + N * pc.apply_one + pc.pull_all)
            + overhead
        )
    step_s = t / steps
    sps = prof.batch * N / step_s
    return SimResult(
        N, s.label(), step_s, sps, sps / (N * prof.batch / alone), max(0.0, 1 - busy / t), {0: steps * wait_for}
    )


class _AsyncServer:
    """asp, ssp:s and softsync:k as discrete events in time order, around the real policy.

    The consistency policy is the parameter server's own state machine
    (:class:`dtrain.param_server.consistency.Policy`, built from the strategy's
    ``consistency``): the simulator hands it each push when the servers' CPU
    reaches it and follows its actions -- an ``Apply`` counts the staleness of its
    gradients, a ``Release`` sends that worker the parameters. So ssp holds a
    worker back, and softsync batches gradients, exactly as a run's servers do.

    Events: ``pushed`` (compute done: the push crosses the worker's link, queues
    for the servers' inbound links, then their CPU), ``applied`` (the policy
    takes the push), ``pulled`` (the worker holds the released parameters and
    computes again, or leaves after its last step). A cycle's push and pull take
    at least the floor between them (as in predict).
    """

    def __init__(
        self,
        n: int,
        pc: PSCosts,
        strag: Stragglers,
        rng: np.random.Generator,
        compute: float,
        overhead: float,
        consistency: str,
    ) -> None:
        from dtrain.param_server.consistency import parse_consistency

        self.n, self.pc, self.strag, self.rng = n, pc, strag, rng
        self.compute, self.overhead = compute, overhead
        self.policy = parse_consistency(consistency).build().start(range(n))
        self.pad = max(0.0, pc.floor - (pc.push_one + pc.apply_one + pc.pull_one))
        self.slow_count = int(math.ceil(strag.a * n)) if strag.kind == "slow" else 0
        self.steps_done = [0] * n  # gradients each worker has pushed
        self.link_in = self.link_out = self.server_cpu = 0.0
        self.stale: dict[int, int] = {}
        self.busy = 0.0
        self.events: list[tuple[float, int, str, int]] = []
        self.seq = 0
        self.applied_at: list[float] = []

    def schedule(self, t: float, kind: str, w: int) -> None:
        heapq.heappush(self.events, (t, self.seq, kind, w))
        self.seq += 1

    def start_compute(self, t: float, w: int) -> None:
        if self.strag.kind == "slow":
            m = self.strag.b if w < self.slow_count else 1.0
        else:
            m = float(self.strag.sample(self.rng, 1)[0])
        self.busy += m * self.compute
        self.schedule(t + m * self.compute + self.pc.coding, "pushed", w)

    def pushed(self, t: float, w: int) -> None:
        arrive = max(t + self.pc.push_one, self.link_in + self.pc.in_per_push)
        self.link_in = arrive
        self.server_cpu = max(self.server_cpu, arrive) + self.pc.apply_one
        self.schedule(self.server_cpu, "applied", w)

    def follow(self, t: float, actions: Sequence[Action]) -> None:
        """Carry out the policy's actions at time ``t``."""
        for act in actions:
            if isinstance(act, Apply):
                for st in act.staleness:
                    self.stale[st] = self.stale.get(st, 0) + 1
            elif isinstance(act, Release):
                out = max(t + self.pc.pull_one, self.link_out + self.pc.out_per_pull)
                self.link_out = out
                self.schedule(out + self.pad + self.overhead, "pulled", act.worker)

    def applied(self, t: float, w: int) -> None:
        self.steps_done[w] += 1
        self.applied_at.append(t)
        p = self.policy
        self.follow(t, p.push(w, p.clock[w] + 1, p.last_read[w]))

    def pulled(self, t: float, w: int, steps: int) -> bool:
        """The worker holds the released parameters; returns whether it has done all its steps."""
        if self.steps_done[w] >= steps:
            self.follow(t, self.policy.leave(w))
            return True
        self.start_compute(t, w)
        return False

    def run(self, prof: ModelProfile, s: Choice, steps: int, alone: float) -> SimResult:
        for w in range(self.n):
            self.policy.pull(w)  # the first read: released at once with version 0
            self.start_compute(0.0, w)
        t_end = 0.0
        first_done = math.inf  # throughput is counted until the first worker finishes its steps
        while self.events:
            t, _, kind, w = heapq.heappop(self.events)
            if kind == "pushed":
                self.pushed(t, w)
            elif kind == "applied":
                self.applied(t, w)
            else:
                t_end = max(t_end, t)
                if self.pulled(t, w, steps):
                    first_done = min(first_done, t)
        window = min(first_done, t_end)
        updates = sum(1 for a in self.applied_at if a <= window)
        N = self.n
        sps = prof.batch * updates / window
        step_s = prof.batch * N / sps  # mean time per step of one worker
        return SimResult(
            N,
            s.label(),
            step_s,
            sps,
            sps / (N * prof.batch / alone),
            max(0.0, 1 - self.busy / (N * t_end)),
            dict(sorted(self.stale.items())),
        )


def scaling_curve(
    prof_at: Callable[[int], ModelProfile],
    c: ClusterSpec,
    s: Choice,
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
        sn = s.with_workers(n)
        cn = c.with_devices(sn.processes)
        out.append(
            simulate_steps(
                prof_at(n), cn, sn, comp=comp, stragglers=stragglers, steps=steps, seed=seed, overhead_s=overhead_s
            )
        )
    return out
