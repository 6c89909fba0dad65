"""The worker side: push gradients to every server, pull parameters back.

:class:`ShardClient` talks to all ``S`` servers at once. One step:

1. flatten the gradient of each server's shard (:meth:`~.sharding.Shard.gather`),
   pack it with the push compressor (``to_wire``) and start sending it to every
   server -- the ``S`` sends are in flight together;
2. wait for the ``S`` replies; a receiver thread per server receives and decodes
   them (``from_wire``) as they come, so the pulls overlap too;
3. copy each shard's parameters into the model (:meth:`~.sharding.Shard.scatter`)
   and drop the gradients (``p.grad = None``).

A reply comes when the server's policy releases the worker (at once under ASP,
after the step under BSP, ...). While waiting the worker watches the servers'
heartbeats and the run's abort flag: a lost server or an abort ends the wait with
an error naming the server or the reason; a reply that takes more than
``4 * timeout_s`` is a :class:`~dtrain.errors.CommTimeoutError` (servers stop by
themselves after ``2 * timeout_s`` without progress).

Cost per step: ``n`` bytes out and ``n`` bytes in for a model of ``n`` bytes, split
over the servers (``n / S`` on each link), plus one 64-byte header each way per
server.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dtrain import trace as _trace
from dtrain.comm.transport import Transport, Work
from dtrain.compress.base import Compressor
from dtrain.errors import CommError, CommTimeoutError, DTrainError
from dtrain.param_server._liveness import Liveness
from dtrain.param_server.protocol import (
    FLAG_STOP,
    OP_BYE,
    OP_DROPPED,
    OP_FINISH,
    OP_PARAMS,
    OP_PULL,
    OP_PUSH,
    SERVER_OPS,
    DroppedError,
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
from dtrain.param_server.sharding import Shard

__all__ = ["WorkerStats", "ShardClient"]


@dataclass
class WorkerStats:
    """What one worker measured (seconds are totals over the run).

    Attributes:
        rank: the worker's rank.
        steps: gradients pushed.
        compute_s: time between steps (forward, backward, data: the user's code).
        push_s: packing gradients and handing them to the transport.
        wait_s: waiting for the servers' replies.
        pull_s: copying the pulled parameters into the model.
        bytes_sent / bytes_received: header and payload bytes.
        clock_lag_max: the largest clock lag a reply reported.
    """

    rank: int = 0
    steps: int = 0
    compute_s: float = 0.0
    push_s: float = 0.0
    wait_s: float = 0.0
    pull_s: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    clock_lag_max: int = 0

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        for k in ("compute_s", "push_s", "wait_s", "pull_s"):
            d[k] = round(d[k], 6)
        return d


class ShardClient:
    """A worker's connection to every server.

    Args:
        transport: point-to-point transport (servers are ranks ``0..S-1``).
        shards: one shard per server, in server order.
        params: the model's parameters (``model.parameters()`` order).
        push_compressor / pull_compressor: encode gradients / decode parameters.
        liveness: heartbeats and the abort flag.
        timeout_s: see the module docstring.
    """

    def __init__(
        self,
        transport: Transport,
        shards: Sequence[Shard],
        params: Sequence[torch.Tensor],
        push_compressor: Compressor,
        pull_compressor: Compressor,
        liveness: Liveness,
        timeout_s: float,
    ) -> None:
        self.t = transport
        self.rank = transport.rank
        self.shards = list(shards)
        self.servers = [s.server for s in self.shards]
        self.params = list(params)
        self.push_c = push_compressor
        self.pull_c = pull_compressor
        self.live = liveness
        self.timeout_s = float(timeout_s)
        self.dtype = self.params[0].dtype
        self.clock = 0
        self.version = {s: 0 for s in self.servers}
        self.stop_requested = False
        self.last_lag = 0
        self.stats = WorkerStats(rank=self.rank)
        self._inbox: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._t_last = time.perf_counter()
        self._bytes_in = 0
        self.finished = False
        self.last_step: dict[str, float] = {}

    # ------------------------------------------------------------------ lifecycle

    def connect(self) -> None:
        """Start the receivers and pull the initial parameters from every server."""
        for s in self.servers:
            th = threading.Thread(target=self._receive, args=(s,), name=f"ps-recv-{self.rank}<-{s}", daemon=True)
            th.start()
            self._threads.append(th)
        self._guard("connect", lambda: self._exchange(OP_PULL, None, OP_PARAMS, 4 * self.timeout_s))
        self._t_last = time.perf_counter()

    def step(self) -> None:
        """Push the current gradients, wait for the policy's release, pull the parameters."""
        if self.finished:
            raise DTrainError(f"rank {self.rank}: ps.step() after ps.finish()")
        t0 = time.perf_counter()
        compute = t0 - self._t_last
        grads = [p.grad for p in self.params]
        timing = self._guard("step", lambda: self._exchange(OP_PUSH, grads, OP_PARAMS, 4 * self.timeout_s))
        with torch.no_grad():
            for p in self.params:
                p.grad = None
        t1 = time.perf_counter()
        push_s, wait_s = timing
        pull_s = t1 - t0 - push_s - wait_s
        st = self.stats
        st.steps += 1
        st.compute_s += compute
        st.push_s += push_s
        st.wait_s += wait_s
        st.pull_s += pull_s
        self.last_step = dict(compute_s=compute, push_s=push_s, wait_s=wait_s, pull_s=pull_s)
        self._t_last = t1
        tracer = _trace.current()
        if tracer is not None:  # the exchange's three phases; the reply's staleness on the wait
            tracer.add("ps push", t0, push_s, clock=self.clock)
            tracer.add("ps wait for servers", t0 + push_s, wait_s, staleness=self.last_lag, clock=self.clock)
            tracer.add("ps pull", t0 + push_s + wait_s, pull_s)

    def finish(self) -> None:
        """Tell every server this worker is done; wait for the final parameters (sent once all workers are done)."""
        if self.finished:
            return
        try:
            self._guard("finish", lambda: self._exchange(OP_FINISH, None, OP_BYE, None))
        finally:
            self.finished = True
            self._stop.set()
            self.live.stop()
        for th in self._threads:
            th.join(timeout=1.0)

    # ------------------------------------------------------------------ checkpoint state

    def state_dict(self) -> dict[str, Any]:
        """This worker's part of a checkpoint (between steps): its clock and its compressors' state."""
        return {
            "clock": self.clock,
            "version": dict(self.version),
            "push_compressor": self.push_c.state_dict(),
            "pull_compressor": self.pull_c.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output before :meth:`connect` (whose pull then carries the saved clock)."""
        if self._threads:
            raise DTrainError(f"rank {self.rank}: load the worker's state before connect()")
        self.clock = int(state["clock"])
        self.push_c.load_state_dict(state["push_compressor"])
        self.pull_c.load_state_dict(state["pull_compressor"])

    # ------------------------------------------------------------------ exchange

    def _guard(self, op: str, fn: Any) -> Any:
        try:
            return fn()
        except Exception as e:
            if not isinstance(e, (RunAbortedError, DroppedError)):
                self.live.abort(f"worker rank {self.rank} stopped: {e}")
            self._stop.set()
            self.live.stop()
            self.finished = True
            raise

    def _exchange(
        self, op: int, grads: list[torch.Tensor | None] | None, reply_op: int, limit_s: float | None
    ) -> tuple[float, float]:
        t0 = time.perf_counter()
        clock = self.clock + 1 if op == OP_PUSH else self.clock
        keep: list[torch.Tensor] = []
        works: list[tuple[int, Work]] = []
        sent_before = self.t.stats.bytes_sent
        try:
            for shard in self.shards:
                s = shard.server
                if op == OP_PUSH:
                    assert grads is not None
                    flat = shard.gather(grads, self.params).to(self.dtype)
                    # the shard's layout lets PowerSGD factor each whole weight matrix (cut pieces go as vectors)
                    layout = [tuple(self.params[pc.index].shape) if pc.whole else (pc.numel,) for pc in shard.pieces]
                    buf = self.push_c.to_wire(flat, f"ps/shard{s}", shapes=layout)
                    keep.append(buf)
                    h = Header(OP_PUSH, clock, self.version[s], buf.numel())
                    msg = send_message(self.t, s, h, buf)
                else:
                    msg = send_message(self.t, s, Header(op, clock, self.version[s] if op == OP_FINISH else 0))
                works += [(s, w) for w in msg]
            for server, w in works:
                s = server  # the handler below names the server whose send failed
                w.wait()
        except CommError as e:
            s = e.peer if e.peer is not None else s
            raise PeerLostError(
                self.rank, OP_NAME[op], f"server rank {s} is gone: send failed ({brief(e)})", peer=s, step=clock
            ) from None
        self.stats.bytes_sent += self.t.stats.bytes_sent - sent_before
        t1 = time.perf_counter()
        replies = self._wait(reply_op, clock, limit_s)
        t2 = time.perf_counter()
        lag = 0
        for shard in self.shards:
            h, flat = replies[shard.server]
            shard.scatter(flat, self.params)
            self.version[shard.server] = h.version
            if h.flags & FLAG_STOP:
                self.stop_requested = True
            lag = max(lag, h.lag)
        self.last_lag = lag
        self.stats.clock_lag_max = max(self.stats.clock_lag_max, lag)
        self.clock = clock
        return t1 - t0, t2 - t1

    def _wait(self, reply_op: int, clock: int, limit_s: float | None) -> dict[int, tuple[Header, torch.Tensor]]:
        what = OP_NAME.get(reply_op, "reply")
        got: dict[int, tuple[Header, torch.Tensor]] = {}
        start = time.monotonic()
        while len(got) < len(self.servers):
            try:
                ev = self._inbox.get(timeout=0.1)
            except queue.Empty:
                ev = None
            if ev is not None:
                kind, s = ev[0], ev[1]
                if kind == "lost":
                    reason = self.live.aborted(refresh=True)
                    if reason:  # the server stopped on purpose and said why
                        raise RunAbortedError(self.rank, what, f"run aborted: {reason}", step=clock)
                    raise PeerLostError(self.rank, what, f"server rank {s} is gone: {ev[2]}", peer=s, step=clock)
                if kind == "dropped":
                    raise DroppedError(
                        self.rank,
                        what,
                        f"server rank {s} dropped this worker (it was declared lost); the run goes on without it",
                        peer=s,
                        step=clock,
                    )
                if kind == "bad":
                    raise ProtocolError(
                        self.rank, what, f"rejected message from server rank {s}: {ev[2]}", peer=s, step=clock
                    )
                h, flat = ev[2], ev[3]
                if h.op != reply_op or h.clock != clock or s in got:
                    raise ProtocolError(
                        self.rank,
                        what,
                        f"unexpected {h} from server rank {s} (expected {OP_NAME[reply_op]} for clock {clock})",
                        peer=s,
                        step=clock,
                    )
                got[s] = (h, flat)
                continue
            reason = self.live.aborted(refresh=False)
            if reason:
                raise RunAbortedError(self.rank, what, f"run aborted: {reason}", step=clock)
            for s, why in self.live.lost().items():
                if s not in got:
                    raise lost_error(self.rank, what, f"server rank {s} is gone: {why}", why, peer=s, step=clock)
            waited = time.monotonic() - start
            if limit_s is not None and waited > limit_s:
                missing = sorted(set(self.servers) - set(got))
                raise CommTimeoutError(
                    self.rank, what, f"no reply from server ranks {missing} within {waited:.0f}s", step=clock
                )
        return got

    def _receive(self, s: int) -> None:
        numel = next(sh.numel for sh in self.shards if sh.server == s)
        while not self._stop.is_set():
            try:
                raw = recv_header(self.t, s)
            except CommTimeoutError:
                continue  # only in-process transports time out here
            except CommError as e:
                if not self._stop.is_set():
                    self._inbox.put(("lost", s, f"connection closed ({brief(e)})"))
                return
            try:
                h = Header.decode(raw, allowed=SERVER_OPS)
                if h.op == OP_DROPPED:
                    self._inbox.put(("dropped", s))
                    return
                if h.nbytes <= 0:
                    raise ValueError("a parameter reply without payload")
                buf = recv_payload(self.t, s, h.nbytes)
                flat = self.pull_c.from_wire(buf, (numel,), self.dtype)
                if tuple(flat.shape) != (numel,):
                    raise ValueError(f"parameters of shape {tuple(flat.shape)}, expected ({numel},)")
            except CommError as e:
                if not self._stop.is_set():
                    self._inbox.put(("lost", s, f"connection closed ({brief(e)})"))
                return
            except Exception as e:  # noqa: BLE001 - anything malformed is the sender's fault
                self._inbox.put(("bad", s, f"{type(e).__name__}: {e}"))
                return
            self.stats.bytes_received += 64 + h.nbytes
            self._inbox.put(("msg", s, h, flat))
            if h.op == OP_BYE:
                return


OP_NAME = {OP_PULL: "pull", OP_PUSH: "push", OP_FINISH: "finish", OP_PARAMS: "pull", OP_BYE: "finish"}
