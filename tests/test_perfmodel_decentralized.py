"""The performance model of model averaging (local SGD, EASGD, gossip) by hand, and the planner's
opt-in candidates."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dtrain.perfmodel import ClusterSpec, Device, Link, predict
from dtrain.perfmodel.collectives import allreduce_time
from dtrain.perfmodel.ranking import candidates, plan
from dtrain.strategies import choice

MiB = float(1 << 20)


def _cluster(n: int = 4) -> ClusterSpec:
    return ClusterSpec(
        nodes=n,
        devices_per_node=1,
        intra=Link(1e10, 1e-5),
        inter=Link(1e7, 1e-3),
        device=Device(flops=1e10, host="h"),
        name="made-up",
    )


def _profile():
    from dtrain.perfmodel.profile import profile_model

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    return profile_model(model, (torch.randn(16, 256), torch.randint(0, 10, (16,))), measure=False)


def test_bytes_per_step_are_the_closed_forms():
    prof, c = _profile(), _cluster()
    n = float(prof.param_bytes)
    local = predict(prof, c, choice("local_sgd", 4, period=8))
    assert local.bytes_per_step == pytest.approx(2 * 3 / 4 * n / 8)
    assert local.comm_s == pytest.approx(allreduce_time(c, "ring", n, 4) / 8)
    hier = predict(prof, c, choice("local_sgd", 4, hierarchy="2:2,4:8"))
    assert hier.bytes_per_step == pytest.approx(2 * 1 / 2 * n / 2 + 2 * 3 / 4 * n / 8)
    sync = predict(prof, c, choice("gossip", 4, topology="ring"))
    assert sync.bytes_per_step == pytest.approx(2 * n)  # two neighbours on a ring of 4
    assert sync.comm_s == pytest.approx(2 * 1e-3 + 2 * n / 1e7)
    expo = predict(prof, _cluster(8), choice("gossip", 8, topology="exponential"))
    assert expo.bytes_per_step == pytest.approx(5 * n)  # +-1, +-2 and 4 on 8 nodes: five neighbours
    asy = predict(prof, c, choice("gossip", 4, topology="ring", mode="async"))
    assert asy.bytes_per_step == pytest.approx(n)  # an active sends its model; the average comes back after it
    assert asy.comm_s == pytest.approx(2 * 1e-3 + 2 * n / 1e7)
    easgd = predict(prof, c, choice("easgd", 4, alpha=0.2, period=4))
    assert easgd.bytes_per_step == pytest.approx(2 * 3 / 4 * n / 4)
    served = predict(prof, _cluster(5), choice("easgd", 4, alpha=0.2, period=4, servers=1))
    assert served.bytes_per_step == pytest.approx(n / 4)  # a push per round; the centre comes back
    # nothing overlaps the averaging: step = compute + averaging + overhead (0 here)
    assert local.step_s == pytest.approx(local.compute_s + local.comm_s)
    # a longer period costs less per step
    assert predict(prof, c, choice("local_sgd", 4, period=32)).step_s < local.step_s


def test_planner_ranks_averaging_only_when_asked():
    c = _cluster()
    plain = {x.strategy for x in candidates(c, 4)}
    asked = {x.strategy for x in candidates(c, 4, averaging=True)}
    assert not plain & {"local_sgd", "easgd", "gossip"}
    assert {"local_sgd", "easgd", "gossip"} <= asked
    assert not {"local_sgd", "easgd", "gossip"} & {
        x.strategy for x in candidates(c, 4, averaging=True, exact_only=True)
    }
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    p = plan(model, (torch.randn(64, 256), torch.randint(0, 10, (64,))), c, measure=False, averaging=True)
    local = p.find("local_sgd period 16 ring")
    assert local is not None and "approximate: models averaged every 16 steps" in local.why
    dp = p.find("dp ring 25MiB")
    assert dp is not None and local.step_s < dp.step_s  # on a 10 MB/s link the average every 16 steps is cheaper
