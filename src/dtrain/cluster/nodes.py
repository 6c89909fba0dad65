"""Several machines: where this node sits in the job, the job's store, and what the nodes agree on before they train.

A job on N machines runs the same command on each::

    dtrain run CONFIG --nnodes N --node-rank R --rdzv-endpoint HOST:PORT [--rdzv-id JOB]

or, inside a SLURM allocation, ``srun --ntasks-per-node=1 dtrain run CONFIG``, which reads the same
from SLURM's environment (:func:`from_slurm`). The meaning is torchrun's: node ``R`` runs
``processes / N`` processes, and global ranks are numbered node by node (node ``R`` holds ranks
``R*k .. R*k+k-1``).

Node 0 hosts the job's store (a ``TCPStore``) on ``HOST:PORT``, listening on that address only
(:func:`dtrain.launch.store.host_store`); the other nodes, torch's elastic agents and every worker are its
clients. Before any worker starts, the nodes meet there (:class:`Meeting`):

1. each node checks that the store serves its job (``--rdzv-id``); a node of another job is refused,
   and node 0 says so too;
2. each node posts its node rank, host, versions and configuration, and waits for the others until the
   rendezvous timeout; a node that never arrives stops every waiting node with a message naming the
   endpoint, how many arrived and the missing node ranks;
3. the configurations and versions must be equal: a difference stops every node, naming the keys and the
   nodes;
4. node 0 opens the run folder and posts the resolved configuration; every node checks it sees that
   folder (``--out`` must be on a filesystem all nodes share, as torchtitan and DeepSpeed assume) and can
   write it, and sees the checkpoint ``--resume`` names; a node that cannot stops every node, naming the
   node and the path.

The interface gloo (and NCCL) use is the one that routes to the endpoint (or ``--iface``), printed at start.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import socket
import struct
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtrain.errors import ConfigError, DTrainError

__all__ = [
    "NodeArgs",
    "NodeError",
    "Meeting",
    "from_slurm",
    "expand_nodelist",
    "parse_endpoint",
    "parse_nnodes",
    "parse_nproc",
    "route_iface",
    "connect_store",
    "DEFAULT_PORT",
    "DEFAULT_RDZV_TIMEOUT_S",
]

DEFAULT_PORT = 29400  # torchrun's c10d default
DEFAULT_RDZV_TIMEOUT_S = 300.0
MARKER = ".dtrain-job"  # in the run folder: node 0's token, which every node (and a rejoining one) must read back
BEAT_S = 1.0  # a node's heartbeat period in the job's store
READ_WAIT_S = 10.0  # how long node 0 keeps the store up for the others to read a disagreement


class NodeError(DTrainError):
    """The nodes of a job could not meet or do not agree; the message names the nodes and what differs."""


def parse_nnodes(text: str | int) -> tuple[int, int]:
    """``"4"`` -> (4, 4); ``"3:4"`` -> (3, 4) (elastic membership, torchrun's MIN:MAX)."""
    s = str(text).strip()
    m = re.fullmatch(r"(\d+)(?::(\d+))?", s)
    if not m:
        raise ConfigError(f"--nnodes takes N or MIN:MAX (e.g. 4 or 3:4), got {s!r}")
    lo = int(m.group(1))
    hi = int(m.group(2)) if m.group(2) else lo
    if not 1 <= lo <= hi:
        raise ConfigError(f"--nnodes {s}: need 1 <= MIN <= MAX")
    return lo, hi


def parse_endpoint(text: str, default_port: int = DEFAULT_PORT) -> tuple[str, int]:
    """``HOST:PORT`` (or ``HOST``, torchrun's default port) -> (host, port)."""
    s = text.strip()
    host, sep, port = s.rpartition(":")
    if not sep:
        host, port = s, str(default_port)
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--rdzv-endpoint takes HOST:PORT (e.g. node0:29400), got {text!r}")
    return host, int(port)


def parse_nproc(text: str | int | None, gpus: int | None = None) -> int:
    """``--nproc-per-node``: a count, or ``gpu`` for one process per visible GPU (``gpus``: how many; default
    torch's count); None -> 0 (the run's processes over the nodes)."""
    if text is None:
        return 0
    s = str(text).strip()
    if s == "gpu":
        if gpus is None:
            import torch

            gpus = torch.cuda.device_count()
        if gpus < 1:
            raise ConfigError(
                "--nproc-per-node gpu starts one process per visible GPU, and this machine has none "
                "(CUDA_VISIBLE_DEVICES, the driver); give a number instead"
            )
        return gpus
    if not s.isdigit() or int(s) < 1:
        raise ConfigError(f"--nproc-per-node takes a number >= 1 or gpu, got {s!r}")
    return int(s)


@dataclass(frozen=True)
class NodeArgs:
    """Where this node sits in a job on several machines (torchrun's launch flags).

    Attributes:
        nnodes: the most nodes (``--nnodes N``, or the MAX of ``MIN:MAX``).
        min_nodes: the fewest nodes the job runs on (MIN of ``--nnodes MIN:MAX``; else ``nnodes``).
        node_rank: this node (0 hosts the job's store).
        endpoint: ``HOST:PORT`` of the job's store, on node 0.
        job: the rendezvous id every node of the job shares (``--rdzv-id``).
        nproc_per_node: processes on this node (0: the run's processes over ``nnodes``).
        rdzv_timeout_s: how long a node waits for the others to arrive.
        iface: the network interface (default: the one that routes to the endpoint).
        source: where these came from: "flags" or "slurm".
    """

    nnodes: int = 1
    min_nodes: int = 1
    node_rank: int = 0
    endpoint: str = ""
    job: str = "dtrain"
    nproc_per_node: int = 0
    rdzv_timeout_s: float = DEFAULT_RDZV_TIMEOUT_S
    iface: str = ""
    source: str = "flags"

    @property
    def multi(self) -> bool:
        """Whether this is a job of several nodes (or of an elastic count)."""
        return self.nnodes > 1 or self.min_nodes != self.nnodes

    @property
    def host_port(self) -> tuple[str, int]:
        return parse_endpoint(self.endpoint)

    def check(self) -> NodeArgs:
        """Raise :class:`ConfigError` naming the flag that is wrong."""
        if self.nnodes < 1 or not 1 <= self.min_nodes <= self.nnodes:
            raise ConfigError(f"--nnodes {self.min_nodes}:{self.nnodes}: need 1 <= MIN <= MAX")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"--node-rank {self.node_rank} is outside the {self.nnodes} nodes (0..{self.nnodes - 1})")
        if self.multi and not self.endpoint:
            raise ConfigError(
                "a job on several nodes needs --rdzv-endpoint HOST:PORT (node 0's address, where it "
                "hosts the job's store)"
            )
        if self.endpoint:
            parse_endpoint(self.endpoint)
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", self.job):
            raise ConfigError(f"--rdzv-id takes letters, digits, '_', '.', '-' (up to 64), got {self.job!r}")
        if self.nproc_per_node < 0:
            raise ConfigError(f"--nproc-per-node must be >= 1, got {self.nproc_per_node}")
        if self.rdzv_timeout_s <= 0:
            raise ConfigError(f"--rdzv-timeout must be > 0 seconds, got {self.rdzv_timeout_s:g}")
        return self

    def processes(self, total: int) -> int:
        """This node's processes for a run of ``total``: the same on every node (torchrun's rule)."""
        if total % self.nnodes:
            raise ConfigError(
                f"{total} processes cannot be spread evenly over {self.nnodes} nodes; use a multiple "
                f"of {self.nnodes} (workers, plus servers for the parameter server)"
            )
        k = total // self.nnodes
        if self.nproc_per_node and self.nproc_per_node != k:
            raise ConfigError(
                f"--nproc-per-node {self.nproc_per_node} on {self.nnodes} nodes starts "
                f"{self.nproc_per_node * self.nnodes} processes, and the run has {total}: set "
                f"--workers so that the run has {self.nproc_per_node * self.nnodes}, or drop "
                "--nproc-per-node"
            )
        return k


