"""Cluster description: the hardware side of the performance model, read from TOML.

A cluster is ``nodes`` machines with ``devices_per_node`` devices each, two link
levels (``intra`` between devices of one node, ``inter`` between nodes: each
node's network interface, full duplex), and a device model. ``dtrain bench
calibrate`` writes this file from measurements; it is also meant to be written
by hand for clusters one does not have. Schema (every key but ``nodes`` and the
``inter`` link may be left out; units as in :mod:`dtrain.perfmodel.units`)::

    name = "horovod-2017"
    nodes = 32
    devices_per_node = 4

    [device]
    kind = "P100"          # free text
    flops = 9.3e12         # sustained FLOP/s of one device (used when no measured time fits)
    memory = "16GiB"       # per device
    gamma = 2e-11          # seconds per byte of a reduction (1 / reduction throughput)
    compute_scale = 1.0    # measured compute on this cluster / measured compute alone
    host = ""              # hostname the measured profiles come from (calibration sets it)
    threads = 1            # intra-op threads of a worker: the planner profiles the model at this many
    overhead = "0.3ms"     # per training step beyond model and communication (loop bookkeeping)
    wake = "0us"           # first message after compute waits this long for the CPU (shared cores)
    floor = "0us"          # least time of one step of a collective (shared cores)
    imbalance = "0us"      # slowest rank's pass minus one's own when all compute at once (shared cores)

    [links.intra]          # device <-> device inside a node
    bandwidth = "80gbit"   # each direction (tc style, bits per second)
    latency = "5us"        # alpha: seconds per message
    efficiency = 1.0       # fraction of the rate a bulk transfer reaches (1: bandwidth is measured)

    [links.inter]          # node <-> switch, full duplex
    bandwidth = "25gbit"
    latency = "30us"
    efficiency = 0.75
    native_latency = "20us" # alpha of the backend's own collectives (default: latency)
    duplex_bandwidth = "23gbit"  # each way while sending and receiving at once (default: bandwidth)
    burst = 0              # bytes passed at once after idle (a token bucket's depth; emulated links)

    [models.resnet101]     # optional: known throughput of a model on one device
    samples_per_s = 129
    backward_fraction = 0.667   # share of compute in backward (default 2/3)
    optimizer_s = 0.0           # optimizer step time per step

    [compressors."topk:0.01"]   # optional: measured compressor costs (calibration writes them)
    ratio = 0.02
    encode_s_per_byte = 3e-9
    decode_s_per_byte = 1e-9

    [calibrated]           # optional: the load the calibration was made under (calibration writes it)
    others_cores = 0.1     # cores' worth of CPU that other processes took (the busier of a second before and after)
    loadavg = 0.3          # the machine's 1-minute load average when it started
    cores = 2              # the machine's cores

A cluster with ``nodes == 1`` uses only ``intra``; a flat job of ``P`` devices
over ``N`` nodes is placed node by node (ranks ``i*d .. i*d+d-1`` on node ``i``).
"""

from __future__ import annotations

import math
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from dtrain.config.files import read_toml
from dtrain.errors import ConfigError
from dtrain.perfmodel.units import format_rate, parse_bytes, parse_rate, parse_time

__all__ = [
    "Link",
    "Device",
    "ModelRate",
    "CompressorCost",
    "Load",
    "ClusterSpec",
    "load_cluster",
    "dump_cluster",
    "LOADED_CORES",
]

# a calibration during which other processes took at least this many cores' worth of CPU was made under load
LOADED_CORES = 0.25


