"""Spawn real processes on gloo over loopback for distributed tests.

``spawn(fn, world_size, *args)`` starts ``world_size`` fresh interpreters
(multiprocessing "spawn"), initialises ``torch.distributed`` with gloo on a free
loopback port in each, runs ``fn(rank, world_size, *args)`` and returns each
rank's outcome. There is one hard timeout for the whole group: on expiry every
process is killed and the test fails with what each rank had reported.

``fn`` must be a module-level function (it is pickled by name).

The processes fork from one forkserver per test session that has imported torch and dtrain once
(:data:`PRELOAD`), so a world starts in milliseconds instead of importing torch in every rank; each
is still a fresh process with its own process group, and takes this process's environment as it is
at the call.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue as _queue
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from _patience import patient

__all__ = ["Outcome", "spawn", "run_distributed", "free_port", "guard", "scenario_result", "PRELOAD"]

PRELOAD = [
    "torch",
    "torch._dynamo",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "sklearn.datasets",
    "sklearn.model_selection",
    "tqdm",
    "dtrain.job.run",
    "dtrain.launch.agent",
]  # _dynamo: optimizers import it


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Outcome:
    rank: int
    status: str  # "ok" | "error" | "died" | "timeout"
    value: Any = None
    error: str = ""
    exitcode: int | None = None


def _entry(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    args: tuple[Any, ...],
    q: Any,
    pg_timeout: float,
    env: dict[str, str],
) -> None:
    os.environ.clear()  # the caller's environment, not the forkserver's (copied when it started)
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        GLOO_SOCKET_IFNAME=env.get("GLOO_SOCKET_IFNAME", "lo"),
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout),
        )
        value = fn(rank, world_size, *args)
        q.put((rank, "ok", value, ""))
        # a rank done early (rank 0 holds the store) stays until every rank is done with the group: a forked
        # process exits at once, and its closed store would reset the others' connections mid-work
        try:
            dist.barrier()
        except Exception:  # noqa: BLE001 - a peer that failed has reported its own error
            pass
    except BaseException:  # noqa: BLE001 - reported to the parent
        q.put((rank, "error", None, traceback.format_exc()))
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    pg_timeout: float = 60.0,
    env: dict[str, str] | None = None,
) -> list[Outcome]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes; return outcomes by rank."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    q = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_entry,
            args=(fn, r, world_size, port, args, q, pg_timeout, {**os.environ, **(env or {})}),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outcomes: dict[int, Outcome] = {}
    timeout = patient(timeout)
    deadline = time.monotonic() + timeout
    while len(outcomes) < world_size and time.monotonic() < deadline:
        try:
            rank, status, value, err = q.get(timeout=0.2)
            outcomes[rank] = Outcome(rank, status, value, err)
        except _queue.Empty:
            pass
        # a process that died without reporting (killed, os._exit) is final
        for r, p in enumerate(procs):
            if r not in outcomes and not p.is_alive() and p.exitcode is not None:
                try:  # it may have reported just before exiting
                    while True:
                        rank, status, value, err = q.get_nowait()
                        outcomes[rank] = Outcome(rank, status, value, err)
                except _queue.Empty:
                    pass
                if r not in outcomes:
                    outcomes[r] = Outcome(r, "died", exitcode=p.exitcode)
    for r, p in enumerate(procs):
        if r not in outcomes:
            outcomes[r] = Outcome(r, "timeout", error=f"no result within {timeout:.0f}s")
        p.join(timeout=2)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
        if outcomes[r].exitcode is None:
            outcomes[r].exitcode = p.exitcode
    return [outcomes[r] for r in range(world_size)]


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0, **kw: Any
) -> list[Any]:
    """Like :func:`spawn` but every rank must succeed; returns the values by rank."""
    outs = spawn(fn, world_size, *args, timeout=timeout, **kw)
    bad = [o for o in outs if o.status != "ok"]
    if bad:
        lines = [f"rank {o.rank}: {o.status} (exit {o.exitcode})\n{o.error}" for o in bad]
        raise AssertionError("distributed test failed:\n" + "\n".join(lines))
    return [o.value for o in outs]


def guard(fn: Callable[[], Any]) -> Any:
    """Run one scenario inside a spawned rank; an exception becomes data (``{"error", "trace"}``) so that
    the rank's other scenarios still run and report."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - reported as data
        return {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}


def scenario_result(r: Any) -> Any:
    """A scenario's value, or the test fails with the error and traceback :func:`guard` kept."""
    import pytest

    if isinstance(r, dict) and "error" in r:
        pytest.fail(r["error"] + "\n" + r.get("trace", ""))
    return r