# ---------------------------------------------------------------------- SLURM


def expand_nodelist(text: str) -> list[str]:
    """SLURM's compressed host list -> host names: ``"gpu[01-03,07],login"`` -> gpu01, gpu02, gpu03, gpu07, login."""
    hosts: list[str] = []
    for m in re.finditer(r"([^,\[]+)(?:\[([^\]]*)\])?([^,]*)", text):
        prefix, ranges, suffix = m.group(1), m.group(2), m.group(3)
        if not prefix and not ranges:
            continue
        if ranges is None:
            hosts.append(prefix + suffix)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            if not hi:
                hosts.append(prefix + lo + suffix)
                continue
            width = len(lo)
            for i in range(int(lo), int(hi) + 1):
                hosts.append(f"{prefix}{i:0{width}d}{suffix}")
    return hosts


def from_slurm(env: Mapping[str, str], port: int = DEFAULT_PORT) -> NodeArgs | None:
    """This node's place from the environment ``srun`` sets (one task per node), or None outside SLURM.

    The node count is ``SLURM_JOB_NUM_NODES`` (or ``SLURM_NNODES``), the node rank ``SLURM_NODEID``, the
    job id ``SLURM_JOB_ID`` and the endpoint the first host of ``SLURM_JOB_NODELIST`` (or
    ``SLURM_NODELIST``) on ``port``; ``MASTER_ADDR``/``MASTER_PORT``, where set, name the endpoint instead.
    """
    if "SLURM_JOB_ID" not in env or "SLURM_NODEID" not in env:
        return None
    nnodes = int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or "1")
    hosts = expand_nodelist(env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "")
    host = env.get("MASTER_ADDR") or (hosts[0] if hosts else "")
    if not host:
        raise ConfigError("SLURM's environment names no host (SLURM_JOB_NODELIST is empty): pass --rdzv-endpoint")
    p = int(env.get("MASTER_PORT") or port)
    return NodeArgs(
        nnodes=nnodes,
        min_nodes=nnodes,
        node_rank=int(env["SLURM_NODEID"]),
        endpoint=f"{host}:{p}",
        job=f"slurm-{env['SLURM_JOB_ID']}",
        source="slurm",
    )