@dataclass(frozen=True)
class Link:
    """One level of the network in the alpha-beta model.

    Attributes:
        bandwidth: bytes per second, each direction.
        latency: alpha, seconds per message (software overhead included when measured).
        efficiency: fraction of ``bandwidth`` that bulk transfers reach (default: 1).
        native_latency: alpha of the backend's own collectives (gloo/NCCL run their
            steps in C++, without dtrain's Python per message); default: ``latency``.
        duplex_bandwidth: bytes per second each way while every node sends and
            receives at once, as in a ring or recursive-doubling step; default:
            ``bandwidth``. TCP's acknowledgements of the incoming flow queue behind
            the outgoing data, so it is lower than a one-way transfer's rate (the more so
            on a slow link).
        burst: bytes the link passes at once after idle (a token bucket's depth:
            the emulated cluster's tbf holds 1 ms of traffic; 0 on real links).
            A collective starts with a full bucket on every link, as the compute
            before it lasts longer than ``burst`` takes to refill.
    """

    bandwidth: float
    latency: float = 0.0
    efficiency: float = 1.0
    native_latency: float | None = None
    duplex_bandwidth: float | None = None
    burst: float = 0.0

    def __post_init__(self) -> None:
        if self.burst < 0:
            raise ConfigError(f"link burst must be >= 0 bytes, got {self.burst}")
        if self.duplex_bandwidth is not None and not self.duplex_bandwidth > 0:
            raise ConfigError(f"link duplex_bandwidth must be > 0, got {self.duplex_bandwidth}")
        if self.native_latency is not None and self.native_latency < 0:
            raise ConfigError(f"link native_latency must be >= 0, got {self.native_latency}")
        if not self.bandwidth > 0:
            raise ConfigError(f"link bandwidth must be > 0, got {self.bandwidth}")
        if self.latency < 0:
            raise ConfigError(f"link latency must be >= 0, got {self.latency}")
        if not 0 < self.efficiency <= 1:
            raise ConfigError(f"link efficiency must be in (0, 1], got {self.efficiency}")

    @property
    def alpha(self) -> float:
        return self.latency

    @property
    def beta(self) -> float:
        """Seconds per byte of a bulk transfer."""
        return 1.0 / (self.bandwidth * self.efficiency)

    @property
    def duplex_beta(self) -> float:
        """Seconds per byte each way while the link also carries traffic the other way."""
        return 1.0 / ((self.duplex_bandwidth or self.bandwidth) * self.efficiency)

    def time(self, nbytes: float, messages: int = 1) -> float:
        return messages * self.alpha + nbytes * self.beta


@dataclass(frozen=True)
class Device:
    """One compute device.

    Attributes:
        kind: free text ("cpu", "P100").
        flops: sustained FLOP/s for dense layers.
        memory: bytes of memory.
        gamma: seconds per byte reduced (summing two fp32 buffers).
        compute_scale: how much slower measured compute runs when every device of
            the cluster computes at once (shared cores of an emulated cluster); 1 on real clusters.
        host: hostname whose measured model profiles apply to this device ("" = none).
        overhead: fixed seconds per training step beyond model and communication
            (the training loop's own bookkeeping; calibration measures it).
        wake: extra latency of the first message after a compute phase, once per
            step of a multi-process strategy (the scheduler's delay when cores are
            shared; 0 on dedicated hosts; calibration measures it).
        floor: least seconds of one step of a collective (a message every rank
            of the step sends or exchanges): on cores shared by more ranks than
            they can run at once each waits for the scheduler (0 = none;
            calibration measures the backend's allreduce of 1 KiB, every rank at
            once, over its ``2(P-1)`` steps).
        p2p_floor: the same for dtrain's own point-to-point collectives (its ring,
            tree, recursive doubling, Rabenseifner and compressed collectives, run
            from Python on a communication thread): calibration times dtrain's ring
            allreduce of 1 KiB the same way. None: ``floor``.
        imbalance: seconds by which the slowest rank's training pass exceeds a
            rank's own in a step where all compute at once (shared cores: the
            passes that lose the CPU differ from step to step); synchronous
            strategies wait for it, asynchronous ones do not (0 on dedicated hosts).
        threads: intra-op threads each worker computes with (a CPU device): the planner profiles the
            model at this many, and ``compute_scale`` is measured with every worker at this many. On one
            machine, ``dtrain run`` gives each of its P workers ``cores // P`` (at least 1), and the local
            calibration for P processes records that.
    """

    kind: str = "cpu"
    flops: float = 1e10
    memory: float = 8 * 2.0**30
    gamma: float = 2.5e-10
    compute_scale: float = 1.0
    host: str = ""
    overhead: float = 0.0
    wake: float = 0.0
    floor: float = 0.0
    imbalance: float = 0.0
    p2p_floor: float | None = None
    threads: int = 1

    @property
    def own_floor(self) -> float:
        """The floor of a step of dtrain's own collectives (``p2p_floor``, else ``floor``)."""
        return self.floor if self.p2p_floor is None else self.p2p_floor

    def __post_init__(self) -> None:
        if self.wake < 0:
            raise ConfigError(f"device wake must be >= 0 seconds, got {self.wake}")
        if self.floor < 0:
            raise ConfigError(f"device floor must be >= 0 seconds, got {self.floor}")
        if self.p2p_floor is not None and self.p2p_floor < 0:
            raise ConfigError(f"device p2p_floor must be >= 0 seconds, got {self.p2p_floor}")
        if self.imbalance < 0:
            raise ConfigError(f"device imbalance must be >= 0 seconds, got {self.imbalance}")
        if self.overhead < 0:
            raise ConfigError(f"device overhead must be >= 0 seconds, got {self.overhead}")
        if self.threads < 1:
            raise ConfigError(f"device threads must be >= 1, got {self.threads}")
        for name in ("flops", "memory", "compute_scale"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"device {name} must be > 0, got {getattr(self, name)}")
        if self.gamma < 0:
            raise ConfigError(f"device gamma must be >= 0, got {self.gamma}")


