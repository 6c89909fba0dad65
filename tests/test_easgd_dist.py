"""EASGD / EAMSGD (dtrain.decentralized.easgd) in real processes (gloo over loopback).

Two spawns of 4 processes: one runs every synchronous scenario (4 workers) and returns the
replicas, the centers and the byte counts, with rank 0 also running the single-process
reference -- the paper's update equations written out on 4 simulated replicas; the other runs
the server form (1 server + 3 workers; then 1 server + 1 worker on a subgroup, against the
synchronous form on one rank). The bad-input checks need no process.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _dist import guard as _guard
from _dist import spawn
from _helpers import max_diff
from torch import nn

WORLD = 4
STEPS = 20
LR = 0.1
ALPHA = 0.1
BATCH = 8
TOL = 1e-5  # float32: the ring sums the elastic differences in another order than the reference
# name -> (local momentum, nesterov, period, the center's momentum)
SYNC = {
    "sgd-p1": (0.0, False, 1, 0.0),
    "momentum-p1": (0.9, False, 1, 0.0),
    "sgd-p3": (0.0, False, 3, 0.0),
    "momentum-p3": (0.9, False, 3, 0.0),
    "eamsgd-nesterov-p3": (0.9, True, 3, 0.0),
    "center-momentum-p2": (0.9, False, 2, 0.5),
}
HEADER = 64 + 7  # a parameter-server message's header, and its payload's description (one 1-D float32 tensor)


def _mlp() -> nn.Module:
    torch.manual_seed(0)  # 8*16 + 16 + 16*4 + 4 = 212 parameters: a multiple of 4, so the ring's segments are equal
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


@functools.cache
def _batch(worker: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * worker + step)
    return torch.randn(BATCH, 8, generator=g), torch.randint(0, 4, (BATCH,), generator=g)


def _np(ts: Any) -> list[Any]:
    # numpy, not tensors: tensors cross the result queue as shared-memory handles that die with the worker
    return [t.detach().clone().numpy() for t in ts]


def _rounds(period: int, steps: int = STEPS) -> int:
    return sum(1 for t in range(1, steps) if t % period == 0)


Params = list[torch.Tensor]


def _reference(
    momentum: float,
    nesterov: bool,
    period: int,
    center_momentum: float,
    workers: int = WORLD,
    steps: int = STEPS,
    lr: float = LR,
    alpha: float = ALPHA,
) -> tuple[list[Params], Params]:
    """The paper's synchronous EASGD (eq. 5-6, tau as in Algorithm 1) on ``workers`` simulated replicas:

    x_i <- x_i - lr * s_i(g_i(x_i)) - alpha (x_i - c)   (the elastic term only when t > 0 and period | t)
    c   <- c + sum_i alpha (x_i - c)                     (with the center's momentum: u <- m u - sum; c <- c - u)

    with the local step ``s_i`` torch's SGD rule: ``g``, or heavy-ball ``v <- mu v + g`` (Nesterov: ``g + mu v``).
    """
    from torch.func import functional_call

    net = _mlp()
    names = [n for n, _ in net.named_parameters()]
    c = [p.detach().clone() for p in net.parameters()]
    x = [[p.clone() for p in c] for _ in range(workers)]
    v: list[list[torch.Tensor | None]] = [[None] * len(c) for _ in range(workers)]
    u: list[torch.Tensor | None] = [None] * len(c)
    for t in range(steps):
        elastic = t > 0 and t % period == 0
        total = [torch.zeros_like(ck) for ck in c]
        new = []
        for i in range(workers):
            xi = [p.clone().requires_grad_(True) for p in x[i]]
            xb, yb = _batch(i, t)
            g = torch.autograd.grad(F.cross_entropy(functional_call(net, dict(zip(names, xi)), (xb,)), yb), xi)
            out = []
            for k in range(len(c)):
                s = g[k]
                if momentum:
                    vk = v[i][k]
                    v[i][k] = vk = g[k].clone() if vk is None else momentum * vk + g[k]
                    s = g[k] + momentum * vk if nesterov else vk
                xk = x[i][k] - lr * s
                if elastic:
                    d = alpha * (x[i][k] - c[k])
                    xk = xk - d
                    total[k] += d
                out.append(xk)
            new.append(out)
        if elastic:
            for k in range(len(c)):
                uk = u[k]
                u[k] = uk = -total[k] if uk is None or not center_momentum else center_momentum * uk - total[k]
                c[k] = c[k] - uk
        x = new
    return x, c


def _train(
    easgd: Any, model: nn.Module, opt: torch.optim.Optimizer, worker: int, steps: int = STEPS, lockstep: bool = False
) -> None:
    import torch.distributed as dist

    for t in range(steps):
        x, y = _batch(worker, t)
        opt.zero_grad()
        F.cross_entropy(easgd(x), y).backward()
        opt.step()
        easgd.step()
        if lockstep:  # the workers alone (easgd.group): no worker runs a round ahead of the others
            dist.barrier(group=easgd.group)


def _center(easgd: Any, model: nn.Module) -> list[Any]:
    sd = easgd.center_state_dict()
    return [sd[n].numpy() for n, _ in model.named_parameters()]


# ---------------------------------------------------------------------- synchronous: 4 workers


def _sync_scenario(rank: int, name: str) -> dict[str, Any]:
    from dtrain.decentralized import EASGD

    mom, nesterov, period, center_mom = SYNC[name]
    model = _mlp()
    with torch.no_grad():  # the wrapper must start every replica from rank 0's parameters
        for p in model.parameters():
            p.add_(0.01 * rank)
    easgd = EASGD(model, alpha=ALPHA, period=period, momentum=center_mom, timeout=60)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=mom, nesterov=nesterov)
    _train(easgd, model, opt, rank)
    avg = easgd.averaged_state_dict()
    return {
        "replica": _np(model.parameters()),
        "center": _center(easgd, model),
        "averaged": [avg[n].numpy() for n, _ in model.named_parameters()],
        "consensus": easgd.consensus_distance(),
        "stats": easgd.stats(),
        "expected": easgd.expected_bytes_per_step(),
        "model_bytes": easgd.model_bytes,
    }


def _sync_bad_alpha() -> str:
    from dtrain.decentralized import EASGD

    try:
        EASGD(_mlp(), alpha=0.45)  # (4 + 1) * 0.45 >= 2
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return "no error"


def _sync_warning() -> list[str]:
    from dtrain.decentralized import EASGD

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        EASGD(_mlp(), alpha=0.3)  # beta = 4 * 0.3 > 1, (4 + 1) * 0.3 < 2
    return [f"{w.category.__name__}: {w.message}" for w in caught]


def _sync_runs(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    res: dict[str, Any] = {name: _guard(lambda: _sync_scenario(rank, name)) for name in SYNC}
    res["bad_alpha"] = _sync_bad_alpha()
    res["warning"] = _guard(_sync_warning)
    if rank == 0:
        res["reference"] = {}
        for name, (mom, nesterov, period, center_mom) in SYNC.items():
            xs, c = _reference(mom, nesterov, period, center_mom)
            res["reference"][name] = {"replicas": [_np(x) for x in xs], "center": _np(c)}
    return res


def _spawn_ok(fn: Any, *args: Any, timeout: float) -> list[Any]:
    outs = spawn(fn, WORLD, *args, timeout=timeout, pg_timeout=120)
    bad = [o for o in outs if o.status != "ok"]
    assert not bad, "\n".join(f"rank {o.rank}: {o.status}\n{o.error}" for o in bad)
    return [o.value for o in outs]


@pytest.fixture(scope="module")
def sync_runs() -> list[Any]:
    return _spawn_ok(_sync_runs, timeout=300)


def _scenario(runs: list[Any], rank: int, name: str) -> dict[str, Any]:
    r = runs[rank][name]
    assert "error" not in r, f"rank {rank}, {name}: {r['error']}"
    return r


@pytest.mark.procs
@pytest.mark.parametrize("name", list(SYNC))
def test_sync_easgd_equals_the_paper_equations_on_4_simulated_replicas(sync_runs: list[Any], name: str) -> None:
    """After 20 float32 steps every worker's replica equals replica i of the paper's equations run in one
    process, and every worker's center equals the reference center, to < 1e-5."""
    ref = sync_runs[0]["reference"][name]
    for rank in range(WORLD):
        r = _scenario(sync_runs, rank, name)
        d_rep = max_diff(r["replica"], ref["replicas"][rank])
        d_cen = max_diff(r["center"], ref["center"])
        print(f"{name}, worker {rank}: max |replica - reference| = {d_rep:.3g}, |center - reference| = {d_cen:.3g}")
        assert d_rep < TOL, (name, rank, d_rep)
        assert d_cen < TOL, (name, rank, d_cen)
    # the replicas really differ from each other and from the center (the elastic force is not a full average)
    spread = max_diff(ref["replicas"][0], ref["replicas"][1])
    assert spread > 1e-3, spread
    assert max_diff(ref["replicas"][0], ref["center"]) > 1e-3


@pytest.mark.procs
@pytest.mark.parametrize("name", ["sgd-p1", "momentum-p3"])
def test_sync_averaged_state_dict_and_consensus_distance(sync_runs: list[Any], name: str) -> None:
    """averaged_state_dict is the mean of the reference replicas; consensus_distance their spread."""
    ref = sync_runs[0]["reference"][name]
    reps = [[torch.as_tensor(a) for a in rep] for rep in ref["replicas"]]
    mean = [sum(rep[k] for rep in reps) / WORLD for k in range(len(reps[0]))]
    flat = [torch.cat([t.reshape(-1) for t in rep]).double() for rep in reps]
    m = sum(flat) / WORLD
    spread = math.sqrt(float(sum(((f - m) ** 2).sum() for f in flat)) / WORLD)
    for rank in range(WORLD):
        r = _scenario(sync_runs, rank, name)
        assert max_diff(r["averaged"], mean) < TOL
        assert r["consensus"] == pytest.approx(spread, rel=1e-4)


@pytest.mark.procs
@pytest.mark.parametrize("name", list(SYNC))
def test_sync_bytes_per_elastic_round_equal_the_closed_form(sync_runs: list[Any], name: str) -> None:
    """Per round every rank sends 2 (N-1)/N of the model (ring allreduce of d), in 2 (N-1) messages."""
    period = SYNC[name][2]
    for rank in range(WORLD):
        r = _scenario(sync_runs, rank, name)
        st = r["stats"]
        assert st["rounds"] == _rounds(period), st
        assert st["steps"] == STEPS
        closed = 2 * (WORLD - 1) / WORLD * r["model_bytes"]
        assert r["expected"] == pytest.approx(closed / period)
        assert st["bytes_sent"] == st["rounds"] * closed, (st, closed)
        assert st["messages"] == st["rounds"] * 2 * (WORLD - 1), st


@pytest.mark.procs
def test_sync_stability_rule(sync_runs: list[Any]) -> None:
    """(N + 1) alpha >= 2 is a ConfigError naming alpha on every rank; N alpha > 1 only warns."""
    for rank in range(WORLD):
        msg = sync_runs[rank]["bad_alpha"]
        assert msg.startswith("ConfigError") and "alpha=0.45" in msg, msg
        caught = sync_runs[rank]["warning"]
        assert not isinstance(caught, dict), caught
        assert any(w.startswith("UserWarning") and "alpha=0.3" in w for w in caught), caught


# ---------------------------------------------------------------------- server form


def _perturb(model: nn.Module, worker: int) -> None:
    g = torch.Generator().manual_seed(77 + worker)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=g))


