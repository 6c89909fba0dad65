"""The parameter server's real server and worker code, with ranks as threads (ThreadTransport + HashStore).

Same code as over torch.distributed; only the transport and the store differ. Each
test builds S servers and W workers in one process and checks against a plain
single-process computation.
"""

import logging
import threading
import time

import pytest
import torch
import torch.distributed as dist
from _helpers import max_diff, train_steps
from torch import nn

from dtrain.comm.transport import ThreadTransport, run_threads
from dtrain.compress.base import Identity
from dtrain.errors import CommError, ConfigError, DTrainError
from dtrain.param_server import DroppedError, ParameterServer, PeerLostError, ProtocolError, RunAbortedError
from dtrain.param_server.protocol import OP_PULL, OP_PUSH, Header, recv_header, recv_payload, send_message

torch.set_num_threads(1)

IN, OUT, PER_WORKER = 8, 4, 4
FAULT_TIMEOUT = 2.0  # heartbeats of threads of one loaded process can stall for a second


_RNG = threading.Lock()  # ranks are threads: seeding the global generator must not interleave


def _model():
    with _RNG:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(IN, 32), nn.Tanh(), nn.Linear(32, OUT))


def _data(steps, workers):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(steps, workers * PER_WORKER, IN, generator=g)
    y = torch.randint(0, OUT, (steps, workers * PER_WORKER), generator=g)
    return x, y


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _adam(params):
    return torch.optim.Adam(params, lr=0.01)


def _reference(opt_factory, steps, workers):
    """Single-process synchronous SGD on the global batch."""
    m = _model()
    x, y = _data(steps, workers)
    train_steps(m, opt_factory(m.parameters()), zip(x, y))
    return [p.detach() for p in m.parameters()]


def _train(
    servers,
    workers,
    steps,
    consistency="bsp",
    opt_factory=_sgd,
    timeout_s=5.0,
    delay=None,
    worker_fn=None,
    after=None,
    **kw,
):
    """Run S servers + W workers as threads; returns per-rank (stats, final params or None).
    ``delay(i, s)``: seconds worker ``i`` waits before its push of step ``s`` (it may block instead and
    return 0); ``after(i, s)``: called once that step has returned."""
    store = dist.HashStore()
    ts = ThreadTransport.create(servers + workers, timeout=2.0)
    x, y = _data(steps, workers)

    def rank_fn(t):
        m = _model()
        if worker_fn is not None and t.rank >= servers:
            special = worker_fn(t, m, store)
            if special is not None:
                return special
        ps = ParameterServer(
            m,
            opt_factory,
            servers=servers,
            consistency=consistency,
            transport=t,
            store=store,
            timeout_s=timeout_s,
            **kw,
        )
        if ps.is_server:
            return ps.serve(), None
        i = ps.worker_index
        for s in range(steps):
            sl = slice(i * PER_WORKER, (i + 1) * PER_WORKER)
            nn.functional.cross_entropy(m(x[s, sl]), y[s, sl]).backward()
            if delay is not None:
                time.sleep(delay(i, s))
            ps.step()
            if after is not None:
                after(i, s)
            if ps.should_stop:
                break
        ps.finish()
        return ps.stats(), [p.detach().clone() for p in m.parameters()]

    return run_threads(servers + workers, rank_fn, timeout=20.0, transports=ts)


# ---------------------------------------------------------------------- equivalence


@pytest.mark.parametrize("servers", [1, 2, 3])
@pytest.mark.parametrize("opt", [_sgd, _adam], ids=["sgd_momentum", "adam"])
def test_bsp_equals_synchronous_sgd_on_the_global_batch(servers, opt):
    ref = _reference(opt, 12, 3)
    out = _train(servers, 3, 12, opt_factory=opt, min_split_bytes=0)
    for stats, params in out[servers:]:
        assert max_diff(params, ref) < 1e-5
        assert stats["steps"] == 12
    for stats, _ in out[:servers]:
        assert stats["updates"] == 12 and stats["staleness"]["max"] == 0


