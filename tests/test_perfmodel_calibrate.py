"""Calibration end to end on a real 2-host emulated cluster (root), and the shaped rate it must find."""

from __future__ import annotations

import os
import shutil
from dataclasses import replace

import pytest

from dtrain.perfmodel import load_cluster
from dtrain.planning.calibrate import main as calibrate_main
from dtrain.planning.calibrate import refresh_load

needs_root = pytest.mark.skipif(
    not (hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("ip") and shutil.which("tc")),
    reason="emulated cluster needs root and iproute2 (ip, tc): network namespaces",
)


@pytest.mark.slow  # minutes of the default suite on 2 cores; CI runs the slow tier
@pytest.mark.procs
@needs_root
def test_calibrate_an_emulated_cluster_writes_a_usable_toml(tmp_path, monkeypatch, capsys):
    import dtrain.cluster as dc

    monkeypatch.setenv("DTRAIN_CLUSTER_DIR", str(tmp_path / "state"))
    name = f"cal{os.getpid() % 100000}"
    dc.up(name, hosts=2, bandwidth="100mbit")
    try:
        out = tmp_path / "c.toml"
        assert calibrate_main(["--cluster", name, "--quick", "--batch", "32", "--out", str(out)]) == 0
        spec = load_cluster(out)
        # a refresh re-measures what the load moves, the duplex rate among it (a stale 10% of the one-way rate
        # must not survive), and keeps the links' latency and one-way rate
        stale = replace(spec, inter=replace(spec.inter, duplex_bandwidth=0.1 * spec.inter.bandwidth))
        fresh = refresh_load(stale, name, batch=32)
    finally:
        dc.down(name)
    assert spec.nodes == 2 and spec.devices_per_node == 1
    # the inter-host level is the tbf-shaped link: 100 Mbit/s less headers, within what a loaded machine gives
    assert 0.6 * 100e6 / 8 < spec.inter.bandwidth < 1.1 * 100e6 / 8
    assert spec.intra.bandwidth > 5 * spec.inter.bandwidth  # loopback inside a host is far faster
    assert spec.inter.latency >= 0 and spec.device.gamma > 0 and spec.device.flops > 0
    assert spec.device.compute_scale >= 1.0 and spec.device.overhead >= 0.0
    assert spec.compressors["fp16"].ratio == 0.5
    assert (fresh.inter.bandwidth, fresh.inter.latency) == (spec.inter.bandwidth, spec.inter.latency)
    assert fresh.inter.duplex_bandwidth is not None
    assert 0.5 * spec.inter.bandwidth < fresh.inter.duplex_bandwidth <= spec.inter.bandwidth
    assert fresh.device.compute_scale >= 1.0 and fresh.device.flops == spec.device.flops
    assert f"wrote {out}" in capsys.readouterr().out


def test_pooled_load_terms_are_the_medians_of_every_reading_and_the_rest_is_the_last_readings():
    from dtrain.perfmodel.spec import ClusterSpec, Device, Link
    from dtrain.planning.calibrate import pool_load

    def reading(scale: float, wake: float, duplex: float | None, p2p: float | None) -> ClusterSpec:
        device = Device(
            compute_scale=scale,
            wake=wake,
            floor=2 * wake,
            p2p_floor=p2p,
            imbalance=3 * wake,
            overhead=scale * 1e-4,
            flops=7e10,
        )
        return ClusterSpec(
            name="c",
            nodes=4,
            devices_per_node=1,
            device=device,
            inter=Link(bandwidth=6e6, latency=8e-5, duplex_bandwidth=duplex),
        )

    calibrated = reading(2.9, 6e-4, 5.4e6, None)
    refreshes = [reading(3.8, 9e-4, 5.0e6, 8e-4), reading(2.7, 5e-4, None, 7e-4)]
    pooled = pool_load([calibrated, *refreshes])
    d = pooled.device
    assert d.compute_scale == pytest.approx(2.9) and d.wake == pytest.approx(6e-4)  # not the last one's 2.7
    assert d.floor == pytest.approx(1.2e-3) and d.imbalance == pytest.approx(1.8e-3)
    assert d.overhead == pytest.approx(2.9e-4)
    assert d.p2p_floor == pytest.approx(7.5e-4)  # the readings that have one
    assert pooled.inter.duplex_bandwidth == pytest.approx(5.2e6)
    assert (pooled.inter.bandwidth, pooled.inter.latency, d.flops) == (6e6, 8e-5, 7e10)
    assert pool_load([refreshes[0]]) == refreshes[0]
    with pytest.raises(ValueError, match="at least one"):
        pool_load([])


@pytest.mark.procs
def test_coding_probe_counts_user_cpu_in_calls_agreed_by_every_rank():
    # two real gloo processes: every rank makes the same number of calls (they are collective), enough
    # for the tick-sampled user share or the cap, and a user share in (0, 1] of positive CPU
    import dtrain.planning._probes as probes
    from dtrain.launch.agent import launch

    out = launch(probes.coding_cpu, ("cnn", "digits", ["fp16", "topk:0.01"], 3), nprocs=2, threads=1)
    for spec in ("fp16", "topk:0.01"):
        calls = {r: p["calls"][spec] for r, p in out.items()}
        assert calls[0] == calls[1] >= 3
        for p in out.values():
            share, cpu = p["user_share"][spec], p["cpu"][spec]
            assert 0 < share <= 1 and cpu > 0
        # the count was made to reach CODING_SHARE_CPU of thread CPU on the busiest rank, or the cap
        per_call = max(p["cpu"][spec] / p["user_share"][spec] for p in out.values())
        assert calls[0] == probes.CODING_SHARE_CALLS or per_call * calls[0] >= 0.5 * probes.CODING_SHARE_CPU
    assert out[0]["numel"] == out[1]["numel"] > 0
