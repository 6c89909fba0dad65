"""The job's store, hosted by dtrain: where torch's agents meet and the workers start their process group.

:func:`host_store` listens on one address (loopback for a run on one machine, node 0's chosen interface for
a job on several), never on every interface as a plain ``TCPStore`` does; torch's agents and every worker
are its clients (:func:`dtrain.launch.agent.launch`). A worker starts its default process group on it under the
keys of its rendezvous round (:func:`init_from_job_store`); the round is the same number on every node
(:func:`round_of`).
"""

from __future__ import annotations

import errno
import os
import socket
import uuid
from typing import Any

from dtrain.errors import DTrainError

__all__ = ["host_store", "init_from_job_store", "round_of"]


def host_store(addr: str, port: int, timeout_s: float = 300.0) -> Any:
    """A ``TCPStore`` server that listens on ``addr:port`` only (a plain one listens on every interface).

    Raises:
        DTrainError: ``addr`` is not this machine's, or the port is taken.
    """
    import datetime

    import torch.distributed as dist

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((addr, port))
        sock.listen(1024)
    except OSError as e:
        sock.close()
        why = "the port is taken" if e.errno == errno.EADDRINUSE else (e.strerror or str(e))
        raise DTrainError(f"cannot host the job's store on {addr}:{port}: {why}") from None
    try:
        store = dist.TCPStore(  # type: ignore[attr-defined]
            addr,
            port,
            None,
            True,
            datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,
            master_listen_fd=sock.fileno(),
            use_libuv=True,
        )
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store's server owns the descriptor now, and closes it when the store goes
    return store


def round_of(handler: Any) -> str:
    """The rendezvous round the agent just completed: the same number on every node of the round."""
    try:
        return str(int(handler._state_holder.state.round))
    except AttributeError:  # another rendezvous backend: a fresh id per rendezvous, from the agent of this node
        return uuid.uuid4().hex[:8]


def init_from_job_store(backend: str | None, timeout_s: float = 300.0) -> None:
    """Start the default process group on the job's store (``DTRAIN_STORE``), under keys of this round only.

    Where dtrain hosts the job's store (:func:`host_store`: on loopback for one machine, on node 0's chosen
    interface for several), torch's agents do not share theirs with the workers
    (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE``), and nothing else listens. The workers of each rendezvous round
    use keys under ``dtrain/JOB/pg/ROUND``: the round is the same number on every node, so after an elastic
    restart no worker reads an address a failed attempt posted (gloo: "connectFullMesh failed ... Connection
    refused"; pytorch/pytorch#135712), and everything on the default store -- the heartbeats, the stall
    verdicts -- is the round's own. Otherwise as :func:`dtrain.runtime.init` (its default timeout); without
    a job store (torch's rendezvous hosts it) the group is left to that.
    """
    import datetime

    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import PrefixStore

    from dtrain import runtime

    where = os.environ.get("DTRAIN_STORE", "")
    if not where or "RANK" not in os.environ or dist.is_initialized():
        return
    host, _, port = where.rpartition(":")
    backend = backend or runtime.default_backend()
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, int(port), None, False, timeout)  # type: ignore[attr-defined]
    prefix = f"dtrain/{os.environ.get('TORCHELASTIC_RUN_ID', 'job')}/pg/{os.environ.get('DTRAIN_ROUND', '0')}"
    if backend == "nccl":
        torch.cuda.set_device(runtime.local_rank())
    dist.init_process_group(
        backend=backend,
        store=PrefixStore(prefix, store),
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=timeout,
    )