@pytest.mark.parametrize("spec", ["bsp", "backup:1"])
def test_the_update_does_not_depend_on_the_order_gradients_arrive_in(spec):
    """Adam in float32 turns last-bit differences of cancelling gradient elements into lr-sized steps;
    the same run with the workers' gradients arriving in opposite orders still ends bitwise equal,
    since the server sums them by worker (for backup:1, the first three of four, dropping the last)."""
    W, steps = 4, 6
    gap = 0.02  # worker i pushes i * gap after the first (or before, reversed)
    if spec == "bsp":
        runs = [
            _train(1, W, steps, consistency=spec, opt_factory=_adam, delay=d)
            for d in (lambda i, s: gap * i, lambda i, s: gap * (W - 1 - i))
        ]
    else:  # workers 0..2 come first in some order; worker 3 (the backup that is dropped) pushes once their
        runs = []  # step has returned, i.e. once the server has updated without it (an event, not a sleep)
        for first in (lambda i: gap * i, lambda i: gap * (2 - i)):
            done, cond = [0] * steps, threading.Condition()

            def delay(i, s, first=first, done=done, cond=cond):
                if i < 3:
                    return first(i)
                with cond:
                    assert cond.wait_for(lambda: done[s] == 3, timeout=10), f"step {s}: {done[s]} of 3 returned"
                return 0.0

            def after(i, s, done=done, cond=cond):
                with cond:
                    done[s] += int(i < 3)
                    cond.notify_all()

            runs.append(_train(1, W, steps, consistency=spec, opt_factory=_adam, delay=delay, after=after))
    for a, b in zip(runs[0][1:], runs[1][1:]):
        assert max_diff(a[1], b[1]) == 0.0
    if spec == "backup:1":
        assert all(set(r[0][0]["dropped"]) == {str(1 + 3)} for r in runs)  # the late one was the one dropped


# ---------------------------------------------------------------------- every policy runs


@pytest.mark.parametrize("spec", ["asp", "ssp:1", "softsync:2", "backup:1"])
def test_async_policies_account_for_every_gradient(spec):
    steps, W = 10, 3
    out = _train(2, W, steps, consistency=spec, delay=lambda i, s: 0.004 * (i == 2))
    for stats, _ in out[:2]:
        assert stats["received"] == W * steps
        applied = sum(stats["applied"].values())
        dropped = sum(stats["dropped"].values())
        assert applied + dropped == W * steps
        if spec == "backup:1":
            assert dropped > 0 and stats["staleness"]["max"] == 0
        else:
            assert dropped == 0
        if spec == "softsync:2":
            assert stats["updates"] == (W * steps + 1) // 2
        if spec.startswith("ssp"):
            assert stats["clock_lag"]["max"] <= 1
    for stats, _ in out[2:]:
        assert stats["steps"] == steps


def test_ssp_staleness_bound_holds_with_a_straggler():
    """Worker 2 sleeps 50 ms a step; under ssp:2 no applied gradient was read more than 2 clocks ahead."""
    out = _train(1, 3, 15, consistency="ssp:2", delay=lambda i, s: 0.05 * (i == 2))
    stats = out[0][0]
    assert stats["clock_lag"]["max"] >= 1  # the fast workers run ahead of the straggler ...
    assert all(int(k) <= 2 for k in stats["clock_lag"]["hist"])  # ... and never exceeded
    assert max(w[0]["clock_lag_max"] for w in out[1:]) <= 2


def test_staleness_lr_scales_the_step():
    """asp with staleness_lr on one worker: never stale, so identical to asp; the flag is recorded."""
    a = _train(1, 1, 6, consistency="asp", opt_factory=_sgd)
    b = _train(1, 1, 6, consistency="asp", opt_factory=_sgd, staleness_lr=True)
    assert max_diff(a[1][1], b[1][1]) == 0.0
    assert b[0][0]["consistency"] == "asp+staleness_lr"


