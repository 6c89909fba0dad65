"""Start a benchmark's processes on this machine's loopback: 127.0.0.1 as the rendezvous and master address,
gloo on ``lo``, one intra-op thread each (what the pipeline benchmarks compare under)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def launch_loopback(fn: Callable[..., Any], args: tuple[Any, ...], nprocs: int) -> dict[int, Any]:
    """``fn(*args)`` on ``nprocs`` processes over loopback; the values by rank."""
    from dtrain.launch.agent import NodeSpec, free_port, launch

    node = NodeSpec(rdzv_endpoint=f"127.0.0.1:{free_port()}", local_addr="127.0.0.1", env={"GLOO_SOCKET_IFNAME": "lo"})
    return launch(fn, args, nprocs=nprocs, threads=1, node=node)
