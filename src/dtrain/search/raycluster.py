"""A Ray cluster over the emulated cluster's hosts, for ``dtrain sweep --cluster NAME``.

Each emulated host (a network namespace, :mod:`dtrain.cluster.netns`) gets a Ray node, started with Ray's
own ``ray start`` inside the namespace: the head on host 0, the others joining it at host 0's address, each
offering ``cpus`` Ray CPUs (trial slots). Trials then land on the hosts as on real machines, and their
``dtrain run`` processes live in the host's namespace (its address, its shaped link). The sweep's driver
runs in host 0's namespace. :func:`ray_down` stops a host's node by stopping every process in its
namespace (``ray stop`` would stop every Ray process on the machine, the other hosts' and a user's own).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from dtrain.errors import DTrainError

__all__ = ["RAY_PORT", "ray_up", "ray_down", "stop_host", "auth_env"]

RAY_PORT = 6379


def _ray_cli() -> str:
    exe = Path(sys.executable).parent / "ray"
    return str(exe) if exe.is_file() else "ray"


def _start(c: Any, host: int, cpus: int, head: str, token: str) -> None:
    args = [
        _ray_cli(),
        "start",
        f"--node-ip-address={c.address(host)}",
        f"--num-cpus={cpus}",
        f"--object-store-memory={100 * 2**20}",
        "--disable-usage-stats",
    ]
    args += ["--head", f"--port={RAY_PORT}", "--include-dashboard=false"] if host == 0 else [f"--address={head}"]
    env = {**os.environ, **auth_env(token), "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1"}
    p = subprocess.run(
        ["ip", "netns", "exec", c.host_ns(host), *args], capture_output=True, text=True, timeout=180, env=env
    )
    if p.returncode != 0:
        raise DTrainError(f"ray start on host {host} ({c.address(host)}) failed: {(p.stderr or p.stdout)[-800:]}")


def auth_env(token: str) -> dict[str, str]:
    """Ray's token authentication (a node or a driver without the cluster's token is refused)."""
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}


def ray_up(name: str, cpus: int = 1) -> tuple[Any, str, str]:
    """Start a Ray node on every host of the emulated cluster ``name``, with a fresh authentication token;
    (the cluster, the head's address, the token)."""
    import secrets

    from dtrain.cluster import load, require_root

    require_root()
    c = load(name)
    head, token = f"{c.address(0)}:{RAY_PORT}", secrets.token_hex(32)
    try:
        for h in range(c.hosts):
            _start(c, h, cpus, head, token)
    except BaseException:
        ray_down(c)
        raise
    return c, head, token


def stop_host(c: Any, host: int) -> None:
    """Stop every process in host ``host``'s namespace: its Ray node, its trials' workers (a lost machine)."""
    out = subprocess.run(["ip", "netns", "pids", c.host_ns(host)], capture_output=True, text=True).stdout.split()
    for pid in out:
        try:
            os.kill(int(pid), 9)
        except (ProcessLookupError, ValueError):
            continue


def ray_down(c: Any) -> None:
    """Stop the Ray nodes (and anything else left running) on every host of ``c``, the head last, and remove
    Ray's pointer to the cluster just stopped (where ``ray.init()`` would look for a running one)."""
    for h in reversed(range(c.hosts)):
        stop_host(c, h)
    current = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"
    with contextlib.suppress(OSError):  # no pointer, or another cluster's: left as it is
        if current.read_text().strip() == f"{c.address(0)}:{RAY_PORT}":
            current.unlink()
