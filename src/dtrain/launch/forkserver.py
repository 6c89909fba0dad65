"""How dtrain's worker processes start: forked from a forkserver that imported torch once.

Workers fork from ``multiprocessing``'s forkserver after it has imported torch and the worker's modules
(:data:`PRELOAD`), so a worker starts in milliseconds instead of importing torch again, and an elastic
restart does too. :func:`prestart` starts that server early (``dtrain run`` calls it before it reads its
configuration, so the two imports overlap; the server runs nothing but imports, and no worker starts
before the configuration has been checked). A worker takes the launching process's environment as it is
at the launch (:func:`adopt_env`; not the server's, copied when the server started), with the variables
torch's agent sets for it on top, and writes to that process's stdout and stderr as they are at the launch
(:class:`LauncherStdio`; not the server's, the starting process's when the server started).
:func:`dtrain.launch.agent.launch` uses all of this.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any

__all__ = ["PRELOAD", "LauncherStdio", "prestart", "adopt_env", "descendants", "quick_rendezvous_events"]

# what every worker imports anyway: the forkserver imports it once and each worker forks with it loaded
# (the server skips what is not installed: sklearn only serves the digits data set). torch._dynamo: torch's
# optimizers import it when the first one is built (1.2 of a one-step worker's 1.4 s on this machine)
PRELOAD = (
    "torch",
    "torch._dynamo",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.elastic.multiprocessing",
    "sklearn.datasets",
    "sklearn.model_selection",
    "tqdm",
    "dtrain.launch.agent",
    "dtrain.job.run",
    "dtrain.strategies.builtin",
)
# the environment of this module's first import: in a worker that forked from the forkserver, the server's
_IMPORT_ENV = dict(os.environ)
# what torch's agent sets for each worker (besides TORCHELASTIC_*): these come from the agent, never the parent
_AGENT_VARS = frozenset(
    {
        "RANK",
        "GROUP_RANK",
        "ROLE_RANK",
        "ROLE_NAME",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "WORLD_SIZE",
        "GROUP_WORLD_SIZE",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
        "CUDA_VISIBLE_DEVICES",
    }
)


def _is_agent_var(name: str) -> bool:
    return name in _AGENT_VARS or name.startswith("TORCHELASTIC_")


def prestart(modules: tuple[str, ...] = PRELOAD) -> None:
    """Start the forkserver the workers fork from, with ``modules`` imported, if it is not running.

    It imports in a process of its own, so calling this before the parent's own slow work (reading the
    configuration, loading data) overlaps the two; :func:`dtrain.launch.agent.launch` calls it too. Idempotent.
    """
    import multiprocessing
    from multiprocessing import forkserver

    # the server skips a module it cannot import; "__main__" reaches each worker as spawn's would
    multiprocessing.set_forkserver_preload([m for m in modules if m != "__main__"])
    forkserver.ensure_running()


def adopt_env(parent: dict[str, str]) -> None:
    """Make this worker's environment the launching process's ``parent``, plus what torch's agent set.

    A forked worker starts with the forkserver's environment, copied when the server started; the agent's
    variables (ranks, rendezvous, error file) are those that differ from it, or carry the agent's names.
    """
    agent = {k: v for k, v in os.environ.items() if _is_agent_var(k) or _IMPORT_ENV.get(k) != v}
    os.environ.clear()
    os.environ.update({k: v for k, v in parent.items() if not _is_agent_var(k)})
    os.environ.update(agent)


class LauncherStdio:
    """The launching process's stdout and stderr (file descriptors 1 and 2), handed to a worker as it starts.

    Pickled into the request to the forkserver, each descriptor travels with it as ``multiprocessing``
    sends a socket's (``reduction.DupFd``); the worker gets :class:`WorkerStdio` and calls its
    :meth:`WorkerStdio.install` before it writes anything. Where a descriptor is closed, the worker keeps its own.
    """

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        from multiprocessing import reduction

        fds: list[Any] = []
        for fd in (1, 2):
            try:
                os.fstat(fd)
            except OSError:
                fds.append(None)
                continue
            fds.append(reduction.DupFd(fd))
        return (WorkerStdio, tuple(fds))


class WorkerStdio:
    """:class:`LauncherStdio` in the worker: the received descriptors, until :meth:`install` puts them in place."""

    def __init__(self, *dup: Any) -> None:
        self.fds = [d.detach() if d is not None else None for d in dup]

    def install(self) -> None:
        """Make the received descriptors this process's 1 and 2 (Python's ``sys.stdout``/``sys.stderr`` write there)."""
        for fd, target in zip(self.fds, (1, 2)):
            if fd is None or fd == target:
                continue
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os.dup2(fd, target)
            os.close(fd)
        self.fds = [None, None]


def _caller_name(depth: int = 2) -> str:
    """The name of the function ``depth`` frames up (0: this one), read from the frame alone."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:  # the stack is not that deep
        return "no_method_name"


def quick_rendezvous_events() -> None:
    """Name the c10d rendezvous's events without ``inspect.stack()``.

    torch's rendezvous names each event it records after the calling method, found through
    ``inspect.stack()``, which reads the source file of every frame on the stack (under cProfile on a
    2-core machine: 5.1 s of a 22 s ``dtrain run``). :func:`_caller_name` gives the same name from the frame.
    """
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    if hasattr(dynamic_rendezvous, "get_method_name"):
        dynamic_rendezvous.get_method_name = _caller_name


def descendants() -> dict[int, str]:
    """This process's children and theirs (the workers fork from the forkserver, a child) with their state
    letters (``/proc``; empty where there is none)."""
    me, parent, state = os.getpid(), {}, {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return {}
    for e in entries:
        if not e.isdigit():
            continue
        try:
            with open(f"/proc/{e}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent[int(e)], state[int(e)] = int(fields[1]), fields[0]
    children = {pid for pid, pp in parent.items() if pp == me}
    return {pid: state[pid] for pid, pp in parent.items() if pp == me or pp in children}
