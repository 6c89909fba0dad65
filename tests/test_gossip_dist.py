"""Gossip across real processes (gloo on loopback).

* sync (D-PSGD), 4 processes: after k steps every replica equals a single-process simulation
  (4 replicas, each an SGD step on its own batch, then ``x <- W x``) within 1e-5, for three
  topologies; bytes counted equal ``degree x model bytes x steps``.
* async (AD-PSGD), 4 processes: with lr=0 the pairwise averages keep every coordinate's sum
  and shrink the consensus distance; with training and a sleeping straggler every rank
  finishes, the actives do not wait for the straggler, and no gossip thread outlives finish().
* failures, 2 processes: a passive whose active never says stop gets a CommTimeoutError naming
  it (and a second finish() completes once it does); a sync round with a silent peer becomes a
  CommTimeoutError naming rank, operation and step.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _dist import guard as _guard
from _dist import run_distributed
from torch import nn

WORLD = 4
STEPS = 6
BATCH = 8
LR = 0.1
TOL = 1e-5
SYNC_TOPOLOGIES: dict[str, Any] = {
    "ring": "ring",
    "exponential": "exponential",
    "edges": [(0, 1), (1, 2), (2, 3), (0, 2)],  # Metropolis-Hastings, degrees 2, 2, 3, 1
    "matrix": [[0.5, 0.25, 0.0, 0.25], [0.25, 0.5, 0.25, 0.0], [0.0, 0.25, 0.5, 0.25], [0.25, 0.0, 0.25, 0.5]],
}


def _mlp() -> nn.Module:
    torch.manual_seed(11)
    return nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 3))


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def _batches(rank: int, steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1000 + rank)
    return [(torch.randn(BATCH, 10, generator=g), torch.randint(0, 3, (BATCH,), generator=g)) for _ in range(steps)]


def _flat(m: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


def _gossip_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("dtrain-gossip") and t.is_alive()]


# ---------------------------------------------------------------------------- sync


def _sync_one(rank: int, spec: Any) -> dict[str, Any]:
    from dtrain.decentralized import Gossip

    net = _mlp()
    g = Gossip(net, spec, mode="sync", timeout=60)
    opt = _sgd(net.parameters())
    for x, y in _batches(rank):
        opt.zero_grad()
        F.cross_entropy(g(x), y).backward()
        opt.step()
        g.step()
    avg = g.averaged_state_dict()
    out = dict(
        params=_flat(net).numpy().copy(),
        stats=g.stats(),
        consensus=g.consensus_distance(),
        averaged=torch.cat([v.reshape(-1) for v in avg.values()]).numpy().copy(),
        matrix=g.topology.matrix,
        out_degree=len(g.topology.out_neighbours(rank)),
    )
    g.finish()
    g.finish()
    return out


def _sync_worker(rank: int, world: int) -> dict[str, Any]:
    return {name: _guard(lambda: _sync_one(rank, spec)) for name, spec in SYNC_TOPOLOGIES.items()}


def _simulate(matrix: Any) -> torch.Tensor:
    """D-PSGD in one process: 4 replicas (each its own SGD with momentum), then ``x <- W x``."""
    w = torch.tensor(matrix, dtype=torch.float64)
    nets = [_mlp() for _ in range(WORLD)]
    opts = [_sgd(n.parameters()) for n in nets]
    data = [_batches(r) for r in range(WORLD)]
    for s in range(STEPS):
        for r in range(WORLD):
            x, y = data[r][s]
            opts[r].zero_grad()
            F.cross_entropy(nets[r](x), y).backward()
            opts[r].step()
        mixed = (w @ torch.stack([_flat(n).double() for n in nets])).float()
        for r, n in enumerate(nets):
            off = 0
            with torch.no_grad():
                for p in n.parameters():
                    p.copy_(mixed[r, off : off + p.numel()].view_as(p))
                    off += p.numel()
    return torch.stack([_flat(n) for n in nets])


@pytest.fixture(scope="module")
def sync_results() -> list[dict[str, Any]]:
    return run_distributed(_sync_worker, WORLD, timeout=120)


@pytest.mark.procs
@pytest.mark.parametrize("name", list(SYNC_TOPOLOGIES))
def test_sync_equals_single_process_dpsgd(sync_results: list[dict[str, Any]], name: str) -> None:
    outs = [r[name] for r in sync_results]
    assert all("error" not in o for o in outs), [o.get("trace") for o in outs]
    ref = _simulate(outs[0]["matrix"])
    got = torch.stack([torch.as_tensor(o["params"]) for o in outs])
    assert float((got - ref).abs().max()) <= TOL
    # the replicas did drift apart (exponential on 4 is complete: one round averages exactly) ...
    spread = float(((ref.double() - ref.double().mean(0)) ** 2).sum(1).mean().sqrt())
    assert spread > 1e-4 if name != "exponential" else spread < 1e-6
    for o in outs:  # ... and the collectives read the same figures as the simulation
        assert o["consensus"] == pytest.approx(spread, rel=1e-4, abs=1e-6)
        assert float((torch.as_tensor(o["averaged"]) - ref.double().mean(0).float()).abs().max()) <= TOL


@pytest.mark.procs
@pytest.mark.parametrize("name", list(SYNC_TOPOLOGIES))
def test_sync_bytes_are_degree_times_model_bytes(sync_results: list[dict[str, Any]], name: str) -> None:
    outs = [r[name] for r in sync_results]
    assert all("error" not in o for o in outs)
    model_bytes = sum(p.numel() for p in _mlp().parameters()) * 4
    for o in outs:
        st = o["stats"]
        assert st["mode"] == "sync" and st["model_bytes"] == model_bytes
        assert st["bytes_sent"] == o["out_degree"] * model_bytes * STEPS
        assert st["messages"] == o["out_degree"] * STEPS
        assert st["expected_bytes_per_step"] * STEPS == st["bytes_sent"]
        assert st["rounds"] == STEPS and st["steps"] == STEPS
    if name != "edges":  # regular: every rank sends degree x model bytes
        assert all(o["stats"]["bytes_sent"] == o["stats"]["degree"] * model_bytes * STEPS for o in outs)
    assert outs[0]["stats"]["degree"] == {"ring": 2, "exponential": 3, "edges": 3, "matrix": 2}[name]


# ---------------------------------------------------------------------------- async


def _global_sum(x: torch.Tensor) -> torch.Tensor:
    s = x.double().clone()
    dist.all_reduce(s)
    return s


def _async_mean(rank: int) -> dict[str, Any]:
    """lr=0: perturbed replicas, only pairwise averages (rank 2, an active, is slow)."""
    from dtrain.decentralized import Gossip

    net = _mlp()
    g = Gossip(net, "ring", mode="async", timeout=60, seed=3)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(50 + rank)
        for p in net.parameters():
            p.add_(torch.randn(p.shape, generator=gen))
    before, d0 = _global_sum(_flat(net)), g.consensus_distance()
    for _ in range(10):
        if rank == 2:
            time.sleep(0.05)
        g.step()
    g.finish()
    after, d1 = _global_sum(_flat(net)), g.consensus_distance()
    return dict(
        sum_diff=float((after - before).abs().max()),
        sum_scale=float(before.abs().max()),
        d0=d0,
        d1=d1,
        stats=g.stats(),
        threads=_gossip_threads(),
    )


def _async_train(rank: int) -> dict[str, Any]:
    """Training; rank 1 (a passive) sleeps 0.3 s per step: a straggler."""
    from dtrain.decentralized import Gossip
    from dtrain.errors import ConfigError

    net = _mlp()
    g = Gossip(net, "ring", mode="async", timeout=60)
    opt = _sgd(net.parameters())
    in_step = slept = 0.0
    for x, y in _batches(rank, 8):
        opt.zero_grad()
        F.cross_entropy(g(x), y).backward()
        opt.step()
        if rank == 1:
            time.sleep(0.3)
            slept += 0.3
        t0 = time.perf_counter()
        g.step()
        in_step += time.perf_counter() - t0
    g.finish()
    g.close()  # idempotent
    try:
        g.step()
        after_finish = "no error"
    except ConfigError as e:
        after_finish = str(e)
    finite = bool(torch.isfinite(_flat(net)).all())
    return dict(
        stats=g.stats(),
        in_step=in_step,
        slept=slept,
        threads=_gossip_threads(),
        finite=finite,
        after_finish=after_finish,
        consensus=g.consensus_distance(),
    )


def _async_subgroup(rank: int) -> dict[str, Any]:
    """Global ranks 1, 2, 3 gossip in a group of their own (an odd ring: group ranks 0 and 2 active)."""
    from dtrain.decentralized import Gossip

    sub = dist.new_group([1, 2, 3])
    if rank == 0:
        return {}
    net = _mlp()
    g = Gossip(net, "ring", mode="async", group=sub, timeout=60)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(rank)))
    before = _flat(net).double()
    dist.all_reduce(before, group=sub)
    for _ in range(5):
        g.step()
    g.finish()
    after = _flat(net).double()
    dist.all_reduce(after, group=sub)
    st = g.stats()
    return dict(
        sum_diff=float((after - before).abs().max()),
        role=st["role"],
        rounds=st["rounds"],
        colouring=st["colouring"],
        partners=st["partners"],
        threads=_gossip_threads(),
    )


def _async_worker(rank: int, world: int) -> dict[str, Any]:
    return {
        "mean": _guard(lambda: _async_mean(rank)),
        "train": _guard(lambda: _async_train(rank)),
        "subgroup": _guard(lambda: _async_subgroup(rank)),
    }


@pytest.fixture(scope="module")
def async_results() -> list[dict[str, Any]]:
    return run_distributed(_async_worker, WORLD, timeout=120)


@pytest.mark.procs
def test_async_pairwise_averages_keep_the_sum_and_shrink_the_spread(async_results: list[dict[str, Any]]) -> None:
    outs = [r["mean"] for r in async_results]
    assert all("error" not in o for o in outs), [o.get("trace") for o in outs]
    for o in outs:
        assert o["sum_diff"] <= 1e-5 * max(1.0, o["sum_scale"])
        assert o["d1"] < 0.5 * o["d0"] and o["d0"] > 0.5
        assert o["threads"] == []
    roles = [o["stats"]["role"] for o in outs]
    assert roles == ["active", "passive", "active", "passive"]
    # every pairwise average is counted once by its active and once by its passive
    assert sum(o["stats"]["rounds"] for o in outs if o["stats"]["role"] == "active") == 20
    assert sum(o["stats"]["rounds"] for o in outs if o["stats"]["role"] == "passive") == 20


@pytest.mark.procs
def test_async_straggler_finishes_and_shuts_down(async_results: list[dict[str, Any]]) -> None:
    outs = [r["train"] for r in async_results]
    assert all("error" not in o for o in outs), [o.get("trace") for o in outs]
    numel = sum(p.numel() for p in _mlp().parameters())
    for o in outs:
        st = o["stats"]
        assert o["finite"] and o["threads"] == [] and "after finish" in o["after_finish"]
        assert st["steps"] == 8 and st["mode"] == "async" and st["topology"] == "ring"
        assert st["degree"] == 2 and st["spectral_gap"] == pytest.approx(2 / 3)
        if st["role"] == "active":  # a request per step, a stop per partner at finish
            assert st["bytes_sent"] == (8 + 2) * (numel + 1) * 4 and st["rounds"] == 8
            assert st["expected_bytes_per_step"] == (numel + 1) * 4
        else:  # a reply per request answered
            assert st["bytes_sent"] == st["rounds"] * numel * 4
    slept = outs[1]["slept"]
    assert slept == pytest.approx(2.4)
    # the actives never wait for the straggler's own steps: their whole time in step() is far below its sleep
    active_in_step = [outs[0]["in_step"], outs[2]["in_step"]]
    assert max(active_in_step) < 0.5 * slept, active_in_step
    assert sum(o["stats"]["rounds"] for o in outs if o["stats"]["role"] == "passive") == 16


@pytest.mark.procs
def test_async_in_a_subgroup(async_results: list[dict[str, Any]]) -> None:
    outs = [r["subgroup"] for r in async_results]
    assert all("error" not in o for o in outs), [o.get("trace") for o in outs]
    assert outs[0] == {}
    assert [o["role"] for o in outs[1:]] == ["active", "passive", "active"]
    assert [o["partners"] for o in outs[1:]] == [[1], [0, 2], [1]] and outs[1]["colouring"] == "parity"
    assert [o["rounds"] for o in outs[1:]] == [5, 10, 5]
    assert all(o["sum_diff"] <= 1e-5 and o["threads"] == [] for o in outs[1:])


# ---------------------------------------------------------------------------- failures


def _failures(rank: int, world: int) -> dict[str, str]:
    from dtrain.decentralized import Gossip

    out: dict[str, str] = {}
    try:  # raised on every rank before any collective
        Gossip(_mlp(), "torus", mode="sync", timeout=2)
        out["torus"] = "no error"
    except Exception as e:  # noqa: BLE001
        out["torus"] = f"{type(e).__name__}: {e}"
    g = Gossip(_mlp(), "ring", mode="async", timeout=2)
    if rank == 1:  # passive: its active (rank 0) has not said stop yet
        try:
            g.finish()
            out["first"] = "no error"
        except Exception as e:  # noqa: BLE001
            out["first"] = f"{type(e).__name__}: {e}"
        g.finish()  # rank 0 says stop now: completes
        out["second"] = "ok"
    else:
        time.sleep(3.0)
        g.finish()
    out["threads"] = ",".join(_gossip_threads())
    s = Gossip(_mlp(), "ring", mode="sync", timeout=2)
    if rank == 0:  # rank 1 never takes part in the round
        try:
            s.step()
            out["sync"] = "no error"
        except Exception as e:  # noqa: BLE001
            out["sync"] = f"{type(e).__name__}: {e}"
    else:
        time.sleep(3.5)
    return out


@pytest.mark.procs
def test_failures_name_rank_op_and_step() -> None:
    outs = run_distributed(_failures, 2, timeout=90)
    assert all(o["torus"].startswith("ConfigError") and "n=2" in o["torus"] for o in outs)
    first = outs[1]["first"]
    assert first.startswith("CommTimeoutError") and "rank 1" in first and "Gossip.finish" in first
    assert "active ranks [0]" in first and "step 0" in first
    assert outs[1]["second"] == "ok" and outs[0]["threads"] == outs[1]["threads"] == ""
    sync = outs[0]["sync"]
    assert sync.startswith("CommTimeoutError") and "rank 0" in sync and "mix round" in sync and "at step 0" in sync


def test_bad_mode_and_topology_are_config_errors() -> None:
    from dtrain.decentralized import Gossip
    from dtrain.errors import ConfigError

    with pytest.raises(ConfigError, match="'semi'"):
        Gossip(_mlp(), "ring", mode="semi")
    with pytest.raises(ConfigError, match="torch.distributed"):
        Gossip(_mlp(), "ring", mode="async")
    assert np.isfinite(_flat(_mlp()).numpy()).all()