def test_staleness_lr_divides_each_step_by_its_staleness():
    """Three workers push one gradient each, all computed on version 0, in the order 0, 1, 2:
    staleness 0, 1, 2, so plain SGD applies g0 + g1 + g2 / 2 (staleness 0 counts as 1)."""
    plain_sgd = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    store = dist.HashStore()
    ts = ThreadTransport.create(4, timeout=2.0)
    x, y = _data(1, 3)
    turn = [threading.Event() for _ in range(4)]
    turn[0].set()
    connected = threading.Barrier(3)  # every worker has pulled version 0 before the first push

    def rank_fn(t):
        m = _model()
        ps = ParameterServer(
            m, plain_sgd, servers=1, consistency="asp", staleness_lr=True, transport=t, store=store, timeout_s=10
        )
        if ps.is_server:
            return ps.serve()
        connected.wait(10)
        i = ps.worker_index
        sl = slice(i * PER_WORKER, (i + 1) * PER_WORKER)
        nn.functional.cross_entropy(m(x[0, sl]), y[0, sl]).backward()
        turn[i].wait(10)  # push in worker order: each after the previous one's reply
        ps.step()
        turn[i + 1].set()
        ps.finish()
        return [p.detach().clone() for p in m.parameters()]

    out = run_threads(4, rank_fn, timeout=20.0, transports=ts)
    m = _model()
    grads = []
    for i in range(3):
        m.zero_grad()
        sl = slice(i * PER_WORKER, (i + 1) * PER_WORKER)
        nn.functional.cross_entropy(m(x[0, sl]), y[0, sl]).backward()
        grads.append([p.grad.clone() for p in m.parameters()])
    expected = [p.detach() - 0.1 * (g0 + g1 + 0.5 * g2) for p, g0, g1, g2 in zip(m.parameters(), *grads)]
    assert out[0]["staleness"]["hist"] == {"0": 1, "1": 1, "2": 1}
    assert max_diff(out[1], expected) < 1e-6


def test_gradient_budget_stops_the_workers():
    out = _train(1, 2, 50, consistency="asp", max_gradients=7)
    steps = [w[0]["steps"] for w in out[1:]]
    assert 7 <= sum(steps) <= 8 and all(s < 50 for s in steps)


def test_compression_hook_is_used_on_the_push():
    """FP16 pushes: half the payload bytes, parameters within fp16 rounding of the exact run."""
    from dtrain.compress import from_spec

    exact = _train(1, 2, 5)
    half = _train(1, 2, 5, compression=from_spec("fp16"))
    assert max_diff(exact[1][1], half[1][1]) < 1e-2
    assert half[1][0]["bytes_sent"] < 0.6 * exact[1][0]["bytes_sent"]


# ---------------------------------------------------------------------- faults


def _hang_after(n, spec):
    """A worker that trains n steps, then stops heartbeating and sending (a hung process)."""

    def fn(t, m, store):
        if t.rank != t.world_size - 1:
            return None
        ps = ParameterServer(m, _sgd, servers=1, consistency=spec, transport=t, store=store, timeout_s=FAULT_TIMEOUT)
        x, y = _data(n, 1)
        for s in range(n):
            nn.functional.cross_entropy(m(x[s]), y[s]).backward()
            ps.step()
        ps._live.stop()  # the heartbeat stops: the server must find out by itself
        ps._client._stop.set()  # (lets this thread's receivers end)
        return "hung"

    return fn


def test_hung_worker_is_dropped_after_the_timeout_under_asp(caplog):
    with caplog.at_level(logging.WARNING, logger="dtrain.param_server"):
        out = _train(
            1,
            3,
            12,
            consistency="asp",
            timeout_s=FAULT_TIMEOUT,
            worker_fn=_hang_after(3, "asp"),
            delay=lambda i, s: 0.05,
        )
    server = out[0][0]
    assert list(server["lost"]) == ["3"] and "no heartbeat" in server["lost"]["3"]
    assert out[3] == "hung"
    assert [w[0]["steps"] for w in out[1:3]] == [12, 12]  # the others went on
    assert server["received"] == 3 + 24
    assert any("dropping worker rank 3" in r.getMessage() for r in caplog.records)


