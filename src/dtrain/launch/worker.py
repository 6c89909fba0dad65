"""What runs in each worker process that :func:`dtrain.launch.agent.launch` starts.

:func:`_child` is the entrypoint torch's elastic agent runs in every worker: it takes over the
launcher's environment and stdio, sets the intra-op threads, starts the process group (on the job's
store), runs the worker function and ends the process so that neither a silent peer nor a stray thread
keeps it from reporting its status. Ctrl-C ends a worker with one KeyboardInterrupt (:class:`_Interrupt`).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from dtrain.errors import CommTimeoutError
from dtrain.launch.forkserver import LauncherStdio, WorkerStdio, adopt_env
from dtrain.launch.store import init_from_job_store

__all__: list[str] = []


class _Interrupt:
    """This worker's SIGINT handler: one KeyboardInterrupt, then nothing.

    Ctrl-C reaches a worker twice: from the terminal (the whole process group) and from the agent,
    which passes the signal on while it stops the workers. A second KeyboardInterrupt would land
    wherever the worker is winding down and print a traceback; the first one is enough.
    """

    def __init__(self) -> None:
        self.seen = False

    def __call__(self, signum: int, frame: Any) -> None:
        if not self.seen:
            self.seen = True
            raise KeyboardInterrupt


def _child(
    fn: Callable[..., Any],
    threads: int,
    env: dict[str, str],
    backend: str | None,
    args: tuple[Any, ...],
    parent_env: dict[str, str],
    stdio: WorkerStdio | LauncherStdio,
) -> Any:
    if isinstance(stdio, WorkerStdio):  # (a LauncherStdio when called in-process, never pickled)
        stdio.install()
    import torch
    from tqdm import tqdm

    interrupt = _Interrupt()
    signal.signal(signal.SIGINT, interrupt)
    adopt_env(parent_env)
    os.environ.update(env)
    torch.set_num_threads(threads)
    # tqdm's default lock holds a multiprocessing RLock: a named semaphore registered with the
    # launcher's resource tracker, which this (spawned) process shares. A worker killed by a signal
    # (SIGKILL; SIGTERM from the launcher when another rank fails) never unregisters it, and the
    # tracker then prints "leaked semaphore objects" warnings after the run's error. A worker's bars
    # live in one process, so a thread lock is all they need.
    tqdm.set_lock(threading.RLock())
    from dtrain import runtime

    init_from_job_store(backend)
    runtime.init(backend=backend)  # (a no-op where the job's store started the group)
    failed = False
    try:
        result = fn(*args)
    except BaseException as e:
        # torch's spawn wrapper ends a worker quietly on KeyboardInterrupt; others it prints. Ctrl-C
        # can come back as another exception: torch's checkpoint collectives turn it into a
        # CheckpointException (a BaseException) naming every rank's KeyboardInterrupt.
        if interrupt.seen:
            raise KeyboardInterrupt from None
        failed = isinstance(e, CommTimeoutError)  # a silent peer: tearing the groups down would wait on it
        raise
    finally:
        if failed:
            _exit_without_teardown()
        else:
            runtime.shutdown()
    _exit_past_stray_threads()  # after a success only: a failure's status and error stay torch's wrapper's
    return result


def _exit_without_teardown() -> None:
    """After a timeout, leave the process groups alone and end the process without destroying them.

    The silent peer may be stopped (SIGSTOP) or hung: destroying a gloo group (``destroy_process_group``,
    or the garbage collector at exit) joins its threads, which wait on that peer forever, so the worker
    would never exit and never let the launcher report the error. torch's wrapper writes the error
    file and calls ``sys.exit(1)``; an exit handler then ends the process at once with that status.
    A peer that died (its connections closed) is no such case: the orderly teardown returns, and its
    own error, the cause, is reported first.
    """

    atexit.register(_hard_exit, 1)


def _hard_exit(status: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


def _exit_past_stray_threads(grace_s: float = 2.0) -> None:
    """After a successful run, end the process at exit without finalizing under dtrain's threads still alive.

    A daemon thread that returns from a call that released the GIL (a gloo wait, a store request, a
    process group's destructor) while the interpreter finalizes cannot take the GIL back: Python ends the
    thread inside C++ code that may not be unwound, and the process dies of SIGABRT ("terminate called
    without an active exception") after its work is done. Threads are given ``grace_s`` to end; if any of
    dtrain's ("dtrain-*", "ps-*") is still alive, an exit handler ends the process with status 0 before
    finalization (torch's wrapper has returned the result by then).
    """
    deadline = time.monotonic() + grace_s
    stray = []
    for th in threading.enumerate():
        if th is threading.current_thread() or not th.name.startswith(("dtrain-", "ps-")):
            continue
        th.join(timeout=max(0.0, deadline - time.monotonic()))
        if th.is_alive():
            stray.append(th.name)
    if stray:
        logging.getLogger(__name__).debug("threads alive at exit: %s", ", ".join(stray))
        atexit.register(_hard_exit, 0)
