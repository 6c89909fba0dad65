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


def pin_to_core(rank: int) -> int:
    """Pin every thread of this process (the intra-op one, gloo's, any started later) to one core of those it
    may use, chosen by ``rank``, so that ranks sharing a machine do not trade cores mid-step; the core."""
    import os

    cores = sorted(os.sched_getaffinity(0))
    core = cores[rank % len(cores)]
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), {core})
        except OSError:  # a thread that ended meanwhile
            pass
    return core