def test_a_dropped_worker_that_comes_back_is_told_and_the_run_goes_on():
    """The last worker stalls past the timeout (no heartbeat), is dropped, then pushes again:
    it gets DroppedError, and the others finish normally."""

    def fn(t, m, store):
        if t.rank != t.world_size - 1:
            return None
        ps = ParameterServer(m, _sgd, servers=1, consistency="asp", transport=t, store=store, timeout_s=FAULT_TIMEOUT)
        x, y = _data(3, 1)
        for s in range(2):
            nn.functional.cross_entropy(m(x[s]), y[s]).backward()
            ps.step()
        ps._live.stop()
        time.sleep(2.2 * FAULT_TIMEOUT)  # a stall: the server drops it
        nn.functional.cross_entropy(m(x[2]), y[2]).backward()
        with pytest.raises(DroppedError, match="server rank 0 dropped this worker"):
            ps.step()
        return "dropped"

    # the others outlast the stall, so the server is still serving when it comes back
    out = _train(1, 3, 25, consistency="asp", timeout_s=FAULT_TIMEOUT, worker_fn=fn, delay=lambda i, s: 0.25)
    assert out[3] == "dropped"
    assert list(out[0][0]["lost"]) == ["3"]
    assert [w[0]["steps"] for w in out[1:3]] == [25, 25]


def test_hung_worker_stops_a_bsp_run_with_its_name():
    with pytest.raises((PeerLostError, RunAbortedError), match="worker rank 3 was lost"):
        _train(1, 3, 8, consistency="bsp", timeout_s=FAULT_TIMEOUT, worker_fn=_hang_after(2, "bsp"))


def _rogue(kind):
    """A worker that pulls, then sends one malformed message of ``kind`` to server 0."""

    def fn(t, m, store):
        hdr = recv = None
        send_message(t, 0, Header(OP_PULL))
        recv = recv_header(t, 0)
        recv_payload(t, 0, int(recv[4]))
        n = sum(p.numel() for p in m.parameters())
        good = Identity().to_wire(torch.ones(n), "k")
        if kind == "unknown op":
            hdr = Header(99)
            send_message(t, 0, hdr)
        elif kind == "wrong shape":
            bad = Identity().to_wire(torch.ones(n + 3), "k")
            send_message(t, 0, Header(OP_PUSH, 1, 0, bad.numel()), bad)
        elif kind == "wrong clock":
            send_message(t, 0, Header(OP_PUSH, 5, 0, good.numel()), good)
        elif kind == "bad magic":
            t.send(torch.tensor([1, OP_PUSH, 1, 0, 0, 0, 0, 0]), 0, 7101)
        elif kind == "wrong version":
            send_message(t, 0, Header(OP_PUSH, 1, 3, good.numel()), good)
        return "rogue"

    return fn


@pytest.mark.parametrize(
    "kind,words",
    [
        ("unknown op", "unknown or unexpected op 99"),
        ("wrong shape", "does not decode to"),
        ("wrong clock", "sent clock 5, expected 1"),
        ("bad magic", "bad magic"),
        ("wrong version", "read version 3"),
    ],
)
def test_malformed_message_is_rejected_naming_the_sender(kind, words):
    store = dist.HashStore()
    ts = ThreadTransport.create(2, timeout=2.0)
    init = [p.detach().clone() for p in _model().parameters()]

    def rank_fn(t):
        m = _model()
        if t.rank == 1:
            return _rogue(kind)(t, m, store)
        ps = ParameterServer(m, _sgd, servers=1, consistency="asp", transport=t, store=store, timeout_s=30)
        try:
            ps.serve()
        except ProtocolError as e:
            return e, ps._server.flat_parameters(), ps.stats()
        return None

    err, flat, stats = run_threads(2, rank_fn, timeout=10.0, transports=ts)[0]
    assert err.peer == 1 and "from worker rank 1" in str(err) and words in str(err)
    assert "nothing was applied" in str(err)
    assert torch.equal(flat, torch.cat([p.reshape(-1) for p in init]))
    assert stats["updates"] == 0


