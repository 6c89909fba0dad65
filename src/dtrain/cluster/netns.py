"""An emulated cluster on one Linux machine: network namespaces, a bridge, tc shaping.

Layout of a cluster called NAME with N hosts (nothing is created in the caller's
own network namespace, so nothing can leak onto the machine's real network):

* ``dtc-NAME-h0 .. dtc-NAME-h{N-1}``: one network namespace per emulated host, with
  ``lo`` up and one interface ``eth0`` holding ``10.213.X.(i+1)/24``; X is a
  subnet number picked per cluster.
* ``dtc-NAME-sw``: the switch, a namespace holding a bridge ``br0`` and the peer
  end ``p{i}`` of every host's veth pair.
* Shaping: a ``tbf`` qdisc on both ends of every veth pair, so each host has a
  full-duplex link of the given rate to a non-blocking switch (what a ring
  allreduce's bound ``2(P-1)/P * n / B`` assumes). tbf counts Ethernet headers,
  so TCP payload tops out near 95% of the rate with the default MTU of 1500. The
  bucket holds 1 ms of traffic, so a message after idle gains at most 1 ms.
* Latency would need ``netem``; where the kernel lacks it (as on the machines
  this was built on) :func:`up` says so instead of silently ignoring it.
* Stragglers: ``slow={host: factor}`` is recorded in the state; the launcher
  gives that host's workers ``DTRAIN_SLOWDOWN=factor`` (see
  :func:`dtrain.training.slowdown.slowdown_factor`), which the training loop honours by
  stretching each step's compute to ``factor`` times its duration.

State is kept in ``/run/dtrain/clusters/NAME.json`` (``DTRAIN_CLUSTER_DIR``
overrides); :func:`down` also finds namespaces by their ``dtc-NAME-`` prefix, so
it cleans up after a crash that lost the state file. Every command needs root.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dtrain.errors import DTrainError
from dtrain.perfmodel.units import format_rate, parse_rate, parse_time

__all__ = [
    "ClusterError",
    "EmulatedCluster",
    "PREFIX",
    "IFACE",
    "up",
    "down",
    "status",
    "load",
    "require_root",
    "state_dir",
]

PREFIX = "dtc-"
IFACE = "eth0"
_NAME = re.compile(r"^[a-z0-9][a-z0-9_]{0,23}$")
_MAX_HOSTS = 64
_CMD_TIMEOUT_S = 30.0


class ClusterError(DTrainError):
    """An emulated-cluster operation failed or is not possible here (e.g. not root)."""


@dataclass(frozen=True)
class EmulatedCluster:
    """What :func:`up` made; enough to address, use and remove it.

    Attributes:
        name: cluster name (namespaces are ``dtc-<name>-h<i>`` and ``dtc-<name>-sw``).
        hosts: number of emulated hosts.
        rate_bps: each host link's rate in bytes per second (each direction).
        subnet: the first three octets of the hosts' /24, e.g. ``"10.213.7"``.
        slow: host index -> compute slowdown factor (>= 1) for straggler studies.
        mtu: MTU of the host links.
        created: UNIX time of creation.
    """

    name: str
    hosts: int
    rate_bps: float
    subnet: str
    slow: dict[int, float] = field(default_factory=dict)
    mtu: int = 1500
    created: float = 0.0

    def host_ns(self, i: int) -> str:
        return f"{PREFIX}{self.name}-h{i}"

    @property
    def switch_ns(self) -> str:
        return f"{PREFIX}{self.name}-sw"

    def address(self, i: int) -> str:
        return f"{self.subnet}.{i + 1}"

    @property
    def namespaces(self) -> list[str]:
        return [self.host_ns(i) for i in range(self.hosts)] + [self.switch_ns]

    def to_json(self) -> str:
        d = asdict(self)
        d["slow"] = {str(k): v for k, v in self.slow.items()}
        return json.dumps(d, indent=2)

    @classmethod
    def from_json(cls, text: str) -> EmulatedCluster:
        d = json.loads(text)
        d["slow"] = {int(k): float(v) for k, v in d.get("slow", {}).items()}
        return cls(**d)

    def describe(self) -> str:
        slow = ", ".join(f"h{h}x{f:g}" for h, f in sorted(self.slow.items())) or "none"
        return (
            f"{self.name}: {self.hosts} hosts at {format_rate(self.rate_bps)} each way, "
            f"{self.subnet}.1-{self.hosts}/24 on {IFACE}, slow: {slow}"
        )


def state_dir() -> Path:
    return Path(os.environ.get("DTRAIN_CLUSTER_DIR", "/run/dtrain/clusters"))


def require_root() -> None:
    """Raise :class:`ClusterError` unless this process can create network namespaces."""
    if os.geteuid() != 0:
        raise ClusterError("the emulated cluster needs root (network namespaces, veth, tc); run as root or with sudo")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise ClusterError(f"the emulated cluster needs the '{tool}' command (package iproute2)")


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=_CMD_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        raise ClusterError(f"'{' '.join(cmd)}' did not finish within {_CMD_TIMEOUT_S:.0f} s") from e
    if check and p.returncode != 0:
        raise ClusterError(f"'{' '.join(cmd)}' failed: {p.stderr.strip() or p.stdout.strip()}")
    return p


def _ns(ns: str, *cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return _run("ip", "netns", "exec", ns, *cmd, check=check)


def _netns_list() -> list[str]:
    out = _run("ip", "netns", "list").stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _check_name(name: str) -> None:
    if not _NAME.match(name):
        raise ClusterError(
            f"cluster name {name!r} is not allowed; use 1-24 lowercase letters, digits or '_' "
            "(no '-': it separates the name from the host in namespace names)"
        )


def load(name: str) -> EmulatedCluster:
    """The state of a running cluster.

    Raises:
        ClusterError: when no cluster of that name is up (or its namespaces are gone).
    """
    _check_name(name)
    path = state_dir() / f"{name}.json"
    if not path.exists():
        raise ClusterError(f"no emulated cluster named {name!r}; start it with `dtrain cluster up --name {name} ...`")
    c = EmulatedCluster.from_json(path.read_text())
    have = set(_netns_list())
    missing = [ns for ns in c.namespaces if ns not in have]
    if missing:
        raise ClusterError(
            f"cluster {name!r} is broken (missing {', '.join(missing)}); run `dtrain cluster down --name {name}` "
            "and start it again"
        )
    return c


def _pick_subnet() -> str:
    used = set()
    d = state_dir()
    if d.exists():
        for p in d.glob("*.json"):
            try:
                used.add(EmulatedCluster.from_json(p.read_text()).subnet)
            except (ValueError, TypeError, KeyError):
                continue
    for x in range(1, 255):
        if f"10.213.{x}" not in used:
            return f"10.213.{x}"
    raise ClusterError("no free subnet left in 10.213.0.0/16; take some clusters down")


def tbf_burst(rate_bps: float, mtu: int) -> int:
    """Bytes the token bucket of a host link lets through at once after idle.

    1 ms of traffic, at least two full frames. No real link does this; 1 ms bounds
    the error per message, and the performance model counts it (``Link.burst``).
    """
    return max(2 * (mtu + 14), int(rate_bps * 1e-3))


def _shape(ns: str, dev: str, rate_bps: float, mtu: int) -> None:
    # queue: up to 100 ms of traffic (TCP needs room for a window, or it loses rate to drops).
    burst = tbf_burst(rate_bps, mtu)
    _ns(
        ns,
        "tc",
        "qdisc",
        "replace",
        "dev",
        dev,
        "root",
        "tbf",
        "rate",
        f"{rate_bps * 8:.0f}bit",
        "burst",
        str(burst),
        "latency",
        "100ms",
    )


def up(
    name: str = "default",
    *,
    hosts: int,
    bandwidth: str | float,
    slow: dict[int, float] | None = None,
    latency: str | float | None = None,
    mtu: int = 1500,
) -> EmulatedCluster:
    """Create an emulated cluster of ``hosts`` namespaces joined by a shaped bridge.

    Args:
        name: cluster name (default: "default").
        hosts: number of emulated hosts (2..64).
        bandwidth: each host link's rate, tc style ("100mbit", "1gbit").
        slow: host index -> compute slowdown factor (>= 1).
        latency: per-link one-way delay; needs netem, refused with a clear error where missing.
        mtu: MTU of the host links (default: 1500).

    Returns:
        The cluster's description (also written to the state file).

    Raises:
        ClusterError: not root, bad arguments, a cluster of that name exists, or a
            command failed (everything made so far is removed again).
    """
    require_root()
    _check_name(name)
    slow = dict(slow or {})
    rate = _check_up_args(name, hosts, bandwidth, slow, latency, mtu)
    c = EmulatedCluster(
        name=name, hosts=hosts, rate_bps=rate, subnet=_pick_subnet(), slow=slow, mtu=mtu, created=time.time()
    )
    state_dir().mkdir(parents=True, exist_ok=True)
    (state_dir() / f"{name}.json").write_text(c.to_json())  # written first: down() can always clean up
    try:
        sw = c.switch_ns
        _run("ip", "netns", "add", sw)
        _ns(sw, "ip", "link", "set", "lo", "up")
        _ns(sw, "ip", "link", "add", "br0", "type", "bridge")
        _ns(sw, "ip", "link", "set", "br0", "up")
        for i in range(hosts):
            _add_host(c, i)
    except BaseException:
        down(name)
        raise
    return c


def _check_up_args(
    name: str, hosts: int, bandwidth: str | float, slow: dict[int, float], latency: str | float | None, mtu: int
) -> float:
    """Refuse :func:`up`'s bad arguments, and a cluster of that name that exists, with a ClusterError; the
    links' rate in bytes per second."""
    if not 2 <= hosts <= _MAX_HOSTS:
        raise ClusterError(f"--hosts must be between 2 and {_MAX_HOSTS}, got {hosts}")
    rate = parse_rate(bandwidth)
    for h, f in slow.items():
        if not 0 <= h < hosts:
            raise ClusterError(f"--slow names host {h}, but hosts are 0..{hosts - 1}")
        if not f >= 1.0:
            raise ClusterError(f"--slow factor for host {h} must be >= 1 (a slowdown), got {f}")
    if not 576 <= mtu <= 65535:
        raise ClusterError(f"--mtu must be between 576 and 65535, got {mtu}")
    if latency is not None and parse_time(latency) > 0:
        raise ClusterError(
            f"a link latency ({latency}) needs the netem qdisc, which this kernel does not provide "
            "(tc ... netem fails here); dtrain's emulated cluster shapes bandwidth only (tbf). "
            "Leave out --latency; the performance model takes latency from calibration instead."
        )
    existing = [ns for ns in _netns_list() if ns.startswith(f"{PREFIX}{name}-")]
    if existing or (state_dir() / f"{name}.json").exists():
        raise ClusterError(f"a cluster named {name!r} already exists; run `dtrain cluster down --name {name}` first")
    return rate