@dataclass(frozen=True)
class ModelRate:
    """A model's known speed on one device (overrides FLOP-based estimates)."""

    samples_per_s: float
    backward_fraction: float = 2.0 / 3.0
    optimizer_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.samples_per_s > 0:
            raise ConfigError(f"samples_per_s must be > 0, got {self.samples_per_s}")
        if not 0 <= self.backward_fraction < 1:
            raise ConfigError(f"backward_fraction must be in [0, 1), got {self.backward_fraction}")


@dataclass(frozen=True)
class CompressorCost:
    """What a compressor does to a gradient of ``n`` bytes: payload ``ratio*n``, encode/decode time.

    ``cpu_ratio``: the CPU that the compressed collective takes in the cluster's own processes over what
    :func:`dtrain.perfmodel._traffic.compressed_traffic` counts on threads of one process (the calibration
    measures both on its model's gradient; 1 when not measured; ``benchmarks/coding_cpu.py`` compares the
    two). User-mode CPU only: the kernel's send work is in the transfer terms, and counted here too it
    would be charged twice.
    """

    ratio: float
    encode_s_per_byte: float = 0.0
    decode_s_per_byte: float = 0.0
    cpu_ratio: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.ratio <= 2:
            raise ConfigError(f"compression ratio must be in (0, 2], got {self.ratio}")
        if not (math.isfinite(self.cpu_ratio) and self.cpu_ratio > 0):
            raise ConfigError(f"compressor cpu_ratio must be a finite number > 0, got {self.cpu_ratio}")


@dataclass(frozen=True)
class Load:
    """The load a calibration was made under: what other processes took of the machine meanwhile.

    Attributes:
        others_cores: cores' worth of CPU time that processes other than the calibration's took, the busier of
            a second's window before it started and one after it ended (``/proc/stat``'s busy time less the
            calibrating process's own).
        loadavg: the 1-minute load average when it started (``os.getloadavg()``).
        cores: the machine's cores.
    """

    others_cores: float = 0.0
    loadavg: float = 0.0
    cores: int = 1

    def __post_init__(self) -> None:
        if not (self.others_cores >= 0 and self.loadavg >= 0 and self.cores >= 1):
            raise ConfigError(f"[calibrated] needs others_cores >= 0, loadavg >= 0 and cores >= 1, got {self}")

    @property
    def loaded(self) -> bool:
        """Whether other processes took at least :data:`LOADED_CORES` cores meanwhile."""
        return self.others_cores >= LOADED_CORES

    def describe(self) -> str:
        return (
            f"other processes kept {self.others_cores:.2f} of {self.cores} cores busy (load average {self.loadavg:.2f})"
        )


