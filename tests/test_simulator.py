"""Simulator: equals the closed form without stragglers; stragglers and asynchrony as computed by hand."""

from __future__ import annotations

import time

import pytest

from dtrain.errors import ConfigError
from dtrain.perfmodel import ClusterSpec, Device, Link, predict
from dtrain.perfmodel.collectives import CompressionModel
from dtrain.perfmodel.profile import LayerProfile, ModelProfile
from dtrain.perfmodel.simulator import Stragglers, parse_policy, scaling_curve, simulate
from dtrain.strategies import choice

MiB = 1 << 20


def profile() -> ModelProfile:
    """Four layers of 1 MiB; forward 10 ms and backward 20 ms each; optimizer 4 ms."""
    layers = tuple(LayerProfile(f"l{i}", MiB // 4, MiB, 1e9, 2e9, 1e5, 0.01, 0.02) for i in range(4))
    return ModelProfile("m", 16, layers, optimizer_s=0.004, host="h")


def cluster(nodes: int, rate: str = "1gbit", per_node: int = 1) -> ClusterSpec:
    from dtrain.perfmodel.units import parse_rate

    return ClusterSpec(
        nodes=nodes,
        devices_per_node=per_node,
        inter=Link(parse_rate(rate), 50e-6),
        intra=Link(parse_rate("40gbit"), 5e-6),
        device=Device(gamma=1e-10, host="h"),
    )


@pytest.mark.parametrize(
    "s",
    [
        choice("dp", 8, "ring", bucket_mb=1.0),
        choice("dp", 8, "tree", bucket_mb=25.0),
        choice("dp", 8, "recursive_doubling", bucket_mb=2.0),
        choice("dp", 8, "ring", overlap="forward"),
        choice("ddp", 8, "native"),
        choice("ps", 6, servers=2, consistency="bsp"),
        choice("ps", 6, servers=2, consistency="backup:1"),
    ],
    ids=lambda s: s.label(),
)
def test_synchronous_simulation_equals_the_closed_form(s):
    c = cluster(8, "100mbit")
    closed = predict(profile(), c, s, overhead_s=0.002)
    sim = simulate(profile(), c, s, steps=10, overhead_s=0.002)
    assert sim.step_s == pytest.approx(closed.step_s, rel=1e-9)
    assert sim.samples_per_s == pytest.approx(closed.samples_per_s, rel=1e-9)
    alone = 0.12 + 0.004 + 0.002  # fwd + bwd + optimizer + overhead
    assert sim.efficiency == pytest.approx(alone / closed.step_s, rel=1e-9)


def test_compressed_sync_simulation_equals_the_closed_form():
    comp = CompressionModel("fp16", "summable", 0.5, 1e-10, 1e-10)
    s = choice("dp", 4, "ring", compression="fp16")
    c = cluster(4, "100mbit")
    assert simulate(profile(), c, s, comp=comp, steps=5).step_s == pytest.approx(predict(profile(), c, s, comp).step_s)


@pytest.mark.parametrize("cons", ["asp", "ssp:2", "softsync:2"])
def test_async_simulation_approaches_the_closed_form(cons):
    c = cluster(8, "1gbit")
    s = choice("ps", 6, servers=2, consistency=cons)
    closed = predict(profile(), c, s)
    sim = simulate(profile(), c, s, steps=60)
    assert sim.step_s == pytest.approx(closed.step_s, rel=0.03)  # start-up transient only
    # identical workers settle into a round robin: each gradient is N-1 pushes old, i.e. N-1 updates,
    # or (N-1)/k updates when softsync:k folds k pushes into one
    expect = 2.5 if cons.startswith("softsync") else 5
    assert sim.staleness_max <= expect + 0.5 and sim.staleness_mean == pytest.approx(expect, abs=0.2)


def test_async_server_bound_throughput_is_the_server_link():
    c = cluster(17, "100mbit")
    s = choice("ps", 16, servers=1, consistency="asp")
    closed = predict(profile(), c, s)
    per_update = 4 * MiB / (100e6 / 8)  # each push and pull occupies the server's link for n / B
    assert closed.step_s == pytest.approx(16 * per_update)
    assert simulate(profile(), c, s, steps=20).step_s == pytest.approx(closed.step_s, rel=0.05)


def test_a_slow_worker_holds_back_sync_but_not_backup_or_async():
    c = cluster(8, "10gbit")
    slow = Stragglers.parse("slow:0.125:3")  # one worker of 8, three times slower
    compute = 0.12
    bsp = choice("ps", 7, servers=1, consistency="bsp")
    base = predict(profile(), c, bsp).step_s
    # bsp waits for the slow one: its compute is 3x, everything else unchanged
    assert simulate(profile(), c, bsp, stragglers=slow, steps=10).step_s == pytest.approx(base + 2 * compute)
    # backup:1 drops the slowest gradient each round: no slowdown
    backup = choice("ps", 7, servers=1, consistency="backup:1")
    assert simulate(profile(), c, backup, stragglers=slow, steps=10).step_s == pytest.approx(base)
    dp = choice("dp", 8, "ring")
    dp_base = predict(profile(), c, dp).step_s
    dp_slow = simulate(profile(), c, dp, stragglers=slow, steps=10).step_s
    assert dp_slow == pytest.approx(dp_base + 2 * compute + 2 * 0.004, rel=0.02)  # optimizer also 3x on that one
    asp = simulate(profile(), c, choice("ps", 7, servers=1, consistency="asp"), stragglers=slow, steps=20)
    # the 6 fast workers keep their pace; the slow one's gradients are the stalest
    assert (
        asp.samples_per_s
        > 0.8 * simulate(profile(), c, choice("ps", 7, servers=1, consistency="asp"), steps=20).samples_per_s
    )
    assert asp.staleness_max > 6


def test_ssp_bounds_how_far_workers_drift():
    c = cluster(5, "10gbit")
    slow = Stragglers.parse("slow:0.25:4")
    ssp = simulate(profile(), c, choice("ps", 4, servers=1, consistency="ssp:1"), stragglers=slow, steps=20)
    asp = simulate(profile(), c, choice("ps", 4, servers=1, consistency="asp"), stragglers=slow, steps=20)
    assert ssp.samples_per_s < asp.samples_per_s  # the bound makes fast workers wait
    assert ssp.staleness_max < asp.staleness_max


def test_lognormal_stragglers_cost_sync_dp_the_expected_maximum():
    c = cluster(64, "10gbit")
    s = choice("dp", 64, "ring")
    noisy = simulate(profile(), c, s, stragglers=Stragglers.parse("lognormal:0.2"), steps=50, seed=1)
    clean = simulate(profile(), c, s, steps=50)
    assert noisy.step_s > clean.step_s  # the slowest of 64 draws sets each step
    assert noisy.wait_frac > clean.wait_frac


def test_thousands_of_workers_are_quick():
    t0 = time.perf_counter()
    res = scaling_curve(
        lambda n: profile(),
        cluster(4096, "10gbit"),
        choice("ps", 1, servers=64, consistency="asp"),
        [4000],
        steps=5,
        stragglers=Stragglers.parse("lognormal:0.1"),
    )
    sync = scaling_curve(
        lambda n: profile(), cluster(1, "10gbit", per_node=4), choice("dp", 1, "ring"), [8, 4096], steps=5
    )
    assert time.perf_counter() - t0 < 30
    assert res[0].workers == 4000 and sum(res[0].staleness.values()) >= 4000 * 4
    assert sync[1].efficiency < sync[0].efficiency


def test_bad_inputs_are_refused():
    with pytest.raises(ConfigError):
        Stragglers.parse("gamma:2")
    with pytest.raises(ConfigError):
        parse_policy("ssp")
    with pytest.raises(ConfigError):
        simulate(profile(), cluster(2), choice("dp", 4))
    with pytest.raises(ConfigError, match="waits for no one"):
        simulate(profile(), cluster(3), choice("ps", 2, servers=1, consistency="backup:2"))


@pytest.mark.parametrize(
    "s", [choice("dp", 4, "ring", bucket_mb=1.0), choice("ddp", 4, "native"), choice("ps", 3, servers=1)], ids=str
)
def test_wake_latency_enters_closed_form_and_simulation_alike(s):
    c = cluster(4, "100mbit")
    slow_wake = ClusterSpec(nodes=4, inter=c.inter, intra=c.intra, device=Device(gamma=1e-10, host="h", wake=3e-3))
    closed, closed_wake = predict(profile(), c, s), predict(profile(), slow_wake, s)
    assert closed_wake.step_s > closed.step_s
    assert simulate(profile(), slow_wake, s, steps=6).step_s == pytest.approx(closed_wake.step_s, rel=1e-9)


@pytest.mark.parametrize(
    "s",
    [
        choice("dp", 4, "ring", bucket_mb=1.0),
        choice("dp", 4, "recursive_doubling"),
        choice("ps", 3, servers=1, consistency="asp"),
        choice("ps", 3, servers=1, consistency="bsp"),
    ],
    ids=str,
)
def test_collective_floor_enters_closed_form_and_simulation_alike(s):
    c = cluster(4, "1gbit")
    floored = ClusterSpec(nodes=4, inter=c.inter, intra=c.intra, device=Device(gamma=1e-10, host="h", floor=0.5))
    closed, closed_floor = predict(profile(), c, s), predict(profile(), floored, s)
    assert closed_floor.step_s > closed.step_s
    # asynchronous runs start up in a transient; synchronous ones equal the closed form exactly
    rel = 0.03 if s.kind == "ps" and s.options.consistency == "asp" else 1e-9
    assert simulate(profile(), floored, s, steps=60).step_s == pytest.approx(closed_floor.step_s, rel=rel)


@pytest.mark.parametrize(
    "s",
    [
        choice("dp", 4, "ring", bucket_mb=1.0),
        choice("dp", 4, "ring", overlap="forward"),
        choice("ps", 3, servers=1, consistency="bsp"),
    ],
    ids=str,
)
def test_imbalance_enters_closed_form_and_simulation_alike(s):
    c = cluster(4, "1gbit")
    skew = ClusterSpec(nodes=4, inter=c.inter, intra=c.intra, device=Device(gamma=1e-10, host="h", imbalance=0.03))
    closed = predict(profile(), skew, s)
    assert closed.step_s == pytest.approx(predict(profile(), c, s).step_s + 0.03)
    assert simulate(profile(), skew, s, steps=8).step_s == pytest.approx(closed.step_s, rel=1e-9)


def test_bucket_latency_counts_the_wake_ups():
    from dtrain.perfmodel.predict import bucket_latency

    c = ClusterSpec(nodes=4, device=Device(wake=1e-3))
    dense = CompressionModel()
    # dtrain's own algorithms: handed to the communication thread and back (2), plus once per step (1)
    assert bucket_latency(c, choice("dp", 4, "ring"), dense, 0) == pytest.approx(3e-3)
    assert bucket_latency(c, choice("dp", 4, "ring"), dense, 1) == pytest.approx(2e-3)
    # the backend's own allreduce from the hooks runs on the backend's worker thread: the same hand-off
    assert bucket_latency(c, choice("dp", 4, "native"), dense, 0) == pytest.approx(3e-3)
    assert bucket_latency(c, choice("ddp", 4, "native"), dense, 1) == pytest.approx(2e-3)
    fp16 = CompressionModel("fp16", "summable", 0.5)
    assert bucket_latency(c, choice("dp", 4, "native", compression="fp16"), fp16, 1) == pytest.approx(2e-3)