def _server_invariant(rank: int) -> dict[str, Any]:
    """1 server + 3 workers, lr 0: only elastic exchanges move anything. The workers keep in step (a
    barrier on their own group after each step): left alone, a worker that starts first may finish
    all its rounds before the others begin, and then the center leaves it behind (that is
    asynchronous EASGD too, but the contraction checked below needs the workers interleaved)."""
    from dtrain.decentralized import EASGD

    model = _mlp()
    easgd = EASGD(model, alpha=ALPHA, period=1, center="server", servers=1, timeout=60)
    if easgd.is_server:
        try:
            easgd.step()
            misuse = "no error"
        except Exception as e:  # noqa: BLE001
            misuse = f"{type(e).__name__}: {e}"
        return {"role": "server", "misuse": misuse, "serve": easgd.serve()}
    start_center = _center(easgd, model)
    _perturb(model, easgd.worker_index)
    start = _np(model.parameters())
    dist0 = easgd.consensus_distance()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    _train(easgd, model, opt, easgd.worker_index, lockstep=True)
    stats = easgd.stats()
    dist1 = easgd.consensus_distance()
    avg = easgd.averaged_state_dict()
    final = _np(model.parameters())
    easgd.finish()
    return {
        "role": "worker",
        "start": start,
        "start_center": start_center,
        "final": final,
        "center": _center(easgd, model),
        "stats": stats,
        "expected": easgd.expected_bytes_per_step(),
        "model_bytes": easgd.model_bytes,
        "consensus": (dist0, dist1),
        "averaged": [avg[n].numpy() for n, _ in model.named_parameters()],
    }


