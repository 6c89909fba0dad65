"""``dtrain bench p2p``: point-to-point latency and bandwidth, dtrain's transport beside the backend's.

Usage::

    dtrain bench p2p [--workers 2] [--sizes 4B,1KB,64KB,1MB,16MB,64MB] [--iters 20] [--warmup 3]

What it does, in the launched workers (``dtrain.launch.agent.launch``):

1. Pairs the ranks ``(0,1), (2,3), ...``; every pair ping-pongs at once, so with
   more than two workers the figure includes the contention of a busy machine
   (an odd last rank sits out).
2. For each size and each path, interleaved round by round so that drifting load
   hits both alike: ``native`` is the backend's blocking ``send``/``recv`` (the
   peer); ``dtrain`` is :class:`dtrain.comm.TorchTransport` -- ``isend``/``irecv``
   with a timeout and byte counters, what every dtrain algorithm sends through.
   A round trip is timed on the lower rank of each pair; one-way = half of it.
3. Fits ``t = alpha + n * beta`` (:func:`dtrain.perfmodel.fit.fit_alpha_beta`)
   to each path's median one-way times, the model every cost formula in
   :mod:`dtrain.comm.cost` uses.

Columns: one-way time (median over the pairs' medians), bandwidth = bytes /
one-way time, and dtrain's bandwidth as a ratio of native's. Sizes use binary
units (1KB = 1024 bytes).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

from dtrain.errors import ConfigError
from dtrain.measure.allreduce import check_timing, format_size, parse_size

__all__ = ["P2PConfig", "main", "round_trip"]

PATHS = ("native", "dtrain")


@dataclass(frozen=True)
class P2PConfig:
    """Options of one p2p benchmark run (see the module docstring)."""

    workers: int = 2
    sizes: tuple[int, ...] = (4, 1 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20)
    iters: int = 20
    warmup: int = 3
    timeout: float = 120.0

    def __post_init__(self) -> None:
        if self.workers < 2:
            raise ConfigError(f"--workers must be >= 2 (ranks ping-pong in pairs), got {self.workers}")
        check_timing(self.sizes, self.iters, self.warmup)
        if self.timeout <= 0:
            raise ConfigError(f"--timeout must be > 0 seconds, got {self.timeout}")


# ----------------------------------------------------------------------------- worker side


def round_trip(path: str, transport: Any, buf: Any, peer: int, initiator: bool) -> float:
    """Seconds of one round trip of ``buf`` with ``peer`` (``path``: "native" send/recv, or dtrain's
    ``transport``); the initiator sends first."""
    import torch.distributed as dist

    t0 = time.perf_counter()
    if path == "native":
        if initiator:
            dist.send(buf, peer)
            dist.recv(buf, peer)
        else:
            dist.recv(buf, peer)
            dist.send(buf, peer)
    elif initiator:
        transport.isend(buf, peer, tag=7).wait()
        transport.irecv(buf, peer, tag=8).wait()
    else:
        transport.irecv(buf, peer, tag=7).wait()
        transport.isend(buf, peer, tag=8).wait()
    return time.perf_counter() - t0


def _worker(cfg: P2PConfig) -> dict[str, Any] | None:
    import torch
    import torch.distributed as dist

    from dtrain.comm import TorchTransport

    rank, P = dist.get_rank(), dist.get_world_size()
    transport = TorchTransport(timeout=cfg.timeout)
    paired = rank < P - P % 2
    peer = rank ^ 1
    initiator = rank % 2 == 0
    medians: dict[str, list[float]] = {p: [] for p in PATHS}
    if paired:  # the pair's first messages set up connections and buffers: never timed
        for path in PATHS:
            for _ in range(3):
                round_trip(path, transport, torch.zeros(1), peer, initiator)
    for nbytes in cfg.sizes:
        buf = torch.zeros(nbytes // 4)
        times: dict[str, list[float]] = {p: [] for p in PATHS}
        for i in range(cfg.warmup + cfg.iters):
            for path in PATHS:
                dist.barrier()
                if paired:
                    dt = round_trip(path, transport, buf, peer, initiator)
                    if i >= cfg.warmup:
                        times[path].append(dt / 2)
        for path in PATHS:
            medians[path].append(statistics.median(times[path]) if paired and initiator else float("nan"))
    # rank 0 collects every initiator's medians
    table = torch.tensor([medians[p] for p in PATHS], dtype=torch.float64)
    gathered = [torch.empty_like(table) for _ in range(P)]
    dist.all_gather(gathered, table)
    if rank != 0:
        return None
    initiators = [g for r, g in enumerate(gathered) if r % 2 == 0 and r < P - P % 2]
    per_path = {
        p: [statistics.median(float(g[k, j]) for g in initiators) for j in range(len(cfg.sizes))]
        for k, p in enumerate(PATHS)
    }
    return {
        "torch": torch.__version__,
        "backend": str(dist.get_backend()),
        "world_size": P,
        "pairs": len(initiators),
        "one_way_s": per_path,
        "config": asdict(cfg),
    }


# ----------------------------------------------------------------------------- driver side


def _fit(sizes: tuple[int, ...], times: list[float]) -> tuple[float, float]:
    from dtrain.perfmodel.fit import fit_alpha_beta

    return fit_alpha_beta([float(s) for s in sizes], times)


def _rate(nbytes: float, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.3f}" if seconds > 0 else "inf"


def table(res: dict[str, Any]) -> str:
    """The printed report of one run (header, fitted alpha/beta per path, one row per size)."""
    cfg = res["config"]
    sizes = tuple(cfg["sizes"])
    lines = [
        f"dtrain bench p2p: torch {res['torch']}, backend {res['backend']}, world size {res['world_size']} "
        f"({res['pairs']} pair(s) at once), float32, median of {cfg['iters']} round trips after {cfg['warmup']} "
        "warm-up; one-way = round trip / 2",
    ]
    for p in PATHS:
        alpha, beta = _fit(sizes, res["one_way_s"][p])
        bw = f"{1 / beta / 1e9:.3f} GB/s" if beta > 0 else "inf GB/s"
        lines.append(f"fit {p:<7} alpha {alpha * 1e6:8.1f} us   beta {beta * 1e9:.4f} ns/B ({bw})")
    lines += [
        "",
        f"{'size':>10}  {'native_us':>10} {'dtrain_us':>10} {'native_GB/s':>12} {'dtrain_GB/s':>12} {'vs_native':>9}",
    ]
    for j, n in enumerate(sizes):
        tn, td = res["one_way_s"]["native"][j], res["one_way_s"]["dtrain"][j]
        lines.append(
            f"{format_size(n):>10}  {tn * 1e6:10.1f} {td * 1e6:10.1f} {_rate(n, tn):>12} {_rate(n, td):>12} "
            f"{tn / td if td > 0 else float('nan'):9.2f}"
        )
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="dtrain bench p2p",
        description="Ping-pong latency and bandwidth: dtrain's transport next to the backend's own send/recv.",
    )
    ap.add_argument("--workers", type=int, default=2, help="worker processes, paired (0,1), (2,3)... (default: 2)")
    ap.add_argument(
        "--sizes",
        default="4B,1KiB,64KiB,1MiB,16MiB,64MiB",
        help="comma-separated sizes: 64KiB = 65,536 bytes, 64KB = 64,000",
    )
    ap.add_argument("--iters", type=int, default=20, help="timed round trips per size and path (default: 20)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed round trips first (default: 3)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds any wait may block (default: 120)")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the raw results as JSON")
    return ap


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print the table; return a process exit code."""
    from dtrain.launch.agent import launch

    ns = _parser().parse_args(argv)
    try:
        cfg = P2PConfig(
            workers=ns.workers,
            sizes=tuple(parse_size(s) for s in ns.sizes.split(",") if s.strip()),
            iters=ns.iters,
            warmup=ns.warmup,
            timeout=ns.timeout,
        )
    except ConfigError as e:
        print(f"dtrain bench p2p: error: {e}", file=sys.stderr)
        return 2
    res = launch(_worker, (cfg,), nprocs=cfg.workers)[0]
    print(table(res))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
