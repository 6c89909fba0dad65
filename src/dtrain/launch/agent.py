"""Start worker processes through torch's elastic launcher (torchrun as a library).

dtrain writes no process spawner of its own: :func:`launch` hands a picklable
function to ``torch.distributed.launcher.api.elastic_launch``, which starts the
processes, runs the c10d rendezvous and collects return values and failures.
This is the one place that sets up the children's environment (intra-op threads).

Workers fork from a forkserver that imported torch once (:mod:`dtrain.launch.forkserver`).

How a launch ends: with every return value; with :class:`LaunchError` naming each
failed rank (with ``max_restarts``, once the agent has restarted the workers that many
times: see :class:`Restart`); or, when this process gets SIGINT (Ctrl-C), SIGTERM, SIGHUP or
SIGQUIT, with :class:`LaunchInterrupted` once the agent has stopped every worker.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import socket
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from dtrain.errors import DTrainError
from dtrain.launch.forkserver import (
    PRELOAD,
    LauncherStdio,
    descendants,
    prestart,
    quick_rendezvous_events,
)
from dtrain.launch.store import host_store, round_of
from dtrain.launch.worker import _child

__all__ = [
    "LaunchError",
    "LaunchInterrupted",
    "NodeSpec",
    "Restart",
    "launch",
    "free_port",
    "host_store",
    "prestart",
    "threads_per_worker",
]  # host_store: from dtrain.launch.store

# the signals torch's elastic agent turns into a shutdown of the workers (its default set)
_STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
# loggers whose lines ("Received 2 death signal", "Terminating process ... via signal SIGTERM")
# repeat what LaunchError / LaunchInterrupted say
_TORCH_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")


class LaunchError(DTrainError):
    """One or more worker processes failed; the message names each rank and its error."""


class LaunchInterrupted(DTrainError):
    """A signal stopped the launch; every worker has been stopped.

    Args:
        signum: the signal this process got (``signal.SIGINT`` for Ctrl-C).
        message: what to tell the user (default: the signal's name).
    """

    def __init__(self, signum: int, message: str = "") -> None:
        self.signum = int(signum)
        super().__init__(message or f"interrupted by {signal.Signals(self.signum).name}")

    @property
    def exit_code(self) -> int:
        """The shell's status for a death by this signal: 128 + its number (130 for SIGINT)."""
        return 128 + self.signum


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def threads_per_worker(nprocs: int) -> int:
    """Share the cores this process may use among ``nprocs`` local workers (at least 1 each); where
    ``OMP_NUM_THREADS`` is set (as torchrun sets it), that many."""
    if os.environ.get("OMP_NUM_THREADS", "").isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
        return int(os.environ["OMP_NUM_THREADS"])
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
        job_store: ``host:port`` of a store dtrain hosts (:func:`host_store`, on the rendezvous endpoint), of
            which torch's agents and the workers are all clients; "" where torch's rendezvous hosts its own
            (``is_host``) and the workers start from torchrun's environment.
        node_rank: this node's place: its workers hold global ranks ``node_rank * nprocs ..`` (with
            ``job_store``; torch's rendezvous alone orders the nodes by address).
        min_nodes: the fewest nodes the job goes on with (elastic; 0: ``nnodes``).
        rdzv_timeout_s: how long the agents wait for the nodes at each rendezvous.
    """

    nnodes: int = 1
    rdzv_endpoint: str = ""
    is_host: bool = True
    local_addr: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    job_store: str = ""
    node_rank: int = 0
    min_nodes: int = 0
    rdzv_timeout_s: float = 300.0


@dataclass(frozen=True)
class Restart:
    """A failure the elastic agent restarts the workers after (``launch``'s ``on_restart`` gets one).

    Attributes:
        attempt: which restart this is (1 for the first).
        max_restarts: how many the launch allows.
        exitcodes: each failed rank's exit code, by global rank (negative: killed by that signal).
        rank: the rank that failed first: one a signal ended before one that exited with an error
            (a peer's death makes the others fail), else the earliest (torch's timestamps), else the lowest.
    """

    attempt: int
    max_restarts: int
    exitcodes: dict[int, int]
    rank: int

    def cause(self, rank: int | None = None) -> str:
        """What ended ``rank`` (default: :attr:`rank`): ``"SIGKILL"``, or ``"exit code 1"``."""
        code = self.exitcodes[self.rank if rank is None else rank]
        if code < 0:
            try:
                return signal.Signals(-code).name
            except ValueError:
                return f"signal {-code}"
        return f"exit code {code}"


def _restart(attempt: int, max_restarts: int, failures: dict[int, Any]) -> Restart:
    """A :class:`Restart` from torch's ``ProcessFailure`` by global rank."""
    codes = {int(r): int(f.exitcode if f.exitcode is not None else 1) for r, f in failures.items()}
    first = min(failures, key=lambda r: _cause_order(r, failures[r]))
    return Restart(attempt=attempt, max_restarts=max_restarts, exitcodes=dict(sorted(codes.items())), rank=first)


def _cause_order(rank: int, failure: Any) -> tuple[bool, int, int]:
    """Sort key that puts the failure that ended the attempt first: a worker a signal ended, then the
    earliest error (its error file's modification time, in ns; torch's ``timestamp`` is whole seconds,
    and a peer that failed on the closed connection often writes within the same second), then the rank."""
    code = failure.exitcode if failure.exitcode is not None else 1
    when = int(failure.timestamp or 0) * 1_000_000_000
    path = getattr(failure, "error_file", "")
    if path and os.path.isfile(path):
        with contextlib.suppress(OSError):
            when = os.stat(path).st_mtime_ns
    return (code >= 0, when, int(rank))


@functools.cache
def _restarting_agent(base: type) -> type:
    """torch's ``LocalElasticAgent`` that tells the launch's ``on_restart`` what failed before each restart.

    The agent keeps the failure to itself when it restarts: ``_invoke_run`` polls
    ``_monitor_workers`` and, on a failure with restarts left, calls ``_restart_workers`` (stop every
    worker, rendezvous again, start them); the failures reach the caller only when no restart is left.
    This subclass keeps the last poll's result, and reports it once the failed attempt's workers
    have all stopped (so the run folder holds their last writes) and before the new ones start.
    Where the callback returns a number of processes, the new attempt starts that many (the spec's
    ``local_world_size``, which the rendezvous reads to assign ranks): a scale-down.
    The callback is the one :func:`launch` set for its thread (``elastic_launch`` builds and runs the
    agent on the calling thread); without one the agent is torch's.
    """

    class _Agent(base):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._dtrain_on_restart = getattr(_HOOK, "on_restart", None)
            self._dtrain_node: NodeSpec | None = getattr(_HOOK, "node", None)
            self._dtrain_seen: Any = None  # the last _monitor_workers result
            self._dtrain_pending: Any = None  # the failed result a restart is under way for

        def _monitor_workers(self, worker_group: Any) -> Any:
            result = super()._monitor_workers(worker_group)
            if result is not None and result.failures:  # the workers are stopped by now
                result.failures = _causes(_failures(self, worker_group)) or result.failures
            self._dtrain_seen = result
            return result

        def _restart_workers(self, worker_group: Any) -> None:  # also for new nodes: then nothing failed
            seen = self._dtrain_seen
            self._dtrain_pending = seen if seen is not None and seen.failures else None
            super()._restart_workers(worker_group)

        def _assign_worker_ranks(self, store: Any, group_rank: int, group_world_size: int, spec: Any) -> Any:
            # after each rendezvous (``store`` is the round's): tell the workers the round, and number the
            # nodes by their node rank rather than by torch's order (their addresses)
            node = self._dtrain_node
            if node is not None and node.job_store:
                spec.args[2]["DTRAIN_ROUND"] = round_of(spec.rdzv_handler)
                if group_world_size > 1:
                    store.set(f"dtrain/node_rank/{group_rank}", str(node.node_rank))
                    ranks = sorted(
                        int(v) for v in store.multi_get([f"dtrain/node_rank/{g}" for g in range(group_world_size)])
                    )
                    group_rank = ranks.index(node.node_rank)
            return super()._assign_worker_ranks(store, group_rank, group_world_size, spec)

        def _initialize_workers(self, worker_group: Any) -> None:  # the failed workers are stopped by now
            pending, self._dtrain_pending = self._dtrain_pending, None
            if pending is not None and self._dtrain_on_restart is not None:
                spec = worker_group.spec
                attempt = spec.max_restarts - self._remaining_restarts
                n = None
                try:
                    n = self._dtrain_on_restart(_restart(attempt, spec.max_restarts, pending.failures))
                except Exception as e:  # noqa: BLE001 - a report that fails must not stop the restart
                    print(f"dtrain: could not report the restart: {e!r}", file=sys.stderr, flush=True)
                if isinstance(n, int) and 0 < n != spec.local_world_size:  # scale down (or up): the
                    spec.local_world_size = n  # rendezvous below assigns the ranks of n workers
            super()._initialize_workers(worker_group)

    return _Agent


def _failures(agent: Any, worker_group: Any) -> dict[int, Any]:
    """Every worker of the failed attempt that ended on its own with an error or by a signal other than the
    agent's own stop (SIGTERM), by global rank, each with its error file.

    The agent's poll reports one failure: the first process it finds ended, which need not be the one that
    ended first (a SIGKILLed worker, or one that raised, and the peer that then failed on its closed
    connection can both have ended by the poll); :func:`_cause_order` tells which came first.
    Read once every worker has stopped.
    """
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    pcontext = getattr(agent, "_pcontext", None)
    procs = getattr(getattr(pcontext, "_pc", None), "processes", None) or []
    error_files = getattr(pcontext, "error_files", None) or {}
    out: dict[int, Any] = {}
    for local, p in enumerate(procs):
        code = p.exitcode
        if code is not None and code != 0 and code != -signal.SIGTERM and local < len(worker_group.workers):
            error_file = error_files.get(local, "") if code > 0 else ""
            out[worker_group.workers[local].global_rank] = ProcessFailure(
                local_rank=local, pid=p.pid, exitcode=code, error_file=error_file
            )
    return out


def _causes(failures: dict[int, Any]) -> dict[int, Any]:
    """The failures that ended the attempt: those a signal ended, else the earliest error alone (the
    peers that then failed on its closed connection are its consequences)."""
    killed = {r: f for r, f in failures.items() if f.exitcode < 0}
    if killed or not failures:
        return killed
    first = min(failures, key=lambda r: _cause_order(r, failures[r]))
    return {first: failures[first]}


_HOOK = threading.local()  # .on_restart, .node: the callback and the node of the launch running on this thread
_SWAP_LOCK = threading.Lock()
_SWAP_USERS = [0]  # launches with an on_restart under way (the last one puts torch's agent back)


@contextlib.contextmanager
def _agent_reports_restarts(on_restart: Callable[[Restart], int | None] | None, node: NodeSpec) -> Iterator[None]:
    """While launching, have ``torch.distributed.launcher.api`` build :func:`_restarting_agent`'s agent.

    ``elastic_launch`` builds its ``LocalElasticAgent`` by that module-level name and takes no agent
    class, so the name is swapped while a launch runs, and put back when the last one ends.
    """
    import importlib

    api: Any = importlib.import_module("torch.distributed.launcher.api")
    with _SWAP_LOCK:
        if _SWAP_USERS[0] == 0:
            api.LocalElasticAgent = _restarting_agent(api.LocalElasticAgent)
        _SWAP_USERS[0] += 1
    _HOOK.on_restart, _HOOK.node = on_restart, node
    try:
        yield
    finally:
        _HOOK.on_restart, _HOOK.node = None, None
        with _SWAP_LOCK:
            _SWAP_USERS[0] -= 1
            if _SWAP_USERS[0] == 0:
                api.LocalElasticAgent = api.LocalElasticAgent.__mro__[1]  # torch's, which it subclasses


def _launch_config(node: NodeSpec, nprocs: int, run_id: str | None, max_restarts: int, monitor_interval: float) -> Any:
    """torch's ``LaunchConfig`` of one node: the c10d rendezvous, workers forked from the forkserver."""
    from torch.distributed.launcher.api import LaunchConfig

    # last_call: after MIN nodes are in, how long a rendezvous waits for more (torch's default is 30 s)
    rdzv = {"is_host": node.is_host, "join_timeout": node.rdzv_timeout_s, "last_call_timeout": 5}
    return LaunchConfig(
        min_nodes=node.min_nodes or node.nnodes,
        max_nodes=node.nnodes,
        nproc_per_node=nprocs,
        run_id=run_id or uuid.uuid4().hex[:12],
        rdzv_backend="c10d",
        rdzv_endpoint=node.rdzv_endpoint,
        rdzv_configs=rdzv,
        max_restarts=max_restarts,
        monitor_interval=monitor_interval,
        start_method="forkserver",
        local_addr=node.local_addr,
    )


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
    max_restarts: int = 0,
    on_restart: Callable[[Restart], int | None] | None = None,
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
        max_restarts: when a worker fails, stop the others and start them all again, up to
            this many times (torch elastic's ``max_restarts``; the workers see
            ``TORCHELASTIC_RESTART_COUNT``); a failure after the last raises :class:`LaunchError`.
        on_restart: called in this process with a :class:`Restart` before each restart, once
            the failed attempt's workers have stopped; where it returns a number, the restarted
            attempt runs that many processes (ranks 0..n-1; the return values then come from them).

    Raises:
        LaunchError: naming each failed rank and the first line of its error.
        LaunchInterrupted: this process got SIGINT, SIGTERM, SIGHUP or SIGQUIT; the
            workers were stopped (the agent sends them the same signal, then SIGKILL).
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    _check_counts(nprocs, max_restarts)
    store, node = _one_machine() if node is None else (None, node)
    if node.nnodes > 1 and run_id is None:
        raise ValueError("a multi-node launch needs the same run_id on every node")
    config = _launch_config(node, nprocs, run_id, max_restarts, monitor_interval)
    env = _worker_env(node)
    t = threads or threads_per_worker(nprocs)
    quick_rendezvous_events()
    if quiet:
        _silence_torch_loggers()
    try:
        with _signal_handlers_kept(), _stopped_workers_woken(), _agent_reports_restarts(on_restart, node):
            prestart((*PRELOAD, fn.__module__))
            return dict(
                elastic_launch(config, entrypoint=_child)(fn, t, env, backend, args, dict(os.environ), LauncherStdio())
            )
    except SignalException as e:
        raise LaunchInterrupted(e.sigval) from None
    except KeyboardInterrupt:  # Ctrl-C before the agent set its handlers (rendezvous): no worker started yet
        raise LaunchInterrupted(signal.SIGINT) from None
    except ChildFailedError as e:
        raise _failed(e.failures) from None
    finally:
        del store  # a store hosted here stops serving


def _check_counts(nprocs: int, max_restarts: int) -> None:
    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    if max_restarts < 0:
        raise ValueError(f"max_restarts must be >= 0, got {max_restarts}")


def _worker_env(node: NodeSpec) -> dict[str, str]:
    """The variables the workers get beyond the launcher's: the node's, and the job's store where it has one."""
    env = dict(node.env)
    if node.job_store:  # the workers start on it (init_from_job_store); the agents share no store of theirs
        env["DTRAIN_STORE"] = node.job_store
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return env


def _silence_torch_loggers() -> None:
    """torch elastic's own log lines off: each of torch's loggers has its own level, so every one under the
    prefixes is set."""
    for name in [*_TORCH_LOGGERS, *logging.root.manager.loggerDict]:
        if name.startswith(_TORCH_LOGGERS):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def _one_machine() -> tuple[Any, NodeSpec]:
    """The job's store on loopback, and the node that uses it: nothing of the run listens beyond 127.0.0.1."""
    port = free_port()
    store = host_store("127.0.0.1", port)
    return store, NodeSpec(
        rdzv_endpoint=f"127.0.0.1:{port}",
        is_host=False,
        job_store=f"127.0.0.1:{port}",
        env={"GLOO_SOCKET_IFNAME": "lo"},
    )


@contextlib.contextmanager
def _stopped_workers_woken(period_s: float = 0.25) -> Iterator[None]:
    """Once a worker has exited while another is stopped (SIGSTOP, a debugger), send the stopped one SIGCONT.

    torch's agent ends the other workers with SIGTERM and then waits a fixed 30 s before SIGKILL
    (``torch.multiprocessing`` ``ProcessContext.join`` without a grace period); a stopped process
    takes no SIGTERM, so without this the launch outlived the failure by those 30 s.
    """
    done = threading.Event()

    def watch() -> None:
        seen: set[int] = set()
        while not done.wait(period_s):
            now = descendants()
            gone = any(pid not in now or now[pid] == "Z" for pid in seen)  # exited since the last look
            seen = {pid for pid, state in now.items() if state != "Z"}
            if gone:
                for pid, state in now.items():
                    if state == "T":
                        with contextlib.suppress(OSError):
                            os.kill(pid, signal.SIGCONT)

    th = threading.Thread(target=watch, name="dtrain-wake-stopped", daemon=True)
    th.start()
    try:
        yield
    finally:
        done.set()
        th.join(timeout=2 * period_s + 1)


@contextlib.contextmanager
def _signal_handlers_kept() -> Iterator[None]:
    """Put this process's handlers of the stop signals back afterwards: torch's agent replaces them
    (with one that raises SignalException, even after the launch) and leaves them so."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread sets handlers
        yield
        return
    saved = {getattr(signal, n): signal.getsignal(getattr(signal, n)) for n in _STOP_SIGNALS if hasattr(signal, n)}
    try:
        yield
    finally:
        for s, handler in saved.items():
            if handler is not None:  # None: set outside Python, cannot be put back
                signal.signal(s, handler)


def _failed(failures: dict[int, Any]) -> LaunchError:
    """The error naming each failed rank (torch's ``ProcessFailure`` by global rank) and its error's last line,
    the failure that ended the run first (:func:`_cause_order`)."""
    lines = []
    for rank, failure in sorted(failures.items(), key=lambda item: _cause_order(*item)):
        msg = failure.message
        if isinstance(msg, dict):
            msg = msg.get("message", str(msg))
        first = str(msg).strip().splitlines()
        detail = first[-1] if first else f"exit code {failure.exitcode}"
        if failure.exitcode and failure.exitcode < 0:
            detail = f"killed by signal {-failure.exitcode}; {detail}"
        lines.append(f"rank {rank}: {detail}")
    return LaunchError("worker processes failed:\n  " + "\n  ".join(lines))