def _add_host(c: EmulatedCluster, i: int) -> None:
    """Host ``i``'s namespace, its veth pair to the switch's bridge, its address and both ends' shaping."""
    ns, sw, mtu = c.host_ns(i), c.switch_ns, str(c.mtu)
    _run("ip", "netns", "add", ns)
    _ns(ns, "ip", "link", "set", "lo", "up")
    # Both ends are born inside the namespaces: nothing appears in ours.
    host_end = (IFACE, "netns", ns, "mtu", mtu)
    _run("ip", "link", "add", *host_end, "type", "veth", "peer", "name", f"p{i}", "netns", sw, "mtu", mtu)
    _ns(sw, "ip", "link", "set", f"p{i}", "master", "br0")
    _ns(sw, "ip", "link", "set", f"p{i}", "up")
    _ns(ns, "ip", "addr", "add", f"{c.address(i)}/24", "dev", IFACE)
    _ns(ns, "ip", "link", "set", IFACE, "up")
    _shape(ns, IFACE, c.rate_bps, c.mtu)
    _shape(sw, f"p{i}", c.rate_bps, c.mtu)


def down(name: str | None = "default", *, all_clusters: bool = False) -> list[str]:
    """Remove a cluster's namespaces (and with them every link and bridge) and its state.

    Idempotent: removing a cluster that does not exist, or half exists after a
    crash, succeeds. Deleting a namespace destroys the veth ends and the bridge in
    it, and a veth pair dies with either end, so nothing is left behind.

    Args:
        name: the cluster (default: "default").
        all_clusters: remove every dtrain cluster instead.

    Returns:
        The namespaces removed.
    """
    require_root()
    if all_clusters:
        prefix = PREFIX
        states = list(state_dir().glob("*.json")) if state_dir().exists() else []
    else:
        assert name is not None
        _check_name(name)
        prefix = f"{PREFIX}{name}-"
        states = [state_dir() / f"{name}.json"]
    removed = []
    for ns in _netns_list():
        if ns.startswith(prefix):
            _kill_processes(ns)
            _run("ip", "netns", "del", ns)
            removed.append(ns)
    for p in states:
        p.unlink(missing_ok=True)
    return removed


