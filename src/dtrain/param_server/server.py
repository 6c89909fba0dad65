"""The server side: receive gradients, let the policy decide, apply, reply.

One :class:`ShardServer` per server rank owns one :class:`~.sharding.Shard`: a
tensor per piece, and the optimizer over them (built by the user's factory, so
its state -- momentum, Adam's moments -- lives here and nowhere else).

Threads. A receiver thread per worker blocks on that worker's next header (a
per-source receive: a closed connection tells at once that the worker is gone)
and hands complete messages to one queue; the main thread takes them in arrival
order, asks the policy, and runs the actions it returns:

1. ``push``: decode the payload (compressor ``from_wire``), check it against the
   shard and the policy's clock table -- a malformed or out-of-protocol message is
   rejected with :class:`~.protocol.ProtocolError` naming the sender and is never
   applied;
2. ``Apply``: average the gradients -- sorted by worker and summed in the
   binomial-tree order of DataParallel's ``tree`` allreduce whatever order they
   arrived in (:mod:`._reduce`), so a BSP run is reproducible -- put them in the
   pieces' ``.grad``, scale the learning rate if asked (staleness-aware LR),
   ``optimizer.step()``; record each gradient's staleness, clock lag and worker;
3. ``Release``: send the current parameters (compressor ``to_wire``, packed once
   per version) to the worker;
4. when every worker has finished or been lost, send each finished worker a
   ``BYE`` with the final parameters and return.

A worker that disappears (connection closed, or no heartbeat for ``timeout_s``)
is dropped under policies that tolerate it (logged, clock table updated); under
BSP the server stops with :class:`~.protocol.PeerLostError` naming it. If workers
wait and nothing arrives for ``2 * timeout_s``, the server stops with
:class:`~dtrain.errors.CommTimeoutError` naming the workers it waits for.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from dtrain import trace as _trace
from dtrain.comm.transport import Transport, Work
from dtrain.compress.base import Compressor
from dtrain.errors import CommError, CommTimeoutError, DTrainError
from dtrain.param_server._liveness import Liveness
from dtrain.param_server._reduce import ordered_mean
from dtrain.param_server._sends import _SendWaiter
from dtrain.param_server.consistency import Action, Apply, Drop, Policy, PolicyViolation, Release
from dtrain.param_server.protocol import (
    FLAG_STOP,
    OP_BYE,
    OP_DROPPED,
    OP_FINISH,
    OP_PARAMS,
    OP_PULL,
    OP_PUSH,
    WORKER_OPS,
    Header,
    PeerLostError,
    ProtocolError,
    RunAbortedError,
    brief,
    lost_error,
    recv_header,
    recv_payload,
    send_message,
)
from dtrain.param_server.server_stats import ServerStats, hist_summary
from dtrain.param_server.sharding import Shard

__all__ = ["ServerStats", "ShardServer", "hist_summary"]

log = logging.getLogger("dtrain.param_server")


_POLL_S = 0.05  # how often a server blocked on its sends asks whether the receiver is lost


class ShardServer:
    """Serve one shard to all workers under a consistency policy.

    Args:
        transport: point-to-point transport; ranks ``0..S-1`` are servers, the rest workers.
        shard: the pieces this server owns.
        params: the model's parameters (read once, to initialise the pieces).
        optimizer_factory: builds the optimizer over the pieces' tensors.
        policy: a fresh consistency policy (this server's own state).
        workers: the worker ranks.
        push_compressor / pull_compressor: decode gradients / encode parameters.
        liveness: heartbeats and the abort flag.
        timeout_s: a silent worker is lost after this; a stall is an error after twice this.
        max_gradients: set the stop flag in replies once this many gradients arrived (None: never).
    """

    def __init__(
        self,
        transport: Transport,
        shard: Shard,
        params: Sequence[torch.Tensor],
        optimizer_factory: Callable[[Any], torch.optim.Optimizer],
        policy: Policy,
        workers: Sequence[int],
        push_compressor: Compressor,
        pull_compressor: Compressor,
        liveness: Liveness,
        timeout_s: float,
        max_gradients: int | None = None,
    ) -> None:
        self.t = transport
        self.rank = transport.rank
        self.shard = shard
        self.dtype = params[0].dtype
        self.pieces: list[torch.nn.Parameter] = []
        for p in shard.pieces:
            src = params[p.index].detach()
            data = src.clone() if p.whole else src.reshape(-1)[p.start : p.start + p.numel].clone()
            self.pieces.append(torch.nn.Parameter(data))
        self.offsets = shard.offsets()
        self.optimizer = optimizer_factory(self.pieces)
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer_factory must return a torch.optim.Optimizer, got {type(self.optimizer).__name__}"
            )
        self.policy = policy.start(workers)
        self.workers = tuple(workers)
        self.push_c = push_compressor
        self.pull_c = pull_compressor
        self.live = liveness
        self.timeout_s = float(timeout_s)
        self.max_gradients = max_gradients
        self.stats = ServerStats(rank=self.rank)
        raw = shard.numel * params[0].element_size()
        self._max_payload = 4 * raw + 65536  # any sane compressed gradient is far below this
        self._inbox: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self._stop = threading.Event()
        self._pending: dict[tuple[int, int], tuple[torch.Tensor, int]] = {}  # (worker, clock) -> (grad, lag)
        self._lag: dict[int, int] = {}
        self._wire: tuple[int, torch.Tensor] | None = None  # (version, packed parameters)
        self._finished: set[int] = set()
        self._lost: set[int] = set()
        self._works: list[tuple[int, Work]] = []
        self._waiter = _SendWaiter()
        #: called on the main thread as ``on_update(version, budget_spent)`` after an event that applied an
        #: update, once its replies are sent (a checkpoint's hook: under bsp no worker is waiting then)
        self.on_update: Callable[[int, bool], None] | None = None
        self.clip: Callable[[list[torch.Tensor], int], float] | None = None  # clipping by the global norm

    # ------------------------------------------------------------------ public

    def flat_parameters(self) -> torch.Tensor:
        """This shard's current parameters, concatenated (a copy)."""
        if not self.pieces:
            return torch.zeros(0, dtype=self.dtype)
        return torch.cat([p.detach().reshape(-1) for p in self.pieces])

    def state_dict(self) -> dict[str, Any]:
        """This server's part of a checkpoint: its shard, optimizer state, clock table and counters.

        Only at a quiet point -- nothing buffered, no worker waiting -- which under
        bsp is the moment :attr:`on_update` runs.
        """
        pol = getattr(self.policy, "inner", self.policy)
        if pol.waiting or pol.buffer or self._pending:
            raise DTrainError(
                f"server rank {self.rank}: cannot checkpoint while workers {sorted(pol.waiting)} wait "
                "or gradients are buffered (checkpoint under bsp, after an update)"
            )
        return {
            "pieces": [p.detach().clone() for p in self.pieces],
            "optimizer": self.optimizer.state_dict(),
            "clock": dict(pol.clock),
            "version": pol.version,
            "received": self.stats.received,
            "updates": self.stats.updates,
            "pull_compressor": self.pull_c.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output before :meth:`serve`.

        The optimizer's state (momentum, moments) is restored; its hyperparameters
        stay as ``optimizer_factory`` set them, so a resumed run may change them.
        Workers resume at their saved clocks (their first pull carries it).
        """
        pieces = state["pieces"]
        shapes = [tuple(p.shape) for p in self.pieces]
        if [tuple(t.shape) for t in pieces] != shapes:
            raise ValueError(
                f"server rank {self.rank}: the saved shard has pieces {[tuple(t.shape) for t in pieces]}, "
                f"this shard {shapes}; resume with the same model and number of servers"
            )
        pol = getattr(self.policy, "inner", self.policy)
        if set(state["clock"]) != set(pol.clock):
            raise ValueError(
                f"server rank {self.rank}: the saved clock table has workers {sorted(state['clock'])}, "
                f"this run {sorted(pol.clock)}"
            )
        with torch.no_grad():
            for p, t in zip(self.pieces, pieces):
                p.copy_(t)
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        self.optimizer.load_state_dict(state["optimizer"])
        for g, h in zip(self.optimizer.param_groups, hyper):
            g.update(h)
        pol.restore_clock({int(w): int(c) for w, c in state["clock"].items()}, int(state["version"]))
        self.stats.received = int(state["received"])
        self.stats.updates = int(state["updates"])
        self.pull_c.load_state_dict(state["pull_compressor"])
        self._wire = None

    def serve(self) -> ServerStats:
        """Run until every worker has finished or been lost; return the statistics."""
        t0 = time.perf_counter()
        threads = [
            threading.Thread(target=self._receive, args=(w,), name=f"ps-recv-{self.rank}<-{w}", daemon=True)
            for w in self.workers
        ]
        for th in threads:
            th.start()
        try:
            self._loop()
            self._goodbye()
        except BaseException as e:
            self.live.abort(f"server rank {self.rank} stopped: {e}")
            raise
        finally:
            self._stop.set()
            self._waiter.close()
            self.stats.wall_s = time.perf_counter() - t0
            self.stats.bytes_out = self.t.stats.bytes_sent
        for th in threads:
            th.join(timeout=1.0)
        return self.stats

    # ------------------------------------------------------------------ receiving

    def _receive(self, w: int) -> None:
        while not self._stop.is_set():
            try:
                raw = recv_header(self.t, w)
            except CommTimeoutError:
                continue  # only in-process transports time out here; the real one waits for hours
            except CommError as e:
                self._inbox.put(("lost", w, f"connection closed ({brief(e)})"))
                return
            try:
                h = Header.decode(raw, allowed=WORKER_OPS)
                if h.nbytes and h.op != OP_PUSH:
                    raise ValueError(f"a {h.op_name} message carries no payload, header says {h.nbytes} bytes")
                if h.op == OP_PUSH and not 0 < h.nbytes <= self._max_payload:
                    raise ValueError(f"push payload of {h.nbytes} bytes for a shard of {self.shard.numel} elements")
            except ValueError as e:
                self._inbox.put(("bad", w, str(e), raw.tolist()))
                return
            payload = None
            if h.nbytes:
                try:
                    payload = recv_payload(self.t, w, h.nbytes)
                except CommError as e:
                    self._inbox.put(("lost", w, f"connection closed ({brief(e)})"))
                    return
            self._inbox.put(("msg", w, h, payload))
            if h.op == OP_FINISH:
                return

    # ------------------------------------------------------------------ main loop

    def _remaining(self) -> set[int]:
        return set(self.workers) - self._finished - self._lost

    def _loop(self) -> None:
        last_event = time.monotonic()
        while self._remaining():
            try:
                ev = self._inbox.get(timeout=0.1)
            except queue.Empty:
                ev = None
            if ev is not None:
                t0 = time.perf_counter()
                version = self.policy.version
                tracer = _trace.current()
                if tracer is not None:  # --trace-steps on a server: the slowest worker's step
                    tracer.at_step(min(self.policy.clock.values(), default=0))
                self._handle(ev)
                self._flush_sends()
                self.stats.busy_s += time.perf_counter() - t0
                if self.on_update is not None and self.policy.version != version:
                    self.on_update(self.policy.version, bool(self._stop_flag()))
                last_event = time.monotonic()
            self._check_health(last_event)

    def _check_health(self, last_event: float) -> None:
        reason = self.live.aborted(refresh=False)
        if reason:
            raise RunAbortedError(self.rank, "serve", f"run aborted: {reason}", step=self.policy.version)
        for w, why in self.live.lost().items():
            if w in self._remaining():
                self._worker_lost(w, why)
                self._flush_sends()
        waiting = set(self.policy.waiting) | self._finished
        silent = time.monotonic() - last_event
        if waiting and self._remaining() and silent > 2 * self.timeout_s:
            raise CommTimeoutError(
                self.rank,
                f"serve ({self.policy.spec()})",
                f"nothing from workers {sorted(self._remaining() - set(self.policy.waiting))} for {silent:.0f}s "
                f"while workers {sorted(waiting)} wait",
                step=self.policy.version,
            )

    def _handle(self, ev: tuple[Any, ...]) -> None:
        kind, w = ev[0], ev[1]
        if w in self._lost:  # declared lost but alive after all: tell it, once per message, and go on
            if kind == "msg":
                self._send_header(w, Header(OP_DROPPED, ev[2].clock, self.policy.version))
            return
        if kind == "lost":
            if w in self._remaining():
                self._worker_lost(w, ev[2])
            return
        if kind == "bad":
            self._reject(w, f"malformed header {ev[3]}: {ev[2]}")
        h: Header = ev[2]
        payload: torch.Tensor | None = ev[3]
        self.stats.bytes_in += 8 * 8 + (payload.numel() if payload is not None else 0)
        if h.op == OP_PULL:
            expected = self.policy.clock.get(w, 0)  # 0, or the clock a resumed worker had at the checkpoint
            if h.clock != expected:
                self._reject(w, f"first pull must carry clock {expected}, got {h.clock}", h)
            self._run(w, h, lambda: self.policy.pull(w))
        elif h.op == OP_PUSH:
            assert payload is not None
            grad = self._decode(w, h, payload)
            lag = self._lag.get(w, 0)
            acts = self._run(w, h, lambda: self.policy.push(w, h.clock, h.version), execute=False)
            self.stats.received += 1
            self._pending[(w, h.clock)] = (grad, lag)
            self._execute(acts)
        elif h.op == OP_FINISH:
            if h.clock != self.policy.clock.get(w, -1):
                self._reject(w, f"finish at clock {h.clock}, but it pushed {self.policy.clock.get(w)} gradients", h)
            self._run(w, h, lambda: self.policy.leave(w))
            self._finished.add(w)
            self.live.unwatch(w)

    def _run(self, w: int, h: Header, event: Callable[[], list[Action]], execute: bool = True) -> list[Action]:
        try:
            acts = event()
        except PolicyViolation as e:
            self._reject(w, str(e), h)
        if execute:
            self._execute(acts)
        return acts

    def _decode(self, w: int, h: Header, payload: torch.Tensor) -> torch.Tensor:
        try:
            g = self.push_c.from_wire(payload, (self.shard.numel,), self.dtype)
        except Exception as e:  # noqa: BLE001 - any decoding failure is the sender's
            self._reject(w, f"gradient payload does not decode to {self.shard.numel} x {self.dtype}: {e}", h)
        if tuple(g.shape) != (self.shard.numel,) or g.dtype != self.dtype:
            self._reject(
                w, f"gradient has shape {tuple(g.shape)} {g.dtype}, expected ({self.shard.numel},) {self.dtype}", h
            )
        return g

    def _reject(self, w: int, why: str, h: Header | None = None) -> None:
        what = f"{h.op_name} " if h is not None else ""
        raise ProtocolError(
            self.rank,
            "serve",
            f"rejected {what}message from worker rank {w}: {why}; nothing was applied",
            peer=w,
            step=h.clock if h is not None else None,
        )

    def _worker_lost(self, w: int, why: str) -> None:
        reason = self.live.aborted(refresh=True)
        if reason:
            raise RunAbortedError(self.rank, "serve", f"run aborted: {reason}", step=self.policy.version)
        if not self.policy.tolerates_loss:
            raise lost_error(
                self.rank,
                f"serve ({self.policy.spec()})",
                f"worker rank {w} was lost ({why}); {self.policy.spec()} cannot go on without it",
                why,
                peer=w,
                step=self.policy.version,
            )
        log.warning(
            "rank %d: dropping worker rank %d (%s); %s goes on with %d workers",
            self.rank,
            w,
            why,
            self.policy.spec(),
            len(self._remaining()) - 1,
        )
        self._lost.add(w)
        self.stats.lost[w] = why
        self.live.unwatch(w)
        if w in self.policy.active:
            self._execute(self.policy.leave(w, lost=True))
        if not self._remaining() and not self._finished:
            raise PeerLostError(
                self.rank, "serve", f"every worker was lost (last: rank {w}, {why})", step=self.policy.version
            )

    # ------------------------------------------------------------------ actions

    def _execute(self, acts: list[Action]) -> None:
        for act in acts:
            if isinstance(act, Apply):
                self._apply(act)
            elif isinstance(act, Drop):
                self._pending.pop((act.arrival.worker, act.arrival.clock), None)
                self.stats.dropped[act.arrival.worker] += 1
            elif isinstance(act, Release):
                self._release(act)

    def _apply(self, act: Apply) -> None:
        grads, lags = [], []
        # by worker, not by arrival: the average is then reproducible and equals DataParallel's (see _reduce)
        for a in sorted(act.arrivals, key=lambda a: (a.worker, a.clock)):
            g, lag = self._pending.pop((a.worker, a.clock))
            grads.append(g)
            lags.append(lag)
            self.stats.applied[a.worker] += 1
        # majority vote (sign:mv) aggregates by its own rule; every other compressor's is the mean
        g = ordered_mean(grads) if self.push_c.mean_combine else self.push_c.combine(grads)
        for p, off in zip(self.pieces, self.offsets):
            p.grad = g[off : off + p.numel()].view_as(p).clone()
        if self.clip is not None:
            self.clip([p.grad for p in self.pieces if p.grad is not None], act.version)
        saved = [group["lr"] for group in self.optimizer.param_groups]
        if act.lr_scale != 1.0:
            for group in self.optimizer.param_groups:
                group["lr"] = group["lr"] * act.lr_scale
        try:
            with _trace.span(
                "ps apply", version=self.policy.version, staleness=max(act.staleness, default=0), workers=len(grads)
            ):
                self.optimizer.step()
        finally:
            for group, lr in zip(self.optimizer.param_groups, saved):
                group["lr"] = lr
        self.stats.updates += 1
        self.stats.staleness.update(act.staleness)
        self.stats.clock_lag.update(lags)
        self._wire = None

    def _packed(self) -> torch.Tensor:
        v = self.policy.version
        if self._wire is None or self._wire[0] != v:
            self._wire = (v, self.pull_c.to_wire(self.flat_parameters(), f"ps/server{self.rank}"))
        return self._wire[1]

    def _stop_flag(self) -> int:
        return FLAG_STOP if self.max_gradients is not None and self.stats.received >= self.max_gradients else 0

    def _release(self, act: Release) -> None:
        if act.worker in self._lost:
            return
        self._lag[act.worker] = act.clock_lag
        self._send(act.worker, OP_PARAMS, self.policy.clock[act.worker], act.clock_lag)

    def _send(self, w: int, op: int, clock: int, lag: int = 0) -> None:
        buf = self._packed()
        h = Header(op, clock, self.policy.version, buf.numel(), lag, self._stop_flag())
        try:
            for work in send_message(self.t, w, h, buf):
                self._works.append((w, work))
        except CommError as e:
            self._inbox.put(("lost", w, f"send failed ({brief(e)})"))

    def _send_header(self, w: int, h: Header) -> None:
        try:
            for work in send_message(self.t, w, h):
                self._works.append((w, work))
        except CommError:
            pass  # it is gone for good

    def _flush_sends(self) -> None:
        """Wait for this event's sends (their buffers are reused next), watching the workers meanwhile.

        The waits run on :class:`_SendWaiter`'s thread while this one asks the liveness monitor: a
        stopped worker (SIGSTOP) never takes a reply that does not fit the socket's buffers, and the
        data path's waits never time out (that would close gloo's connections), so without this the
        loop would block on it for good instead of handling it after ``timeout_s``."""
        works, self._works = self._works, []
        while works:
            batch = self._waiter.start(works)
            while not batch.done.wait(_POLL_S):
                w = batch.current
                lost = self.live.lost()
                if w is not None and w in lost and w in self._remaining():
                    works = batch.abandon()  # its thread stays blocked on w's send; a new one takes the rest
                    self._waiter = _SendWaiter()
                    self._worker_lost(w, lost[w])  # raises where the policy cannot go on without w
                    break
            else:
                works = []
            for w, e in batch.errors:
                self._inbox.put(("lost", w, f"send failed ({brief(e)})"))

    def _goodbye(self) -> None:
        if not self._finished:
            raise PeerLostError(self.rank, "serve", "no worker finished; every worker was lost")
        for w in sorted(self._finished):
            self._send(w, OP_BYE, self.policy.clock[w])
        self._flush_sends()