# ---------------------------------------------------------------------- network


def _iface_addresses() -> dict[str, str]:
    """IPv4 address of each interface that has one (Linux: SIOCGIFADDR)."""
    out: dict[str, str] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            with contextlib.suppress(OSError):
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
                out[name] = socket.inet_ntoa(packed[20:24])
    return out


def route_iface(host: str, port: int = DEFAULT_PORT, iface: str = "") -> tuple[str, str]:
    """(interface, its address) this machine reaches ``host`` through, or those of ``iface`` where given.

    Raises:
        NodeError: the host does not resolve, no interface routes to it, or ``iface`` has no IPv4 address.
    """
    addrs = _iface_addresses()
    if iface:
        if iface not in addrs:
            raise NodeError(
                f"--iface {iface}: no such interface with an IPv4 address here (have: "
                f"{', '.join(f'{n} {a}' for n, a in sorted(addrs.items())) or 'none'})"
            )
        return iface, addrs[iface]
    try:
        ip = socket.gethostbyname(host)
    except OSError as e:
        raise NodeError(f"--rdzv-endpoint {host}:{port}: cannot resolve {host!r} ({e.strerror or e})") from None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((ip, port))  # no packet: the kernel only picks the route and the source address
        except OSError as e:
            raise NodeError(f"--rdzv-endpoint {host}:{port}: no route to {ip} ({e.strerror or e})") from None
        local = s.getsockname()[0]
    if ip.startswith("127.") or local.startswith("127."):
        return "lo", local
    for name, a in addrs.items():
        if a == local:
            return name, a
    raise NodeError(
        f"--rdzv-endpoint {host}:{port}: the route to {ip} leaves from {local}, which no interface "
        "holds; name one with --iface"
    )