def test_configuration_errors_come_before_anything_starts():
    ts = ThreadTransport.create(2)
    store = dist.HashStore()
    with pytest.raises(ConfigError, match="at least one worker"):
        ParameterServer(_model(), _sgd, servers=2, transport=ts[0], store=store)
    with pytest.raises(ConfigError, match="unknown consistency"):
        ParameterServer(_model(), _sgd, consistency="fast", transport=ts[0], store=store)
    with pytest.raises(ConfigError, match="servers must be"):
        ParameterServer(_model(), _sgd, servers=0, transport=ts[0], store=store)
    with pytest.raises(ConfigError, match="timeout_s"):
        ParameterServer(_model(), _sgd, timeout_s=0, transport=ts[0], store=store)
    with pytest.raises(ConfigError, match="one dtype"):
        m = _model()
        m[0].double()
        ParameterServer(m, _sgd, transport=ts[0], store=store)
    with pytest.raises(ConfigError, match="store"):
        ParameterServer(_model(), _sgd, transport=ts[0])
    with pytest.raises(ConfigError, match="backup:1 needs more than 1 workers"):
        ParameterServer(_model(), _sgd, consistency="backup:1", transport=ts[1], store=store)


def test_roles_are_enforced():
    def rank_fn(t):
        store = shared
        ps = ParameterServer(_model(), _sgd, servers=1, transport=t, store=store, timeout_s=5)
        if ps.is_server:
            with pytest.raises(DTrainError, match="is a server"):
                ps.step()
            ps.serve()
            return repr(ps)
        with pytest.raises(DTrainError, match="is a worker"):
            ps.serve()
        ps.finish()
        with pytest.raises(DTrainError, match="after ps.finish"):
            ps._client.step()
        return repr(ps)

    shared = dist.HashStore()
    out = run_threads(2, rank_fn, timeout=10.0)
    assert out == [
        "ParameterServer(rank=0, server, servers=1, workers=1, consistency='bsp')",
        "ParameterServer(rank=1, worker 0, servers=1, workers=1, consistency='bsp')",
    ]


def test_a_hung_server_stops_the_workers_with_its_name():
    """Server 1 never serves and stops heartbeating; workers stop with an error naming it, and so does server 0."""
    store = dist.HashStore()
    ts = ThreadTransport.create(4, timeout=2.0)

    def rank_fn(t):
        if t.rank == 1:
            ps = ParameterServer(
                _model(), _sgd, servers=2, consistency="asp", transport=t, store=store, timeout_s=FAULT_TIMEOUT
            )
            ps._live.stop()
            return "hung"
        with pytest.raises(CommError) as ei:
            ps = ParameterServer(
                _model(), _sgd, servers=2, consistency="asp", transport=t, store=store, timeout_s=FAULT_TIMEOUT
            )
            ps.serve()
        return ei.value

    out = run_threads(4, rank_fn, timeout=15.0, transports=ts)
    assert out[1] == "hung"
    for e in out[2:]:
        assert isinstance(e, PeerLostError) and e.peer == 1 and "server rank 1 is gone" in str(e), e
    assert isinstance(out[0], RunAbortedError) and "server rank 1 is gone" in str(out[0])


@pytest.mark.parametrize("spec", ["asp", "backup:1"])
def test_applied_samples_count_what_the_servers_applied(spec):
    """merge_stats' computed vs applied samples: equal under asp; under backup:1 with W workers
    an update applies at most W - 1 gradients, and the dropped ones are exactly the difference."""
    from dtrain.param_server.runner import format_table, merge_stats

    steps, W = 8, 3
    out = _train(1, W, steps, consistency=spec, delay=lambda i, s: 0.004 * (i == 2))
    m = merge_stats([st for st, _ in out], batch_per_worker=PER_WORKER)
    server = out[0][0]
    assert m["gradients_computed"] == W * steps
    assert m["samples_computed"] == W * steps * PER_WORKER
    assert m["gradients_applied"] == sum(server["applied"].values())
    assert m["samples_applied"] == m["samples_computed"] - PER_WORKER * sum(server["dropped"].values())
    if spec == "asp":
        assert m["samples_applied"] == m["samples_computed"]
    else:
        # W - 1 gradients per update while all W work; fewer once the fast ones have finished their steps
        assert server["updates"] <= m["gradients_applied"] <= (W - 1) * server["updates"]
        assert m["samples_applied"] < m["samples_computed"]
    assert f"samples: {m['samples_computed']} computed, {m['samples_applied']} applied" in format_table(m)
