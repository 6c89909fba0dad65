"""Gossip: decentralized SGD over a topology, synchronous (D-PSGD) or asynchronous (AD-PSGD).

Every worker trains its own replica; ``gossip.step()``, called after ``optimizer.step()``,
mixes it with its neighbours' in the :class:`~dtrain.decentralized.topology.Topology`:

* ``mode="sync"`` -- D-PSGD (Lian et al. 2017, "Can Decentralized Algorithms Outperform
  Centralized Algorithms?", arXiv 1705.09056): every step one round
  ``x_i <- sum_j W[i, j] x_j`` of the flattened trainable parameters
  (:func:`~dtrain.decentralized.topology.mix_round`). Each rank sends its parameters to its
  out-neighbours, so per step it sends exactly ``degree x model bytes``
  (:meth:`Gossip.expected_bytes_per_step`), whatever the world size.
* ``mode="async"`` -- AD-PSGD (Lian et al. 2018, "Asynchronous Decentralized Parallel
  Stochastic Gradient Descent", arXiv 1710.06952): no barrier. The ranks are split into
  *active* and *passive* by :func:`~dtrain.decentralized.topology.bipartition` (the graph's own
  2-colouring when it is bipartite, e.g. a ring of even ``n``; else even/odd ranks over the
  even--odd edges; else a BFS-depth split, which is always connected), so two actives never
  wait on each other and no cycle of waits can form. An active's ``step()`` picks a passive
  partner uniformly at random (``seed``), sends its parameters and receives the pair's average,
  which becomes its parameters. A passive runs one answering thread per active partner
  (blocking on that partner's requests, so no polling): it averages the request with the
  passive's *published* parameters under a lock, replies at once and leaves the change as a
  correction that the passive's own ``step()`` adds to its live parameters between optimizer
  steps. A slow passive therefore answers promptly, and a straggler slows only the actives
  that pick it. The pair's average keeps the pair's sum, so (without optimizer steps) the
  replicas' mean never moves and the consensus distance shrinks.

Async traffic runs on a process group of its own (``torch.distributed.new_group``, created by
every rank in ``__init__``) with tags of its own. Every wait that can fail has ``timeout``
(a CommError / CommTimeoutError names rank, operation, peer and step), except a passive's wait
for its *next* request, which is idle time, not a failure (bounded by ``idle_timeout``; a
crashed active still surfaces as a closed connection). :meth:`Gossip.finish` (also
``close()``, or leaving a ``with`` block) ends it on every rank: each active sends a stop
message to each partner, each passive waits (``timeout``) until every partner's stop has
arrived, so no request is left unanswered, applies what it answered, and all ranks meet in a
barrier of the async group, which is then destroyed. It is idempotent; sync mode has nothing
to shut down.

Buffers (e.g. BatchNorm statistics) are not mixed; momentum stays local (as in the papers).
"""

from __future__ import annotations

import datetime
import random
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dtrain.comm.transport import CommStats, TorchTransport
from dtrain.decentralized.replica import ReplicaWrapper, assign_flat, flatten_params
from dtrain.decentralized.topology import Bipartition, Topology, TopologySpec, bipartition, mix_round, topology
from dtrain.errors import CommError, CommTimeoutError, ConfigError

__all__ = ["Gossip", "MODES", "IDLE_TIMEOUT_S"]

MODES = ("sync", "async")
IDLE_TIMEOUT_S = 7 * 24 * 3600.0  # a passive's wait for its next request: idle, not a failure
TAG_REQUEST = 0x6A0001  # active -> passive: parameters + [1.0] (a request) or [0.0] (stop)
TAG_REPLY = 0x6A0002  # passive -> active: the pair's average


def _reraise(e: CommError, rank: int, op: str, step: int, peer: int | None = None) -> CommError:
    cls = CommTimeoutError if isinstance(e, CommTimeoutError) else CommError
    return cls(rank, op, e.cause, peer=e.peer if peer is None else peer, step=step)