@dataclass(frozen=True)
class ClusterSpec:
    """The cluster the performance model predicts for (see the module docstring for the TOML)."""

    nodes: int
    devices_per_node: int = 1
    inter: Link = field(default_factory=lambda: Link(bandwidth=parse_rate("1gbit"), latency=50e-6))
    intra: Link = field(default_factory=lambda: Link(bandwidth=parse_rate("40gbit"), latency=10e-6))
    device: Device = field(default_factory=Device)
    models: Mapping[str, ModelRate] = field(default_factory=dict)
    compressors: Mapping[str, CompressorCost] = field(default_factory=dict)
    name: str = "cluster"
    load: Load | None = None  # what else ran while it was calibrated (None: written by hand, or not known)

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise ConfigError(f"nodes must be >= 1, got {self.nodes}")
        if self.devices_per_node < 1:
            raise ConfigError(f"devices_per_node must be >= 1, got {self.devices_per_node}")

    @property
    def devices(self) -> int:
        return self.nodes * self.devices_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.devices_per_node

    def link(self, a: int, b: int) -> Link:
        """The slowest level a message from rank ``a`` to rank ``b`` crosses."""
        return self.intra if self.node_of(a) == self.node_of(b) else self.inter

    def with_devices(self, p: int) -> ClusterSpec:
        """The same hardware holding ``p`` devices (fills nodes in order; may add nodes)."""
        d = min(self.devices_per_node, p)
        return replace(self, nodes=max(1, math.ceil(p / d)), devices_per_node=d)

    def describe(self) -> str:
        return (
            f"{self.name}: {self.nodes} node(s) x {self.devices_per_node} {self.device.kind}, "
            f"inter {format_rate(self.inter.bandwidth)} / {self.inter.latency * 1e6:.0f}us, "
            f"intra {format_rate(self.intra.bandwidth)} / {self.intra.latency * 1e6:.0f}us"
        )


# ---------------------------------------------------------------------- TOML


def _link(d: Mapping[str, Any], where: str, default: Link | None) -> Link:
    if not d:
        if default is None:
            raise ConfigError(f'{where}: missing; give at least bandwidth = "..." (e.g. "1gbit")')
        return default
    unknown = set(d) - {"bandwidth", "latency", "efficiency", "native_latency", "duplex_bandwidth", "burst"}
    if unknown:
        raise ConfigError(
            f"{where}: unknown key(s) {', '.join(sorted(unknown))}; "
            "use bandwidth, latency, efficiency, native_latency, duplex_bandwidth, burst"
        )
    if "bandwidth" not in d:
        raise ConfigError(f'{where}: bandwidth is required (e.g. bandwidth = "25gbit")')
    return Link(
        bandwidth=parse_rate(d["bandwidth"]),
        latency=parse_time(d.get("latency", 0.0)),
        efficiency=float(d.get("efficiency", 1.0)),
        native_latency=parse_time(d["native_latency"]) if "native_latency" in d else None,
        duplex_bandwidth=parse_rate(d["duplex_bandwidth"]) if "duplex_bandwidth" in d else None,
        burst=float(parse_bytes(d.get("burst", 0))),
    )


def cluster_from_dict(data: Mapping[str, Any], *, source: str = "cluster") -> ClusterSpec:
    """Build a :class:`ClusterSpec` from the parsed TOML (see the module docstring)."""
    known = {"name", "nodes", "devices_per_node", "device", "links", "models", "compressors", "calibrated"}
    unknown = set(data) - known
    if unknown:
        raise ConfigError(f"{source}: unknown key(s) {', '.join(sorted(unknown))}; known: {', '.join(sorted(known))}")
    if "nodes" not in data:
        raise ConfigError(f"{source}: 'nodes' is required")
    links = dict(data.get("links", {}))
    dev = dict(data.get("device", {}))
    unknown = set(dev) - {
        "kind",
        "flops",
        "memory",
        "gamma",
        "compute_scale",
        "host",
        "overhead",
        "wake",
        "floor",
        "imbalance",
        "p2p_floor",
        "threads",
    }
    if unknown:
        raise ConfigError(f"{source}: [device] has unknown key(s) {', '.join(sorted(unknown))}")
    device = Device(
        kind=str(dev.get("kind", "cpu")),
        flops=float(dev.get("flops", 1e10)),
        memory=parse_bytes(dev.get("memory", 8 * 2**30)),
        gamma=parse_time(dev.get("gamma", 2.5e-10)),
        compute_scale=float(dev.get("compute_scale", 1.0)),
        host=str(dev.get("host", "")),
        overhead=parse_time(dev.get("overhead", 0.0)),
        wake=parse_time(dev.get("wake", 0.0)),
        floor=parse_time(dev.get("floor", 0.0)),
        imbalance=parse_time(dev.get("imbalance", 0.0)),
        p2p_floor=parse_time(dev["p2p_floor"]) if "p2p_floor" in dev else None,
        threads=int(dev.get("threads", 1)),
    )
    inter = _link(links.get("inter", {}), f"{source}: [links.inter]", None if int(data["nodes"]) > 1 else Link(1e9))
    intra = _link(links.get("intra", {}), f"{source}: [links.intra]", Link(parse_rate("40gbit"), 10e-6))
    models = {str(k): ModelRate(**dict(v)) for k, v in dict(data.get("models", {})).items()}
    comps = {str(k): CompressorCost(**dict(v)) for k, v in dict(data.get("compressors", {})).items()}
    cal = dict(data.get("calibrated", {}))
    if set(cal) - {"others_cores", "loadavg", "cores"}:
        raise ConfigError(
            f"{source}: [calibrated] has unknown key(s) "
            f"{', '.join(sorted(set(cal) - {'others_cores', 'loadavg', 'cores'}))}"
        )
    load = Load(float(cal.get("others_cores", 0.0)), float(cal.get("loadavg", 0.0)), int(cal.get("cores", 1)))
    return ClusterSpec(
        name=str(data.get("name", Path(source).stem)),
        nodes=int(data["nodes"]),
        devices_per_node=int(data.get("devices_per_node", 1)),
        inter=inter,
        intra=intra,
        device=device,
        models=models,
        compressors=comps,
        load=load if cal else None,
    )