def _kill_processes(ns: str) -> None:
    """Stop processes still running inside a namespace we are about to delete (ours only)."""
    out = _run("ip", "netns", "pids", ns, check=False).stdout.split()
    for pid in out:
        try:
            os.kill(int(pid), 9)
        except (ProcessLookupError, ValueError, PermissionError):
            continue


def status() -> list[dict[str, object]]:
    """Every dtrain cluster known from state files or found by namespace prefix.

    Returns:
        One dict per cluster: name, state ("up", "broken" or "orphaned"), hosts,
        rate, namespaces found, and the description when the state file exists.
    """
    require_root()
    found: dict[str, list[str]] = {}
    for ns in _netns_list():
        if ns.startswith(PREFIX):
            cname = ns[len(PREFIX) :].rsplit("-", 1)[0]
            found.setdefault(cname, []).append(ns)
    names = set(found)
    if state_dir().exists():
        names |= {p.stem for p in state_dir().glob("*.json")}
    rows: list[dict[str, object]] = []
    for cname in sorted(names):
        path = state_dir() / f"{cname}.json"
        have = sorted(found.get(cname, []))
        if path.exists():
            c = EmulatedCluster.from_json(path.read_text())
            ok = set(c.namespaces) <= set(have)
            rows.append(
                {
                    "name": cname,
                    "state": "up" if ok else "broken",
                    "hosts": c.hosts,
                    "rate": format_rate(c.rate_bps),
                    "namespaces": have,
                    "description": c.describe(),
                }
            )
        else:
            orphan = f"{cname}: namespaces without a state file (crash?); `dtrain cluster down --name {cname}`"
            rows.append(
                {
                    "name": cname,
                    "state": "orphaned",
                    "hosts": None,
                    "rate": None,
                    "namespaces": have,
                    "description": orphan,
                }
            )
    return rows