# ---------------------------------------------------------------------- the job's store


def connect_store(host: str, port: int, timeout_s: float) -> Any:
    """A client of the job's store at ``host:port``, retrying until ``timeout_s``.

    Raises:
        NodeError: nothing answered there within the timeout.
    """
    import datetime

    import torch.distributed as dist

    try:
        return dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=timeout_s))  # type: ignore[attr-defined]
    except (RuntimeError, TimeoutError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise NodeError(
            f"cannot reach the job's store at {host}:{port} within {timeout_s:.0f} s: node 0 (which "
            f"hosts it) has not started there, or the endpoint is wrong; missing node rank(s): 0 "
            f"({first[:200]})"
        ) from None


# ---------------------------------------------------------------------- the meeting


def _versions() -> dict[str, str]:
    import torch

    import dtrain

    return {
        "dtrain": str(getattr(dtrain, "__version__", "?")),
        "torch": torch.__version__,
        "python": ".".join(map(str, sys.version_info[:3])),
    }


def _flat(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, Mapping):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def differences(records: Mapping[int, Mapping[str, Any]]) -> list[str]:
    """One phrase per key whose value is not the same on every node: ``lr: node 0 = 0.05, node 2 = 0.1``."""
    flat = {r: _flat(rec) for r, rec in records.items()}
    keys = sorted(set().union(*(f.keys() for f in flat.values())))
    out = []
    for k in keys:
        by_value: dict[str, list[int]] = {}
        for r in sorted(flat):
            by_value.setdefault(json.dumps(flat[r].get(k, "(unset)"), sort_keys=True), []).append(r)
        if len(by_value) > 1:
            parts = [f"node{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))} = {v}" for v, rs in by_value.items()]
            out.append(f"{k}: " + "; ".join(parts))
    return out


class Meeting:
    """The nodes of one job meeting on its store before any worker starts (see the module's steps).

    Args:
        args: this node's place.
        store: the job's store (hosted here on node 0, else a client of node 0's).
        say: where node 0 reports a refused node of another job (default: stderr).
    """

    def __init__(self, args: NodeArgs, store: Any, say: Callable[[str], None] | None = None) -> None:
        self.args = args
        self.store = store
        self.say = say or (lambda line: print(f"dtrain: {line}", file=sys.stderr, flush=True))
        self.host = socket.gethostname()
        self.ns = f"dtrain/{args.job}"
        self._watch: threading.Thread | None = None
        self._beat: threading.Thread | None = None
        self._stop = threading.Event()

    # ------------------------------------------------------------------ steps

    def open(self) -> None:
        """Node 0: mark the store as this job's and watch for nodes of other jobs. Others: check the mark."""
        a = self.args
        if a.node_rank == 0:
            self.store.set("dtrain/job", a.job)
            self._watch = threading.Thread(target=self._watch_refused, name="dtrain-refused", daemon=True)
            self._watch.start()
            return
        job = self.store.get("dtrain/job").decode()
        if job != a.job:
            n = self.store.add("dtrain/refused", 1)
            self.store.set(f"dtrain/refused/{n}", f"host {self.host}, node rank {a.node_rank}, --rdzv-id {a.job}")
            raise NodeError(
                f"the store at {a.endpoint} serves job {job!r}, and this node was started with --rdzv-id "
                f"{a.job!r}: refused (give it the job's --rdzv-id, or another --rdzv-endpoint)"
            )

    def arrive(self, config: Mapping[str, Any]) -> dict[int, dict[str, Any]]:
        """Post this node's record, wait for the others, and check that every node runs the same job.

        Returns:
            every node's record by node rank.

        Raises:
            NodeError: the node rank is taken, nodes are missing at the timeout, or the records differ.
        """
        a = self.args
        me = json.dumps(
            {"host": self.host, "pid": os.getpid(), "versions": _versions(), "config": dict(config)},
            sort_keys=True,
            default=str,
        )
        key = f"{self.ns}/node/{a.node_rank}"
        got = self.store.compare_set(key, "", me).decode()
        if got != me:
            other = json.loads(got)
            if self._alive(a.node_rank):
                raise NodeError(
                    f"node rank {a.node_rank} of job {a.job!r} is taken by host {other['host']} (pid "
                    f"{other['pid']}), which is running; give every node its own --node-rank"
                )
            self.store.set(key, me)  # its holder is gone: this node takes its place in the running job
            self.say(
                f"node {a.node_rank} of job {a.job!r} rejoins it (its earlier process, host {other['host']} "
                f"pid {other['pid']}, is gone)"
            )
        self._beat = threading.Thread(target=self._heartbeat, name="dtrain-node-beat", daemon=True)
        self._beat.start()
        present = self._wait_for(lambda r: f"{self.ns}/node/{r}", "arrived")
        records = {r: json.loads(self.store.get(f"{self.ns}/node/{r}")) for r in present}
        diff = differences({r: {"versions": rec["versions"], **rec["config"]} for r, rec in records.items()})
        self._read("records", present, stopping=bool(diff))
        if diff:
            hosts = ", ".join(f"node {r} {rec['host']}" for r, rec in sorted(records.items()))
            raise NodeError(
                f"the nodes of job {a.job!r} disagree ({hosts}): "
                + " | ".join(diff[:8])
                + (f" | and {len(diff) - 8} more" if len(diff) > 8 else "")
            )
        return records

    def publish_plan(self, config: Mapping[str, Any], out: Path) -> None:
        """Node 0: the resolved configuration, and the token written into the run folder for the others."""
        token = uuid.uuid4().hex
        (out / MARKER).write_text(token + "\n")
        self.store.set(f"{self.ns}/plan", json.dumps({"config": dict(config), "token": token}, default=str))

    def plan(self) -> dict[str, Any]:
        """Node 0's resolved configuration (waits for it)."""
        return dict(json.loads(self.store.get(f"{self.ns}/plan"))["config"])

    def check_paths(self, out: Path, resume: str = "") -> None:
        """Every node: can it see node 0's run folder and write it, and see the checkpoint to resume from?
        Each posts its verdict; any failure stops every node with one line naming the node and the path."""
        a = self.args
        token = json.loads(self.store.get(f"{self.ns}/plan"))["token"]
        problem = ""
        marker = out / MARKER
        try:
            if not out.is_dir():
                problem = f"cannot see the run folder {out} (put --out on a filesystem every node shares)"
            elif not marker.is_file() or marker.read_text().strip() != token:
                problem = f"sees another folder at {out} than node 0 (put --out on a filesystem every node shares)"
            else:
                probe = out / f".dtrain-write-check.node{a.node_rank}"
                probe.touch()
                probe.unlink()
                if resume and not Path(resume).is_dir():
                    problem = f"cannot see the checkpoint {resume} that --resume names"
        except OSError as e:
            problem = f"cannot write the run folder {out}: {e.strerror or e}"
        self.store.set(f"{self.ns}/check/{a.node_rank}", problem or "ok")
        present = self._wait_for(lambda r: f"{self.ns}/check/{r}", "checked the run folder", among=self._arrived())
        bad = {r: self.store.get(f"{self.ns}/check/{r}").decode() for r in present}
        bad = {r: v for r, v in bad.items() if v != "ok"}
        self._read("checks", present, stopping=bool(bad))
        if bad:
            raise NodeError("; ".join(f"node {r}: {v}" for r, v in sorted(bad.items())))

    def close(self) -> None:
        self._stop.set()
        for th in (self._watch, self._beat):
            if th is not None:
                th.join(timeout=2)

    def _heartbeat(self) -> None:
        """Count up ``beat/R`` every second while this node runs: a node that finds its rank taken tells a
        running holder from a gone one by it."""
        while not self._stop.wait(BEAT_S):
            try:
                self.store.add(f"{self.ns}/beat/{self.args.node_rank}", 1)
            except Exception:  # noqa: BLE001 - the store is going away with the job
                return

    def _alive(self, rank: int) -> bool:
        """Whether node ``rank``'s heartbeat moves (watched for three beats)."""
        key = f"{self.ns}/beat/{rank}"
        first = int(self.store.add(key, 0))
        time.sleep(3 * BEAT_S)
        return int(self.store.add(key, 0)) != first

    # ------------------------------------------------------------------ helpers

    def _read(self, what: str, present: list[int], stopping: bool) -> None:
        """Say that this node has read every node's ``what``. Node 0 holds the store: before it stops the job
        (``stopping``) it waits, a few seconds at most, until the others have read too, or they would lose the
        store before learning why."""
        a = self.args
        if a.node_rank != 0:
            self.store.set(f"{self.ns}/read/{what}/{a.node_rank}", "1")
            return
        others = [f"{self.ns}/read/{what}/{r}" for r in present if r != 0]
        deadline = time.monotonic() + min(READ_WAIT_S, a.rdzv_timeout_s)
        while stopping and others and not self.store.check(others) and time.monotonic() < deadline:
            time.sleep(0.02)

    def _arrived(self) -> list[int]:
        return [r for r in range(self.args.nnodes) if self.store.check([f"{self.ns}/node/{r}"])]

    def _wait_for(self, key: Callable[[int], str], what: str, among: list[int] | None = None) -> list[int]:
        """Wait until every node (or, elastic, at least MIN by the timeout) has posted ``key(r)``; the node ranks."""
        a = self.args
        ranks = among if among is not None else list(range(a.nnodes))
        deadline = time.monotonic() + a.rdzv_timeout_s
        verdict = f"{self.ns}/verdict"
        try:
            while True:
                present = [r for r in ranks if self.store.check([key(r)])]
                if len(present) == len(ranks):
                    return present
                if self.store.check([verdict]):  # node 0 gave up first (it came first): its words
                    raise NodeError(self.store.get(verdict).decode())
                if time.monotonic() >= deadline:
                    if among is None and len(present) >= a.min_nodes:
                        return present  # elastic: the job starts on those that came
                    missing = [r for r in ranks if r not in present]
                    message = (
                        f"rendezvous at {a.endpoint} (job {a.job!r}): {len(present)} of {len(ranks)} nodes "
                        f"{what} within {a.rdzv_timeout_s:.0f} s; missing node rank(s): "
                        f"{', '.join(map(str, missing))}"
                    )
                    if a.node_rank == 0:  # the store goes with this node: leave the verdict for the others
                        self.store.set(verdict, message)
                        time.sleep(1.0)
                    raise NodeError(message)
                time.sleep(0.05)
        except (RuntimeError, OSError) as e:
            if isinstance(e, NodeError):
                raise
            raise NodeError(
                f"lost the job's store at {a.endpoint} while {len(ranks)} nodes {what}: node 0 "
                f"stopped ({str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__})"
            ) from None

    def _watch_refused(self) -> None:
        seen = 0
        while not self._stop.wait(0.5):
            try:
                n = int(self.store.add("dtrain/refused", 0))
                for i in range(seen + 1, n + 1):
                    who = self.store.get(f"dtrain/refused/{i}").decode()
                    self.say(
                        f"refused a node of another job at {self.args.endpoint}: {who} (this job's --rdzv-id is "
                        f"{self.args.job})"
                    )
                seen = max(seen, n)
            except Exception:  # noqa: BLE001 - the store is going away with the job
                return
