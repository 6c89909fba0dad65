"""Multi-node launch on an emulated cluster: one torchrun node per emulated host.

:func:`run_on_cluster` does on one machine exactly what a job on N real
machines does: on every host ``i`` it starts ``ip netns exec dtc-NAME-h<i>
python -m dtrain.cluster._node``, which calls :func:`dtrain.launch.agent.launch` with a
:class:`~dtrain.launch.agent.NodeSpec` -- a c10d rendezvous hosted on host 0
(``is_host`` there), each node advertising its own address (``local_addr``), and
``GLOO_SOCKET_IFNAME=eth0`` so gloo binds the host's shaped interface rather than
the hostname's address. Ranks are numbered host by host (host ``i`` holds global
ranks ``i*k .. i*k+k-1`` for ``k`` processes per host) as torchrun does.

The whole job has one hard timeout; on expiry every node's process group (the
agent and its workers, all started here) is killed and the error names the hosts
that had not finished.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from dtrain.cluster.netns import IFACE, EmulatedCluster, load, require_root
from dtrain.errors import ConfigError
from dtrain.launch.agent import LaunchError
from dtrain.rundir.files import CONFIG

__all__ = ["run_on_cluster", "launch_on_cluster", "node_env", "run_nodes_on_cluster"]


def node_env(c: EmulatedCluster, host: int) -> dict[str, str]:
    """Environment of the workers on one emulated host (interface, host index, slowdown)."""
    # the hosts share this machine's cores: one intra-op thread a worker (spinning OpenMP threads of several
    # hosts on the same cores slowed steps tenfold)
    env = {
        "GLOO_SOCKET_IFNAME": IFACE,
        "DTRAIN_CLUSTER": c.name,
        "DTRAIN_CLUSTER_HOST": str(host),
        "OMP_NUM_THREADS": "1",
    }
    if host in c.slow:
        env["DTRAIN_SLOWDOWN"] = f"{c.slow[host]:g}"
    return env


def run_on_cluster(
    fn: Callable[..., Any],
    args: tuple[Any, ...] = (),
    *,
    cluster: str | EmulatedCluster,
    nprocs_per_host: int = 1,
    threads: int = 1,
    timeout_s: float = 600.0,
    stream_first: bool = False,
    env: dict[str, str] | None = None,
) -> dict[int, Any]:
    """Run ``fn(*args)`` on every process of every host of an emulated cluster.

    Args:
        fn: module-level (picklable) worker function; ``dtrain.init()`` is done before it.
        args: its arguments (picklable).
        cluster: the cluster's name or description.
        nprocs_per_host: worker processes per host (default: 1).
        threads: intra-op threads per worker (default: 1; the hosts share this machine's cores).
        timeout_s: hard limit for the whole job (default: 600).
        stream_first: let host 0's output through to this terminal (else only logs on failure).
        env: extra environment for every worker.

    Returns:
        ``{global rank: return value}`` over all hosts.

    Raises:
        LaunchError: a node failed or the job ran past ``timeout_s``; names the hosts
            and the last lines of their logs.
    """
    require_root()
    c = cluster if isinstance(cluster, EmulatedCluster) else load(cluster)
    if nprocs_per_host < 1:
        raise ValueError(f"nprocs_per_host must be >= 1, got {nprocs_per_host}")
    run_id = uuid.uuid4().hex[:12]
    port = random.randint(20000, 40000)  # inside our own namespaces nothing else listens
    work = Path(tempfile.mkdtemp(prefix=f"dtrain-{c.name}-"))
    # The node (and the workers it spawns) must import ``fn`` by name, as this process does.
    penv = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    procs: list[subprocess.Popen[bytes]] = []
    logs: list[IO[bytes]] = []
    try:
        for h in range(c.hosts):
            payload = {
                "fn": fn,
                "args": args,
                "nprocs": nprocs_per_host,
                "nnodes": c.hosts,
                "endpoint": f"{c.address(0)}:{port}",
                "is_host": h == 0,
                "local_addr": c.address(h),
                "env": {**node_env(c, h), **(env or {})},
                "threads": threads,
                "run_id": run_id,
                "result": str(work / f"result{h}.pkl"),
            }
            procs.append(_start_node(c, h, payload, work, penv, logs, stream=stream_first and h == 0))
        late, gave_up = _wait(procs, timeout_s)
        return _collect(c, procs, work, late, gave_up, timeout_s)
    finally:
        _clean_up(procs, logs, work)


def _clean_up(procs: list[subprocess.Popen[bytes]], logs: list[IO[bytes]], work: Path) -> None:
    """Kill the nodes still running, close their logs, and remove the job's folder (unless DTRAIN_KEEP_LOGS)."""
    for p in procs:
        if p.poll() is None:
            _kill(p)
    for log in logs:
        log.close()
    if not os.environ.get("DTRAIN_KEEP_LOGS"):
        for f in work.iterdir():
            f.unlink()
        work.rmdir()


def _start_node(
    c: EmulatedCluster,
    h: int,
    payload: dict[str, Any],
    work: Path,
    penv: dict[str, str],
    logs: list[IO[bytes]],
    *,
    stream: bool,
) -> subprocess.Popen[bytes]:
    """Start host ``h``'s node (``python -m dtrain.cluster._node``) in its namespace, logging to ``work``.

    The log file is appended to ``logs`` before the node starts, so the caller closes it whatever happens.
    """
    pfile = work / f"payload{h}.pkl"
    pfile.write_bytes(pickle.dumps(payload))
    main_file = _main_file(payload["fn"])
    log = open(work / f"host{h}.log", "wb")
    logs.append(log)
    out = None if stream else log
    cmd = ["ip", "netns", "exec", c.host_ns(h), sys.executable, "-m", "dtrain.cluster._node", str(pfile), main_file]
    return subprocess.Popen(
        cmd, stdout=out, stderr=subprocess.STDOUT if out else None, start_new_session=True, env=penv
    )


def _wait(procs: list[subprocess.Popen[bytes]], timeout_s: float) -> tuple[list[int], bool]:
    """Wait for every node until ``timeout_s``, or 2 s more after one failed; kill the late ones.

    Returns:
        (the hosts still running, which were killed; whether the wait gave up after a failure).
    """
    deadline = time.monotonic() + timeout_s
    gave_up = False
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if any(p.returncode not in (None, 0) for p in procs):
            time.sleep(2.0)  # let the others notice and report their own error
            gave_up = True
            break
        time.sleep(0.05)
    late = [h for h, p in enumerate(procs) if p.poll() is None]
    for h in late:
        _kill(procs[h])
    return late, gave_up


def _collect(
    c: EmulatedCluster,
    procs: list[subprocess.Popen[bytes]],
    work: Path,
    late: list[int],
    gave_up: bool,
    timeout_s: float,
) -> dict[int, Any]:
    """Every host's results, merged, or a :class:`LaunchError` that names each host that failed and why."""
    results: dict[int, Any] = {}
    failures = []
    for h, p in enumerate(procs):
        rfile = work / f"result{h}.pkl"
        if rfile.exists():
            ok, value = pickle.loads(rfile.read_bytes())
            if ok:
                results.update(value)
                continue
            failures.append(f"host {h}: {value}")
        elif h in late:
            why = "killed after another host failed" if gave_up else f"still running after {timeout_s:.0f} s (killed)"
            failures.append(f"host {h}: {why}; log: {_tail(work, h)}")
        else:
            failures.append(f"host {h}: node exited with code {p.returncode}; log: {_tail(work, h)}")
    if failures:
        raise LaunchError(f"job on emulated cluster {c.name!r} failed:\n  " + "\n  ".join(failures))
    return results


def _main_file(fn: Callable[..., Any]) -> str:
    """The script file when ``fn`` lives in ``__main__`` (the node imports it in its place), else ""."""
    if getattr(fn, "__module__", None) != "__main__":
        return ""
    f = getattr(sys.modules["__main__"], "__file__", None)
    if not f:
        raise ValueError("run_on_cluster needs a module-level function of an importable module or script file")
    return os.path.abspath(str(f))


def _kill(p: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)  # the node's own session: its agent and workers
    except ProcessLookupError:
        pass
    p.wait(timeout=10)


def _tail(work: Path, h: int, lines: int = 6) -> str:
    p = work / f"host{h}.log"
    if not p.exists():
        return "(no log)"
    text = p.read_text(errors="replace").strip().splitlines()
    return " | ".join(text[-lines:]) or "(empty)"


def launch_on_cluster(
    fn: Callable[..., Any],
    args: tuple[Any, ...] = (),
    *,
    nprocs: int,
    cluster: str,
    timeout_s: float = 3600.0,
    stream_first: bool = True,
) -> dict[int, Any]:
    """Drop-in for :func:`dtrain.launch.agent.launch` that spreads ``nprocs`` over a cluster's hosts.

    ``dtrain run --cluster NAME`` calls this instead of ``launch``: the processes
    are split evenly over the hosts (host ``i`` gets ranks ``i*k..i*k+k-1``).

    Raises:
        ConfigError: ``nprocs`` is not a multiple of the number of hosts.
        ClusterError: the cluster is not up.
        LaunchError: as :func:`run_on_cluster`.
    """
    c = load(cluster)
    _check_even(c, nprocs)
    return run_on_cluster(
        fn, args, cluster=c, nprocs_per_host=nprocs // c.hosts, timeout_s=timeout_s, stream_first=stream_first
    )


def run_nodes_on_cluster(
    config_toml: str, out: Path, *, cluster: str, processes: int, quiet: bool = False, extra: list[str] | None = None
) -> None:
    """``dtrain run --cluster NAME``: on every host, in its namespace, the per-node command a user runs on a
    real machine (``dtrain run CONFIG --nnodes H --node-rank i --rdzv-endpoint HOST0:PORT --rdzv-id JOB``).

    Everything the emulated cluster runs is thus the multi-node path of :mod:`dtrain.cluster.nodes`; this
    driver only starts the nodes (each in its own session), lets host 0's stderr through, and waits. When a
    node fails, the others get 10 s to stop on their own (they do: the job's checks and collectives fail on
    every node) before they are killed; Ctrl-C is passed on to every node.

    Raises:
        ConfigError: ``processes`` does not spread evenly over the hosts.
        LaunchError: a node failed; names the hosts and the last lines of their output.
    """
    c = load(cluster)
    _check_even(c, processes)
    require_root()
    port = random.randint(20000, 40000)  # inside our own namespaces nothing else listens
    job = f"{c.name}-{uuid.uuid4().hex[:8]}"
    work = Path(tempfile.mkdtemp(prefix=f"dtrain-{c.name}-"))
    (work / CONFIG).write_text(config_toml)
    penv = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    procs: list[subprocess.Popen[bytes]] = []
    logs: list[IO[bytes]] = []
    try:
        for h in range(c.hosts):
            cmd = _node_command(c, h, work / CONFIG, out, f"{c.address(0)}:{port}", job, extra or [])
            node_log: IO[bytes] = open(work / f"host{h}.log", "wb")
            logs.append(node_log)
            shown = h == 0 and not quiet
            # host 0's progress and messages (stderr) come through; its closing lines are the caller's to print
            procs.append(
                subprocess.Popen(
                    cmd,
                    stdout=node_log,
                    stderr=None if shown else subprocess.STDOUT,
                    start_new_session=True,
                    env={**penv, **node_env(c, h)},
                )
            )
        try:
            failed = _wait_nodes(procs)
        except KeyboardInterrupt:
            _interrupt_nodes(procs)
            raise
        if failed:
            lines = [f"host {h}: exit code {procs[h].returncode}; {_tail(work, h)}" for h in failed]
            raise LaunchError(f"job on emulated cluster {c.name!r} failed:\n  " + "\n  ".join(lines))
    finally:
        _clean_up(procs, logs, work)


def _check_even(c: EmulatedCluster, processes: int) -> None:
    """Raise ConfigError unless ``processes`` spread evenly over the cluster's hosts."""
    if processes < c.hosts or processes % c.hosts:
        raise ConfigError(
            f"{processes} processes cannot be spread evenly over the {c.hosts} hosts of cluster {c.name!r}; "
            f"use a multiple of {c.hosts} (workers, plus servers for the parameter server)"
        )


def _node_command(
    c: EmulatedCluster, h: int, config: Path, out: Path, endpoint: str, job: str, extra: list[str]
) -> list[str]:
    """The per-node ``dtrain run`` of host ``h``, run in its namespace."""
    return [
        *("ip", "netns", "exec", c.host_ns(h), sys.executable, "-m", "dtrain.cli", "run", str(config)),
        *("--out", str(out), "--nnodes", str(c.hosts), "--node-rank", str(h)),
        *("--rdzv-endpoint", endpoint, "--rdzv-id", job),
        *extra,
    ]


def _interrupt_nodes(procs: list[subprocess.Popen[bytes]]) -> None:
    """Ctrl-C: pass SIGINT on to every node's session and give each 30 s to stop."""
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGINT)
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=30)


def _wait_nodes(procs: list[subprocess.Popen[bytes]], grace_s: float = 10.0) -> list[int]:
    """Wait for every node; after one fails, the others get ``grace_s``. The hosts that failed (or were killed)."""
    first_failure: float | None = None
    while any(p.poll() is None for p in procs):
        if first_failure is None and any(p.returncode not in (None, 0) for p in procs):
            first_failure = time.monotonic()
        if first_failure is not None and time.monotonic() - first_failure > grace_s:
            for p in procs:
                if p.poll() is None:
                    _kill(p)
            break
        time.sleep(0.05)
    return [h for h, p in enumerate(procs) if p.returncode != 0]
