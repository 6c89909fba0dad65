"""Start worker processes through torch's elastic launcher (torchrun as a library).

dtrain writes no process spawner of its own: :func:`launch` hands a picklable
function to ``torch.distributed.launcher.api.elastic_launch``, which starts the
processes, runs the c10d rendezvous and collects return values and failures.
This is the one place that sets up the children's environment (intra-op threads).
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dtrain.errors import DTrainError

__all__ = ["LaunchError", "NodeSpec", "launch", "free_port", "threads_per_worker"]


class LaunchError(DTrainError):
    """One or more worker processes failed; the message names each rank and its error."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def threads_per_worker(nprocs: int) -> int:
    """Share the cores this process may use among ``nprocs`` local workers (at least 1 each)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, nprocs))


@dataclass(frozen=True)
class NodeSpec:
    """Where this node sits in a multi-node job (default: a single local node).

    Attributes:
        nnodes: number of nodes (machines or emulated hosts).
        rdzv_endpoint: ``host:port`` of the c10d rendezvous (on the first node).
        is_host: whether this node hosts the rendezvous store.
        local_addr: this node's address, advertised to the others.
        env: extra environment for this node's workers (e.g. GLOO_SOCKET_IFNAME).
    """

    nnodes: int = 1
    rdzv_endpoint: str = ""
    is_host: bool = True
    local_addr: str | None = None
    env: dict[str, str] = field(default_factory=dict)


def _child(
    fn: Callable[..., Any], threads: int, env: dict[str, str], backend: str | None, args: tuple[Any, ...]
) -> Any:
    import torch

    os.environ.update(env)
    torch.set_num_threads(threads)
    from dtrain import runtime

    runtime.init(backend=backend)
    try:
        return fn(*args)
    finally:
        runtime.shutdown()


def launch(
    fn: Callable[..., Any],
    args: tuple[Any, ...] = (),
    *,
    nprocs: int,
    node: NodeSpec | None = None,
    threads: int | None = None,
    backend: str | None = None,
    run_id: str | None = None,
    monitor_interval: float = 0.1,
    quiet: bool = True,
) -> dict[int, Any]:
    """Run ``fn(*args)`` on ``nprocs`` processes of this node; return values by global rank.

    Every child gets RANK/WORLD_SIZE/LOCAL_RANK... from torchrun and has
    ``dtrain.init()`` called before ``fn``. ``fn`` must be picklable (module level).

    Args:
        fn: the worker function.
        args: its arguments (picklable).
        nprocs: processes on this node.
        node: multi-node placement (default: one local node on a free loopback port).
        threads: intra-op threads per worker (default: this node's cores / nprocs).
        backend: process-group backend (default: NCCL with CUDA, else gloo).
        run_id: rendezvous id, equal on every node (default: random, single node only).
        quiet: silence torch elastic's own log lines (failures still raise
            :class:`LaunchError`; workers' tracebacks stay on their stderr).

    Raises:
        LaunchError: naming each failed rank and the first line of its error.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    node = node or NodeSpec(rdzv_endpoint=f"127.0.0.1:{free_port()}", env={"GLOO_SOCKET_IFNAME": "lo"})
    if node.nnodes > 1 and run_id is None:
        raise ValueError("a multi-node launch needs the same run_id on every node")
    rdzv_conf: dict[str, Any] = {"is_host": node.is_host}
    config = LaunchConfig(
        min_nodes=node.nnodes,
        max_nodes=node.nnodes,
        nproc_per_node=nprocs,
        run_id=run_id or uuid.uuid4().hex[:12],
        rdzv_backend="c10d",
        rdzv_endpoint=node.rdzv_endpoint,
        rdzv_configs=rdzv_conf,
        max_restarts=0,
        monitor_interval=monitor_interval,
        start_method="spawn",
        local_addr=node.local_addr,
    )
    t = threads or threads_per_worker(nprocs)
    if quiet:
        for name in ("torch.distributed.elastic", "torch.distributed.launcher"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        return dict(elastic_launch(config, entrypoint=_child)(fn, t, dict(node.env), backend, args))
    except ChildFailedError as e:
        lines = []
        for rank, failure in sorted(e.failures.items()):
            msg = failure.message
            if isinstance(msg, dict):
                msg = msg.get("message", str(msg))
            first = str(msg).strip().splitlines()
            detail = first[-1] if first else f"exit code {failure.exitcode}"
            if failure.exitcode and failure.exitcode < 0:
                detail = f"killed by signal {-failure.exitcode}; {detail}"
            lines.append(f"rank {rank}: {detail}")
        raise LaunchError("worker processes failed:\n  " + "\n  ".join(lines)) from None
