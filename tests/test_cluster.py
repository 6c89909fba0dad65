"""Emulated cluster: up/down/status on real network namespaces, and a multi-node launch on it.

Needs root (network namespaces, veth, tc); skipped with that reason elsewhere.
Every test uses its own cluster name and removes it in a finally/fixture.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from _helpers import dtrain_cli, read_metrics, read_summary

from dtrain.cluster import ClusterError, EmulatedCluster, down, load, run_on_cluster, status, up
from dtrain.cluster.cli import main as cluster_main
from dtrain.cluster.cli import parse_slow
from dtrain.cluster.netns import PREFIX

IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
HAS_IP = shutil.which("ip") is not None and shutil.which("tc") is not None
needs_root = pytest.mark.skipif(
    not (IS_ROOT and HAS_IP), reason="emulated cluster needs root and iproute2 (ip, tc): network namespaces"
)
NAME = f"pt{os.getpid() % 100000}"


def _netns() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _root_links() -> str:
    return subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout


@pytest.fixture
def cluster_name(tmp_path, monkeypatch):
    monkeypatch.setenv("DTRAIN_CLUSTER_DIR", str(tmp_path / "state"))
    yield NAME
    if IS_ROOT and HAS_IP:
        down(NAME)


# ---------------------------------------------------------------- no root needed


def test_parse_slow_accepts_index_and_h_prefix():
    assert parse_slow(["2:3", "h1:1.5"]) == {2: 3.0, 1: 1.5}
    with pytest.raises(ClusterError, match="HOST:FACTOR"):
        parse_slow(["2"])


def test_state_round_trips_through_json():
    c = EmulatedCluster(name="x", hosts=3, rate_bps=12.5e6, subnet="10.213.4", slow={2: 3.0}, created=1.0)
    assert EmulatedCluster.from_json(c.to_json()) == c
    assert c.host_ns(2) == f"{PREFIX}x-h2" and c.address(2) == "10.213.4.3"


@pytest.mark.procs
@pytest.mark.skipif(not IS_ROOT or shutil.which("setpriv") is None, reason="needs root to drop to an unprivileged user")
def test_non_root_is_told_it_needs_root():
    p = subprocess.run(
        [
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            sys.executable,
            "-m",
            "dtrain.cluster.cli",
            "status",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 2
    assert "needs root" in p.stderr


# ---------------------------------------------------------------- root


@pytest.mark.procs
@needs_root
def test_up_status_down_leaves_nothing(cluster_name):
    links_before = _root_links()
    c = up(cluster_name, hosts=3, bandwidth="100mbit", slow={1: 2.0})
    assert load(cluster_name) == c
    have = _netns()
    assert set(c.namespaces) <= set(have)
    row = next(r for r in status() if r["name"] == cluster_name)
    assert row["state"] == "up" and row["hosts"] == 3 and row["rate"] == "100mbit"
    # shaping on both ends of every link, at the asked rate
    for i in range(3):
        q = subprocess.run(
            ["ip", "netns", "exec", c.host_ns(i), "tc", "qdisc", "show", "dev", "eth0"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert "tbf" in q and "rate 100Mbit" in q
        q = subprocess.run(
            ["ip", "netns", "exec", c.switch_ns, "tc", "qdisc", "show", "dev", f"p{i}"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert "tbf" in q and "rate 100Mbit" in q
    # nothing in our own namespace
    assert _root_links() == links_before
    # hosts reach each other over the bridge (a TCP connect from h0 to h2)
    code = (
        "import socket,sys; s=socket.socket(); s.bind((sys.argv[1],0)); s.listen(1); "
        "c=socket.create_connection((sys.argv[1], s.getsockname()[1]), timeout=5); print('ok')"
    )
    p = subprocess.run(
        ["ip", "netns", "exec", c.host_ns(2), sys.executable, "-c", code, c.address(2)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert p.stdout.strip() == "ok", p.stderr
    # nothing listens on port 9: a reachable host answers "connection refused" at once
    probe = "import socket,sys; s=socket.create_connection((sys.argv[1], 9), timeout=3)"
    p = subprocess.run(
        ["ip", "netns", "exec", c.host_ns(0), sys.executable, "-c", probe, c.address(2)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert "ConnectionRefusedError" in p.stderr, p.stderr

    removed = down(cluster_name)
    assert sorted(removed) == sorted(c.namespaces)
    assert not [ns for ns in _netns() if ns.startswith(f"{PREFIX}{cluster_name}-")]
    assert _root_links() == links_before
    assert cluster_name not in {r["name"] for r in status()}
    assert down(cluster_name) == []  # idempotent


@pytest.mark.procs
@needs_root
def test_down_after_crash_finds_namespaces_by_prefix(cluster_name, tmp_path):
    c = up(cluster_name, hosts=2, bandwidth="1gbit")
    (tmp_path / "state" / f"{cluster_name}.json").unlink()  # the state file is lost
    row = next(r for r in status() if r["name"] == cluster_name)
    assert row["state"] == "orphaned"
    # and a half-built host left by a crash during `up`
    subprocess.run(["ip", "netns", "add", f"{PREFIX}{cluster_name}-h9"], check=True)
    removed = down(cluster_name)
    assert set(removed) == set(c.namespaces) | {f"{PREFIX}{cluster_name}-h9"}
    assert not [ns for ns in _netns() if ns.startswith(f"{PREFIX}{cluster_name}-")]


@pytest.mark.procs
@needs_root
def test_bad_requests_fail_before_anything_is_made(cluster_name):
    with pytest.raises(ClusterError, match="netem"):
        up(cluster_name, hosts=2, bandwidth="100mbit", latency="5ms")
    with pytest.raises(ClusterError, match="hosts"):
        up(cluster_name, hosts=1, bandwidth="100mbit")
    with pytest.raises(ClusterError, match="slow"):
        up(cluster_name, hosts=2, bandwidth="100mbit", slow={5: 2.0})
    with pytest.raises(Exception, match="rate"):
        up(cluster_name, hosts=2, bandwidth="fast")
    with pytest.raises(ClusterError, match="name"):
        up("Bad-Name", hosts=2, bandwidth="100mbit")
    assert not [ns for ns in _netns() if ns.startswith(f"{PREFIX}{cluster_name}-")]
    with pytest.raises(ClusterError, match="no emulated cluster"):
        load(cluster_name)


@pytest.mark.procs
@needs_root
def test_cli_up_status_down(cluster_name, capsys):
    assert cluster_main(["up", "--hosts", "2", "--bandwidth", "50mbit", "--name", cluster_name]) == 0
    assert cluster_main(["up", "--hosts", "2", "--bandwidth", "50mbit", "--name", cluster_name]) == 2  # exists
    assert cluster_main(["status"]) == 0
    out = capsys.readouterr()
    assert f"[up] {cluster_name}: 2 hosts at 50mbit" in out.out
    assert "already exists" in out.err
    assert cluster_main(["down", "--name", cluster_name]) == 0
    assert cluster_main(["down", "--name", cluster_name]) == 0
    assert "removed 0 namespaces" in capsys.readouterr().out


def _allreduce_worker(n: int) -> tuple[int, list[float], str]:
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    t = torch.arange(n, dtype=torch.float32) * (rank + 1)
    dist.all_reduce(t)
    return rank, t.tolist(), os.environ.get("DTRAIN_SLOWDOWN", "1")


@pytest.mark.procs
@pytest.mark.slow  # the default tier trains over the hosts (test_dtrain_run_cluster_trains_over_the_hosts)
@needs_root
def test_multinode_launch_runs_one_node_per_host(cluster_name):
    c = up(cluster_name, hosts=2, bandwidth="1gbit", slow={1: 3.0})
    res = run_on_cluster(_allreduce_worker, (5,), cluster=c, nprocs_per_host=2, timeout_s=120)
    assert sorted(res) == [0, 1, 2, 3]
    expected = [float(i * (1 + 2 + 3 + 4)) for i in range(5)]  # sum over ranks of i * (rank + 1)
    for r, (rank, values, slow) in res.items():
        assert rank == r and values == expected
        assert slow == ("3" if r >= 2 else "1")  # ranks 2, 3 live on the slowed host 1


@pytest.mark.procs
@needs_root
def test_dtrain_run_cluster_trains_over_the_hosts(cluster_name, tmp_path):
    """`dtrain run --cluster NAME`: one torchrun node per host, real TCP between the namespaces.

    The run must equal the same job launched locally (same seed, same global batch,
    same ring allreduce): the network changes the timing, never the arithmetic.
    """
    up(cluster_name, hosts=2, bandwidth="1gbit")
    common = ["--workers", "2", "--epochs", "1", "--max-steps", "6", "--no-progress", "--algorithm", "ring"]
    env = {**os.environ, "DTRAIN_CLUSTER_DIR": os.environ["DTRAIN_CLUSTER_DIR"]}

    def run(out, *extra):
        p = dtrain_cli("run", *common, "--out", str(out), *extra, timeout=300, env=env)
        assert p.returncode == 0, p.stderr[-3000:]
        return read_summary(out), read_metrics(out)

    s_cluster, rows = run(tmp_path / "cluster", "--cluster", cluster_name)
    s_local, _ = run(tmp_path / "local")
    assert s_cluster["world_size"] == 2 and s_cluster["steps"] == 6
    assert {r["rank"] for r in rows} == {0, 1}
    assert s_cluster["final_loss"] == pytest.approx(s_local["final_loss"], rel=1e-5)
    assert s_cluster["test_accuracy"] == pytest.approx(s_local["test_accuracy"], abs=1e-9)
    # a process count that does not spread over the hosts is refused before anything starts
    p = dtrain_cli(
        "run",
        "--workers",
        "3",
        "--batch-size",
        "63",
        "--cluster",
        cluster_name,
        "--out",
        str(tmp_path / "bad"),
        "--no-progress",
        timeout=120,
        env=env,
    )
    assert p.returncode != 0 and "spread evenly" in p.stderr, p.stderr[-2000:]
    assert not (tmp_path / "bad" / "metrics.jsonl").exists()
