"""Calibration end to end on a real 2-host emulated cluster (root), and the shaped rate it must find."""

from __future__ import annotations

import os
import shutil

import pytest

from dtrain.bench.calibrate import main as calibrate_main
from dtrain.perfmodel import load_cluster

needs_root = pytest.mark.skipif(
    not (hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("ip") and shutil.which("tc")),
    reason="emulated cluster needs root and iproute2 (ip, tc): network namespaces",
)


@needs_root
def test_calibrate_an_emulated_cluster_writes_a_usable_toml(tmp_path, monkeypatch, capsys):
    import dtrain.cluster as dc

    monkeypatch.setenv("DTRAIN_CLUSTER_DIR", str(tmp_path / "state"))
    name = f"cal{os.getpid() % 100000}"
    dc.up(name, hosts=2, bandwidth="20mbit")
    try:
        out = tmp_path / "c.toml"
        assert calibrate_main(["--cluster", name, "--quick", "--batch", "32", "--out", str(out)]) == 0
    finally:
        dc.down(name)
    spec = load_cluster(out)
    assert spec.nodes == 2 and spec.devices_per_node == 1
    # the inter-host level is the tbf-shaped link: 20 Mbit/s less headers, within what a loaded machine gives
    assert 0.6 * 20e6 / 8 < spec.inter.bandwidth < 1.1 * 20e6 / 8
    assert spec.intra.bandwidth > 5 * spec.inter.bandwidth  # loopback inside a host is far faster
    assert spec.inter.latency >= 0 and spec.device.gamma > 0 and spec.device.flops > 0
    assert spec.device.compute_scale >= 1.0 and spec.device.overhead >= 0.0
    assert spec.compressors["fp16"].ratio == 0.5
    assert f"wrote {out}" in capsys.readouterr().out