class Gossip(ReplicaWrapper):
    """Decentralized SGD by gossip over ``topology`` (see the module docstring).

    Args:
        module: this worker's replica.
        topology: ``"ring"``, ``"torus"``, ``"exponential"``, ``"random"`` (``"random:D"``),
            ``"complete"``, a :class:`Topology`, a mixing matrix or a list of edges
            (:func:`dtrain.decentralized.topology.topology`); its ``n`` is the group's size.
        mode: ``"sync"`` (D-PSGD, a mixing round every step) or ``"async"`` (AD-PSGD, pairwise).
        group: the process group of the workers (default: the default group).
        seed: the random topology's seed and the active ranks' choice of partner (same on all ranks).
        timeout: seconds any exchange may block before a CommTimeoutError (default 300).
        idle_timeout: async only: how long a passive waits for its next request (default a week).

    Raises:
        ConfigError: an unknown mode; a bad topology; async with fewer than 2 workers.
    """

    def __init__(
        self,
        module: nn.Module,
        topology: TopologySpec = "ring",
        mode: str = "sync",
        *,
        group: Any = None,
        seed: int = 0,
        timeout: float | None = None,
        idle_timeout: float | None = None,
    ) -> None:
        if mode not in MODES:
            raise ConfigError(f"Gossip mode must be one of {', '.join(MODES)}, got mode={mode!r}")
        if not dist.is_initialized():
            raise ConfigError("Gossip needs torch.distributed initialized (call dtrain.init() first)")
        topo = _build(topology, dist.get_world_size(group), seed)  # before any collective: all ranks raise
        roles = bipartition(topo) if mode == "async" else None
        super().__init__(module, group=group, timeout=timeout)
        self.topology: Topology = topo
        self.mode = mode
        self.seed = seed
        self._closed = False  # step() refused (finish() was called)
        self._finished = False  # finish() completed
        self._lock = threading.Lock()
        self._errors: list[CommError] = []
        self._numel = sum(p.numel() for p in self.params)
        self._dtype = flatten_params(self.params).dtype if self.params else torch.float32
        self._itemsize = torch.empty(0, dtype=self._dtype).element_size()
        if roles is not None:
            self._setup_async(roles, IDLE_TIMEOUT_S if idle_timeout is None else float(idle_timeout))

    # -- async plumbing ------------------------------------------------------------------
    def _setup_async(self, roles: Bipartition, idle_timeout: float) -> None:
        self.roles = roles
        self.active = roles.active[self.rank]
        self.partners = roles.partners[self.rank]
        members = [dist.get_global_rank(self.group, r) if self.group is not None else r for r in range(self.world)]
        pg_timeout = datetime.timedelta(seconds=self.timeout_s)
        if self.group is None:
            self._agroup = dist.new_group(timeout=pg_timeout)  # every rank of the job, same order
        else:
            self._agroup = dist.new_group(sorted(members), timeout=pg_timeout, use_local_synchronization=True)
        self._apeer = [dist.get_group_rank(self._agroup, g) for g in members]  # group rank -> async rank
        self._atr = TorchTransport(self._agroup, timeout=self.timeout_s)
        self._idle_tr = TorchTransport(self._agroup, timeout=idle_timeout)
        self._rng = random.Random(self.seed * 1_000_003 + self.rank)
        self._stopped: set[int] = set()  # passive: partners whose stop arrived; active: partners sent one
        self._threads: list[threading.Thread] = []
        if not self.active:
            flat = flatten_params(self.params)
            self._pub = flat.clone()  # what requests are averaged with: live params as of step() + answers
            self._base = flat.clone()  # _pub as of the last step(); live += _pub - _base applies the answers
            for a in self.partners:
                th = threading.Thread(
                    target=self._serve, args=(a,), name=f"dtrain-gossip-r{self.rank}-from{a}", daemon=True
                )
                th.start()
                self._threads.append(th)

    def _serve(self, a: int) -> None:
        """A passive's answering thread for active partner ``a``: requests until ``a``'s stop."""
        buf = torch.empty(self._numel + 1, dtype=self._pub.dtype, device=self._pub.device)
        peer = self._apeer[a]
        try:
            while True:
                self._idle_tr.recv(buf, peer, TAG_REQUEST)
                if float(buf[-1]) == 0.0:
                    return
                with self._lock:
                    avg = (buf[:-1] + self._pub) * 0.5
                    self._pub.copy_(avg)
                    self.rounds += 1
                    self.count_sent(CommStats(1, avg.numel() * avg.element_size()))
                self._atr.send(avg, peer, TAG_REPLY)
        except CommError as e:
            with self._lock:
                self._errors.append(_reraise(e, self.rank, "Gossip(async) answer", self.steps, peer=a))
        except Exception as e:  # noqa: BLE001 - surfaced in the main thread by step()/finish()
            with self._lock:
                self._errors.append(CommError(self.rank, "Gossip(async) answer", repr(e), peer=a, step=self.steps))
        finally:
            with self._lock:
                self._stopped.add(a)

    def _raise_errors(self) -> None:
        with self._lock:
            if self._errors:
                raise self._errors[0]

    def _apply_answers(self) -> None:
        """Passive: add what the answering threads averaged since the last call to the live params."""
        with self._lock:
            x = flatten_params(self.params)
            x.add_(self._pub - self._base)
            assign_flat(self.params, x)
            self._pub.copy_(x)
            self._base.copy_(x)

    def _pairwise_average(self) -> None:
        """Active: send the parameters to a random passive partner, take the pair's average back."""
        x = flatten_params(self.params)
        p = self._rng.choice(self.partners)
        msg = torch.cat([x, torch.ones(1, dtype=x.dtype, device=x.device)])
        reply = torch.empty_like(x)
        try:
            recv = self._atr.irecv(reply, self._apeer[p], TAG_REPLY)  # posted before the request
            self._atr.isend(msg, self._apeer[p], TAG_REQUEST).wait()
            recv.wait()
        except CommError as e:
            raise _reraise(e, self.rank, "Gossip(async) pairwise average", self.steps, peer=p) from e
        assign_flat(self.params, reply)
        self.count_sent(CommStats(1, msg.numel() * msg.element_size()))
        self.rounds += 1

    # -- the wrapper's rule ----------------------------------------------------------------
    def step(self) -> None:
        """Mix after ``optimizer.step()``: a gossip round (sync), a pairwise average (async active),
        or applying the averages answered since the last step (async passive)."""
        if self._closed:
            raise ConfigError(f"Gossip.step() after finish() on rank {self.rank} (step {self.steps})")
        if self.mode == "sync":
            self._mix_round()
        elif self.active:
            self._pairwise_average()
        else:
            self._raise_errors()
            self._apply_answers()
        self.steps += 1

    def _mix_round(self) -> None:
        x = flatten_params(self.params)
        before = self.transport.stats.snapshot()
        try:
            mix_round(self.transport, x, self.topology)
        except CommError as e:
            raise _reraise(e, self.rank, f"Gossip(sync) mix round ({e.op})", self.steps) from e
        self.count_sent(self.transport.stats.snapshot() - before)
        assign_flat(self.params, x)
        self.rounds += 1

    def finish(self) -> None:
        """Shut the async exchange down on every rank (collective; idempotent; nothing to do in sync).

        Actives send each partner a stop; passives wait up to ``timeout`` for every partner's stop
        (so every request is answered), join their threads and apply the answers; then the ranks
        meet in a barrier of the async group and destroy it. After a timeout it may be called again: it resumes
        where it stopped (no stop is sent twice). ``step()`` is refused from the first call on.

        Raises:
            CommTimeoutError: a passive did not get every stop in time (names the missing actives).
            CommError: an answering thread failed, or a stop or the barrier failed.
        """
        self._closed = True
        if self._finished:
            return
        if self.mode == "async":
            if self.active:
                self._send_stops()
            else:
                self._join_threads()
            self._barrier()
        self._finished = True

    def _send_stops(self) -> None:
        stop = torch.zeros(self._numel + 1, dtype=self._dtype, device=self.params[0].device if self.params else None)
        for p in self.partners:
            if p in self._stopped:
                continue
            try:
                self._atr.send(stop, self._apeer[p], TAG_REQUEST)
            except CommError as e:
                raise _reraise(e, self.rank, "Gossip.finish (stop)", self.steps, peer=p) from e
            self._stopped.add(p)
            self.count_sent(CommStats(1, stop.numel() * stop.element_size()))

    def _join_threads(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        for th in self._threads:
            th.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            missing = sorted(set(self.partners) - self._stopped)
        if missing:
            raise CommTimeoutError(
                self.rank,
                "Gossip.finish",
                f"no stop message from active ranks {missing} within {self.timeout_s:.0f}s (did they call finish()?)",
                step=self.steps,
            )
        self._raise_errors()
        if self._threads:
            self._apply_answers()
            self._threads = []

    def _barrier(self) -> None:
        try:
            work = dist.barrier(group=self._agroup, async_op=True)
            assert work is not None
            work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as e:
            raise CommError(self.rank, "Gossip.finish (barrier)", str(e).splitlines()[0][:300], step=self.steps) from e
        dist.destroy_process_group(self._agroup)  # every rank is past its last use of the async group

    def close(self) -> None:
        """Same as :meth:`finish`."""
        self.finish()

    def __enter__(self) -> Gossip:
        return self

    def __exit__(self, *exc: object) -> None:
        self.finish()

    # -- what it reports -------------------------------------------------------------------
    def model_bytes(self) -> int:
        """Bytes of the flattened trainable parameters (one message of a sync round)."""
        return self._numel * self._itemsize

    def expected_bytes_per_step(self) -> float:
        """This rank's bytes sent per step, in closed form.

        * sync: ``out_degree x model_bytes`` (``degree x model_bytes`` on a regular topology).
        * async, active: ``model_bytes + itemsize`` (the parameters and the request flag).
        * async, passive: ``sum over active partners a of model_bytes / |partners(a)|``: the
          replies it sends per step if every rank steps at the same rate (uniform choice).

        Stop messages at :meth:`finish` (async actives: one per partner) are not per step.
        """
        mb = self.model_bytes()
        if self.mode == "sync":
            return float(len(self.topology.out_neighbours(self.rank)) * mb)
        if self.active:
            return float(mb + self._itemsize)
        return float(sum(mb / len(self.roles.partners[a]) for a in self.partners))

    def stats(self) -> dict[str, Any]:
        """The base's counters plus mode, topology, spectral gap, degree, expected bytes per step
        and, async, this rank's role, partners and the split's colouring."""
        with self._lock:
            out = super().stats()
        out.update(
            mode=self.mode,
            topology=self.topology.name,
            spectral_gap=self.topology.spectral_gap,
            degree=self.topology.degree,
            model_bytes=self.model_bytes(),
            expected_bytes_per_step=self.expected_bytes_per_step(),
        )
        if self.mode == "async":
            out.update(
                role="active" if self.active else "passive",
                partners=list(self.partners),
                colouring=self.roles.colouring,
            )
        return out


def _build(spec: TopologySpec, n: int, seed: int) -> Topology:
    return topology(spec, n, seed=seed)