def _server_training(rank: int) -> dict[str, Any]:
    """1 server + 3 workers, EAMSGD (Nesterov momentum), period 2, beta = 0.9, each worker on a fixed batch."""
    from dtrain.decentralized import EASGD

    model = _mlp()
    easgd = EASGD(model, alpha=0.3, period=2, center="server", servers=1, timeout=60)
    if easgd.is_server:
        return {"role": "server", "serve": easgd.serve()}
    w = easgd.worker_index
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, nesterov=True)
    x, y = _batch(w, 0)
    for _ in range(STEPS):
        opt.zero_grad()
        F.cross_entropy(easgd(x), y).backward()
        opt.step()
        easgd.step()
    stats = easgd.stats()
    easgd.finish()
    return {"role": "worker", "center": _center(easgd, model), "stats": stats}


def _one_worker(rank: int, group: Any, mom: float, period: int, center_mom: float) -> dict[str, Any] | None:
    """1 server + 1 worker on ``group`` = ranks [0, 1]; the worker then runs the synchronous form alone."""
    import torch.distributed as dist

    from dtrain.decentralized import EASGD

    if rank > 1:
        return None
    model = _mlp()
    easgd = EASGD(
        model, alpha=ALPHA, period=period, center="server", servers=1, momentum=center_mom, group=group, timeout=60
    )
    if easgd.is_server:
        easgd.serve()
        return None
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=mom)
    _train(easgd, model, opt, 0)
    easgd.finish()
    out: dict[str, Any] = {"server": (_np(model.parameters()), _center(easgd, model))}
    solo = dist.new_group([1], use_local_synchronization=True)
    model2 = _mlp()
    sync = EASGD(model2, alpha=ALPHA, period=period, momentum=center_mom, group=solo, timeout=60)
    opt2 = torch.optim.SGD(model2.parameters(), lr=LR, momentum=mom)
    _train(sync, model2, opt2, 0)
    out["sync"] = (_np(model2.parameters()), _center(sync, model2))
    xs, c = _reference(mom, False, period, center_mom, workers=1)
    out["reference"] = (_np(xs[0]), _np(c))
    return out