def load_cluster(path: str | Path) -> ClusterSpec:
    """Read a cluster TOML file.

    Raises:
        ConfigError: missing file, bad TOML, or a value that says what to change.
    """
    data = read_toml(path, "cluster file", hint="write one by hand or run `dtrain bench calibrate`")
    return cluster_from_dict(data, source=str(path))


def _num(x: float) -> str:
    return repr(float(x)) if not float(x).is_integer() or abs(x) >= 1e15 else f"{x:.1f}"


def dump_cluster(c: ClusterSpec, comment: str = "") -> str:
    """The cluster as TOML that :func:`load_cluster` reads back exactly."""
    out = ["# dtrain cluster description (schema: dtrain.perfmodel.spec)"]
    out += [f"# {line}" for line in comment.splitlines()]
    out += [f'name = "{c.name}"', f"nodes = {c.nodes}", f"devices_per_node = {c.devices_per_node}", ""]
    d = c.device
    out += [
        "[device]",
        f'kind = "{d.kind}"',
        f"flops = {_num(d.flops)}",
        f"memory = {_num(d.memory)}",
        f"gamma = {_num(d.gamma)}",
        f"compute_scale = {_num(d.compute_scale)}",
        f'host = "{d.host}"',
        f"overhead = {_num(d.overhead)}",
        f"wake = {_num(d.wake)}",
        f"floor = {_num(d.floor)}",
        f"imbalance = {_num(d.imbalance)}",
        f"threads = {d.threads}",
    ]
    out += ([f"p2p_floor = {_num(d.p2p_floor)}"] if d.p2p_floor is not None else []) + [""]
    for name, link in (("intra", c.intra), ("inter", c.inter)):
        out += [
            f"[links.{name}]",
            f"bandwidth = {_num(link.bandwidth * 8)}  # {format_rate(link.bandwidth)}",
            f"latency = {_num(link.latency)}",
            f"efficiency = {_num(link.efficiency)}",
        ]
        if link.native_latency is not None:
            out.append(f"native_latency = {_num(link.native_latency)}")
        if link.burst:
            out.append(f"burst = {_num(link.burst)}")
        if link.duplex_bandwidth is not None:
            out.append(f"duplex_bandwidth = {_num(link.duplex_bandwidth * 8)}  # {format_rate(link.duplex_bandwidth)}")
        out.append("")
    for mname, m in c.models.items():
        out += [
            f'[models."{mname}"]',
            f"samples_per_s = {_num(m.samples_per_s)}",
            f"backward_fraction = {_num(m.backward_fraction)}",
            f"optimizer_s = {_num(m.optimizer_s)}",
            "",
        ]
    for cname, cc in c.compressors.items():
        out += [
            f'[compressors."{cname}"]',
            f"ratio = {_num(cc.ratio)}",
            f"encode_s_per_byte = {_num(cc.encode_s_per_byte)}",
            f"decode_s_per_byte = {_num(cc.decode_s_per_byte)}",
            f"cpu_ratio = {_num(cc.cpu_ratio)}",
            "",
        ]
    if c.load is not None:
        out += [
            "[calibrated]",
            f"others_cores = {_num(c.load.others_cores)}",
            f"loadavg = {_num(c.load.loadavg)}",
            f"cores = {c.load.cores}",
            "",
        ]
    return "\n".join(out)


def this_host() -> str:
    return socket.gethostname()