ONE_WORKER = {"sgd-p1": (0.0, 1, 0.0), "momentum-p3-center-momentum": (0.9, 3, 0.5)}


def _server_runs(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    from dtrain.decentralized import EASGD

    torch.set_num_threads(1)
    res: dict[str, Any] = {}
    try:
        EASGD(_mlp(), center="server", servers=4)  # 4 processes: no worker left
        res["too_many_servers"] = "no error"
    except Exception as e:  # noqa: BLE001
        res["too_many_servers"] = f"{type(e).__name__}: {e}"
    res["invariant"] = _server_invariant(rank)
    res["training"] = _server_training(rank)
    pair = dist.new_group([0, 1])
    for name, args in ONE_WORKER.items():
        res[name] = _one_worker(rank, pair, *args)
    return res


@pytest.fixture(scope="module")
def server_runs() -> list[Any]:
    return _spawn_ok(_server_runs, timeout=300)


def _workers(runs: list[Any], key: str) -> list[dict[str, Any]]:
    assert runs[0][key]["role"] == "server"
    return [runs[r][key] for r in range(1, WORLD)]


def _flat(ts: list[Any]) -> torch.Tensor:
    return torch.cat([torch.as_tensor(t).reshape(-1) for t in ts]).double()


@pytest.mark.procs
def test_server_form_conserves_the_sum_of_replicas_and_center(server_runs: list[Any]) -> None:
    """lr 0: every exchange moves x_i by -d and the center by +d, so sum_i x_i + x~ is conserved (to 1e-5);
    the replicas move toward the center and the center toward the replicas."""
    ws = _workers(server_runs, "invariant")
    c0, c1 = _flat(ws[0]["start_center"]), _flat(ws[0]["center"])
    for w in ws[1:]:  # every worker got the same start and the same final center
        assert max_diff(w["start_center"], ws[0]["start_center"]) == 0.0
        assert max_diff(w["center"], ws[0]["center"]) == 0.0
    before = sum(_flat(w["start"]) for w in ws) + c0
    after = sum(_flat(w["final"]) for w in ws) + c1
    drift = float((after - before).abs().max())
    print(f"max |sum x_i + x~ (end) - (start)| = {drift:.3g}")
    assert drift < 1e-5, drift
    for w in ws:  # each replica moved toward the center
        assert float((_flat(w["final"]) - c1).norm()) < 0.5 * float((_flat(w["start"]) - c0).norm())
    mean0 = sum(_flat(w["start"]) for w in ws) / len(ws)
    mean1 = sum(_flat(w["final"]) for w in ws) / len(ws)
    assert float((c1 - c0).norm()) > 0.1  # the center moved ...
    assert float((c1 - mean1).norm()) < 0.5 * float((c0 - mean0).norm())  # ... toward the replicas
    d0, d1 = ws[0]["consensus"]
    assert d1 < 0.5 * d0, (d0, d1)  # the workers' own collectives ran on the workers' group
    for w in ws:
        assert w["consensus"] == ws[0]["consensus"]
        assert max_diff(w["averaged"], [t.numpy() for t in _unflat(mean1, w["final"])]) < TOL


def _unflat(flat: torch.Tensor, like: list[Any]) -> list[torch.Tensor]:
    out, off = [], 0
    for a in like:
        n = torch.as_tensor(a).numel()
        out.append(flat[off : off + n].reshape(torch.as_tensor(a).shape).float())
        off += n
    return out


@pytest.mark.procs
def test_server_form_bytes_per_round_and_server_updates(server_runs: list[Any]) -> None:
    """Per round a worker pushes d and pulls x~: 2 * model_bytes, plus 71 bytes of headers each way; the
    server applied exactly one update per exchange; a server's step() is refused."""
    ws = _workers(server_runs, "invariant")
    for w in ws:
        st, mb = w["stats"], w["model_bytes"]
        assert st["rounds"] == _rounds(1) and st["center"] == "server", st
        assert w["expected"] == pytest.approx(2.0 * mb)
        assert st["bytes_sent"] == st["rounds"] * (mb + HEADER), st
        assert st["bytes_received"] == st["rounds"] * (mb + HEADER), st
        assert st["bytes_sent"] + st["bytes_received"] == st["rounds"] * (w["expected"] + 2 * HEADER)
        assert st["messages"] == 2 * st["rounds"], st
    srv = server_runs[0]["invariant"]
    assert srv["serve"]["updates"] == 3 * _rounds(1), srv["serve"]
    assert srv["misuse"].startswith("DTrainError") and "server" in srv["misuse"], srv["misuse"]


@pytest.mark.procs
def test_server_form_eamsgd_runs_to_completion_and_learns(server_runs: list[Any]) -> None:
    ws = _workers(server_runs, "training")
    net = _mlp()
    xs = torch.cat([_batch(w, 0)[0] for w in range(3)])
    ys = torch.cat([_batch(w, 0)[1] for w in range(3)])
    with torch.no_grad():
        loss0 = float(F.cross_entropy(net(xs), ys))
        for p, c in zip(net.parameters(), ws[0]["center"]):
            p.copy_(torch.as_tensor(c))
        loss1 = float(F.cross_entropy(net(xs), ys))
    print(f"center's loss on the workers' batches: {loss0:.4f} -> {loss1:.4f}")
    for w in ws:
        assert w["stats"]["rounds"] == _rounds(2)
        assert max_diff(w["center"], ws[0]["center"]) == 0.0
    assert loss1 < 0.9 * loss0, (loss0, loss1)
    assert server_runs[0]["training"]["serve"]["updates"] == 3 * _rounds(2)


@pytest.mark.procs
@pytest.mark.parametrize("name", list(ONE_WORKER))
def test_server_form_with_one_worker_equals_the_synchronous_form_exactly(server_runs: list[Any], name: str) -> None:
    """1 server + 1 worker: the center the worker reads is never stale, so the asynchronous form is the
    synchronous one with N = 1 bit for bit (replica and center), and both are the paper's equations."""
    r = server_runs[1][name]
    (x_srv, c_srv), (x_sync, c_sync), (x_ref, c_ref) = r["server"], r["sync"], r["reference"]
    assert max_diff(x_srv, x_sync) == 0.0
    assert max_diff(c_srv, c_sync) == 0.0
    assert max_diff(x_srv, x_ref) < 1e-6
    assert max_diff(c_srv, c_ref) < 1e-6
    assert max_diff(x_srv, c_srv) > 1e-3  # the replica is not simply the center


@pytest.mark.procs
def test_server_form_needs_a_worker(server_runs: list[Any]) -> None:
    for rank in range(WORLD):
        msg = server_runs[rank]["too_many_servers"]
        assert msg.startswith("ConfigError") and "servers=4" in msg, msg


# ---------------------------------------------------------------------- bad inputs (no process group)

BAD = [
    ("alpha", 0.0),
    ("alpha", 1.0),
    ("alpha", -0.25),
    ("alpha", 1.5),
    ("alpha", float("nan")),
    ("alpha", "0.1"),
    ("period", 0),
    ("period", -3),
    ("period", 2.5),
    ("servers", 0),
    ("servers", -1),
    ("center", "gossip"),
    ("momentum", 1.0),
    ("momentum", -0.5),
]


@pytest.mark.parametrize("key,value", BAD, ids=[f"{k}={v!r}" for k, v in BAD])
def test_bad_inputs_raise_config_error_naming_the_value(key: str, value: Any) -> None:
    from dtrain.decentralized import EASGD
    from dtrain.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        EASGD(_mlp(), **{key: value})
    assert f"{key}={value!r}" in str(info.value), str(info.value)
